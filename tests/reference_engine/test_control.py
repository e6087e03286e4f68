"""Pause modes with requests in flight, continue, abort, flush and health while paused."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

LONG = {"max_new_tokens": 600, "ignore_eos": True}


def _loads(engine) -> dict:
    return engine.get("/v1/loads").json()["loads"][0]


def _wait_running(engine, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _loads(engine)["num_running_reqs"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{n} requests never ran: {_loads(engine)}")


@pytest.fixture
def pool():
    with cf.ThreadPoolExecutor(8) as ex:
        yield ex


def _launch(engine, pool, n: int, params: dict = LONG, prefix: str = "inflight"):
    futs = [pool.submit(engine.generate, {"text": f"{prefix} {i}", "rid": f"{prefix}-{i}",
                                          "sampling_params": params}) for i in range(n)]
    _wait_running(engine, n)
    return futs


def test_pause_abort_returns_after_in_flight_requests_came_back_aborted(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 2, prefix="abort-mode")
    r = engine.post("/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    # The pause call returned only after both requests had been answered.
    loads = _loads(engine)
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0
    for f in futs:
        meta = f.result(timeout=5).json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                         "err_type": None}
        assert meta["completion_tokens"] < LONG["max_new_tokens"]
    assert engine.get("/ready").status_code == 503
    assert engine.get("/ping").status_code == 200


def test_new_requests_wait_while_paused_and_run_after_continue(resumed, pool):
    engine = resumed
    engine.post("/pause_generation", {"mode": "in_place"})
    fut = pool.submit(engine.generate, {"text": "held", "sampling_params": {"max_new_tokens": 3}})
    time.sleep(0.5)
    assert not fut.done()  # held at the pause gate, not rejected
    r = engine.post("/continue_generation", {})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert fut.result(timeout=20).status_code == 200
    assert engine.get("/ready").status_code == 200


def test_pause_retract_frees_kv_and_requests_resume_with_their_tokens(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 2, {"max_new_tokens": 300, "ignore_eos": True}, prefix="retract")
    engine.post("/pause_generation", {"mode": "retract"})
    loads = _loads(engine)
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 2
    assert loads["num_used_tokens"] == 0
    # Retracted requests hold no KV, so a paused engine counts as idle for flush.
    assert engine.post("/flush_cache").status_code == 200
    r = engine.post("/update_weight_version", {"new_version": "after-retract", "abort_all_requests": False})
    assert r.json() == {"success": True, "message": "Weight version updated to after-retract",
                        "new_version": "after-retract"}
    try:
        engine.post("/continue_generation", {})
        for f in futs:
            meta = f.result(timeout=60).json()["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": 300}
            assert meta["num_retractions"] == 1
            spans = meta["weight_versions"]
            assert [s["version"] for s in spans] == ["default", "after-retract"]
            assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
            assert spans[1]["end"] == 300 and meta["weight_version"] == "after-retract"
    finally:
        engine.post("/update_weight_version", {"new_version": "default", "abort_all_requests": False})


def test_pause_in_place_keeps_kv_so_flush_is_refused_until_they_finish(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 2, {"max_new_tokens": 200, "ignore_eos": True}, prefix="inplace")
    engine.post("/pause_generation", {"mode": "in_place"})
    loads = _loads(engine)
    assert loads["num_running_reqs"] == 2 and loads["num_used_tokens"] > 0
    r = engine.post("/flush_cache")
    assert r.status_code == 400 and r.text == "Flush cache failed.\n"
    time.sleep(0.3)
    assert _loads(engine)["num_used_tokens"] == loads["num_used_tokens"]  # frozen
    engine.post("/continue_generation", {})
    for f in futs:
        meta = f.result(timeout=60).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["num_retractions"] == 0
    assert engine.post("/flush_cache").status_code == 200


def test_flush_is_refused_while_busy_and_waits_with_timeout(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 1, {"max_new_tokens": 150, "ignore_eos": True}, prefix="busy")
    r = engine.post("/flush_cache")
    assert r.status_code == 400 and r.text == "Flush cache failed.\n"
    r = engine.post("/flush_cache?timeout=0.01")
    assert r.status_code == 400 and r.text == "Timed out waiting for idle state."
    r = engine.post("/flush_cache?timeout=30")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert _loads(engine)["num_running_reqs"] == 0  # the deferred flush waited for the request
    assert futs[0].result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.get("/flush_cache").status_code == 200  # GET works too, as in sglang


def test_abort_request_by_exact_rid_and_abort_all(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 3, prefix="victim")
    engine.post("/abort_request", {"rid": "victim"})  # not an exact rid: nothing happens
    engine.post("/abort_request", {"rid": "victim-1"})
    assert futs[1].result(timeout=10).json()["meta_info"]["finish_reason"]["message"] == "Aborted"
    time.sleep(0.05)
    assert not futs[0].done() and not futs[2].done()
    r = engine.post("/abort_request", {"abort_all": True})
    assert r.status_code == 200 and r.content == b""
    for f in (futs[0], futs[2]):
        assert f.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_of_a_retracted_request_answers_abort_in_waiting_queue(resumed, pool):
    engine = resumed
    futs = _launch(engine, pool, 1, {"max_new_tokens": 400, "ignore_eos": True}, prefix="waitq")
    engine.post("/pause_generation", {"mode": "retract"})
    engine.post("/abort_request", {"rid": "waitq-0"})
    meta = futs[0].result(timeout=10).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert meta["completion_tokens"] > 0  # tokens made before the retraction
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta


def test_health_blocks_while_paused_then_503_and_recovers(resumed):
    engine = resumed  # started with SGLANG_HEALTH_CHECK_TIMEOUT=2
    assert engine.get("/health").status_code == 200
    assert engine.get("/health_generate").status_code == 200
    engine.post("/pause_generation", {"mode": "retract"})
    t0 = time.monotonic()
    assert engine.get("/health").status_code == 503
    assert 1.5 < time.monotonic() - t0 < 10
    assert engine.get("/ping").status_code == 200
    engine.post("/continue_generation", {})
    assert engine.get("/health").status_code == 200


def test_abort_of_a_request_held_at_the_pause_gate_answers_it_at_once(resumed, pool):
    engine = resumed
    engine.post("/pause_generation", {"mode": "in_place"})
    fut = pool.submit(engine.generate, {"text": "gated", "rid": "gated-rid",
                                        "sampling_params": {"max_new_tokens": 3}})
    time.sleep(0.3)
    assert not fut.done()
    engine.post("/abort_request", {"rid": "gated-rid"})
    meta = fut.result(timeout=10).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert meta["completion_tokens"] == 0


def test_health_answers_at_once_while_every_slot_is_busy(resumed, pool):
    engine = resumed  # 16 slots
    with cf.ThreadPoolExecutor(16) as many:
        futs = [many.submit(engine.generate, {"text": f"busy {i}", "sampling_params": {
            "max_new_tokens": 800, "ignore_eos": True}}) for i in range(16)]
        _wait_running(engine, 16)
        t0 = time.monotonic()
        assert engine.get("/health").status_code == 200
        assert time.monotonic() - t0 < 1.5
        engine.post("/abort_request", {"abort_all": True})
        assert all(f.result(timeout=30).status_code == 200 for f in futs)


def test_a_continue_answered_is_seen_by_the_next_loads_read(resumed, pool):
    """Whoever continued an engine and then reads /v1/loads (the trainer's check that it
    left no engine paused) sees it serving: in sglang the read queues behind the resume at
    the scheduler, so the answer to continue must not come before the resume applied.
    Requests are in flight, so the scheduler is between steps when the resume arrives."""
    engine = resumed
    futs = _launch(engine, pool, 2, prefix="continue-seen")
    for round_ in range(40):
        engine.post("/pause_generation", {"mode": "retract" if round_ % 2 else "in_place"})
        assert _loads(engine)["paused"], round_
        engine.post("/continue_generation", {})
        assert not _loads(engine)["paused"], f"round {round_}: still paused after continue"
    engine.post("/abort_request", {"abort_all": True})
    for f in futs:
        assert f.result(timeout=20).status_code == 200
