"""TP rank processes live and die with their engine."""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.reference_engine.conftest import start_engine, stop_engine, wait_until_healthy


def _rank_pids(engine_pid: int) -> list[int]:
    """TP rank processes (spawned children; not multiprocessing's resource tracker)."""
    return [c.pid for c in psutil.Process(engine_pid).children()
            if "spawn_main" in " ".join(c.cmdline())]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_tp2_engine_reports_both_ranks(tp2_engine):
    info = tp2_engine.get("/server_info").json()
    assert info["tp_size"] == 2
    ranks = tp2_engine.post("/weights_checker", {}).json()["ranks"]
    assert [r["parallelism_info"][0]["tp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["checksums"] == ranks[1]["checksums"]  # every rank holds the full weights
    assert len(_rank_pids(tp2_engine.proc.pid)) == 1


def test_rank_dies_with_its_engine_and_engine_dies_with_its_rank(tiny_model_dir, engine_log_dir):
    a = start_engine(tiny_model_dir, engine_log_dir, "--tp-size", "2", "--skip-server-warmup",
                     wait_healthy=False)
    b = start_engine(tiny_model_dir, engine_log_dir, "--tp-size", "2", "--skip-server-warmup",
                     wait_healthy=False)
    try:
        wait_until_healthy(a)
        wait_until_healthy(b)
        (rank_a,) = _rank_pids(a.proc.pid)
        (rank_b,) = _rank_pids(b.proc.pid)
        os.kill(a.proc.pid, signal.SIGKILL)  # no cleanup runs: only PDEATHSIG/the watch can act
        a.proc.wait(timeout=10)
        assert _wait_gone(rank_a, 10), "rank 1 outlived its killed engine"
        os.kill(rank_b, signal.SIGKILL)  # a crashed rank takes the whole server down, as in sglang
        assert b.proc.wait(timeout=15) != 0
    finally:
        stop_engine(a)
        stop_engine(b)


def test_sigterm_stops_the_engine_even_with_a_stream_open(tiny_model_dir, engine_log_dir):
    import threading

    import requests

    e = start_engine(tiny_model_dir, engine_log_dir, "--skip-server-warmup")
    try:
        opened = threading.Event()

        def hold_stream() -> None:
            try:
                with requests.post(e.url + "/generate", json={"text": "x", "stream": True, "sampling_params": {
                        "max_new_tokens": 1000, "ignore_eos": True}}, stream=True, timeout=60) as r:
                    for _ in r.iter_lines():
                        opened.set()
            except requests.RequestException:
                pass

        t = threading.Thread(target=hold_stream, daemon=True)
        t.start()
        assert opened.wait(20)
        e.post("/pause_generation", {"mode": "in_place"})  # the stream now never ends by itself
        t0 = time.monotonic()
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=20) is not None
        assert time.monotonic() - t0 < 15
    finally:
        stop_engine(e)
