"""Server-args composition (slime's precedence) and argv rendering, as a table of cases."""

from __future__ import annotations

import sys

import pytest

from slime_like.engine.launch import (
    RENAMED_FIELDS,
    compose_server_args,
    forced_server_args,
    parse_argv,
    render_argv,
    server_arg_table,
)
from slime_like.errors import ConfigError


def _forced(**kw):
    base = dict(model_path="/m", host="10.0.0.1", port=31000, nccl_port=31001, seed=7, engine_rank=2)
    base.update(kw)
    return forced_server_args(**base)


# (case id, forced kwargs, sglang_flags, overrides, worker_type, expected subset of args)
PRECEDENCE_CASES = [
    ("forced_only", {}, {}, {}, "regular",
     {"model_path": "/m", "host": "10.0.0.1", "port": 31000, "tp_size": 1, "random_seed": 9,
      "skip_server_warmup": True, "enable_metrics": True, "trust_remote_code": True}),
    ("flag_beats_forced", {}, {"mem_fraction_static": 0.5, "dp_size": 2}, {}, "regular",
     {"mem_fraction_static": 0.5, "dp_size": 2}),
    ("prefixed_flag_name", {}, {"sglang_mem_fraction_static": 0.6}, {}, "regular",
     {"mem_fraction_static": 0.6}),
    ("unset_flag_is_ignored", {}, {"mem_fraction_static": None}, {}, "regular",
     {"mem_fraction_static": "<absent>"}),
    ("override_beats_flag", {}, {"mem_fraction_static": 0.5}, {"mem_fraction_static": 0.9},
     "regular", {"mem_fraction_static": 0.9}),
    ("override_beats_forced", {}, {}, {"port": 32000, "tp_size": 4}, "regular",
     {"port": 32000, "tp_size": 4}),
    ("override_none_restores_sglang_default", {}, {"chunked_prefill_size": 4096},
     {"chunked_prefill_size": None}, "regular", {"chunked_prefill_size": "<absent>"}),
    ("tp_from_pp", {"num_gpus_per_engine": 8, "pp_size": 2}, {}, {}, "regular",
     {"tp_size": 4, "pp_size": 2}),
    ("prefill_extras", {"disaggregation_bootstrap_port": 31002}, {}, {}, "prefill",
     {"disaggregation_mode": "prefill", "load_balance_method": "follow_bootstrap_room",
      "disaggregation_bootstrap_port": 31002}),
    ("prefill_override_tunes_balance", {"disaggregation_bootstrap_port": 31002}, {},
     {"load_balance_method": "round_robin"}, "prefill", {"load_balance_method": "round_robin"}),
    ("decode_extras", {}, {}, {}, "decode", {"disaggregation_mode": "decode"}),
    ("encoder_extras", {}, {}, {}, "encoder", {"encoder_only": True}),
    ("memory_saver_disables_prefill_graph", {"enable_memory_saver": True}, {}, {}, "regular",
     {"enable_memory_saver": True, "cuda_graph_backend_prefill": "disabled"}),
    ("memory_saver_keeps_explicit_prefill_graph", {"enable_memory_saver": True}, {},
     {"cuda_graph_backend_prefill": "full"}, "regular", {"cuda_graph_backend_prefill": "full"}),
]


@pytest.mark.parametrize("case", PRECEDENCE_CASES, ids=[c[0] for c in PRECEDENCE_CASES])
def test_precedence_is_forced_then_flags_then_overrides(case):
    _, forced_kw, flags, overrides, worker_type, expected = case
    out = compose_server_args(forced=_forced(**forced_kw), sglang_flags=flags,
                              overrides=overrides, worker_type=worker_type)
    for key, value in expected.items():
        if value == "<absent>":
            assert key not in out.args
        else:
            assert out.args[key] == value, key
    assert out.dropped == []


def test_dashed_override_keys_are_read_with_underscores_and_warned():
    out = compose_server_args(forced=_forced(), sglang_flags={},
                              overrides={"mem-fraction-static": 0.7}, worker_type="regular")
    assert out.args["mem_fraction_static"] == 0.7
    assert any("mem-fraction-static" in w and "mem_fraction_static" in w for w in out.warnings)


def test_unknown_fields_are_dropped_with_one_warning_naming_them():
    out = compose_server_args(forced=_forced(), sglang_flags={"not_a_field": 1},
                              overrides={"also_bogus": True, "tp_size": 2}, worker_type="regular")
    assert out.dropped == ["not_a_field", "also_bogus"]
    assert "not_a_field" not in out.args and "also_bogus" not in out.args
    dropped_warnings = [w for w in out.warnings if "dropped" in w]
    assert len(dropped_warnings) == 1
    assert "not_a_field" in dropped_warnings[0] and "overrides.also_bogus" in dropped_warnings[0]


def test_renamed_field_is_reported_with_its_replacement():
    out = compose_server_args(forced=_forced(), sglang_flags={"cuda_graph_max_bs": 64},
                              overrides={}, worker_type="regular")
    assert out.dropped == ["cuda_graph_max_bs"]
    assert any("cuda_graph_max_bs_decode" in w for w in out.warnings)


def test_renamed_table_names_only_fields_0_5_23_lacks_or_deprecates():
    table = server_arg_table()
    for old in RENAMED_FIELDS:
        assert old not in table or table[old].deprecated, old


def test_deprecated_field_passes_through_with_a_warning():
    out = compose_server_args(forced=_forced(num_gpus_per_engine=4), sglang_flags={
        "enable_dp_attention": True, "dp_size": 4}, overrides={}, worker_type="regular")
    assert out.args["enable_dp_attention"] is True
    assert any("deprecated" in w and "attn_dp_size" in w for w in out.warnings)


@pytest.mark.parametrize("overrides,path", [
    ({"tp_size": "four"}, "overrides.tp_size"),
    ({"load_format": "nope"}, "overrides.load_format"),
    ({"skip_tokenizer_init": "yes"}, "overrides.skip_tokenizer_init"),
    ({"mem_fraction_static": [0.1, 0.2]}, "overrides.mem_fraction_static"),
])
def test_bad_value_names_the_field_and_where_it_came_from(overrides, path):
    with pytest.raises(ConfigError) as e:
        compose_server_args(forced=_forced(), sglang_flags={}, overrides=overrides,
                            worker_type="regular")
    assert e.value.path == path


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="--sglang-dtype"):
        compose_server_args(forced=_forced(), sglang_flags={"dtype": "int3"}, overrides={},
                            worker_type="regular")


@pytest.mark.parametrize("worker_type,forced_kw,overrides,match", [
    ("prefill", {}, {}, "bootstrap port"),
    ("prefill", {"disaggregation_bootstrap_port": 9}, {"disaggregation_mode": "decode"},
     "contradicts worker_type='prefill'"),
    ("regular", {}, {"disaggregation_mode": "prefill"}, "contradicts worker_type='regular'"),
    ("encoder", {}, {"encoder_only": False}, "encoder_only"),
    ("placeholder", {}, {}, "not an engine worker type"),
])
def test_worker_type_contradictions_are_config_errors(worker_type, forced_kw, overrides, match):
    with pytest.raises(ConfigError, match=match):
        compose_server_args(forced=_forced(**forced_kw), sglang_flags={}, overrides=overrides,
                            worker_type=worker_type)


@pytest.mark.parametrize("kw,field", [
    ({"num_gpus_per_engine": 6, "pp_size": 4}, "pp_size"),
    ({"nnodes": 2}, "dist_init_addr"),
    ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
    ({"num_gpus_per_engine": 0}, "num_gpus_per_engine"),
])
def test_forced_args_reject_impossible_layouts(kw, field):
    with pytest.raises(ConfigError) as e:
        _forced(**kw)
    assert e.value.path == field


def test_every_node_of_one_engine_gets_the_same_seed():
    a = _forced(nnodes=2, node_rank=0, dist_init_addr="h:1", engine_rank=3)
    b = _forced(nnodes=2, node_rank=1, dist_init_addr="h:1", engine_rank=3)
    c = _forced(engine_rank=4)
    assert a["random_seed"] == b["random_seed"] != c["random_seed"]


def test_argv_starts_with_the_program_and_carries_the_same_flags():
    args = compose_server_args(forced=_forced(), sglang_flags={}, overrides={},
                               worker_type="regular").args
    sg = render_argv(args, "sglang", python="py")
    ref = render_argv(args, "reference", python="py")
    assert sg[:3] == ["py", "-m", "sglang.launch_server"]
    assert ref[:3] == ["py", "-m", "slime_like.reference_engine"]
    assert sg[3:] == ref[3:]
    assert render_argv(args, "sglang")[0] == sys.executable


def test_argv_spells_switches_lists_and_json_as_sglang_parses_them():
    args = {"model_path": "/m", "skip_server_warmup": True, "enable_metrics": False,
            "enable_tf32_matmul": False, "json_model_override_args": {"a": 1},
            "encoder_urls": ["http://a:1", "http://b:2"], "allowed_media_domains": [],
            "mem_fraction_static": 0.5, "tp_size": 2, "api_key": None}
    argv = render_argv(args, "sglang", python="py")[3:]
    assert argv == ["--model-path", "/m", "--skip-server-warmup", "--no-enable-tf32-matmul",
                    "--json-model-override-args", '{"a": 1}',
                    "--encoder-urls", "http://a:1", "http://b:2",
                    "--mem-fraction-static", "0.5", "--tp-size", "2"]


def test_render_then_parse_gives_back_the_args():
    args = compose_server_args(
        forced=_forced(disaggregation_bootstrap_port=31005, enable_memory_saver=True),
        sglang_flags={"dp_size": 2, "encoder_urls": ["http://e:1"]},
        overrides={"json_model_override_args": '{"x": 2}', "enable_tf32_matmul": True},
        worker_type="prefill").args
    assert parse_argv(render_argv(args, "reference")[3:]) == args


def test_render_refuses_a_field_sglang_does_not_have():
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        render_argv({"model_path": "/m", "cuda_graph_max_bs": 8}, "sglang")


def test_every_replacement_named_for_a_renamed_field_exists_in_0_5_23():
    table = server_arg_table()
    for old, hint in RENAMED_FIELDS.items():
        if hint.startswith("("):
            continue  # removed without a replacement
        for part in hint.split(" (")[0].split(" / "):
            name, _, value = part.strip().partition("=")
            assert name in table, (old, name)
            if value and not value.startswith("<") and table[name].choices:
                assert value in table[name].choices, (old, part)
