"""Flags: slime's names and defaults, pass-through of every sglang/router flag, validation."""

from __future__ import annotations

import argparse

import pytest

from slime_like.config import build_parser, parse_args
from slime_like.config.passthrough import (
    RESERVED_SERVER_FIELDS,
    SLIME_ROUTER_DEFAULTS,
    router_arg_table,
    server_arg_table,
    smg_arg_table,
)
from slime_like.errors import ConfigError

BASE = ["--hf-checkpoint", "base-model", "--actor-num-gpus-per-node", "4"]


def _error(argv: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    return err.value


def test_help_lists_flags_by_group():
    text = build_parser().format_help()
    order = ["cluster:", "rollout:", "server groups:", "router:", "weight update:",
             "fault tolerance:", "slime_like:", "sglang server args (--sglang-*):",
             "router args (--router-*):"]
    positions = [text.index(title) for title in order]
    assert positions == sorted(positions)
    for flag in ["--actor-num-nodes", "--rollout-num-gpus-per-engine", "--colocate",
                 "--offload-rollout", "--sglang-config", "--prefill-num-servers",
                 "--rollout-external-engine-addrs", "--sglang-router-request-timeout-secs",
                 "--sglang-server-concurrency", "--update-weight-disk-dir",
                 "--update-weights-interval", "--use-fault-tolerance",
                 "--rollout-health-check-first-wait", "--engine", "--pause-generation-mode", "--config",
                 "--sglang-mem-fraction-static", "--router-policy"]:
        assert f"  {flag}" in text, flag


def test_slime_defaults_for_the_rollout_side():
    a = parse_args(["--hf-checkpoint", "m", "--rollout-num-gpus", "8"])
    assert (a.actor_num_nodes, a.actor_num_gpus_per_node, a.num_gpus_per_node) == (1, 8, 8)
    assert a.rollout_num_gpus_per_engine == 1
    assert a.colocate is False and a.offload_train is False and a.offload_rollout is False
    assert a.sglang_server_concurrency == 512
    assert a.sglang_router_ip is None and a.sglang_router_port is None
    assert a.sglang_router_request_timeout_secs == 14400
    assert a.update_weight_buffer_size == 512 * 1024**2
    assert a.update_weights_interval == 1
    assert a.use_fault_tolerance is False
    assert a.rollout_health_check_interval == 30.0 and a.rollout_health_check_timeout == 30.0
    assert a.update_weight_transport == "distributed"  # slime's "nccl", not colocated
    assert a.engine == "sglang" and a.pause_mode == "retract"


def _value_for(spec) -> list[str]:
    if spec.kind in ("storetrue", "deprecatedstoretrue", "booleanoptional"):
        return []
    if spec.choices:
        return [str(spec.choices[0])]
    return {"int": ["3"], "float": ["0.5"]}.get(spec.type or "", ["x"])


def test_every_sglang_server_flag_reaches_sglang_flags_except_reserved_fields():
    version, specs = server_arg_table()
    assert version == "0.5.23"
    options = {o for action in build_parser()._actions for o in action.option_strings}
    argv, expected = [], set()
    for spec in specs:
        if spec.dest == "config":
            continue  # --sglang-config is slime's server-group YAML, not sglang's --config
        ours = ["--sglang-" + f[2:] for f in spec.flags if not f.startswith("--no-")]
        if spec.dest in RESERVED_SERVER_FIELDS:
            assert not options & set(ours), ours
            with pytest.raises(ConfigError, match="not a flag"):
                parse_args([ours[0], *_value_for(spec)], validate=False)
            continue
        assert set(ours) <= options, ours  # aliases too, e.g. --sglang-pipeline-parallel-size
        argv += [ours[0], *_value_for(spec)]
        expected.add(spec.dest)
    # validate=False: values that parse (e.g. pp_size 3) may break cross-flag rules.
    a = parse_args(argv, validate=False)
    assert set(a.sglang_flags) == expected and len(expected) > 500


def test_sglang_flags_hold_typed_values_and_only_what_was_set():
    a = parse_args([*BASE, "--rollout-num-gpus", "2", "--sglang-mem-fraction-static", "0.7",
                    "--sglang-pipeline-parallel-size", "1",
                    "--no-sglang-enable-tf32-matmul", "--sglang-cuda-graph-bs-decode", "1", "8"])
    assert a.sglang_flags == {"mem_fraction_static": 0.7, "pp_size": 1,
                              "enable_tf32_matmul": False, "cuda_graph_bs_decode": [1, 8]}
    assert not any(k.startswith("sglang_") and k not in (
        "sglang_config", "sglang_server_concurrency", "sglang_router_ip", "sglang_router_port",
        "sglang_router_request_timeout_secs", "sglang_flags") for k in vars(a))


def test_every_router_flag_passes_through_except_host_and_port():
    version, specs = router_arg_table()
    assert version == "0.3.2"
    parser = build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    for spec in specs:
        for flag in spec.flags:
            assert (("--router-" + flag[2:]) in options) == (spec.dest not in ("host", "port"))


def test_every_smg_flag_passes_through_and_the_router_is_chosen_by_flag():
    _, specs = smg_arg_table()
    parser = build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    for spec in specs:
        if spec.dest not in ("host", "port"):
            assert "--router-" + spec.flags[0][2:] in options, spec.dest
    a = parse_args([*BASE, "--rollout-num-gpus", "2", "--router", "smg", "--router-policy",
                    "least_load", "--router-least-load-kv-pressure-weight", "0.3"])
    assert a.router == "smg"
    assert a.router_flags["policy"] == "least_load"
    assert a.router_flags["least_load_kv_pressure_weight"] == 0.3
    assert parse_args([*BASE, "--rollout-num-gpus", "2"]).router == "sglang-router"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--router-policy", "least_load"],
     "--router-policy: 'least_load' is not one of sglang-router's ['random', 'round_robin', "
     "'cache_aware', 'power_of_two', 'manual']; smg has it (--router smg)"),
    (["--router", "smg", "--router-policy", "power_of_two"],
     "--router-policy: power_of_two: both routers refuse to start with it and fewer than 2 "
     "workers, and slime_like starts its routers empty (engines are added as they become "
     "healthy); use least_load (--router smg), cache_aware or round_robin"),
    (["--router-enable-rl"], "--router-enable-rl: sglang-router 0.3.2 has no such flag; it is "
                             "a flag of smg (--router smg)"),
    (["--router", "smg", "--router-mini-lb"], "--router-mini-lb: smg 1.13.0 has no such flag; "
                                              "it is a flag of sglang-router (--router "
                                              "sglang-router)"),
])
def test_a_router_flag_the_chosen_router_lacks_is_refused_naming_the_other(argv, expected):
    assert str(_error([*BASE, "--rollout-num-gpus", "2", *argv])) == expected


def test_router_flags_carry_slime_defaults_and_user_values():
    a = parse_args([*BASE, "--rollout-num-gpus", "2", "--router-policy", "round_robin",
                    "--router-log-level", "debug"])
    assert a.router_flags == {**SLIME_ROUTER_DEFAULTS, "policy": "round_robin",
                              "log_level": "debug"}


@pytest.mark.parametrize(("argv", "expected"), [
    (["--rollout-num-gpu", "3"], "--rollout-num-gpu: unknown flag; did you mean "
                                 "'--rollout-num-gpus'?"),
    (["--rollout-num-gpus", "-1"], "--rollout-num-gpus: must be >= 0, got -1"),
    (["--rollout-num-gpus-per-engine", "0"], "--rollout-num-gpus-per-engine: must be > 0, got 0"),
    (["--rollout-num-gpus", "four"], "--rollout-num-gpus: must be an integer, got 'four'"),
    (["--pause-mode", "freeze"], "--pause-generation-mode: invalid choice: 'freeze' (choose from 'abort', "
                                 "'retract', 'in_place')"),
    (["--sglang-tp-size", "2"], "--sglang-tp-size: not a flag: set from "
                                "--rollout-num-gpus-per-engine and pp_size; a server group may "
                                "set it in its YAML overrides"),
    (["--sglang-port", "30000"], "--sglang-port: not a flag: set per engine by placement"),
    (["--sglang-mem-fraction-static", "lots"], "--sglang-mem-fraction-static: must be a number, "
                                               "got 'lots'"),
    (["--router-request-timeout-secs", "5"], "--router-request-timeout-secs: not settable: use "
                                             "--sglang-router-request-timeout-secs"),
    (["--rollout-health-check-timeout", "0"], "--rollout-health-check-timeout: must be > 0, "
                                              "got 0"),
    (["--sglang-router-port", "70000"], "--sglang-router-port: must be a port in 1..65535, "
                                        "got 70000"),
    (["--update-weight-mode", "sparse"], "--update-weight-mode: invalid choice: 'sparse' "
                                         "(choose from 'full', 'delta')"),
    (["--update-weight-delta-full-every", "0"], "--update-weight-delta-full-every: must be > 0, "
                                                "got 0"),
])
def test_bad_flag_names_the_flag(argv, expected):
    assert str(_error([*BASE, "--rollout-num-gpus", "2", *argv])) == expected


def test_abbreviated_flags_are_not_guessed():
    assert _error([*BASE, "--rollout-num-gpus", "2", "--colo"]).path == "--colo"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hf-checkpoint", "m"], "--rollout-num-gpus: required: the GPUs of all rollout engines (0 "
                               "starts routers without engines), unless --colocate or "
                               "--sglang-config gives it"),
    (["--rollout-num-gpus", "2"], "--hf-checkpoint: required with --engine sglang (the checkpoint"
                                  " the engines serve and the trainer updates)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "5", "--rollout-num-gpus-per-engine", "2"],
     "--rollout-num-gpus: must be a multiple of --rollout-num-gpus-per-engine (2), got 5"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "24", "--rollout-num-gpus-per-engine", "12"],
     "--rollout-num-gpus-per-engine: an engine larger than a node spans whole nodes: must be a "
     "multiple of --num-gpus-per-node (8), got 12"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "4", "--prefill-num-servers", "4"],
     "--prefill-num-servers: 4 prefill engines of 1 GPUs leave no decode GPUs of "
     "--rollout-num-gpus 4"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "4", "--update-weight-transport", "disk"],
     "--update-weight-disk-dir: required with --update-weight-transport disk (a directory both "
     "the trainer and every engine can read)"),
    (["--hf-checkpoint", "m", "--rollout-external-engine-addrs", "h:1", "--colocate"],
     "--rollout-external-engine-addrs: cannot be combined with --colocate (external engines "
     "cannot share the trainer's GPUs)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--prefill-num-servers", "1",
      "--rollout-external-engine-addrs", "h:1"],
     "--prefill-num-servers: cannot be combined with --rollout-external-engine-addrs (external "
     "engines are not placed)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--debug-rollout-only",
      "--debug-train-only"], "--debug-rollout-only: cannot be combined with --debug-train-only "
                             "(pick one)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4",
      "--sglang-pp-size", "3"], "--sglang-pp-size: must divide num_gpus_per_engine (4 at "
                                "--rollout-num-gpus-per-engine), got 3"),
    (["--hf-checkpoint", "m", "--rollout-external-engine-addrs", "10.0.0.5:30000", "10.0.0.6"],
     "--rollout-external-engine-addrs: expected HOST:PORT for each engine, got '10.0.0.6'"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--sglang-router-ip", "10.0.0.1"],
     "--sglang-router-ip: attaching to a router the job does not own is not supported (the "
     "fleet alone adds and removes workers); drop it, --sglang-router-port fixes our router's "
     "port"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--debug-train-only"],
     "--debug-train-only: not supported: the job trains on samples the engines generate"),
    (["--hf-checkpoint", "m", "--colocate", "--update-weights-interval", "2"],
     "--update-weights-interval: > 1 with --offload-rollout needs "
     "--sglang-enable-weights-cpu-backup (released weights come back only with the next sync, "
     "so engines would sit idle until then)"),
    (["--hf-checkpoint", "m", "--rollout-external-engine-addrs", "h:1"],
     "--rollout-external-engine-addrs: needs --use-fault-tolerance (no process of ours reports "
     "an external engine's death: only probes see it)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "0"],
     "--rollout-num-gpus: 0 leaves the job without engines; give "
     "--rollout-external-engine-addrs or GPUs"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--offload"],
     "--offload: only with --colocate (engines on their own GPUs have nothing to give "
     "the trainer)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--offload-rollout"],
     "--offload-rollout: only with --colocate (engines on their own GPUs have nothing to give "
     "the trainer)"),
    (["--hf-checkpoint", "m", "--colocate", "--no-offload-train", "--no-offload-train-weights"],
     "--no-offload-train-weights: only with --offload-train (it says whether the trainer's "
     "weights move when its state does)"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--use-kl-loss",
      "--kl-loss-coef", "0.1"],
     "--use-kl-loss: needs a reference model: a model with update_weights: false in "
     "--sglang-config"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--kl-coef", "0.1"],
     "--kl-coef: needs a reference model: a model with update_weights: false in "
     "--sglang-config"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--kl-loss-coef", "0.1"],
     "--kl-loss-coef: has no effect without --use-kl-loss"),
    (["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "16"],
     "--actor-num-gpus-per-node: must be <= --num-gpus-per-node (8), got 16"),
    (["--hf-checkpoint", "m", "--colocate", "--update-weight-delta"],
     "--update-weight-mode: delta updates run over the disk and distributed transports; the "
     "tensor transport (--colocate) shares the trainer's memory, so there are no bytes to save"),
])
def test_inconsistent_flags_are_rejected_before_placement(argv, expected):
    assert str(_error(argv)) == expected


def test_colocate_implies_offload_and_rollout_gpus_unless_set():
    a = parse_args(["--hf-checkpoint", "m", "--colocate", "--actor-num-nodes", "2"])
    assert (a.offload_train, a.offload_rollout) == (True, True)
    assert a.rollout_num_gpus == 16
    assert a.update_weight_transport == "tensor"
    b = parse_args(["--hf-checkpoint", "m", "--colocate", "--no-offload-rollout",
                    "--rollout-num-gpus", "4"])
    assert (b.offload_train, b.offload_rollout, b.rollout_num_gpus) == (True, False, 4)
    c = parse_args(["--hf-checkpoint", "m", "--colocate", "--offload", "--no-offload-train"])
    assert (c.offload_train, c.offload_rollout) == (False, True)
    # the weights move with the trainer's state unless told to stay
    assert a.offload_train_weights is True
    d = parse_args(["--hf-checkpoint", "m", "--colocate", "--no-offload-train-weights"])
    assert (d.offload_train, d.offload_train_weights) == (True, False)


def test_zero_rollout_gpus_only_with_external_engines():
    a = parse_args(["--hf-checkpoint", "m", "--rollout-num-gpus", "0", "--use-fault-tolerance",
                    "--rollout-external-engine-addrs", "h:1"])
    assert a.topology.external and a.nominal_plan.engines == ()


def test_prefill_num_servers_builds_prefill_and_decode_groups():
    a = parse_args(["--hf-checkpoint", "m", "--rollout-num-gpus", "8",
                    "--rollout-num-gpus-per-engine", "2", "--prefill-num-servers", "1"])
    model = a.topology.models[0]
    assert [(g.worker_type, g.num_gpus, g.num_engines) for g in model.groups] == [
        ("prefill", 2, 1), ("decode", 6, 3)]
    assert model.pd_disaggregation


def test_external_engines_take_no_slots():
    a = parse_args(["--hf-checkpoint", "m", "--use-fault-tolerance",
                    "--rollout-external-engine-addrs", "10.0.0.5:30000", "10.0.0.6:30000"])
    assert a.topology.external and a.rollout_num_gpus == 0
    assert a.nominal_plan.layout.num_bundles == 8 and a.nominal_plan.engines == ()


def test_parse_without_validation_leaves_values_as_given():
    a = parse_args(["--colocate"], validate=False)
    assert a.offload_train is None and not hasattr(a, "topology")
    assert isinstance(a, argparse.Namespace)


def test_the_job_refuses_debug_rollout_only_which_only_the_python_api_uses(capsys):
    from slime_like.train import main

    assert main(["--hf-checkpoint", "m", "--rollout-num-gpus", "2", "--debug-rollout-only",
                 "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "slime-like train: error: --debug-rollout-only: not supported by the job: every step "
        "checks the engines' samples against the trainer (slime_like.api.launch_fleet places "
        "engines only)\n")
    placed = parse_args(["--hf-checkpoint", "m", "--rollout-num-gpus", "2",
                         "--debug-rollout-only"])
    assert placed.nominal_plan.trainer == () and len(placed.nominal_plan.engines) == 2
