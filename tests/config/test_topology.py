"""Resolution of `--sglang-config`: slime's defaults and inference, legacy keys, warnings."""

from __future__ import annotations

import pytest

from slime_like.config.sglang_config import parse_sglang_config
from slime_like.config.topology import TopologyInputs, resolve_sglang_config
from slime_like.errors import ConfigError

INPUTS = TopologyInputs(hf_checkpoint="base", rollout_num_gpus=None,
                        rollout_num_gpus_per_engine=1, num_gpus_per_node=8)


def _resolve(data, inputs=INPUTS):
    return resolve_sglang_config(parse_sglang_config(data), inputs)


def test_engine_size_comes_from_group_then_model_then_flag():
    topo = _resolve({"sglang": [
        {"name": "a", "num_gpus_per_engine": 2, "server_groups": [
            {"worker_type": "regular", "num_gpus": 4, "num_gpus_per_engine": 4},
            {"worker_type": "regular", "num_gpus": 4}]},
        {"name": "b", "model_path": "other", "server_groups": [
            {"worker_type": "regular", "num_gpus": 3}]}]})
    sizes = [(g.where, g.num_gpus_per_engine, g.num_engines)
             for m in topo.models for g in m.groups]
    assert sizes == [("sglang[0].server_groups[0]", 4, 1), ("sglang[0].server_groups[1]", 2, 2),
                     ("sglang[1].server_groups[0]", 1, 3)]


def test_update_weights_is_inferred_from_the_model_path_with_a_warning():
    topo = _resolve({"sglang": [
        {"name": "actor", "server_groups": [{"worker_type": "regular", "num_gpus": 2}]},
        {"name": "ref", "model_path": "ref-ckpt",
         "server_groups": [{"worker_type": "regular", "num_gpus": 2}]}]})
    assert [(m.name, m.model_path, m.update_weights) for m in topo.models] == [
        ("actor", "base", True), ("ref", "ref-ckpt", False)]
    assert topo.updatable_model.name == "actor"
    assert topo.warnings == ("sglang[1].update_weights: inferred false, because its model_path "
                             "'ref-ckpt' differs from --hf-checkpoint; set it to silence this",)


def test_legacy_engine_groups_are_server_groups():
    legacy = _resolve({"sglang": [{"name": "m", "engine_groups": [
        {"worker_type": "regular", "num_gpus": 2}]}]})
    assert legacy.models[0].groups[0].num_gpus == 2


def test_placeholder_reserves_gpus_without_engines_and_router_only_models_are_allowed():
    topo = _resolve({"sglang": [
        {"name": "m", "server_groups": [
            {"worker_type": "regular", "num_gpus": 2, "num_gpus_per_engine": 2},
            {"worker_type": "placeholder", "num_gpus": 3}]},
        {"name": "empty", "model_path": "x", "update_weights": False}]})
    m, empty = topo.models
    assert (m.num_gpus, m.num_engines, topo.num_gpus) == (5, 1, 5)
    assert empty.groups == () and empty.num_engines == 0


def test_overrides_keys_are_normalized_and_unknown_far_keys_only_warn():
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 1,
         "overrides": {"mem-fraction-static": 0.8, "field_from_a_newer_sglang": 1}}]}]})
    assert dict(topo.models[0].groups[0].overrides) == {"mem_fraction_static": 0.8,
                                                         "field_from_a_newer_sglang": 1}
    assert "field_from_a_newer_sglang: not a ServerArgs field" in topo.warnings[0]


def test_same_override_given_twice_is_an_error():
    with pytest.raises(ConfigError) as err:
        _resolve({"sglang": [{"name": "m", "server_groups": [
            {"worker_type": "regular", "num_gpus": 1,
             "overrides": {"mem_fraction_static": 0.8, "mem-fraction-static": 0.7}}]}]})
    assert str(err.value) == ("sglang[0].server_groups[0].overrides.mem-fraction-static: given "
                              "twice (as 'mem_fraction_static' too)")


def test_tp_from_pp_override_is_accepted():
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 8, "num_gpus_per_engine": 4,
         "overrides": {"tp_size": 2, "pp_size": 2}}]}]})
    assert topo.models[0].groups[0].num_engines == 2


def test_multi_node_engine_gets_one_actor_per_node():
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 16, "num_gpus_per_engine": 16}]}]})
    g = topo.models[0].groups[0]
    assert (g.num_engines, g.nnodes, g.gpus_per_node) == (1, 2, 8)


def test_epd_encoder_with_prefill_and_decode_is_valid():
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "encoder", "num_gpus": 1},
        {"worker_type": "prefill", "num_gpus": 1},
        {"worker_type": "decode", "num_gpus": 2}]}]})
    assert topo.models[0].pd_disaggregation and topo.models[0].has_encoders


def test_reference_engine_may_run_without_a_checkpoint():
    inputs = TopologyInputs(engine="reference", rollout_num_gpus_per_engine=1)
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 1}]}]}, inputs)
    assert topo.models[0].model_path is None and topo.models[0].update_weights


def test_null_override_means_sglang_default_not_an_error():
    topo = _resolve({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 2, "num_gpus_per_engine": 2,
         "overrides": {"pp_size": None, "tp_size": None, "chunked_prefill_size": None}}]}]})
    assert topo.models[0].groups[0].overrides["pp_size"] is None
