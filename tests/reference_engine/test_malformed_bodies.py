"""Every route of a real engine, fuzzed with malformed bodies: no 5xx, and it keeps serving.

The route table is the engine's own FastAPI app (built around a stand-in engine object only
to list its routes), so a route added later is fuzzed too. Bodies come from hypothesis:
bytes that are not JSON or not UTF-8, JSON nested far past any parser's limit, JSON values
of the wrong type, NaN and 2**70, and objects over the route's own field names. Generation
routes also get well-typed objects with small random values (they must answer 200 or a 400
that names the problem); weight and control routes get only bodies that are no valid call
(not JSON, not an object, or an object whose every field has a wrong type), so no fuzzed
body pauses the engine, releases its memory or starts a weight update for real.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import get_args

import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slime_like.models.tokenizer import ByteTokenizer
from slime_like.protocol import io_struct as p
from slime_like.protocol.openai_struct import ChatCompletionRequest, CompletionRequest
from slime_like.reference_engine.http_server import create_app
from tests.reference_engine.conftest import start_engine, stop_engine

GENERATION = {"/generate": (*p.GenerateRequest.model_fields, "sampling_params"),
              "/v1/completions": tuple(CompletionRequest.model_fields),
              "/v1/chat/completions": tuple(ChatCompletionRequest.model_fields)}
SAMPLING_KEYS = tuple(p.SamplingParams.model_fields)
# sglang's own 500 for a call out of order, whatever the body (the route reads none)
STATE_500 = {"/stop_profile": "Profiling is not in progress"}
QUERY_KEYS = ("include", "format", "dp_rank", "timeout", "model")
def fuzz_settings(max_examples: int) -> settings:
    """Bounded and reproducible: a fixed number of bodies per route, no example database."""
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _routes() -> list[tuple[str, str, tuple[str, ...]]]:
    """(method, path, body field names) of every route the engine serves."""
    stub = SimpleNamespace(
        frontend=SimpleNamespace(tokenizer=ByteTokenizer()), weight_control=None,
        scheduler=SimpleNamespace(step_hooks=[]),
        args=SimpleNamespace(api_key=None, admin_api_key=None, all_args={}),
        metrics=SimpleNamespace(enabled=True), tokenizer=ByteTokenizer(), model_path="")
    out = []
    for route in create_app(stub).routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method == "HEAD":
                continue
            fields = GENERATION.get(route.path)
            if fields is None:
                fields = tuple(k for b in route.dependant.body_params
                               for t in (b.field_info.annotation, *get_args(b.field_info.annotation))
                               for k in getattr(t, "model_fields", {}))
            out.append((method, route.path.replace("{model:path}", "tiny"), fields))
    return out


ROUTES = _routes()

small = st.one_of(st.none(), st.booleans(), st.integers(-3, 16), st.floats(-3, 3, allow_nan=False),
                  st.text(max_size=6))
json_values = st.recursive(small, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
# values no scalar or flat-list field accepts: a control body built from them is always refused
wrong_typed = st.one_of(st.lists(st.lists(small, min_size=1, max_size=2), min_size=1, max_size=2),
                        st.dictionaries(st.text(min_size=1, max_size=3),
                                        st.lists(st.lists(small, max_size=2), min_size=1),
                                        min_size=1, max_size=2))
raw_bodies = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"\xff\xfe\x00", b"{", b'{"a":', b"[" * 100_000, b"{\"a\":" * 50_000,
                     b"NaN", b'{"max_new_tokens": 1e999}', b'{"n": 100000000000000000000000}',
                     b'{"text": "\\ud800"}', b"", b"null", b"[]", b'"text"', b"12"]),
    json_values.map(lambda v: json.dumps(v).encode()))


def _not_a_valid_control_call(body: bytes) -> bool:
    """False for what a control route may take as a real call: no body, null, or any JSON
    object (unknown keys are ignored, every field has a default or is missing). Control
    routes get only bodies that cannot parse as a call, so the fuzz never pauses the engine,
    releases its memory or opens a weight update for real."""
    if not body.strip():
        return False
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return True
    return value is not None and not isinstance(value, dict)


def _objects(fields: tuple[str, ...], generation: bool):
    keys = st.sampled_from(fields) if fields else st.text(min_size=1, max_size=5)
    values = json_values if generation else wrong_typed
    obj = st.dictionaries(keys, values, min_size=1, max_size=4)
    if generation:
        sampling = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=4)
        obj = st.one_of(obj, st.fixed_dictionaries(
            {"text": st.text(min_size=1, max_size=8)},
            optional={"sampling_params": sampling, "stream": st.booleans(),
                      "return_logprob": st.booleans(), "top_logprobs_num": st.integers(-2, 5),
                      "logprob_start_len": st.integers(-3, 4)}),
            st.fixed_dictionaries({"model": st.text(max_size=5), "prompt": json_values,
                                   "messages": json_values}, optional={"max_tokens": small,
                                                                       "stream": st.booleans()}))
    return obj.map(lambda o: json.dumps(o).encode())


def _fuzz_route(url: str, method: str, path: str, fields: tuple[str, ...]) -> None:
    generation = path in GENERATION
    raw = raw_bodies if generation else raw_bodies.filter(_not_a_valid_control_call)

    @fuzz_settings(40 if generation else 12)
    @example(body=b"[" * 100_000, content_type="application/json", query={})  # was a 500
    @example(body=b'{"text": "\xff\xfe"}', content_type="application/json", query={})
    @given(body=st.one_of(raw, _objects(fields, generation)),
           content_type=st.sampled_from(["application/json", "text/plain", None]),
           query=st.dictionaries(st.sampled_from(QUERY_KEYS), st.text(max_size=5), max_size=2))
    def one(body: bytes, content_type: str | None, query: dict):
        headers = {"Content-Type": content_type} if content_type else {}
        r = requests.request(method, url + path, data=body if fields else None,
                             headers=headers, params=query, timeout=30)
        if r.status_code == 500 and STATE_500.get(path, "\0") in r.text:
            return
        assert r.status_code < 500, (method, path, body[:200], r.status_code, r.text[:300])

    one()


def test_no_route_answers_a_malformed_body_with_a_5xx_and_the_engine_keeps_serving(
        tiny_model_dir, tmp_path):
    """One test (one engine, one xdist worker): every route in turn, then the engine serves."""
    engine = start_engine(tiny_model_dir, tmp_path, "--enable-weights-cpu-backup",
                          "--context-length", "128", "--max-running-requests", "8")
    try:
        for method, path, fields in ROUTES:
            _fuzz_route(engine.url, method, path, fields)
        # nothing left it paused, released, in a weight update or broken
        assert engine.proc.poll() is None, engine.log_tail()
        assert engine.get("/ready").status_code == 200
        assert engine.get("/health_generate").status_code == 200
        r = engine.generate({"text": "still here", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        assert engine.get("/v1/loads?include=memory").json()["loads"][0]["memory"]["kv_cache_bytes"] > 0
    finally:
        stop_engine(engine)
