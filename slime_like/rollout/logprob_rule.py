"""The rule that decides whether engines serve the weights they claim (pure; no I/O).

Two questions, each answered with evidence that survives numerical noise:

1. **Were a sample's tokens made by the claimed weights at all?** The engine's
   log-probabilities (batched decode over a KV cache) and the trainer's (one full forward)
   differ by rounding: a few ulps of the logits per token, with a long thin tail. One token
   must not decide a step, so the rule judges each span (one sample's tokens at one
   version) by the mean |engine - trainer| over its model tokens: a sample made by other
   weights moves every token, rounding moves a few.
2. **Is an engine one version behind while claiming the newer one?** At a small learning
   rate two neighbouring versions differ per token by about as little as the noise, so no
   tolerance tells them apart. The neighbour test does: with the engine's log-probabilities
   e, the trainer's at the claimed version a and at the previous one b, the score
   S = sum(|e - a| - |e - b|) leans positive when the engine matches the previous version.
   Each term lies within +-|a - b| whatever the noise, and its mean is <= 0 when the engine
   serves the claimed version (for any noise symmetric about zero), so by Hoeffding's
   inequality S >= t = ||a - b||_2 sqrt(2 ln(1/alpha)) happens with probability <= alpha
   for an engine at the claimed version, heavy tails included; S <= -t likewise confirms
   it. Where the versions differ a lot on a few tokens and little on the rest, that sum is
   weak (its bound grows with the largest differences), so a sign test runs beside it:
   each token votes for the version it is closer to, and an engine at the claimed version
   votes for the previous one with probability <= 1/2 per token, so votes beyond
   n/2 + sqrt(n ln(1/alpha) / 2) for either side decide too (each test at alpha/2). Between
   the two the versions are too close to tell apart on these tokens: undecided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np

#: Probability that the neighbour test calls an engine at the claimed version stale (or one
#: at the previous version current), per test: 1e-9 keeps a 1,000-step run of 64 engines
#: below 1e-4 of a false failure.
NEIGHBOUR_ALPHA = 1e-9


@dataclass(frozen=True)
class TokenDiff:
    """One compared token: where it is and both sides' log-probabilities."""

    sample: int
    position: int
    version: str
    engine: float
    trainer: float

    @property
    def diff(self) -> float:
        return abs(self.engine - self.trainer)

    def as_dict(self) -> dict:
        return {**asdict(self), "diff": self.diff, "p_engine": math.exp(self.engine),
                "p_trainer": math.exp(self.trainer)}


@dataclass
class NoiseSummary:
    """The distribution of |engine - trainer| over a step's model tokens: what a user
    watches for drift before it matters."""

    tokens: int = 0
    median: float = float("nan")
    p99: float = float("nan")
    max: float = float("nan")
    over_tolerance: int = 0       # tokens whose own difference exceeds the tolerance
    #: the largest differences, largest first: every token over the tolerance (up to
    #: `keep`), and at least the worst one
    worst: list[TokenDiff] = field(default_factory=list)

    @classmethod
    def of(cls, diffs: Sequence[TokenDiff], tolerance: float, keep: int = 5) -> NoiseSummary:
        if not diffs:
            return cls()
        values = np.fromiter((d.diff for d in diffs), dtype=np.float64, count=len(diffs))
        over = int((values > tolerance).sum())
        order = np.argsort(values)[::-1][:max(1, min(over, keep))]
        return cls(tokens=len(diffs), median=float(np.median(values)),
                   p99=float(np.quantile(values, 0.99)), max=float(values.max()),
                   over_tolerance=over, worst=[diffs[int(i)] for i in order])

    def metrics(self, prefix: str = "logprob_diff") -> dict:
        """metrics.jsonl fields: the quantiles, the count over the tolerance, and the worst
        tokens (position, both sides' log-probabilities and probabilities)."""
        return {f"{prefix}_median": self.median, f"{prefix}_p99": self.p99,
                f"{prefix}_max": self.max, f"{prefix}_over_tolerance": self.over_tolerance,
                f"{prefix}_worst": [w.as_dict() for w in self.worst]}


@dataclass(frozen=True)
class SpanDeviation:
    """One span's mean |engine - trainer| over its model tokens."""

    sample: int
    version: str
    tokens: int
    mean: float


def span_deviation(sample: int, version: str, engine: Sequence[float],
                   trainer: Sequence[float]) -> SpanDeviation:
    """The whole span's evidence: the mean absolute difference of its tokens."""
    if len(engine) != len(trainer):
        raise ValueError(f"sample {sample}, version {version}: {len(engine)} engine and "
                         f"{len(trainer)} trainer log-probabilities")
    if not engine:
        return SpanDeviation(sample, version, 0, 0.0)
    diff = np.abs(np.asarray(engine, dtype=np.float64) - np.asarray(trainer, dtype=np.float64))
    return SpanDeviation(sample, version, len(engine), float(diff.mean()))


class Leaning(str, Enum):
    """Which of two neighbouring versions an engine's log-probabilities match."""

    CLAIMED = "claimed"
    PREVIOUS = "previous"
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class NeighbourTest:
    """The neighbour test's numbers (see the module docstring)."""

    score: float        # sum(|e - a| - |e - b|): > 0 leans to the previous version
    threshold: float    # ||a - b||_2 sqrt(2 ln(2/alpha))
    separation: float   # mean |a - b|: how far apart the versions are on these tokens
    tokens: int
    votes: int = 0            # tokens closer to one version than the other
    votes_previous: int = 0   # of those, closer to the previous version
    vote_margin: float = 0.0  # sqrt(votes ln(2/alpha) / 2): votes beyond half that decide

    @property
    def leaning(self) -> Leaning:
        half = self.votes / 2.0
        if self.threshold > 0 and (self.score >= self.threshold
                                   or self.votes_previous - half >= self.vote_margin):
            return Leaning.PREVIOUS
        if self.threshold > 0 and (self.score <= -self.threshold
                                   or half - self.votes_previous >= self.vote_margin):
            return Leaning.CLAIMED
        return Leaning.UNDECIDED


def neighbour_test(engine: Sequence[float], claimed: Sequence[float],
                   previous: Sequence[float], alpha: float = NEIGHBOUR_ALPHA) -> NeighbourTest:
    """Does `engine` match the previous version's log-probabilities better than the
    claimed version's, beyond what any symmetric noise explains at level `alpha`?"""
    if not len(engine) == len(claimed) == len(previous):
        raise ValueError(f"neighbour test: {len(engine)} engine, {len(claimed)} claimed and "
                         f"{len(previous)} previous log-probabilities")
    e = np.asarray(engine, dtype=np.float64)
    a = np.asarray(claimed, dtype=np.float64)
    b = np.asarray(previous, dtype=np.float64)
    if e.size == 0:
        return NeighbourTest(0.0, 0.0, 0.0, 0)
    log_inv = math.log(2.0 / alpha)
    closer = np.abs(e - a) - np.abs(e - b)  # > 0: closer to the previous version
    decided = closer[(a != b) & (closer != 0)]
    return NeighbourTest(
        float(closer.sum()), float(np.linalg.norm(a - b) * math.sqrt(2.0 * log_inv)),
        float(np.abs(a - b).mean()), int(e.size), votes=int(decided.size),
        votes_previous=int((decided > 0).sum()),
        vote_margin=math.sqrt(decided.size * log_inv / 2.0))
