"""Every config in configs/ parses, places, and renders engine command lines."""

from __future__ import annotations

from pathlib import Path

from slime_like.config import parse_args
from slime_like.config.fleet_slices import engine_settings
from slime_like.engine.from_placement import engine_argv, engine_server_args
from slime_like.engine.launch import parse_argv

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _args(name: str):
    return parse_args(["--config", str(CONFIGS / name)])


def _argvs(args, model_path: str | None = None) -> list[dict]:
    """Each engine actor's argv, read back into field values (ports as its actor would pick)."""
    out = []
    for i, e in enumerate(args.nominal_plan.engines):
        argv = engine_argv(e, engine_settings(args), port=30000 + 10 * i, nccl_port=30001 + 10 * i,
                           dist_init_port=30002 + 10 * i if e.nnodes > 1 else None,
                           bootstrap_port=30003 + 10 * i, model_path=model_path)
        prog = "slime_like.reference_engine" if args.engine == "reference" else \
            "sglang.launch_server"
        assert argv[1:3] == ["-m", prog]
        out.append(parse_argv(argv[3:]))
    return out


# Where each CPU config runs end to end (the real job through Ray and sglang-router).
RUN_BY = {
    "quickstart.yaml": "tests/job/test_train_job.py",
    "chaos.yaml": "tests/chaos/test_chaos.py",
    "multi_model_cpu.yaml": "tests/topologies/test_multi_model.py",
    "pd_cpu.yaml": "tests/topologies/test_pd.py",
    "colocate_cpu.yaml": "tests/topologies/test_colocate.py",
    "external_cpu.yaml": "tests/topologies/test_external.py",
    "multinode_cpu.yaml": "tests/topologies/test_multinode.py",
    "async_cpu.yaml": "tests/job/test_async_job.py",
}
GPU_ONLY = ("colocate.yaml", "multi_model.yaml", "pd.yaml")


def test_every_config_is_exercised():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted([*RUN_BY, *GPU_ONLY])
    root = CONFIGS.parent
    for name, test in RUN_BY.items():
        assert f"configs/{name}" in (root / test).read_text(), (name, test)
        assert _args(name).engine == "reference"


def test_gpu_only_configs_say_so_and_dry_run_plans_offline(tmp_path, capsys, monkeypatch):
    from slime_like.models.tiny import make_tiny_model
    from slime_like.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id must come from the local cache
    tiny = make_tiny_model(tmp_path / "tiny", layers=1, hidden=32)
    for name in GPU_ONLY:
        header = (CONFIGS / name).read_text().split("\nengine:")[0]
        assert "GPU only" in header and "--dry-run" in header, name
        # a checkpoint neither local nor a hub id fails the dry run with one line
        assert main(["--config", str(CONFIGS / name), "--dry-run",
                     "--hf-checkpoint", "no/such/model"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("slime-like train: error: --hf-checkpoint: ") and \
            err.count("\n") == 1, err
        # the shipped hub id cannot be reached offline: one warning line, and the plan
        assert main(["--config", str(CONFIGS / name), "--dry-run"]) == 0
        got = capsys.readouterr()
        assert got.err.startswith("slime-like train: warning: --hf-checkpoint: ") and \
            got.err.count("\n") == 1 and "the job will need it" in got.err, got.err
        assert got.out.count("$ ") == len(_args(name).nominal_plan.engines)
        # with a local checkpoint it prints every engine's server command line
        assert main(["--config", str(CONFIGS / name), "--dry-run",
                     "--hf-checkpoint", str(tiny)]) == 0
        out = capsys.readouterr().out
        assert out.count("$ ") == len(_args(name).nominal_plan.engines)
        assert "-m sglang.launch_server" in out


def test_chaos_is_the_quickstart_with_four_engines_and_every_fault():
    args = _args("chaos.yaml")
    assert args.engine == "reference" and len(args.nominal_plan.engines) == 4
    assert args.chaos_seed is not None and len(args.chaos_faults) == 7
    # detection well inside the request timeout: a hang never holds a step for long
    assert args.rollout_health_check_interval + args.rollout_health_check_timeout \
        < args.rollout_request_timeout


def test_quickstart_is_one_trainer_and_two_reference_engines():
    args = _args("quickstart.yaml")
    plan = args.nominal_plan
    assert args.engine == "reference" and args.hf_checkpoint is None
    assert plan.layout.num_bundles == 3 and len(plan.trainer) == 1
    assert [(e.engine_id, e.slot) for e in plan.engines] == [("default/g0/e0", 1),
                                                             ("default/g0/e1", 2)]
    assert args.update_weight_transport == "distributed" and args.use_fault_tolerance
    seen = _argvs(args, model_path="tiny-model-dir")
    assert [(a["model_path"], a["tp_size"], a["base_gpu_id"], a["random_seed"]) for a in seen] == [
        ("tiny-model-dir", 1, 1, 1234), ("tiny-model-dir", 1, 2, 1235)]
    assert args.router_flags["policy"] == "round_robin"


def test_pd_renders_prefill_and_decode_engines_behind_one_pd_router():
    args = _args("pd.yaml")
    assert [(r.model_name, r.pd_disaggregation) for r in args.nominal_plan.routers] == [
        ("actor", True)]
    seen = _argvs(args)
    assert [(a["disaggregation_mode"], a["tp_size"], a["base_gpu_id"]) for a in seen] == [
        ("prefill", 1, 4), ("prefill", 1, 5), ("decode", 2, 6)]
    assert seen[0]["disaggregation_bootstrap_port"] == 30003
    assert seen[0]["load_balance_method"] == "follow_bootstrap_room"
    assert "disaggregation_bootstrap_port" not in seen[2]
    assert seen[0]["chunked_prefill_size"] == 8192
    # --sglang-* flags reach every engine; a group's override wins over them.
    assert [a["mem_fraction_static"] for a in seen] == [0.7, 0.7, 0.8]
    assert {a["disaggregation_transfer_backend"] for a in seen} == {"mooncake"}


def test_multi_model_has_a_router_per_model_and_frozen_reference():
    args = _args("multi_model.yaml")
    routers = args.nominal_plan.routers
    assert [(r.model_name, r.model_path, r.update_weights) for r in routers] == [
        ("actor", "Qwen/Qwen3-4B", True), ("ref", "Qwen/Qwen3-8B", False)]
    seen = _argvs(args)
    assert [(a["model_path"], a["tp_size"], a["base_gpu_id"], a["host"]) for a in seen] == [
        ("Qwen/Qwen3-4B", 2, 4, "node0"), ("Qwen/Qwen3-4B", 2, 6, "node0"),
        ("Qwen/Qwen3-8B", 4, 0, "node1"), ("Qwen/Qwen3-8B", 4, 4, "node1")]
    assert [a.get("mem_fraction_static") for a in seen] == [None, None, 0.85, 0.85]


def test_colocate_engines_use_the_memory_saver_on_trainer_gpus():
    args = _args("colocate.yaml")
    assert (args.offload_train, args.offload_rollout) == (True, True)
    assert args.update_weight_transport == "tensor"
    seen = _argvs(args)
    assert [(a["base_gpu_id"], a["enable_memory_saver"]) for a in seen] == [
        (0, True), (2, True), (4, True), (6, True)]
    assert {a["cuda_graph_backend_prefill"] for a in seen} == {"disabled"}


def test_multi_node_engine_shares_dist_init_addr_of_node_rank_0(tmp_path):
    cfg = tmp_path / "big.yaml"
    cfg.write_text("sglang:\n  - name: big\n    server_groups:\n"
                   "      - {worker_type: regular, num_gpus: 16, num_gpus_per_engine: 16}\n")
    args = parse_args(["--hf-checkpoint", "m", "--sglang-config", str(cfg)])
    rank0, rank1 = args.nominal_plan.engines
    a0 = engine_server_args(rank0, engine_settings(args), port=30000, dist_init_port=30100).args
    a1 = engine_server_args(rank1, engine_settings(args), port=30000, dist_init_port=30100).args
    assert (a0["nnodes"], a0["node_rank"], a1["node_rank"]) == (2, 0, 1)
    assert a0["dist_init_addr"] == a1["dist_init_addr"] == "node1:30100"
    assert (a0["tp_size"], a0["random_seed"]) == (16, a1["random_seed"])
