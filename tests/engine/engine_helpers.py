"""Helpers for engine tests: wait for processes to go, scan for leftover servers."""

from __future__ import annotations

import time

import psutil


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def server_processes(port: int) -> list[psutil.Process]:
    """Every live engine server process told to serve on `port` (the psutil scan)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = proc.info.get("cmdline") or []
            if "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, IndexError):
            pass
    return found

