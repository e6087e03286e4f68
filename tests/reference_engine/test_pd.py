"""PD disaggregation: sglang-router 0.3.2 in PD mode in front of a prefill and a decode engine.

The router posts every request to both engines with bootstrap host/port/room; the prefill
engine hands the prompt's KV, first token and RNG state to the decode engine through its
bootstrap port. What users rely on: the tokens and log-probabilities are those a regular
engine with the same weights produces, a lost hand-off fails fast with a clear error, and
weight updates reach both engines.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest
import requests

from slime_like.cluster.ports import free_port
from slime_like.models.loading import init_dummy_weights, load_pretrained
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.router.router import Router
from slime_like.weights import WeightSync
from tests.reference_engine.conftest import start_engine, stop_engine

TOK = ByteTokenizer()
WAITING_TIMEOUT_S = 3  # decode side: how long a room may take to arrive
BOOTSTRAP_TIMEOUT_S = 5  # prefill side: how long a hand-off waits for its decode engine


@pytest.fixture(scope="module")
def pd(tiny_model_dir, engine_log_dir):
    """(router url, prefill, decode, regular): one weight version everywhere to start with."""
    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
           "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)}
    bootstrap_port = free_port()
    engines = []
    router = Router(host="127.0.0.1", pd_disaggregation=True,
                    router_flags={"policy": "round_robin"}, log_dir=engine_log_dir)
    try:
        prefill = start_engine(tiny_model_dir, engine_log_dir, "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", str(bootstrap_port),
                               "--weight-version", "v0", env=env)
        engines.append(prefill)
        decode = start_engine(tiny_model_dir, engine_log_dir, "--disaggregation-mode", "decode",
                              "--weight-version", "v0", env=env)
        engines.append(decode)
        regular = start_engine(tiny_model_dir, engine_log_dir, "--weight-version", "v0")
        engines.append(regular)
        router.start()
        # Registered the way the project's router/ does: POST /workers with the worker type.
        router.client.add_worker(prefill.url, worker_type="prefill", bootstrap_port=bootstrap_port)
        router.client.add_worker(decode.url, worker_type="decode")
        router.client.wait_ready(timeout=30)
        yield router.url, prefill, decode, regular, bootstrap_port
    finally:
        router.stop()
        for e in engines:
            stop_engine(e)


def _bodies() -> list[dict]:
    """Greedy and seeded-sampling requests, with and without prompt logprobs."""
    bodies = []
    for i in range(8):
        sp = {"max_new_tokens": 12, "ignore_eos": True}
        sp.update({"temperature": 0} if i % 2 == 0 else
                  {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1000 + i})
        body = {"input_ids": TOK.encode(f"prompt number {i} for pd"), "sampling_params": sp,
                "return_logprob": True, "top_logprobs_num": 2 if i % 3 == 0 else 0}
        if i % 4 == 1:
            body["logprob_start_len"] = 0
        bodies.append(body)
    return bodies


def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        resps = list(pool.map(lambda b: requests.post(url + "/generate", json=b, timeout=120), bodies))
    for r in resps:
        assert r.status_code == 200, r.text
    return [r.json() for r in resps]


def _assert_same_generation(pd_out: dict, ref_out: dict, exact: bool = False) -> None:
    assert pd_out["output_ids"] == ref_out["output_ids"]
    pm, rm = pd_out["meta_info"], ref_out["meta_info"]
    assert [t for _, t, _ in pm["output_token_logprobs"]] == pd_out["output_ids"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        got = [lp for lp, _, _ in pm[key]]
        want = [lp for lp, _, _ in rm[key]]
        assert len(got) == len(want), key
        if exact:
            assert got == want, key
        else:  # fp32; batch composition differs between the two runs
            assert all((a is None and b is None) or abs(a - b) < 1e-5 for a, b in zip(got, want, strict=True)), key
    if "output_top_logprobs" in rm:
        assert [[t for _, t, _ in row] for row in pm["output_top_logprobs"]] == \
               [[t for _, t, _ in row] for row in rm["output_top_logprobs"]]
    assert pm["finish_reason"] == rm["finish_reason"]
    assert pm["prompt_tokens"] == rm["prompt_tokens"] and pm["completion_tokens"] == rm["completion_tokens"]


def _steps(engine) -> int:
    return engine.get("/server_info").json()["internal_states"][0]["forward_steps"]


def test_a_batch_through_the_pd_router_matches_a_regular_engine(pd):
    router_url, prefill, decode, regular, _ = pd
    before = (_steps(prefill), _steps(decode))
    bodies = _bodies()
    got = _post_all(router_url, bodies)
    want = _post_all(regular.url, bodies)
    for g, w in zip(got, want, strict=True):
        _assert_same_generation(g, w)
    # The router merged the prefill engine's prompt logprobs (the decode side has none).
    assert len(got[1]["meta_info"]["input_token_logprobs"]) == len(bodies[1]["input_ids"])
    assert after_both_worked(before, prefill, decode)

    # One request alone on each side: the same forward shapes, so bit-identical numbers.
    lone = bodies[1]
    _assert_same_generation(requests.post(router_url + "/generate", json=lone, timeout=60).json(),
                            regular.generate(lone).json(), exact=True)

    # Streaming through the router ends with the same answer.
    with requests.post(router_url + "/generate", json={**bodies[3], "stream": True}, stream=True,
                       timeout=60) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    import json
    _assert_same_generation(json.loads(events[-2]), want[3])

    # Without logprobs the router does not wait for the prefill answer; same tokens.
    plain = {k: v for k, v in bodies[2].items() if k not in ("return_logprob", "top_logprobs_num")}
    r = requests.post(router_url + "/generate", json=plain, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == want[2]["output_ids"]

    # The OpenAI routes go through the same hand-off (checked here: one fixture, one worker).
    _assert_openai_routes_match(pd)


def after_both_worked(before: tuple[int, int], prefill, decode) -> bool:
    return _steps(prefill) > before[0] and _steps(decode) > before[1]


def test_a_room_that_never_arrives_fails_with_500_in_bounded_time(pd):
    _, prefill, decode, _, bootstrap_port = pd
    room = random.getrandbits(62)
    body = {"input_ids": TOK.encode("lost room"), "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    t0 = time.monotonic()
    r = decode.generate(body, timeout=60)
    waited = time.monotonic() - t0
    assert r.status_code == 500, r.text
    message = r.json()["message"]
    assert f"bootstrap_room={room}" in message and "timed out" in message
    assert WAITING_TIMEOUT_S - 0.5 <= waited < WAITING_TIMEOUT_S + 10

    # A bootstrap port where no prefill engine listens: the same bounded failure.
    r = decode.generate({**body, "bootstrap_port": free_port()}, timeout=60)
    assert r.status_code == 500 and "might be dead" in r.json()["message"]

    # The prefill side: a hand-off no decode engine takes fails the prefill request too.
    t0 = time.monotonic()
    r = prefill.generate({**body, "bootstrap_room": room + 1}, timeout=60)
    assert r.status_code == 500 and "no decode engine took" in r.json()["message"]
    assert time.monotonic() - t0 < BOOTSTRAP_TIMEOUT_S + 10
    # A request the prefill engine refuses (here: longer than its context) fails the decode
    # side at once, not after its waiting timeout.
    p = prefill.generate({**body, "input_ids": [5] * 2000, "bootstrap_room": room + 2}, timeout=60)
    assert p.status_code == 400 and "longer than the model's context length" in p.text
    t0 = time.monotonic()
    d = decode.generate({**body, "bootstrap_room": room + 2}, timeout=60)
    assert d.status_code == 500 and "prefill engine refused the request" in d.json()["message"]
    assert time.monotonic() - t0 < WAITING_TIMEOUT_S
    # Both engines still serve.
    assert decode.get("/health").status_code == 200 and prefill.get("/health").status_code == 200


def test_after_a_weight_update_on_both_engines_pd_matches_a_regular_engine(pd, tiny_model_dir):
    router_url, prefill, decode, regular, _ = pd
    model = load_pretrained(tiny_model_dir)
    init_dummy_weights(model, seed=4242)
    sync = WeightSync([(prefill.url, 1), (decode.url, 1), (regular.url, 1)],
                      update_weight_buffer_size=64 << 10, http_timeout_s=60, group_timeout_s=60)
    try:
        sync.update(model, weight_version="v1")
    finally:
        sync.close()
    sums = {e.url: e.post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"]
            for e in (prefill, decode, regular)}
    assert len(set(sums.values())) == 1, sums
    bodies = _bodies()[:4]
    got = _post_all(router_url, bodies)
    want = _post_all(regular.url, bodies)
    for g, w in zip(got, want, strict=True):
        _assert_same_generation(g, w)
        assert g["meta_info"]["weight_version"] == "v1"
        assert g["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 12}]


def test_an_abort_pause_of_the_decode_engine_aborts_requests_waiting_for_their_kv(pd):
    _, _, decode, _, bootstrap_port = pd
    body = {"input_ids": TOK.encode("waiting for kv"), "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(62)}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(decode.generate, body, timeout=60)
        time.sleep(0.5)  # the request is now polling the prefill's bootstrap server
        t0 = time.monotonic()
        try:
            assert decode.post("/pause_generation", {"mode": "abort"}).status_code == 200
            r = fut.result(timeout=30)
        finally:
            decode.post("/continue_generation", {})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert time.monotonic() - t0 < WAITING_TIMEOUT_S - 0.5  # well before the waiting timeout


def _assert_openai_routes_match(pd) -> None:
    """Chat and completions through the PD router: the prefill engine hands the KV over and
    the decode engine answers, as for /generate."""
    router_url, prefill, decode, regular, _ = pd
    before = (_steps(prefill), _steps(decode))
    chat = {"model": "m", "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 6,
            "temperature": 0.0, "logprobs": True, "ignore_eos": True}
    got = requests.post(router_url + "/v1/chat/completions", json=chat, timeout=60)
    want = requests.post(regular.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert got.status_code == 200, got.text
    got = got.json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert [e["logprob"] for e in got["choices"][0]["logprobs"]["content"]] == pytest.approx(
        [e["logprob"] for e in want["choices"][0]["logprobs"]["content"]], abs=1e-5)
    assert after_both_worked(before, prefill, decode)
    completion = {"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0.0,
                  "ignore_eos": True}
    got = requests.post(router_url + "/v1/completions", json=completion, timeout=60)
    assert got.status_code == 200, got.text
    want = requests.post(regular.url + "/v1/completions", json=completion, timeout=60).json()
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
