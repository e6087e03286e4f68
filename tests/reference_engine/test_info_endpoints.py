"""Info, load, metrics and profiling endpoints of a running engine."""

from __future__ import annotations

import importlib.util
import json

import pytest
import requests

from slime_like.reference_engine.loads import EXTENSIONS, MEMORY_EXTENSIONS
from tests.contract.sglang_loads import json_type, sglang_load_shapes


def test_model_info_and_its_deprecated_alias(engine):
    info = engine.get("/model_info").json()
    assert info["model_path"].endswith("tiny-llama")
    assert info["served_model_name"] == "tiny"
    assert info["weight_version"] == "default"
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert engine.get("/get_model_info").json() == info


def test_server_info_has_every_resolved_sglang_arg(engine):
    info = engine.get("/server_info").json()
    for key in ("model_path", "served_model_name", "tp_size", "dp_size", "pp_size", "port",
                "weight_version", "disaggregation_mode", "mem_fraction_static", "schedule_policy"):
        assert key in info, key
    assert info["version"] == "0.5.23" and info["tp_size"] == 1 and info["dp_size"] == 1
    assert info["served_model_name"] == "tiny" and info["disaggregation_mode"] == "null"
    assert info["port"] == int(engine.url.rsplit(":", 1)[1])
    assert isinstance(info["internal_states"], list) and info["internal_states"][0]["dp_rank"] == 0
    assert engine.get("/get_server_info").json()["model_path"] == info["model_path"]


def test_v1_models_v1_loads_and_legacy_get_load(engine):
    models = engine.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == engine.get("/server_info").json()["context_length"]
    loads = engine.get("/v1/loads").json()
    entry = loads["loads"][0]
    for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                "max_total_num_tokens", "token_usage", "cache_hit_rate"):
        assert key in entry, key
    assert engine.get("/v1/loads?include=bogus").status_code == 400
    legacy = engine.get("/get_load").json()
    assert isinstance(legacy, list) and legacy[0]["dp_rank"] == 0 and "num_tokens" in legacy[0]


# No include (everything), core alone, what smg polls, one section, all, and a bad section.
INCLUDES = [None, "core", "core,disagg,queues,memory", "memory", "all", "bogus"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="sglang is not installed (pip install --no-deps sglang==0.5.23; "
                           "scripts/env.sh does it with SLIME_LIKE_SGLANG=1)")
def test_v1_loads_entries_have_sglangs_own_keys_and_types(engine):
    """Each `/v1/loads` entry is sglang 0.5.23's `LoadSnapshot.to_dict(include)` (its keys,
    sections and JSON types, from sglang's own code), plus the reference engine's declared
    extensions; routers (smg's load-aware policies) parse these entries."""
    expected = sglang_load_shapes(INCLUDES)
    for include in INCLUDES:
        want = expected[include or "-"]
        resp = engine.get("/v1/loads", params={"include": include} if include else None)
        if "error" in want:
            assert resp.status_code == 400 and "Invalid include sections" in resp.text, include
            continue
        got = json_type(resp.json()["loads"][0])
        # sections of features the reference engine does not have (speculative decoding, LoRA)
        want = {k: v for k, v in want.items() if k not in ("speculative", "lora")}
        extra = {k: got.pop(k) for k in EXTENSIONS}
        assert extra == {"num_cached_tokens": "int", "paused": "bool", "num_retracted_reqs": "int"}
        if "memory" in got:
            assert {k: got["memory"].pop(k) for k in MEMORY_EXTENSIONS} == {"kv_cache_bytes": "int"}
        assert got == want, include


def test_metrics_use_sglang_names_and_count_requests(engine):
    before = engine.get("/metrics").text
    engine.generate({"text": "count me", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    text = engine.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:num_requests_total",
                 "sglang:num_aborted_requests_total", "sglang:e2e_request_latency_seconds_bucket",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:weight_load_duration_seconds"):
        assert name in text, name

    def value(body: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name + "{"))

    assert value(text, "sglang:generation_tokens_total") >= value(before, "sglang:generation_tokens_total") + 3
    assert value(text, "sglang:num_requests_total") >= value(before, "sglang:num_requests_total") + 1


def test_metrics_route_exists_only_with_enable_metrics(tp2_engine):
    assert tp2_engine.get("/metrics").status_code == 404


def test_profile_writes_a_chrome_trace_to_output_dir(engine, tmp_path):
    r = engine.post("/start_profile", {"output_dir": str(tmp_path), "profile_id": "t1"})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    assert engine.post("/start_profile", {"output_dir": str(tmp_path)}).status_code == 500
    engine.generate({"text": "profile me", "sampling_params": {"max_new_tokens": 4}})
    r = engine.post("/stop_profile")
    assert r.status_code == 200 and r.text == "Stop profiling. This will take some time.\n"
    trace = tmp_path / "t1-TP-0.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    assert engine.post("/stop_profile").status_code == 500


def test_unknown_route_is_fastapi_404(engine):
    r = requests.get(engine.url + "/no_such_endpoint", timeout=10)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
