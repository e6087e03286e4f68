"""Your trainer's own log-probability check: the job's rule and probe over a fleet you
launched (`slime_like.api.LogprobChecker`).

You give a scoring function of your model, `score(version, pairs, temperature)`: per
(prompt_ids, output_ids) pair, the log-probability of each output token under your
weights of `version` (raise `LookupError` for a version you no longer hold). The checker
asks every serving engine to score a fixed probe by name and checks a batch's samples
exactly as the job does (`rollout/logprob_check.py`): it raises `LogprobMismatch` naming
an engine that serves other weights than it claims, and returns the noise it saw.
Score each version right after you push it (call `check` once per push): the previous
version's numbers are then kept for the neighbour test without a copy of old weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slime_like.engine.session import EngineSession
from slime_like.fleet.fleet import Fleet
from slime_like.rollout.generate import Sample
from slime_like.rollout.logprob_check import LogprobCheck, check_logprobs
from slime_like.rollout.probe import EngineProbe

Pairs = list[tuple[list[int], list[int]]]
ScoreFn = Callable[[int, Pairs, float], list[list[float]]]


def serving_handles(fleet: Fleet) -> list[EngineSession]:
    """The updatable model's serving engines, each under the fleet's name for it (what the
    report, the console and events call it): a session of its own per engine, for the
    probe's scoring requests (a session is no dataclass, its address is)."""
    names = {e.url: e.engine_id for e in list(fleet.engines) if e.url}
    return [EngineSession(replace(h.address, engine_id=names.get(h.url, h.engine_id)))
            for h in fleet.handles(fleet.updatable_model)]


class _OwnScorer:
    """Your `score` as the check's trainer side: each span's tokens at its own version."""

    def __init__(self, score: ScoreFn):
        self.score = score

    def span_logprobs(self, samples: list, temperature: float = 1.0,
                      kv_kept: bool = False) -> list[list[float]]:
        if kv_kept:
            raise ValueError("LogprobChecker does not recompute an in_place engine's kept KV; "
                             "check samples of retract or abort pushes")
        by_version: dict[int, list[int]] = {}
        for i, (_, _, spans) in enumerate(samples):
            for version, _, _ in spans:
                by_version.setdefault(int(version), []).append(i)
        out = [[0.0] * len(output) for _, output, _ in samples]
        for version, rows in by_version.items():
            rows = sorted(set(rows))
            scored = self.score(version, [(samples[i][0], samples[i][1]) for i in rows],
                                temperature)
            for i, lps in zip(rows, scored, strict=True):
                for v, start, end in samples[i][2]:
                    if int(v) == version:
                        out[i][start:end] = lps[start:end]
        return out


class LogprobChecker:
    """The job's log-probability check for a trainer of your own."""

    def __init__(self, fleet: Fleet, score: ScoreFn, *, tolerance: float = 1e-4,
                 probe_tokens: int = 256, max_staleness: int = 0):
        self.fleet = fleet
        self.tolerance = tolerance
        self.max_staleness = max_staleness
        self.probe = EngineProbe(probe_tokens)
        self._scorer = _OwnScorer(score)

    def check(self, samples: list[Sample], temperature: float = 1.0) -> LogprobCheck:
        """Every serving engine at the version it claims, every sample at its tokens'
        versions (at most `max_staleness` behind the fleet); raises `LogprobMismatch`."""
        version = int(self.fleet.version)
        report = None
        if self.probe.enabled:
            self.probe.choose(samples)
            answers = self.probe.ask_engines(serving_handles(self.fleet))
            report = self.probe.judge(answers, self._scorer, version)
        return check_logprobs(samples, self._scorer, version, self.tolerance, temperature,
                              staleness=self.max_staleness, probe=report)
