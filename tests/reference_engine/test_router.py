"""The real sglang-router 0.3.2 in front of two reference engines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from slime_like.cluster.ports import free_port


@pytest.fixture(scope="module")
def router(engine, engine_log_dir):
    """A router started with one worker (the TP=1 engine); the test adds the second."""
    port = free_port()
    log = open(engine_log_dir / f"router-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", engine.url, "--policy", "round_robin", "--log-level", "warn",
         "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (engine_log_dir / f"router-{port}.log").read_text()
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("router never became ready")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def _forward_steps(engine) -> int:
    return engine.get("/server_info").json()["internal_states"][0]["forward_steps"]


def test_router_adds_a_worker_and_spreads_generate_over_both_engines(router, engine, tp2_engine):
    r = requests.post(router + "/workers", json={"url": tp2_engine.url}, timeout=10)
    assert r.status_code == 202, r.text
    worker_id = r.json()["worker_id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = requests.get(router + "/workers", timeout=5).json()["workers"]
        if len(workers) == 2 and all(w["is_healthy"] for w in workers):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"worker never became healthy: {workers}")
    by_url = {w["url"]: w for w in workers}
    assert by_url[tp2_engine.url]["id"] == worker_id
    # The router read served_model_name / model_path from each engine's /server_info.
    assert by_url[engine.url]["model_id"] == "tiny"

    before = (_forward_steps(engine), _forward_steps(tp2_engine))
    outs = []
    for i in range(6):
        r = requests.post(router + "/generate", json={
            "text": f"through the router {i}", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "rid": f"routed-{i}"}, timeout=30)
        assert r.status_code == 200, r.text
        outs.append(r.json())
    after = (_forward_steps(engine), _forward_steps(tp2_engine))
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
    assert [o["meta_info"]["id"] for o in outs] == [f"routed-{i}" for i in range(6)]
    assert after[0] > before[0] and after[1] > before[1]  # round robin reached both engines

    with requests.post(router + "/generate", json={
            "text": "stream via router", "stream": True, "sampling_params": {"max_new_tokens": 3}},
            stream=True, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["finish_reason"] is not None

    r = requests.delete(router + f"/workers/{worker_id}", timeout=10)
    assert r.status_code == 202
