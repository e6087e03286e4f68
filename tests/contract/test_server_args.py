"""Contract: the argv we render parses and constructs in sglang 0.5.23's real ServerArgs.

Every configuration below goes through compose_server_args -> render_argv("sglang") ->
`sglang.srt.server_args.prepare_server_args`, in one child process for the whole session,
and every value we meant must come back equal from sglang's parsed record.
"""

from __future__ import annotations

import json

import pytest

from slime_like.engine.launch import (
    RENAMED_FIELDS,
    compose_server_args,
    forced_server_args,
    render_argv,
    server_arg_table,
    worker_type_of,
)
from tests.contract.sglang_parse import register_argv

pytestmark = pytest.mark.sglang

MODEL = "Qwen/Qwen3-8B"
BAD_ARGV = ["--model-path", MODEL, "--cuda-graph-max-bs", "8"]


def _case(name, worker_type="regular", flags=None, overrides=None, **forced_kw):
    forced = dict(model_path=MODEL, host="10.1.2.3", port=15000, nccl_port=15001, seed=42)
    forced.update(forced_kw)
    return name, forced, flags or {}, overrides or {}, worker_type


CASES = [
    _case("regular_tp1"),
    _case("tp4", num_gpus_per_engine=4, base_gpu_id=4),
    _case("pp2_tp4", num_gpus_per_engine=8, pp_size=2),
    _case("dp_attention_deprecated_spelling", num_gpus_per_engine=8, dp_size=8,
          flags={"enable_dp_attention": True}),
    _case("dp_attention_0_5_23_spelling", num_gpus_per_engine=8, flags={"attn_dp_size": 8}),
    _case("moe_ep8_deepep", num_gpus_per_engine=8, ep_size=8,
          flags={"moe_a2a_backend": "deepep", "deepep_mode": "auto"}),
    _case("pd_prefill", "prefill", disaggregation_bootstrap_port=15002,
          flags={"disaggregation_transfer_backend": "mooncake"},
          overrides={"chunked_prefill_size": 8192}),
    _case("pd_decode", "decode", num_gpus_per_engine=4,
          flags={"disaggregation_transfer_backend": "mooncake"},
          overrides={"mem_fraction_static": 0.88}),
    _case("encoder", "encoder"),
    _case("colocated_memory_saver", enable_memory_saver=True,
          flags={"mem_fraction_static": 0.7, "enable_weights_cpu_backup": True}),
    _case("two_node_engine_rank1", num_gpus_per_engine=16, nnodes=2, node_rank=1,
          dist_init_addr="[fd00::3]:15100", host="fd00::3"),
    _case("yaml_overrides", api_key="k", admin_api_key="a",
          flags={"cuda_graph_max_bs_decode": 64},
          overrides={"json-model-override-args": {"rope_scaling": {"type": "yarn", "factor": 2.0}},
                     "served_model_name": "policy", "weight_version": "v0",
                     "load_format": "dummy", "context_length": 4096,
                     "enable_tf32_matmul": False, "allowed_media_domains": ["a.org", "b.org"]}),
    _case("renamed_and_unknown_fields_are_dropped",
          flags={"cuda_graph_max_bs": 64, "prefill_round_robin_balance": True},
          overrides={"not_an_sglang_field": 1}),
]


def _composed(case):
    _, forced_kw, flags, overrides, worker_type = case
    return compose_server_args(forced=forced_server_args(**forced_kw), sglang_flags=flags,
                               overrides=overrides, worker_type=worker_type)


for _case_ in CASES:
    register_argv(f"case:{_case_[0]}", render_argv(_composed(_case_).args, "sglang")[3:])
# One argv sglang must refuse, so the check itself is shown able to fail.
register_argv("bad_flag", BAD_ARGV)


@pytest.fixture
def sglang_answers(sglang_parsed):
    return sglang_parsed


def _same(ours, theirs) -> bool:
    if isinstance(ours, dict):
        theirs = json.loads(theirs) if isinstance(theirs, str) else theirs
    if isinstance(ours, float) or isinstance(theirs, float):
        return theirs is not None and abs(float(ours) - float(theirs)) < 1e-12
    return ours == theirs


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_rendered_argv_constructs_sglang_server_args_with_the_values_we_meant(sglang_answers, index):
    composed = _composed(CASES[index])
    answer = sglang_answers["results"][f"case:{CASES[index][0]}"]
    assert answer["ok"], f"sglang refused {CASES[index][0]}: {answer['error']}"
    parsed = answer["args"]
    wrong = {k: (v, parsed.get(k)) for k, v in composed.args.items() if not _same(v, parsed.get(k))}
    assert not wrong, f"(ours, sglang's) differ: {wrong}"
    assert worker_type_of(parsed) == CASES[index][4]


def test_contract_runs_against_sglang_0_5_23(sglang_answers):
    assert sglang_answers["sglang_version"] == server_arg_table().version == "0.5.23"


def test_flag_table_matches_installed_sglang_fields(sglang_answers):
    fields = set(sglang_answers["fields"])
    missing = sorted(set(server_arg_table().specs) - fields)
    assert not missing, f"our table has flags sglang's ServerArgs lacks: {missing}"


def test_fields_we_call_renamed_are_gone_or_deprecated_in_sglang(sglang_answers):
    fields = set(sglang_answers["fields"])
    table = server_arg_table()
    for old in RENAMED_FIELDS:
        assert old not in fields or table[old].deprecated, old


def test_sglang_refuses_an_argv_with_a_bad_flag(sglang_answers):
    bad = sglang_answers["results"]["bad_flag"]
    assert not bad["ok"] and "--cuda-graph-max-bs" in bad["error"]
