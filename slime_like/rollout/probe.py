"""Every serving engine answers for the version it claims, by name, each step.

A sample does not say which engine made it (the router chose), so the step's samples alone
cannot name an engine that serves other weights than it claims, and one stale engine among
many is diluted in them. The probe asks each serving engine directly: a fixed set of
sequences (the first checked samples, up to `tokens` model tokens) scored by the engine
itself (its prompt log-probabilities, one prefill), compared with the trainer's at the
version the engine reported and at the version before it (`rollout/logprob_rule.py`).

The trainer's side costs no copy of past weights: it scores the same sequences at each
version the fleet serves and keeps those log-probabilities (a few KB a version), so the
previous version's are at hand when the next one is checked. Only the updatable model's
regular engines are probed (a prefill or decode engine of a PD pair cannot serve a request
alone; a frozen model's version never moves).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from slime_like.engine.session import EngineSession
from slime_like.protocol.modes import WorkerType
from slime_like.rollout.generate import Sample
from slime_like.rollout.logprob_rule import Leaning, NeighbourTest, neighbour_test
from slime_like.rollout.scoring import EngineScores, score_on_engines

logger = logging.getLogger(__name__)

KEEP_VERSIONS = 8  # the trainer's probe log-probabilities kept, newest first


class SpanScorer(Protocol):
    """The trainer's side of the check: each output token's log-probability at its span's
    version (`TrainerGroup.span_logprobs`, or `slime_like.api.LogprobChecker`'s adapter of
    your own scoring function)."""

    def span_logprobs(self, samples: list, temperature: float = 1.0,
                      kv_kept: bool = False) -> list[list[float]]: ...


@dataclass(frozen=True)
class EngineVerdict:
    """What the probe found of one engine."""

    engine_id: str
    url: str
    claimed: str
    tokens: int
    deviation: float                    # mean |engine - trainer at the claimed version|
    neighbour: NeighbourTest | None     # None: the previous version's numbers not at hand

    @property
    def leaning(self) -> Leaning:
        return self.neighbour.leaning if self.neighbour else Leaning.UNDECIDED

    def failure(self, tolerance: float) -> str | None:
        """Why this engine does not serve what it claims, or None."""
        if self.leaning is Leaning.PREVIOUS:
            assert self.neighbour is not None
            n = self.neighbour
            return (f"engine {self.engine_id} ({self.url}) claims weight version "
                    f"{self.claimed} but serves version {previous_of(self.claimed)}: on the "
                    f"probe's {n.tokens} tokens its log-probabilities match version "
                    f"{previous_of(self.claimed)}'s better than {self.claimed}'s (score "
                    f"{n.score:.3g} against a bound of {n.threshold:.3g}; {n.votes_previous} "
                    f"of {n.votes} tokens closer to it; the two versions differ by "
                    f"{n.separation:.2g} per token)")
        if self.deviation > tolerance:
            return (f"engine {self.engine_id} ({self.url}) claims weight version "
                    f"{self.claimed} but its log-probabilities of the probe's {self.tokens} "
                    f"tokens differ from the trainer's at that version by {self.deviation:.3g}"
                    f" per token on average (> {tolerance:g})")
        return None


def previous_of(version: str) -> str:
    return str(int(version) - 1) if version.isdigit() else "?"


@dataclass
class ProbeReport:
    """One step's probe: each engine's verdict, and the engines that did not answer."""

    verdicts: list[EngineVerdict] = field(default_factory=list)
    unanswered: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # answered, trainer could not judge

    def failures(self, tolerance: float) -> list[str]:
        return [why for v in self.verdicts if (why := v.failure(tolerance))]

    def metrics(self) -> dict:
        decided = [v for v in self.verdicts if v.leaning is Leaning.CLAIMED]
        separations = [v.neighbour.separation for v in self.verdicts if v.neighbour]
        return {"logprob_probe_engines": len(self.verdicts),
                "logprob_probe_confirmed": len(decided),
                "logprob_probe_undecided": sum(v.leaning is Leaning.UNDECIDED
                                               for v in self.verdicts),
                "logprob_probe_unanswered": len(self.unanswered) + len(self.skipped),
                "logprob_probe_max_deviation": max((v.deviation for v in self.verdicts),
                                                   default=float("nan")),
                "logprob_probe_separation": min(separations, default=float("nan"))}


class EngineProbe:
    """The fixed probe sequences and the trainer's log-probabilities of them by version."""

    def __init__(self, tokens: int = 256):
        self.budget = tokens
        self.pairs: list[tuple[list[int], list[int]]] = []
        self._trainer: dict[str, list[list[float]]] = {}

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def choose(self, samples: list[Sample]) -> None:
        """The first call's samples (single-version ones, model tokens only) up to the
        budget of tokens; later calls keep them, so versions compare on the same tokens."""
        if self.pairs or not self.enabled:
            return
        total = 0
        for s in samples:
            if s.mixed or s.loss_mask is not None or not s.output_ids:
                continue
            self.pairs.append((list(s.prompt_ids), list(s.output_ids)))
            total += len(s.output_ids)
            if total >= self.budget:
                break

    def ask_engines(self, handles: list[EngineSession]) -> tuple[list[EngineScores], dict[str, str]]:
        """Every regular engine scores the probe (their HTTP side, before any memory
        release of a colocated step)."""
        engines = [h for h in handles if h.worker_type == WorkerType.REGULAR]
        return score_on_engines(engines, self.pairs) if self.pairs else ([], {})

    def trainer_logprobs(self, version: str, trainer: SpanScorer) -> list[list[float]] | None:
        """The trainer's log-probabilities of the probe at `version` (temperature 1: what
        engines report for prompt tokens), kept; None if the trainer no longer has that
        version's weights."""
        if version in self._trainer:
            return self._trainer[version]
        if not version.isdigit():
            return None
        rows = [(p, o, [(int(version), 0, len(o))]) for p, o in self.pairs]
        try:
            scored = trainer.span_logprobs(rows, 1.0)
        except Exception as e:  # noqa: BLE001 - the trainer moved past that version
            logger.debug("probe: no trainer weights for version %s: %s", version, e)
            return None
        self._trainer[version] = scored
        for old in sorted(self._trainer, key=lambda v: int(v) if v.isdigit() else -1)[:-KEEP_VERSIONS]:
            del self._trainer[old]
        return scored

    def judge(self, answers: tuple[list[EngineScores], dict[str, str]], trainer: SpanScorer,
              fleet_version: int) -> ProbeReport:
        """Each engine's verdict. The fleet's version is scored first, so its numbers are
        kept for the next version's neighbour test even when no engine claims it."""
        scored, unanswered = answers
        report = ProbeReport(unanswered=dict(unanswered))
        if not self.pairs:
            return report
        self.trainer_logprobs(str(fleet_version), trainer)
        for s in scored:
            claimed = self.trainer_logprobs(s.version, trainer)
            if claimed is None:
                report.skipped[s.engine_id] = f"no trainer weights of version {s.version}"
                continue
            previous = self._trainer.get(previous_of(s.version))
            e = [x for row in s.logprobs for x in row]
            a = [x for row in claimed for x in row]
            deviation = sum(abs(x - y) for x, y in zip(e, a, strict=True)) / max(1, len(e))
            test = (neighbour_test(e, a, [x for row in previous for x in row])
                    if previous is not None else None)
            report.verdicts.append(EngineVerdict(s.engine_id, s.url, s.version, len(e),
                                                 deviation, test))
        return report
