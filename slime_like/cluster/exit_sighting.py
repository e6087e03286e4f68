"""A server's death seen when it starts, not when the kernel has finished it.

A killed or crashed process is reaped (`wait()` returns, the exit code exists) only after
the kernel has freed all its memory: 20-70 ms for a reference engine holding a few hundred
MB on a CPU host, longer on a loaded one, and a real sglang server also tears down its CUDA
context and the GPU memory it held. Until then the router keeps sending it requests.

The kernel marks every thread it is tearing down (`PF_EXITING`, set at the start of
`do_exit()`, before anything is freed), and `/proc/<pid>/task/<tid>/stat` shows those
flags. So the server is down once every thread of it carries the mark: no thread can still
answer a request. One thread alone exiting is not a death (a program's main thread may end
while others serve, a pool may retire a worker): a thread's exit only triggers a look at
every thread (`exiting`).

How `ExitSighting` learns that a thread exited:

  - Linux 6.9 and later: a pidfd per thread (`PIDFD_THREAD`) is readable once that thread
    has exited. The other threads of a killed process finish exiting within a millisecond
    (only the last one frees the memory), so a blocking `poll()` on a few of them wakes at
    once, costing nothing while the server lives. A single-threaded server has no such
    thread: its pidfd wakes at the end, as the reap does.
  - older kernels: the leader's flags are read every `POLL_INTERVAL_S` (one `pread` of an
    open /proc file, about 4 us).

Elsewhere (no /proc: macOS) `available()` is False and the reap alone tells the death.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: include/linux/sched.h: the task is in do_exit()
PF_EXITING = 0x00000004
#: include/uapi/linux/pidfd.h: a pidfd for one thread, readable once it exits (6.9+)
PIDFD_THREAD = os.O_EXCL
#: threads of the server watched at once by pidfd (any one of them exiting wakes the check)
WATCHED_THREADS = 4
#: how often the threads are listed again while fewer than WATCHED_THREADS are watched
RESCAN_S = 1.0
#: the flags' read interval on kernels without thread pidfds
POLL_INTERVAL_S = 0.01


def _state_flags(path: str) -> tuple[str, int] | None:
    """(state, flags) of one /proc stat file; None when it is gone."""
    try:
        with open(path, "rb") as f:
            return _parse(f.read())
    except OSError:
        return None


def _parse(data: bytes) -> tuple[str, int] | None:
    if not data:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')'
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[6])


@functools.cache
def available() -> bool:
    """Whether this host shows task flags in /proc (Linux); asked once per process."""
    return _state_flags(f"/proc/{os.getpid()}/stat") is not None


@functools.cache
def thread_pidfds() -> bool:
    """Whether this kernel gives pidfds for single threads (Linux 6.9+); asked once."""
    try:
        os.close(os.pidfd_open(threading.get_native_id(), PIDFD_THREAD))
        return True
    except (AttributeError, OSError):
        return False


def exiting(pid: int) -> bool:
    """True once every thread of process `pid` is in the kernel's exit path, or the process
    is gone; False while any thread of it runs, sleeps or is stopped."""
    leader = _state_flags(f"/proc/{pid}/stat")
    if leader is None:
        return True
    if not leader[1] & PF_EXITING:
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        thread = _state_flags(f"/proc/{pid}/task/{tid}/stat")
        if thread is not None and not thread[1] & PF_EXITING:
            return False
    return True


class ExitSighting:
    """Watches one live child process (its pid cannot be reused before the caller reaps
    it) and calls `on_exiting(reason)` once when every thread of it is exiting; stops when
    `reaped` is set first. `by_pidfd`: None picks what the kernel offers."""

    def __init__(self, pid: int, reaped: threading.Event, on_exiting: Callable[[str], None],
                 *, by_pidfd: bool | None = None, name: str = "server"):
        self.pid, self.reaped, self.on_exiting = pid, reaped, on_exiting
        self.by_pidfd = thread_pidfds() if by_pidfd is None else by_pidfd
        self._thread = threading.Thread(target=self._run, name=f"{name}-exit-sighting",
                                        daemon=True)

    def start(self) -> ExitSighting:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            seen = self._wait_on_threads() if self.by_pidfd else self._poll_flags()
        except Exception:  # noqa: BLE001 - the reap still tells the death
            logger.exception("pid %d: exit sighting failed; its reap alone will tell", self.pid)
            return
        if seen and not self.reaped.is_set():
            self.on_exiting(f"is exiting: every thread of pid {self.pid} in the kernel's exit "
                            "(killed or crashed; its memory being freed)")

    def _wait_on_threads(self) -> bool:
        """Block on pidfds of a few of the server's threads and on the process's own; each
        wake-up asks `exiting`. True when it says so, False once reaped."""
        try:
            process_fd = os.pidfd_open(self.pid)
        except OSError:
            return False  # reaped already
        poller = select.poll()
        poller.register(process_fd, select.POLLIN)
        watched: dict[int, int] = {}  # fd -> tid
        try:
            while not self.reaped.is_set():
                if len(watched) < WATCHED_THREADS:
                    self._watch_more(watched, poller)
                short = len(watched) < WATCHED_THREADS
                ready = poller.poll(RESCAN_S * 1000 if short else None)
                for fd, _ in ready:
                    if fd in watched:  # that thread is gone: watch another one
                        poller.unregister(fd)
                        os.close(fd)
                        del watched[fd]
                if ready and exiting(self.pid):
                    return True
            return False
        finally:
            for fd in [process_fd, *watched]:
                os.close(fd)

    def _watch_more(self, watched: dict[int, int], poller: select.poll) -> None:
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{self.pid}/task"))
        except OSError:
            return
        have = set(watched.values())
        for tid in tids:  # the oldest first: a server's long-lived threads
            if len(watched) >= WATCHED_THREADS:
                break
            if tid == self.pid or tid in have:
                continue  # the leader's own pidfd wakes only with the last thread
            with contextlib.suppress(OSError):  # exited meanwhile
                fd = os.pidfd_open(tid, PIDFD_THREAD)
                watched[fd] = tid
                poller.register(fd, select.POLLIN)

    def _poll_flags(self) -> bool:
        """Read the leader's flags every POLL_INTERVAL_S from one open file."""
        try:
            fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY)
        except OSError:
            return False
        try:
            while not self.reaped.wait(POLL_INTERVAL_S):
                try:
                    leader = _parse(os.pread(fd, 4096, 0))
                except OSError:  # gone: reaped
                    leader = None
                if (leader is None or leader[1] & PF_EXITING) and exiting(self.pid):
                    return True
            return False
        finally:
            os.close(fd)
