"""`--config FILE.yaml`: any flag as a key, checked like the CLI, and the CLI wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_like.config import parse_args
from slime_like.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = _write(tmp_path, """
hf_checkpoint: base-model
actor_num_gpus_per_node: 4
rollout_num_gpus: 4
rollout_num_gpus_per_engine: 2
colocate: true
offload_train: false
rollout_external_engine_addrs: null
sglang_mem_fraction_static: 0.7
sglang_cuda_graph_bs_decode: [1, 2, 4]
router_policy: round_robin
rollout_health_check_first_wait: 10
pause_mode: in_place
""")
    a = parse_args(["--config", str(cfg), "--rollout-num-gpus-per-engine", "4",
                    "--sglang-mem-fraction-static", "0.5"])
    assert a.hf_checkpoint == "base-model" and a.rollout_num_gpus == 4
    assert a.rollout_num_gpus_per_engine == 4  # CLI over file
    assert a.offload_rollout is True and a.offload_train is False  # implied / file
    assert a.sglang_flags == {"mem_fraction_static": 0.5, "cuda_graph_bs_decode": [1, 2, 4]}
    assert a.router_flags["policy"] == "round_robin"
    assert a.rollout_health_check_first_wait == 10.0 and a.pause_mode == "in_place"
    assert a.config == str(cfg) and a.rollout_external_engine_addrs is None


def test_inline_sglang_config_is_resolved(tmp_path):
    cfg = _write(tmp_path, """
hf_checkpoint: base-model
actor_num_gpus_per_node: 4
sglang_config:
  sglang:
    - name: actor
      server_groups:
        - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}
""")
    a = parse_args(["--config", str(cfg)])
    assert a.rollout_num_gpus == 2  # unset: the server groups' sum
    assert [(e.model_name, e.num_gpus) for e in a.nominal_plan.engines] == [("actor", 2)]


def test_sglang_config_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub", "sglang:\n  - name: m\n    server_groups:\n"
                             "      - {worker_type: regular, num_gpus: 3}\n", "groups.yaml")
    cfg = _write(tmp_path / "sub", "hf_checkpoint: base\nactor_num_gpus_per_node: 1\n"
                                   "sglang_config: groups.yaml\n")
    a = parse_args(["--config", str(cfg)])
    assert a.topology.models[0].name == "m" and a.rollout_num_gpus == 3


def test_prompt_data_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    cfg = _write(tmp_path / "sub", "engine: reference\nactor_num_gpus_per_node: 1\n"
                                   "rollout_num_gpus: 1\nprompt_data: data.jsonl\n")
    assert parse_args(["--config", str(cfg)]).prompt_data == str(tmp_path / "sub" / "data.jsonl")
    cli = parse_args(["--config", str(cfg), "--prompt-data", "here.jsonl"])
    assert cli.prompt_data == "here.jsonl"  # the command line is relative to where it runs


@pytest.mark.parametrize(("text", "path", "message"), [
    ("rollout_num_gpu: 4\n", "rollout_num_gpu", "unknown flag; did you mean 'rollout_num_gpus'?"),
    ("rollout_num_gpus: four\n", "rollout_num_gpus", "must be an integer, got 'four'"),
    ("rollout_num_gpus: 2.5\n", "rollout_num_gpus", "must be an integer, got '2.5'"),
    ("rollout_num_gpus: -1\n", "rollout_num_gpus", "must be >= 0, got -1"),
    ("rollout_num_gpus: true\n", "rollout_num_gpus", "must be a number, got true"),
    ("colocate: 1\n", "colocate", "must be true or false, got 1"),
    ("pause_mode: freeze\n", "pause_mode", "must be one of abort, retract, in_place; got 'freeze'"),
    ("hf_checkpoint: [a, b]\n", "hf_checkpoint", "must be a single value, got a list"),
    ("num_gpus_per_node: null\n", "num_gpus_per_node", "must not be null"),
    ("config: other.yaml\n", "config", "a config file cannot name another config file"),
    ("sglang_port: 2\n", "sglang_port", "not a flag: set per engine by placement"),
    ("router_prefill: [[a]]\nrollout_num_gpus: 0\nhf_checkpoint: m\n", None,
     "--router-prefill: not settable: prefill engines come from the server groups of "
     "--sglang-config"),
])
def test_bad_value_in_file_names_file_and_key(tmp_path, text, path, message):
    cfg = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(cfg)])
    expected = f"{cfg}:{path}: {message}" if path else message
    assert str(err.value) == expected


def test_file_that_is_not_a_mapping_or_missing(tmp_path):
    cfg = _write(tmp_path, "- rollout_num_gpus\n")
    with pytest.raises(ConfigError, match="must be a mapping of flag names to values, got a list"):
        parse_args(["--config", str(cfg)])
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert err.value.path == "--config" and "no such file" in err.value.message
