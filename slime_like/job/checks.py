"""What the job checks on every step's samples before it trains on them.

The engines' `output_token_logprobs` must equal the trainer's recomputation at the weight
version each token claims (fp32 on CPU: ~1e-6): a stale or corrupt sync fails the run at
once instead of training on samples of other weights. A sample whose tokens span several
versions (an update landed while it was generated) is checked span by span, each token at
its own span's version (`trainer/versions.py`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from slime_like.errors import SlimeLikeError
from slime_like.rollout.generate import Sample
from slime_like.trainer.group import TrainerGroup


class LogprobMismatch(SlimeLikeError):
    """Engine and trainer disagree on the log-probability of sampled tokens."""


@dataclass
class LogprobCheck:
    """One step's check: the largest difference and what it covered."""

    worst: float
    samples: int = 0          # samples checked
    tokens: int = 0           # model tokens compared
    mixed_samples: int = 0    # checked samples whose tokens span several versions
    spans: int = 0            # (sample, version) spans compared


def _stale(samples: list[Sample], version: int, staleness: int) -> list[str]:
    allowed = {str(v) for v in range(version - staleness, version + 1)}
    return sorted({v for s in samples for v in s.versions() if v not in allowed})


def check_logprobs(samples: list[Sample], trainer: TrainerGroup, version: int,
                   tolerance: float, temperature: float = 1.0, *, staleness: int = 0,
                   kv_kept: bool = False, fraction: float = 1.0,
                   seed: int = 0) -> LogprobCheck:
    """Compare the engines' log-probability of every model token with the trainer's at
    that token's weight version.

    The fleet serves `version`; a token may be at most `staleness` versions older (0 for
    the sync schedule, where syncs happen between steps). A token claiming any other
    version — newer, older, or one the trainer never pushed — is a stale serve and fails
    the run like a log-probability mismatch. The trainer answers for older versions from
    the copies it keeps (`--update-weights-interval > 1`, asynchronous schedules).
    `kv_kept`: the engines kept old-weight KV across updates (in_place); the trainer
    recomputes the same way. `fraction` < 1 checks that share of the samples, drawn with
    `seed`. Engines report logprobs of the temperature-scaled distribution; the trainer
    scales the same way. Tokens an environment inserted (`loss_mask` 0) are skipped.
    """
    stale = _stale(samples, version, staleness)
    if stale:
        accepted = (f"{version}" if staleness == 0
                    else f"{max(0, version - staleness)}..{version}")
        raise LogprobMismatch(f"stale serve: samples made at weight version(s) {stale} while "
                              f"the fleet serves {version} (accepted: {accepted})")
    if not samples:
        return LogprobCheck(float("nan"))
    chosen = samples
    if fraction < 1.0:
        k = max(1, math.ceil(fraction * len(samples)))
        chosen = [samples[i] for i in sorted(random.Random(seed).sample(range(len(samples)), k))]
    rows = [(s.prompt_ids, s.output_ids, [(int(v), a, b) for v, a, b in s.spans()])
            for s in chosen]
    ours = trainer.span_logprobs(rows, temperature, kv_kept)
    result = LogprobCheck(0.0, samples=len(chosen))
    for s, lp in zip(chosen, ours, strict=True):
        result.mixed_samples += s.mixed
        result.spans += len(s.spans())
        for a, b, model_token in zip(s.output_logprobs, lp, s.model_token_mask(), strict=True):
            if model_token:
                result.worst = max(result.worst, abs(a - b))
                result.tokens += 1
    if result.worst > tolerance:
        raise LogprobMismatch(f"engine vs trainer log-probabilities differ by "
                              f"{result.worst:.3g} (> {tolerance:g}) at weight version(s) "
                              f"{sorted({v for s in chosen for v in s.versions()})}: the "
                              "engines do not serve the trainer's weights")
    return result


def weight_versions(samples: list[Sample]) -> list[int | str]:
    """The distinct weight versions the samples' tokens were generated at (ints where
    they are)."""
    found = {v for s in samples for v in s.versions()}
    return sorted(int(v) for v in found) if all(v.isdigit() for v in found) else sorted(found)
