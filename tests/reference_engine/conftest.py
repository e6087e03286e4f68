"""Real reference-engine processes on free ports, shared by the tests of this package.

Starting an engine costs a few seconds (torch import, model load, warm-up), so engines are
session-scoped; a test that pauses, updates or releases an engine puts it back as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from slime_like.cluster.ports import free_port
from slime_like.reference_engine.step_floor import MIN_STEP_ENV
from tests.own_port import listens_on, lost_its_port

# Engines listen on loopback; a machine-wide HTTP proxy must never see these requests.
for _var in ("no_proxy", "NO_PROXY"):
    os.environ[_var] = ",".join(x for x in ("127.0.0.1", "localhost", os.environ.get(_var, "")) if x)


@dataclass
class RunningEngine:
    """One engine process and how to reach it."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str]

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def post(self, endpoint: str, body: dict | None = None, **kw) -> requests.Response:
        return requests.post(self.url + endpoint, json={} if body is None else body,
                             timeout=kw.pop("timeout", 60), **kw)

    def get(self, endpoint: str, **kw) -> requests.Response:
        return requests.get(self.url + endpoint, timeout=kw.pop("timeout", 60), **kw)

    def generate(self, body: dict, **kw) -> requests.Response:
        return self.post("/generate", body, **kw)


def start_engine(model_dir: Path, log_dir: Path, *extra: str, env: dict | None = None,
                 wait_healthy: bool = True, timeout: float = 90.0,
                 program: tuple[str, ...] = ("-m", "slime_like.reference_engine")) -> RunningEngine:
    """Launch `python -m slime_like.reference_engine` (or `program`, which takes the same
    flags: a wrapper that runs it) and wait until /health answers 200 from it. An engine
    whose port another process bound first is started again on another port."""
    for attempt in range(3):
        port = free_port()
        argv = [sys.executable, *program, "--model-path", str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), *extra]
        log_path = log_dir / f"engine-{port}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        engine = RunningEngine(f"http://127.0.0.1:{port}", proc, log_path, argv)
        if not wait_healthy:
            return engine
        try:
            wait_until_healthy(engine, timeout)
            return engine
        except RuntimeError:
            if attempt == 2 or not lost_its_port(engine.log_tail()):
                raise
    raise AssertionError("unreachable")


def wait_until_healthy(engine: RunningEngine, timeout: float = 90.0) -> None:
    """Poll /health until 200 from this engine (its process listens on the port); an
    engine that exits or never answers is stopped and reported."""
    deadline = time.monotonic() + timeout
    port = int(engine.url.rsplit(":", 1)[1])
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"engine exited with {engine.proc.returncode}:\n{engine.log_tail()}")
        with contextlib.suppress(requests.RequestException):
            if (requests.get(engine.url + "/health", timeout=5).status_code == 200
                    and listens_on(engine.proc.pid, port)):
                return
        time.sleep(0.2)
    stop_engine(engine)
    raise RuntimeError(f"engine not healthy after {timeout}s:\n{engine.log_tail()}")


def stop_engine(engine: RunningEngine) -> None:
    """SIGTERM the engine's process group, SIGKILL what is left after a grace period."""
    if engine.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGTERM)
        try:
            engine.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.proc.pid, signal.SIGKILL)
            engine.proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # TP ranks are in the same group
        os.killpg(engine.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def engine(tiny_model_dir, engine_log_dir) -> Iterator[RunningEngine]:
    """A TP=1 engine with metrics and a short health timeout (paused-health tests).

    Its steps last at least 3 ms, so a test's long request (1000 tokens) runs for seconds,
    not the tiny model's one second, and is still running when the test acts on it.
    """
    e = start_engine(tiny_model_dir, engine_log_dir, "--enable-metrics", "--served-model-name",
                     "tiny", "--max-running-requests", "16",
                     env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2", MIN_STEP_ENV: "3"})
    yield e
    stop_engine(e)


@pytest.fixture(scope="session")
def tp2_engine(tiny_model_dir, engine_log_dir) -> Iterator[RunningEngine]:
    """A TP=2 engine (rank 0 serves HTTP, rank 1 is a child process); weight tests use it."""
    e = start_engine(tiny_model_dir, engine_log_dir, "--tp-size", "2", "--weight-version", "v0")
    yield e
    stop_engine(e)


@pytest.fixture
def resumed(engine) -> Iterator[RunningEngine]:
    """The shared engine, continued and idle again after the test whatever happened."""
    yield engine
    engine.post("/continue_generation", {})
    engine.post("/abort_request", {"abort_all": True})
