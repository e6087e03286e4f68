"""What the fleet tests check after a fault (who is routed, everyone back in service, what
is left of a process or port) and how they drive one (rounds of requests, a SIGSTOP)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import psutil


def routed_urls(fleet, model: str = "policy") -> set[str]:
    """The engines the real router lists now."""
    return {w.url for w in fleet.routers[model].client.list_workers()}


def wait_all_registered(fleet, timeout: float = 60) -> None:
    """Recoveries and resyncs finished, and every engine REGISTERED (asserted)."""
    assert fleet.wait_recovered(timeout=120)
    deadline = time.monotonic() + timeout
    while set(fleet.states().values()) != {"REGISTERED"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(fleet.states().values()) == {"REGISTERED"}


def wait_until(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.05)


def running(pid: int) -> bool:
    """A live process (a zombie waiting for its reaper is gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def refused(url: str) -> bool:
    """Nothing listens at the URL's host and port any more."""
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((u.hostname, u.port)) != 0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process SIGSTOPped for the body; continued after it, whatever happened (a no-op
    when its recovery killed it meanwhile)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def recorder(fleet) -> list:
    """Every fleet event from now on, in order."""
    events: list = []
    fleet.subscribe(events.append)
    return events


def first(events: list, start: int = 0, **match) -> int | None:
    """Index of the first event from `start` whose attributes match (None if none)."""
    for i in range(start, len(events)):
        ev = events[i]
        if all(getattr(ev, k) == v if k != "kind" else ev.kind is v for k, v in match.items()):
            return i
    return None


class Rounds:
    """Rounds of generation on a thread until stopped (partial rollout on), every round
    kept for the checks."""

    def __init__(self, fleet, params: dict, prompts: int = 8, n: int = 2):
        self.fleet, self.params, self.n = fleet, params, n
        self.prompts = [[1 + i, 2 + i, 3 + i] for i in range(prompts)]
        self.rounds: list[list] = []
        self.gen = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Rounds:
        self._thread.start()
        wait_until(lambda: self.gen is not None or self.error is not None, what="the generator")
        return self

    def _run(self) -> None:
        try:
            with self.fleet.generator(keep_mixed_versions=True, partial_rollout=True) as gen:
                self.gen = gen
                while not self._stop.is_set():
                    self.rounds.append(gen.generate(self.prompts, self.n, self.params))
        except BaseException as err:  # noqa: BLE001 - raised by stop()
            self.error = err

    def wait_rounds(self, more: int = 1, timeout: float = 120.0, what: str = "a round") -> None:
        """`more` rounds end from now on."""
        done = len(self.rounds)
        wait_until(lambda: len(self.rounds) >= done + more or self.error is not None,
                   timeout, what)

    def stop(self) -> list[list]:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "a generation round never ended"
        if self.error is not None:
            raise self.error
        return self.rounds
