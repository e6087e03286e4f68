"""The KL term against a frozen reference model: its log-probabilities and reward shaping.

With a frozen model in `--sglang-config` and `--use-kl-loss` or `--kl-coef`, the reference's
log-probabilities of the sampled tokens come through its own router before the train step.
`--kl-coef` shapes each sample's reward by its summed k1 estimate (in place); the KL loss
itself is the trainer's (`trainer/grpo.py`).
"""

from __future__ import annotations

from typing import Any

from slime_like.config.slices import KLSettings
from slime_like.fleet.fleet import Fleet
from slime_like.rollout.generate import Sample


def reference_kl(settings: KLSettings, fleet: Fleet, samples: list[Sample],
                 rewards: list[float]) -> tuple[list[list[float]] | None, dict[str, Any]]:
    """The frozen reference model's logprobs of the sampled tokens (through its router), the
    --kl-coef reward shaping (in place), and the step's KL metrics; (None, {}) without KL."""
    if not settings.enabled:
        return None, {}
    ref = fleet.token_logprobs([(s.prompt_ids, s.output_ids) for s in samples],
                               fleet.reference_model)
    per_sample = [sum(a - b for a, b, m in zip(s.output_logprobs, r, s.model_token_mask(),
                                               strict=True) if m)
                  for s, r in zip(samples, ref, strict=True)]
    tokens = sum(sum(s.model_token_mask()) for s in samples) or 1
    out: dict[str, Any] = {"kl_ref": sum(per_sample) / tokens, "kl_model": fleet.reference_model}
    if settings.kl_coef > 0:
        for i, kl in enumerate(per_sample):
            rewards[i] -= settings.kl_coef * kl
        out["kl_reward_penalty"] = settings.kl_coef * sum(per_sample) / len(per_sample)
    return ref, out
