"""/release_memory_occupation and /resume_memory_occupation by tag (docs/REFERENCE_ENGINE.md, "Weights").

The colocated flow users run around a train step: pause (retract), release weights and KV,
train, resume, push weights, continue. With `--enable-weights-cpu-backup` resuming `weights`
brings the same contents back; each tag is released and resumed on its own; generation is
refused (503) while weights or KV are released; resuming a tag that is not released is an
error (sglang crashes; here a 400).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator

import pytest

from slime_like.models.tokenizer import ByteTokenizer
from tests.reference_engine.conftest import RunningEngine, start_engine, stop_engine

TOK = ByteTokenizer()
GREEDY = {"input_ids": TOK.encode("memory by tag"),
          "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
          "return_logprob": True}


@pytest.fixture(scope="module")
def backup_engine(tiny_model_dir, engine_log_dir) -> Iterator[RunningEngine]:
    """A TP=2 engine keeping a host copy of its weights (sglang's --enable-weights-cpu-backup)."""
    e = start_engine(tiny_model_dir, engine_log_dir, "--tp-size", "2", "--enable-memory-saver",
                     "--enable-weights-cpu-backup")
    yield e
    stop_engine(e)


def _checksums(engine: RunningEngine) -> list[str]:
    body = engine.post("/weights_checker", {"action": "checksum"}).json()
    assert body["success"], body
    return [r["per_gpu_checksum"] for r in body["ranks"]]


def _kv_bytes(engine: RunningEngine) -> int:
    return engine.get("/v1/loads", params={"include": "memory"}).json()["loads"][0]["memory"]["kv_cache_bytes"]


def test_each_tag_is_released_and_resumed_on_its_own(backup_engine):
    e = backup_engine
    before = e.generate(GREEDY).json()
    sums = _checksums(e)

    assert e.post("/release_memory_occupation", {"tags": ["kv_cache"]}).json() is None
    assert _kv_bytes(e) == 0
    r = e.generate(GREEDY)
    assert r.status_code == 503 and "KV cache was released" in r.json()["message"]
    assert e.post("/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert _checksums(e) != sums  # storage dropped on both ranks
    assert e.post("/release_memory_occupation", {"tags": ["cuda_graph"]}).status_code == 200
    r = e.post("/release_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 400 and "already released" in r.json()["error"]["message"]

    assert e.post("/resume_memory_occupation", {"tags": ["weights"]}).json() is None
    assert _checksums(e) == sums  # the host copy came back on every rank
    assert e.generate(GREEDY).status_code == 503  # the KV cache is still released
    assert e.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert _kv_bytes(e) > 0
    after = e.generate(GREEDY).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["cached_tokens"] == 0  # releasing kv_cache flushed the prefix cache

    r = e.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 400 and "not released" in r.json()["error"]["message"]


def _start_running(pool: cf.ThreadPoolExecutor, e, body: dict) -> cf.Future:
    """Send `body` from `pool`; return once the engine runs it."""
    fut = pool.submit(e.generate, body, timeout=120)
    deadline = time.monotonic() + 30
    while e.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)
    return fut


def test_the_colocated_cycle_keeps_retracted_requests_and_serves_the_same_weights(backup_engine):
    """pause(retract) -> release all -> resume all -> continue: the retracted request ends
    exactly as an uninterrupted one."""
    e = backup_engine
    body = {**GREEDY, "sampling_params": {**GREEDY["sampling_params"], "max_new_tokens": 800}}
    want = e.generate(body).json()
    with cf.ThreadPoolExecutor(1) as pool:
        fut = _start_running(pool, e, body)
        assert e.post("/pause_generation", {"mode": "retract"}).status_code == 200
        r = e.post("/release_memory_occupation", {"tags": None})  # null = every tag
        assert r.status_code == 200, r.text
        assert _kv_bytes(e) == 0
        assert e.post("/resume_memory_occupation", {}).status_code == 200
        assert e.post("/continue_generation", {}).status_code == 200
        got = fut.result(timeout=120).json()
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["num_retractions"] == 1
    lps = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
    ref = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    assert all(abs(a - b) < 1e-5 for a, b in zip(lps, ref, strict=True))


def test_release_while_a_request_runs_is_refused(backup_engine):
    e = backup_engine
    body = {**GREEDY, "sampling_params": {**GREEDY["sampling_params"], "max_new_tokens": 800}}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = _start_running(pool, e, body)
        r = e.post("/release_memory_occupation", {"tags": ["kv_cache"]})
        assert r.status_code == 400 and "idle" in r.json()["error"]["message"]
        assert fut.result(timeout=120).status_code == 200
    assert _kv_bytes(e) > 0


@pytest.fixture(scope="module")
def plain_engine(tiny_model_dir, engine_log_dir) -> Iterator[RunningEngine]:
    """A colocated engine without a weights backup (the shipped colocate config's)."""
    e = start_engine(tiny_model_dir, engine_log_dir, "--enable-memory-saver")
    yield e
    stop_engine(e)


def test_a_frozen_model_without_a_backup_keeps_its_weights_through_the_fleets_release(
        plain_engine):
    """No sync ever refills a frozen model (a KL reference), so the fleet's release around a
    train step gives back everything but its weights; a trained engine gives back all."""
    from slime_like.engine.address import EngineAddress
    from slime_like.engine.session import EngineSession
    from slime_like.fleet.lifecycle import ManagedEngine
    from slime_like.fleet.offload import Offload

    e = plain_engine
    before, sums = e.generate(GREEDY).json(), _checksums(e)
    frozen = ManagedEngine("ref/g0/e0", "ref", [], update_weights=False,
                           handle=EngineSession(EngineAddress(e.url)))
    tags: dict = {}
    Offload._release(frozen, None, tags)
    assert tags["ref/g0/e0"] == ["kv_cache", "cuda_graph"]
    assert _kv_bytes(e) == 0 and _checksums(e) == sums  # KV given back, weights kept
    frozen.handle.resume_memory_occupation(tags["ref/g0/e0"])
    assert e.generate(GREEDY).json()["output_ids"] == before["output_ids"]

    trained = ManagedEngine("actor/g0/e0", "actor", [], update_weights=True,
                            handle=EngineSession(EngineAddress(e.url)))
    Offload._release(trained, None, tags)
    assert tags["actor/g0/e0"] is None  # all tags: the sync refills its weights
    assert _checksums(e) != sums
    trained.handle.resume_memory_occupation(None)
