"""The log-probability check of a batch of samples: what the job runs on every step's
samples before it trains on them, and what `slime_like.api.LogprobChecker` runs for a
trainer of your own.

The engines' `output_token_logprobs` must match the trainer's recomputation at the weight
version each token claims: a stale or corrupt sync fails the run at once instead of
training on samples of other weights. A sample whose tokens span several versions (an
update landed while it was generated) is compared token by token at each span's version
(`trainer/versions.py`). The decision (`rollout/logprob_rule.py`, docs/ASYNC.md "The
log-probability check") judges a whole sample, never one token: each sample's mean
|engine - trainer| over its model tokens must stay within `--logprob-check-tolerance`,
and every serving engine answers by name for the version it claims (`rollout/probe.py`: the
neighbour test catches an engine one version behind even when the versions differ by less
than the tolerance). Per step the noise is reported (median, p99, max, tokens over the
tolerance and the worst tokens), so drift shows before it matters.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from slime_like.errors import SlimeLikeError
from slime_like.rollout.generate import Sample
from slime_like.rollout.logprob_rule import NoiseSummary, SpanDeviation, TokenDiff
from slime_like.rollout.probe import ProbeReport, SpanScorer


class LogprobMismatch(SlimeLikeError):
    """Engine and trainer disagree on the log-probability of sampled tokens."""


@dataclass
class LogprobCheck:
    """One step's check: the noise it saw, the worst sample, and what it covered."""

    worst: float              # the largest single-token difference (reported, not decisive)
    samples: int = 0          # samples checked
    tokens: int = 0           # model tokens compared
    mixed_samples: int = 0    # checked samples whose tokens span several versions
    spans: int = 0            # (sample, version) spans compared
    worst_sample: float = float("nan")  # the largest per-sample mean difference
    noise: NoiseSummary = field(default_factory=NoiseSummary)
    probe: ProbeReport | None = None

    def metrics(self) -> dict:
        """The step's check as metrics.jsonl fields."""
        return {"logprob_max_abs_diff": self.worst,
                "logprob_sample_mean_diff_max": self.worst_sample,
                "logprob_checked_samples": self.samples,
                "logprob_checked_mixed_samples": self.mixed_samples,
                "logprob_checked_tokens": self.tokens,
                **self.noise.metrics(),
                **(self.probe.metrics() if self.probe is not None else {})}


def _stale(samples: list[Sample], version: int, staleness: int) -> list[str]:
    allowed = {str(v) for v in range(version - staleness, version + 1)}
    return sorted({v for s in samples for v in s.versions() if v not in allowed})


def check_logprobs(samples: list[Sample], trainer: SpanScorer, version: int,
                   tolerance: float, temperature: float = 1.0, *, staleness: int = 0,
                   kv_kept: bool = False, fraction: float = 1.0, seed: int = 0,
                   probe: ProbeReport | None = None) -> LogprobCheck:
    """Compare the engines' log-probability of every model token with the trainer's at
    that token's weight version; fail on a sample whose mean difference exceeds
    `tolerance`, or on an engine the probe found serving other weights than it claims.

    The fleet serves `version`; a token may be at most `staleness` versions older (0 for
    the sync schedule, where syncs happen between steps). A token claiming any other
    version — newer, older, or one the trainer never pushed — is a stale serve and fails
    the run like a log-probability mismatch. The trainer answers for older versions from
    the copies it keeps (`--update-weights-interval > 1`, asynchronous schedules).
    `kv_kept`: the engines kept old-weight KV across updates (in_place); the trainer
    recomputes the same way. `fraction` < 1 checks that share of the samples, drawn with
    `seed`. Engines report logprobs of the temperature-scaled distribution; the trainer
    scales the same way. Tokens an environment inserted (`loss_mask` 0) are skipped.
    `probe`: this step's answers of each serving engine (`rollout/probe.py`).
    """
    stale = _stale(samples, version, staleness)
    if stale:
        accepted = (f"{version}" if staleness == 0
                    else f"{max(0, version - staleness)}..{version}")
        raise LogprobMismatch(f"stale serve: samples made at weight version(s) {stale} while "
                              f"the fleet serves {version} (accepted: {accepted})")
    named = probe.failures(tolerance) if probe is not None else []
    if named:
        raise LogprobMismatch("the engines do not serve the weights they claim: "
                              + "; ".join(named))
    if not samples:
        return LogprobCheck(float("nan"), probe=probe)
    chosen = samples
    if fraction < 1.0:
        k = max(1, math.ceil(fraction * len(samples)))
        chosen = [samples[i] for i in sorted(random.Random(seed).sample(range(len(samples)), k))]
    rows = [(s.prompt_ids, s.output_ids, [(int(v), a, b) for v, a, b in s.spans()])
            for s in chosen]
    ours = trainer.span_logprobs(rows, temperature, kv_kept)
    result = LogprobCheck(0.0, samples=len(chosen), probe=probe)
    diffs: list[TokenDiff] = []
    worst_sample: SpanDeviation | None = None
    for i, (s, lp) in enumerate(zip(chosen, ours, strict=True)):
        result.mixed_samples += s.mixed
        result.spans += len(s.spans())
        mine: list[TokenDiff] = []
        mask = s.model_token_mask()
        for version_, start, end in s.spans():
            mine += [TokenDiff(i, t, version_, s.output_logprobs[t], lp[t])
                     for t in range(start, end) if mask[t]]
        diffs += mine
        mean = sum(d.diff for d in mine) / len(mine) if mine else 0.0
        if worst_sample is None or mean > worst_sample.mean:
            worst_sample = SpanDeviation(i, "/".join(s.versions()), len(mine), mean)
    result.tokens = len(diffs)
    result.noise = NoiseSummary.of(diffs, tolerance)
    result.worst = result.noise.max if diffs else 0.0
    result.worst_sample = worst_sample.mean if worst_sample else 0.0
    if worst_sample is not None and worst_sample.mean > tolerance:
        worst_token = result.noise.worst[0]
        raise LogprobMismatch(
            f"engine vs trainer log-probabilities differ by {worst_sample.mean:.3g} per token "
            f"on average (> {tolerance:g}) over the {worst_sample.tokens} tokens of a sample "
            f"made at weight version(s) {worst_sample.version} (largest token difference "
            f"{worst_token.diff:.3g}; versions checked "
            f"{sorted({v for s in chosen for v in s.versions()})}): the engines do not serve "
            "the trainer's weights" + _probe_note(probe))
    return result


def _probe_note(probe: ProbeReport | None) -> str:
    """What the probe says of each engine now, for a failure it did not name itself."""
    if probe is None or not probe.verdicts:
        return ""
    return "; every engine answers for its version now: " + ", ".join(
        f"{v.engine_id} at {v.claimed} ({v.deviation:.2g})" for v in probe.verdicts)
