"""What the fleet's engines take for each call type, and the deadline that follows.

A `CallClock` keeps the last answers of each call type (pause, begin, a bucket update,
end, continue, a group join, a health probe...) across every engine it saw, and derives
each type's deadline from them (`config/deadlines.DeadlinePolicy`). One hung engine must
not hold the others for a timeout sized for the slowest call anything could make: a pause
that answers in a millisecond everywhere else is overdue after a second, while a bucket
update of a large model may take many. The cap is the caller's own timeout, which also
applies until enough answers are in.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

from slime_like.config.deadlines import DeadlinePolicy


class CallClock:
    """Recent answer times per call type (thread-safe) and each type's deadline."""

    def __init__(self, policy: DeadlinePolicy | None = None, cap_s: float = 300.0):
        self.policy = policy or DeadlinePolicy()
        self.cap_s = float(cap_s)
        self._answers: dict[str, deque[float]] = {}
        self._deadlines: dict[str, float] = {}  # cached until the next answer of the type
        self._lock = threading.Lock()

    def record(self, kind: str, seconds: float) -> None:
        """One answer of call type `kind` that took `seconds`."""
        with self._lock:
            answers = self._answers.get(kind)
            if answers is None:
                answers = self._answers[kind] = deque(maxlen=int(self.policy.window))
            answers.append(float(seconds))
            self._deadlines.pop(kind, None)

    def record_answer(self, kind: str, future: Future) -> None:
        """A lane call's round trip (`future.seconds`, set by its session), once, if it
        was answered without an error (a failure says nothing of how long answers take)."""
        seconds = getattr(future, "seconds", None)
        if seconds is None or getattr(future, "clocked", False) or not future.done() \
                or future.cancelled() or future.exception() is not None:
            return
        future.clocked = True  # type: ignore[attr-defined]
        self.record(kind, seconds)

    def snapshot(self) -> dict[str, float]:
        """The deadline of every call type with a basis (below the cap), as of now: what a
        wait looks up while it spins, without asking the clock each time."""
        with self._lock:
            kinds = list(self._answers)
        limits = {kind: self.deadline(kind) for kind in kinds}
        return {kind: limit for kind, limit in limits.items() if limit < self.cap_s}

    def deadline(self, kind: str) -> float:
        """Seconds a call of type `kind` may take before its engine counts as hung."""
        with self._lock:
            cached = self._deadlines.get(kind)
            if cached is not None:
                return cached
            answers = sorted(self._answers.get(kind, ()))
            p = self.policy
            if len(answers) < int(p.min_samples):
                out = self.cap_s
            else:
                index = min(len(answers) - 1, int(float(p.quantile) * len(answers)))
                out = min(self.cap_s, max(float(p.floor_s), float(p.factor) * answers[index]))
            self._deadlines[kind] = out
            return out

    def basis(self, kind: str) -> str:
        """How the deadline of `kind` was derived, for an error message."""
        with self._lock:
            count = len(self._answers.get(kind, ()))
        p = self.policy
        if count < int(p.min_samples):
            return f"the cap: {count} answers of {kind} so far, fewer than {p.min_samples}"
        return (f"max({p.floor_s:g}s, {p.factor:g} x the {p.quantile:g} quantile of the last "
                f"{count} answers of {kind}), at most {self.cap_s:g}s")
