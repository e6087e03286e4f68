"""A reference engine as a real server process pinned to one CPU core, for benchmarks.

One torch (OpenMP) thread on one core: what the engine's figures are per core, and nothing
else in the benchmark's process competes with it. The process has its own process group,
killed whole on `stop` (TP ranks included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_like.cluster.ports import free_port  # noqa: E402


@dataclass
class PinnedEngine:
    """One running engine: its process, URL and log."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after 15 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_pinned_engine(model_dir: Path, cpu: int, log: Path, *args: str,
                        timeout_s: float = 120.0,
                        env: dict[str, str] | None = None) -> PinnedEngine:
    """`python -m slime_like.reference_engine ARGS` on core `cpu` (`env` added to its
    environment), healthy or raised."""
    port = free_port()
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slime_like.reference_engine", "--model-path", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    engine = PinnedEngine(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(engine.url + "/health", timeout=5).status_code == 200:
                    return engine
            time.sleep(0.2)
        raise RuntimeError(f"engine not healthy in {timeout_s:.0f} s")
    except BaseException:
        engine.stop()
        raise
