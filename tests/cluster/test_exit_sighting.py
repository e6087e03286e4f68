"""A server's death is seen when every thread of it starts exiting, not only once the
kernel has freed its memory and it is reaped (`cluster/exit_sighting.py`): by thread
pidfds where the kernel has them (6.9+), by reading the flags otherwise; both run here
where this kernel allows."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from slime_like.cluster import exit_sighting
from slime_like.cluster.exit_sighting import ExitSighting, exiting
from slime_like.cluster.process import ServerProcess

pytestmark = pytest.mark.skipif(not exit_sighting.available(),
                                reason="task flags in /proc are Linux's")

MODES = [pytest.param(False, id="flags"),
         pytest.param(True, id="thread-pidfds", marks=pytest.mark.skipif(
             not exit_sighting.thread_pidfds(), reason="thread pidfds need Linux 6.9+"))]

# The main thread ends alone (the exit syscall, not exit_group) while another thread lives.
MAIN_THREAD_ENDS = (
    "import ctypes, platform, threading, time\n"
    "threading.Thread(target=time.sleep, args=(120,)).start()\n"
    "ctypes.CDLL(None).syscall({'x86_64': 60, 'aarch64': 93}[platform.machine()], 0)\n")

# A server that holds 1 GiB of touched memory (the kernel frees it after a SIGKILL, before
# the process can be reaped), serves from a few threads and retires short-lived ones (a
# thread ending on its own is no death). It prints its marker built at run time: the log
# also holds the command line.
HOLDS_MEMORY = (
    "import threading, time\n"
    "held = bytearray(1 << 30)\n"
    "held[::4096] = b'x' * (len(held) // 4096)\n"
    "for _ in range(3):\n"
    "    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
    "for _ in range(6):\n"
    "    threading.Thread(target=time.sleep, args=(0.3,)).start()\n"
    "time.sleep(1.0)\n"
    "print('hold' + 'ing', flush=True)\n"
    "time.sleep(120)\n")

EXITING = ("is exiting: every thread of pid {pid} in the kernel's exit (killed or crashed; "
           "its memory being freed)")


def _state(pid: int) -> str | None:
    found = exit_sighting._state_flags(f"/proc/{pid}/stat")
    return found[0] if found else None


def _until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s")
        time.sleep(0.01)


def test_a_running_process_is_not_exiting_and_a_killed_unreaped_one_is():
    proc = subprocess.Popen(["sleep", "120"])
    try:
        assert not exiting(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        _until(lambda: _state(proc.pid) == "Z", "a zombie")  # dead, not reaped: pid kept
        assert exiting(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert exiting(proc.pid)  # gone altogether


@pytest.mark.parametrize("by_pidfd", MODES)
def test_a_main_thread_that_ends_while_another_serves_is_not_a_death(by_pidfd):
    proc = subprocess.Popen([sys.executable, "-c", MAIN_THREAD_ENDS])
    reaped, seen = threading.Event(), []
    try:
        ExitSighting(proc.pid, reaped, seen.append, by_pidfd=by_pidfd).start()
        _until(lambda: _state(proc.pid) == "Z", "a leader that ended")
        assert proc.poll() is None and len(os.listdir(f"/proc/{proc.pid}/task")) == 2
        assert not exiting(proc.pid)  # its leader is marked exiting; its other thread is not
        time.sleep(0.5)  # the sighting has looked (polls every 10 ms, or woke on the leader)
        assert seen == []
    finally:
        proc.kill()
        proc.wait()
        reaped.set()


def _kill_and_sight(log_path, by_pidfd: bool) -> tuple[list[str], bool, int]:
    """One held-memory child killed under an `ExitSighting` and reaped only after its
    finding: (what it reported, whether the process's own pidfd, readable once its last
    thread is done, already was then, the pid)."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", HOLDS_MEMORY], stdout=out)
    reaped, seen, whole_exit_done = threading.Event(), [], []
    sighted = threading.Event()
    process_fd = os.pidfd_open(proc.pid)

    def found(why: str) -> None:
        whole_exit_done.append(bool(select.select([process_fd], [], [], 0)[0]))
        seen.append(why)
        sighted.set()

    try:
        _until(lambda: "holding" in log_path.read_text(), "holding its memory", timeout=60)
        ExitSighting(proc.pid, reaped, found, by_pidfd=by_pidfd).start()
        time.sleep(0.1)  # the short-lived threads are gone: only a kill wakes it now
        assert seen == []
        os.kill(proc.pid, signal.SIGKILL)
        assert sighted.wait(30)
    finally:
        os.close(process_fd)
        proc.kill()
        proc.wait()
        reaped.set()
    return seen, whole_exit_done[0], proc.pid


@pytest.mark.parametrize("by_pidfd", MODES)
def test_the_sighting_finds_a_killed_process_before_its_reap(tmp_path, by_pidfd):
    """Each mode on its own, on a child reaped only after the finding. By thread pidfds
    the finding comes while the kernel is still freeing the memory (about 1 ms after the
    kill against tens of ms for the teardown; one of three kills suffices, for a loaded
    machine's scheduling)."""
    for attempt in range(3):
        seen, whole_exit_done, pid = _kill_and_sight(tmp_path / f"hold-{attempt}.log",
                                                     by_pidfd)
        assert seen == [EXITING.format(pid=pid)]
        if not by_pidfd or not whole_exit_done:
            break
    assert not by_pidfd or not whole_exit_done


def test_a_killed_server_is_down_before_the_kernel_has_freed_its_memory(tmp_path):
    """Through `ServerProcess`: `wait_down` returns when the threads exit, while (with
    thread pidfds) the process's last thread is still freeing the memory; `wait_exit` (the
    reap) still follows with the exit code. With the flags' poll, a poll may land after a
    fast teardown: one of three kills suffices."""
    outcomes = []
    for attempt in range(3):
        log = tmp_path / f"hold-{attempt}.log"
        server = ServerProcess([sys.executable, "-c", HOLDS_MEMORY], log_path=log,
                               name=f"hold-{attempt}")
        server.start()
        process_fd = os.pidfd_open(server.pid)
        try:
            _until(lambda log=log: "\nholding" in log.read_text(), "holding its memory",
                   timeout=60)
            assert server.wait_down(0) is None  # alive: not down
            os.kill(server.pid, signal.SIGKILL)
            reason = server.wait_down(10)
            whole_exit_done = bool(select.select([process_fd], [], [], 0)[0])
            outcomes.append((reason, whole_exit_done))
            assert server.wait_exit(10) == -signal.SIGKILL
            assert server.wait_down(0) == reason  # the first finding stays
        finally:
            os.close(process_fd)
            server.terminate(grace=1)
        if reason == EXITING.format(pid=server.pid) and not whole_exit_done:
            break
    assert outcomes[-1] == (EXITING.format(pid=server.pid), False), outcomes
