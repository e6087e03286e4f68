"""What the job checks on every step's samples before it trains on them.

The engines' `output_token_logprobs` must equal the trainer's recomputation at the weight
version the samples claim (fp32 on CPU: ~1e-6): a stale or corrupt sync fails the run at
once instead of training on samples of other weights.
"""

from __future__ import annotations

from slime_like.errors import SlimeLikeError
from slime_like.rollout.generate import Sample
from slime_like.trainer.group import TrainerGroup


class LogprobMismatch(SlimeLikeError):
    """Engine and trainer disagree on the log-probability of sampled tokens."""


def check_logprobs(samples: list[Sample], trainer: TrainerGroup, version: int,
                   tolerance: float, temperature: float = 1.0) -> float:
    """Largest |engine - trainer| logprob over the step's samples, all made at `version`.

    Syncs happen between steps, so every sample must claim the fleet's version; one that
    claims another is a stale serve, and fails the run like a log-probability mismatch.
    With --update-weights-interval > 1 the trainer has moved past `version` by the later
    steps of an interval; it answers from the copy of the served weights it kept at the
    last sync, so the comparison is always at the version the samples claim. Engines report
    logprobs of the temperature-scaled distribution; the trainer scales the same way.
    Every model token is compared, in every turn of a multi-turn sample; the tokens an
    environment inserted (`loss_mask` 0) carry no engine logprob and are skipped.
    """
    stale = sorted({s.weight_version for s in samples if s.weight_version != str(version)})
    if stale:
        raise LogprobMismatch(f"stale serve: samples made at weight version(s) {stale} while "
                              f"the fleet serves {version}")
    current = samples
    if not current:
        return float("nan")
    ours = trainer.completion_logprobs([(s.prompt_ids, s.output_ids) for s in current], version,
                                       temperature)
    worst = 0.0
    for s, lp in zip(current, ours, strict=True):
        for a, b, model_token in zip(s.output_logprobs, lp, s.model_token_mask(), strict=True):
            if model_token:
                worst = max(worst, abs(a - b))
    if worst > tolerance:
        raise LogprobMismatch(f"engine vs trainer log-probabilities differ by {worst:.3g} "
                              f"(> {tolerance:g}) at weight version {version}: the engines "
                              "do not serve the trainer's weights")
    return worst


def weight_versions(samples: list[Sample]) -> list[int | str]:
    """The distinct weight versions the samples were generated at (ints where they are)."""
    found = {s.weight_version for s in samples}
    return sorted(int(v) for v in found) if all(v.isdigit() for v in found) else sorted(found)
