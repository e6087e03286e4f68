"""Scale commands for a running job: `slime-like fleet scale RUN_DIR --engines N`.

The job's fleet grows and shrinks while it trains (`Fleet.resize`: engines added, or
drained without losing a request); `--rollout-num-gpus` is where a run starts. An operator
asks through the run folder, the one thing both sides already share:

    RUN_DIR/scale/job.json             the running job (pid, host): no job, no command
    RUN_DIR/scale/requests/<id>.json   a command (`request_scale` writes it atomically)
    RUN_DIR/scale/answers/<id>.json    what the job did, or the error that stopped it

The job's `ScaleWatcher` takes the commands in order on a thread of its own, while the
steps go on. Whoever may write the run folder may scale the run, and no port is opened:
the command runs on the host that holds the run folder (the job's driver host).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

POLL_S = 0.5


class Resizable(Protocol):
    def resize(self, engines: int, *, model: str | None = None, deadline_s: float = 30.0,
               timeout_s: float = 600.0) -> dict: ...


class ScaleError(RuntimeError):
    """A scale command could not be sent, or the job answered with an error."""


def scale_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "scale"


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: the reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_job(run_dir: str | Path) -> dict:
    """The job running in `run_dir` (its job.json); ScaleError if none is."""
    path = scale_dir(run_dir) / "job.json"
    try:
        job = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ScaleError(f"{run_dir}: no job is running there (no {path}; give the job's "
                         "run folder, its --output-dir, once its engines serve)") from None
    if job.get("host") == socket.gethostname() and not _pid_alive(int(job.get("pid", 0))):
        raise ScaleError(f"{run_dir}: the job that ran there (pid {job.get('pid')}) has ended")
    return job


def request_scale(run_dir: str | Path, engines: int, *, model: str | None = None,
                  drain_deadline_s: float = 30.0, wait_s: float = 900.0) -> dict:
    """Ask the job running in `run_dir` for `engines` engines of `model`; its answer
    (`{"id": ...}` only, with `wait_s` 0). ScaleError if no job runs there, the job
    answered with an error, or no answer came within `wait_s`."""
    if engines < 1:
        raise ScaleError(f"--engines must be at least 1, got {engines}")
    running_job(run_dir)
    now = time.time_ns()  # ids sort in the order the commands were given
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9))
    rid = f"{stamp}.{now % 10**9:09d}-{uuid.uuid4().hex[:6]}"
    _write_json(scale_dir(run_dir) / "requests" / f"{rid}.json",
                {"id": rid, "engines": engines, "model": model,
                 "drain_deadline_s": drain_deadline_s, "at": time.time()})
    if wait_s <= 0:
        return {"id": rid}
    answer_path = scale_dir(run_dir) / "answers" / f"{rid}.json"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if answer_path.is_file():
            answer = json.loads(answer_path.read_text())
            if not answer.get("ok"):
                raise ScaleError(f"the job refused scale command {rid}: {answer.get('error')}")
            return answer
        running_job(run_dir)  # the job ended without answering
        time.sleep(0.2)
    raise ScaleError(f"no answer to scale command {rid} within {wait_s:g}s (it stays "
                     f"queued: {answer_path} will hold the answer)")


class ScaleWatcher:
    """The job's side: scale commands from the run folder, applied in order to the fleet."""

    def __init__(self, fleet: Resizable, run_dir: str | Path, poll_s: float = POLL_S):
        self.fleet = fleet
        self.dir = scale_dir(run_dir)
        self.poll_s = poll_s
        self.done: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ScaleWatcher:
        _write_json(self.dir / "job.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                            "started": time.time()})
        self._thread = threading.Thread(target=self._run, name="scale-commands", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for path in sorted((self.dir / "requests").glob("*.json")):
                if self._stop.is_set():
                    return
                self._apply(path)

    def _apply(self, path: Path) -> None:
        t0 = time.monotonic()
        try:
            req = json.loads(path.read_text())
            rid = str(req.get("id") or path.stem)
        except (OSError, ValueError) as err:
            req, rid = {}, path.stem
            answer: dict[str, Any] = {"ok": False, "error": f"unreadable command: {err}"}
        else:
            try:
                logger.warning("scale command %s: %s engines of %s", rid, req.get("engines"),
                               req.get("model") or "the updatable model")
                answer = {"ok": True, **self.fleet.resize(
                    int(req["engines"]), model=req.get("model"),
                    deadline_s=float(req.get("drain_deadline_s", 30.0)))}
            except Exception as err:  # noqa: BLE001 - the operator reads it; the job goes on
                logger.warning("scale command %s failed: %s", rid, err)
                answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        answer.update(id=rid, seconds=round(time.monotonic() - t0, 3))
        _write_json(self.dir / "answers" / f"{rid}.json", answer)
        path.unlink(missing_ok=True)
        self.done.append(answer)

    def stop(self) -> None:
        """No more commands (the job ends); one under way finishes first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        (self.dir / "job.json").unlink(missing_ok=True)
