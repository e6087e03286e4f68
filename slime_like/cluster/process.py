"""ServerProcess: one engine server process, from spawn to a clean kill of its whole tree.

The server runs in its own process group with PR_SET_PDEATHSIG=SIGKILL, logs to a file,
and is watched by one thread that blocks in `wait()`, so an exit is seen the moment it
happens (no polling delay). That thread is also the one that spawns the child: Linux sends
the parent-death signal when the spawning *thread* exits, and this thread lives exactly as
long as the child, whatever thread the caller (a Ray actor method) runs on.

`wait()` returns only once the kernel has freed the dead server's memory; `wait_down` also
returns as soon as every thread of it is exiting (`exit_sighting.py`), so a crash is acted
on while its memory is still being freed. A relaunch still waits for the reap
(`terminate`): a new server never starts beside the old one's memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from slime_like.cluster import exit_sighting
from slime_like.errors import LaunchError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

# Removed before spawning, as slime does: they conflict with sglang's memory saver.
DROPPED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# slime's defaults for engine processes; each can be overridden from the job's environment.
DEFAULT_ENV = {
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_JIT_DEEPGEMM_FAST_WARMUP": "true",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    # /health must not queue a generation behind a paused scheduler; we probe on purpose.
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
}

ADDRESS_IN_USE_MARKERS = ("address already in use", "errno 98", "eaddrinuse")


def server_env(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None,
               local_hosts: Sequence[str] = ()) -> dict[str, str]:
    """The server's environment: the job's, slime's defaults under it, alloc confs removed,
    and our own hosts exempt from any HTTP proxy (a proxy breaks router <-> engine traffic)."""
    env = dict(os.environ if base is None else base)
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    for k in DROPPED_ENV:
        env.pop(k, None)
    env.update(extra or {})
    hosts = ["127.0.0.1", "localhost", "::1", *(h.strip("[]") for h in local_hosts)]
    for key in ("no_proxy", "NO_PROXY"):
        have = [h for h in env.get(key, "").split(",") if h]
        env[key] = ",".join(dict.fromkeys(have + hosts))
    return env


# Resolved here, in the parent: between fork and exec in a threaded process (a Ray worker)
# the child may call nothing that takes a lock, and dlopen does.
# Linux only; elsewhere (macOS laptops) only shutdown() takes the server down with us.
_prctl = (ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
          if sys.platform.startswith("linux") else None)


def _set_pdeathsig() -> None:
    """Runs in the child before exec: die with the parent, whatever killed it."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# Preferred: util-linux's `setpriv --pdeathsig` sets the same signal and execs the server, so
# no Python runs between fork and exec. Python there (`preexec_fn`) crashed children of a
# process whose other threads had run gloo collectives and FSDP (a trainer rank that also
# drives the fleet).
_SETPRIV = shutil.which("setpriv") if _prctl is not None else None


def _launch(argv: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """The argv to exec and the preexec function that give the child PDEATHSIG."""
    if _SETPRIV is not None:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
    return list(argv), _set_pdeathsig


def read_tail(path: Path, max_bytes: int = 6000) -> str:
    """The last bytes of a log file, decoded leniently."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ServerProcess:
    """One server process: start, wait healthy, notice exit at once, kill the whole tree."""

    def __init__(self, argv: Sequence[str], *, log_path: str | Path,
                 env: Mapping[str, str] | None = None, name: str = "engine"):
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else server_env()
        self.name = name
        self._proc: subprocess.Popen | None = None
        self._spawned = threading.Event()
        self._exited = threading.Event()
        self._down = threading.Event()  # exited, or every thread of it exiting
        self._down_reason = ""
        self._down_lock = threading.Lock()
        self._spawn_error: BaseException | None = None
        self._on_exit: list[Callable[[int], None]] = []
        self._children: set[int] = set()
        self._log_start = 0  # where this run's output begins in a log shared with earlier runs

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the server (from the watcher thread; see the module docstring)."""
        if self._proc is not None:
            raise LaunchError(f"{self.name}: already started (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._run, name=f"{self.name}-watch", daemon=True).start()
        self._spawned.wait()
        if self._spawn_error is not None:
            raise LaunchError(f"{self.name}: could not start {self.argv[:3]}: {self._spawn_error}")

    def _run(self) -> None:
        try:
            with open(self.log_path, "ab") as log:
                self._log_start = log.tell()
                log.write(f"[slime_like] starting: {' '.join(self.argv)}\n".encode())
                log.flush()
                argv, preexec = _launch(self.argv)
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, start_new_session=True, preexec_fn=preexec, close_fds=True)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._spawn_error = e
            self._exited.set()
            self._going_down(f"could not start: {e}")
            self._spawned.set()
            return
        self._spawned.set()
        if exit_sighting.available():
            exit_sighting.ExitSighting(self._proc.pid, self._exited, self._going_down,
                                       name=self.name).start()
        code = self._proc.wait()
        self._exited.set()
        self._going_down(f"exited with code {code}")
        for cb in list(self._on_exit):
            try:
                cb(code)
            except Exception:  # a callback's failure must not hide the exit from the others
                logger.exception("%s: exit callback failed", self.name)

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call `callback(returncode)` from the watcher thread the moment the server exits."""
        self._on_exit.append(callback)
        if self._exited.is_set() and self._proc is not None:
            callback(self._proc.returncode)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc and self._exited.is_set() else None

    def is_alive(self) -> bool:
        return self._proc is not None and not self._exited.is_set()

    def wait_exit(self, timeout: float | None = None) -> int | None:
        """Block until the server exits (or `timeout`); its return code, or None if alive."""
        self._exited.wait(timeout)
        return self.returncode

    def wait_down(self, timeout: float | None = None) -> str | None:
        """Block until the server is down: exited, or every thread of it exiting (killed or
        crashed, its memory still being freed). How it went down, or None if alive."""
        self._down.wait(timeout)
        return self._down_reason or None

    def _going_down(self, reason: str) -> None:
        with self._down_lock:
            if not self._down.is_set():
                self._down_reason = reason
                self._down.set()

    def log_tail(self, max_bytes: int = 6000) -> str:
        return read_tail(self.log_path, max_bytes)

    def exit_looks_like_address_in_use(self) -> bool:
        """Whether the server exited because a port was taken (the race `ports.py` describes),
        judged from this run's part of the log only."""
        if not self._exited.is_set():
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode("utf-8", "replace")[-20000:].lower()
        except OSError:
            return False
        return any(m in text for m in ADDRESS_IN_USE_MARKERS)

    def wait_healthy(self, probe: Callable[[], bool], timeout: float, *, interval: float = 0.25,
                     what: str = "healthy") -> float:
        """Poll `probe` until it returns True; seconds taken. The server exiting or the
        deadline passing raises LaunchError with the log tail."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            if self._exited.is_set():
                raise LaunchError(f"{self.name}: server exited with code {self.returncode} "
                                  f"before it was {what} (log: {self.log_path})", self.log_tail())
            if probe():
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise LaunchError(f"{self.name}: server not {what} after {timeout:.0f}s "
                                  f"(pid {self.pid}, log: {self.log_path})", self.log_tail())
            # Waiting on the exit event, not sleeping: an exit ends the wait at once.
            self._exited.wait(min(interval, max(0.0, deadline - time.monotonic())))

    # ---- teardown --------------------------------------------------------------------------

    def _tree(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        if self._proc is None:
            return procs
        try:
            root = psutil.Process(self._proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        # Children seen earlier may have been re-parented away from the root by now.
        for pid in self._children:
            try:
                p = psutil.Process(pid)
                if p not in procs:
                    procs.append(p)
            except psutil.NoSuchProcess:
                pass
        return procs

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the server, its process group and every descendant at once (no grace)."""
        self._signal_tree(sig)

    def _signal_tree(self, sig: signal.Signals) -> list[psutil.Process]:
        procs = self._tree()
        self._children.update(p.pid for p in procs[1:])
        if self._proc is not None:
            # The group outlives its leader: this reaches workers a crashed server orphaned.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        return procs

    def terminate(self, grace: float = 10.0) -> int | None:
        """SIGTERM the whole tree, SIGKILL what is left after `grace` seconds; the exit code."""
        if self._proc is None:
            return None
        procs = self._signal_tree(signal.SIGTERM)
        # The root is reaped by the watcher thread alone; psutil waiting on it would steal
        # its exit status.
        descendants = [p for p in procs if p.pid != self._proc.pid]
        self._exited.wait(grace)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.1, grace / 2))
        if not self._exited.is_set() or alive:
            self._signal_tree(signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)
            self._exited.wait(5)
        return self.returncode
