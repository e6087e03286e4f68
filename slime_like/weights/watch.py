"""Waiting on engine calls during a transfer: deadlines, and the engine to blame.

Every HTTP call of a transfer is an `EngineCall` (engine, step, future). A `Watch` waits
with an overall deadline and gives up as soon as any watched call fails, naming the engine
and the step; after a broken collective it picks the engine that most likely broke it.
With a `CallClock` it also gives each call a deadline of its own, derived from what that
call type took across the engines: a call past it, counted from both its send and the first
answer another engine gave the same step, is that engine hanging (`WeightSyncError.hung`),
and the sync goes on without it instead of waiting for the health monitor to declare it
dead.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from slime_like.engine.deadlines import CallClock
from slime_like.engine.fanout import describe
from slime_like.engine.session import CallCancelled, EngineSession
from slime_like.errors import EngineError, WeightSyncError

# A call found past its deadline gets this long to show its answer is in already (its pool
# thread may not have run yet, e.g. while the trainer's own thread held the GIL; this wait
# lets go of the GIL, and a waiting thread gets it within the 5 ms switch interval).
LAST_CHANCE_S = 0.02
# How often a spinning wait looks for calls past their deadline (deadlines are >= the
# policy's floor, 0.2 s for a sync's calls: no need to look at every poll).
LATE_CHECK_S = 0.005
# How often a wait blocked on calls' futures wakes to look for one past its deadline.
WAKE_S = 0.02


class DeadlinePassed(WeightSyncError):
    """A wait's overall deadline passed (not one call's: see `Watch`)."""


def call_type(step: str) -> str:
    """The call type of a step's name: "update_weights_from_distributed (bucket 3/15)" is
    an "update_weights_from_distributed"."""
    return step.split(" (", 1)[0]


@dataclass
class EngineCall:
    """An HTTP call in flight to one engine, for one step of the transfer."""

    engine: EngineSession
    step: str
    future: Future
    started: float = field(default_factory=time.monotonic)

    @property
    def done_at(self) -> float | None:
        """When the engine answered (or the call failed unsent); set by its session."""
        return getattr(self.future, "answered_at", None)

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    @property
    def kind(self) -> str:
        return call_type(self.step)


class Watch:
    """Waits that give up at a deadline, or as soon as any watched engine call fails.

    This is what keeps the trainer out of a collective its peers never joined: an engine
    that answers 400 before joining a broadcast fails its HTTP call, and the wait on the
    broadcast sees that at once instead of sitting out the group timeout.
    """

    def __init__(self, timeout_s: float, clock: CallClock | None = None, *,
                 per_call: bool = True):
        """`clock`: with `per_call`, each call waited on gets its call type's deadline as
        of now (a group join does not: every join of a rendezvous waits for the slowest,
        so the late one cannot be told apart). The calls answered meanwhile are kept in
        `answered`, for the owner to teach the clock (the wait itself only looks up)."""
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._open: dict[int, EngineCall] = {}  # not answered yet, or failed
        self._finished: collections.deque[EngineCall] = collections.deque()
        self._failed: list[EngineCall] = []
        self.clock = clock
        self.limits = clock.snapshot() if clock is not None and per_call else {}
        self.per_call = bool(self.limits)
        self.answered: list[EngineCall] = []
        # Steps at least one engine answered -> when the first answer came (perf_counter).
        self._answered: dict[str, float] = {}
        self._late_check_at = 0.0

    @property
    def calls(self) -> list[EngineCall]:
        """The watched calls not answered yet, and those that failed."""
        return list(self._open.values())

    def add(self, call: EngineCall) -> EngineCall:
        self._open[id(call)] = call
        # Each call tells the watch once it ends: a check reads only what ended since the
        # last one, where looking at every call's future (a lock each) at each poll of a
        # transfer cost the trainer's CPU in proportion to the fleet.
        call.future.add_done_callback(lambda _f, c=call: self._finished.append(c))
        return call

    def check(self) -> None:
        """Raise the engine call that failed first (naming engine and step)."""
        while self._finished:
            c = self._finished.popleft()
            if c.future.exception() is not None:
                self._failed.append(c)
            else:
                self._open.pop(id(c), None)
                at = _answered_at(c.future)
                self._answered[c.step] = min(at, self._answered.get(c.step, at))
                self.answered.append(c)
        if self._failed:
            first = min(self._failed, key=lambda c: c.done_at or 0.0)
            raise call_error(first, first.error)
        if self.per_call and (now := time.monotonic()) >= self._late_check_at:
            self._late_check_at = now + LATE_CHECK_S
            late = self._late()
            if late:
                raise self._hung(late)

    def _late(self) -> list[EngineCall]:
        """Calls past their call type's deadline, on a step another engine answered (a
        step nobody answered is not one engine's hang: the trainer, or a collective).

        The deadline counts from the later of the call's send and the step's first answer:
        what the engines of a step share (a broadcast every receiver waits out, a trainer or
        host slow for a moment) is not one engine's lateness. A bucket's receivers all
        finish when its broadcast does, so on a loaded host a healthy engine that answered
        a little after its peers was once cut as hung because the broadcast itself ran long.
        A type without a basis yet is left to the call's own HTTP timeout."""
        now = time.perf_counter()
        late = [c for c in self._open.values()
                if (first := self._answered.get(c.step)) is not None
                and (sent := getattr(c.future, "sent_at", None)) is not None
                and (limit := self.limits.get(c.kind)) is not None
                and now - max(sent, first) > limit]
        if late:
            wait_futures([c.future for c in late], timeout=LAST_CHANCE_S)
            late = [c for c in late if not c.future.done()]
        return late

    def _hung(self, late: list[EngineCall]) -> WeightSyncError:
        assert self.clock is not None
        first = min(late, key=lambda c: c.future.sent_at)
        kind = first.kind
        now = time.perf_counter()
        waited = now - first.future.sent_at
        behind = now - self._answered[first.step]
        others = sorted({c.engine.url for c in late} - {first.engine.url})
        err = WeightSyncError(first.step, (
            f"no answer after {waited:.2f}s ({behind:.2f}s after another engine answered "
            f"the same step), past the deadline of {kind} "
            f"({self.limits[kind]:.2f}s = {self.clock.basis(kind)}): left out as hung"
            + (f"; also hung: {', '.join(others)}" if others else "")), first.engine.url)
        err.hung = sorted({c.engine.url for c in late})
        err.unresponsive = list(err.hung)
        return err

    def wait(self, done: Callable[[], bool], what: str, poll_s: float = 2e-4,
             max_poll_s: float = 1e-3) -> None:
        """Poll until done() (or an engine call fails, or the deadline passes): for what
        only polling can see (a collective's handle, a group formed). The poll starts at
        `poll_s` and doubles up to `max_poll_s`: each look checks every watched call, which
        at 64 engines costs the GIL the pool threads answering them need."""
        while not done():
            self._check_in_time(what)
            time.sleep(poll_s)
            poll_s = min(2 * poll_s, max_poll_s)

    def _check_in_time(self, what: str) -> None:
        """A failed call raised, a hung one too; then the overall deadline."""
        self.check()
        if time.monotonic() > self.deadline:
            slow = sorted({c.engine.url for c in self.calls if not c.future.done()})
            raise DeadlinePassed(
                what, f"not finished after {self.timeout_s:.0f}s"
                + (f"; engines still busy: {', '.join(slow)}" if slow else ""),
                slow[0] if slow else None)

    def wait_calls(self, calls: Sequence[EngineCall]) -> list:
        """Results of engine calls, failing fast on the first error among all watched.

        Blocks on the calls' futures (woken when all answered or one failed) rather than
        polling them: at 64 engines a poll every 0.2 ms held the GIL the engines' pool
        threads need to send and read the very calls it waited for. It still wakes every
        `WAKE_S` for the per-call deadlines, the overall one and a failure of another
        watched call."""
        what = calls[0].step if calls else ""
        while True:
            self._check_in_time(what)
            if all(c.future.done() for c in calls):
                break
            # Only these calls' futures: other watched calls (a transfer's updates) may run
            # far longer, and a failure among them is seen at the next wake.
            pending = [c.future for c in calls if not c.future.done()]
            wait_futures(pending, timeout=WAKE_S, return_when=FIRST_EXCEPTION)
        self.check()
        return [c.future.result() for c in calls]

    def explain(self, exc: BaseException, grace_s: float = 5.0) -> WeightSyncError:
        """The error for a failed collective, naming the engine that most likely broke it.

        A peer that refused a bucket, or died, breaks the collective for everyone, so the
        other engines' receives fail too. Called after our end of the group is closed (so no
        engine is still blocked), it waits for the engines' answers and picks, in order: an
        engine that no longer answers, an engine whose refusal is not itself a broken
        connection, then the earliest failure.
        """
        if isinstance(exc, WeightSyncError) and exc.hung:
            return exc  # past its deadline: the cause is known, and it will not answer
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(c.future.done() for c in self.calls):
            time.sleep(0.01)
        if isinstance(exc, WeightSyncError) and exc.engine is not None and \
                exc.__cause__ is not None and _blame_rank(exc.__cause__) == 1:
            # The first failure seen was an engine's own refusal, before any collective
            # broke: what failed later on other engines followed from it.
            return exc
        failed = sorted((c for c in self.calls if c.error is not None), key=_blame_order)
        if not failed:
            if isinstance(exc, WeightSyncError):
                return exc
            err = WeightSyncError("broadcast", f"{type(exc).__name__}: {exc}")
        else:
            first = failed[0]
            also = "" if isinstance(exc, WeightSyncError) else (
                f" (the broadcast then failed: {type(exc).__name__}: {exc})")
            err = WeightSyncError(first.step, describe(first.error) + also, first.engine.url)
        err.__cause__ = exc
        return err


def _answered_at(future: Future) -> float:
    """When a call's answer came, on the clock of its `sent_at` (now, if unknown)."""
    sent, seconds = getattr(future, "sent_at", None), getattr(future, "seconds", None)
    return time.perf_counter() if sent is None or seconds is None else sent + seconds


# What a receive reports when a *peer* broke the collective (not a cause, a consequence).
_COLLATERAL = ("pair.cc", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "NCCL error", "ncclRemoteError", "ncclSystemError")


def no_answer(exc: BaseException | None) -> bool:
    """An engine call that got no HTTP answer at all: the engine is gone, or its control
    loop is stuck (a refusal, by contrast, is an answer)."""
    return isinstance(exc, EngineError) and exc.status is None


def _blame_order(call: EngineCall) -> tuple[int, float]:
    """Engines that gave no answer first, the one asked earliest leading (the others timed
    out waiting on a collective it never joined); then refusals, the earliest first."""
    rank = _blame_rank(call.error)
    return rank, call.started if rank == 0 else (call.done_at or 0.0)


def _blame_rank(exc: BaseException) -> int:
    if isinstance(exc, CallCancelled):
        return 3  # never sent: a consequence of the failure, not a cause
    if no_answer(exc):
        return 0  # no answer at all: the engine is gone
    if not any(marker in str(exc) for marker in _COLLATERAL):
        return 1  # a refusal of its own (unknown group, bad layout, closed session...)
    return 2


def call_error(call: EngineCall, exc: BaseException) -> WeightSyncError:
    if isinstance(exc, WeightSyncError):
        return exc
    err = WeightSyncError(call.step, describe(exc), call.engine.url)
    if no_answer(exc):
        err.unresponsive = [call.engine.url]  # no answer (gone, or its control loop is stuck)
    err.__cause__ = exc
    return err
