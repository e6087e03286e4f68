"""How far an FP8 rollout is from the full-precision trainer, token by token.

With `--sglang-quantization fp8` the engines sample from quantized weights while the trainer
learns on its own. The log-probability check compares the engines with the trainer's
*quantized* copy (the weights they really hold, so it still holds to the tolerance); this
is the other comparison, the one a user corrects with TIS: each model token's
log-probability under the trainer's unquantized weights against the engine's, and the
truncated importance weight exp(logp_trainer - logp_rollout) that `--use-tis` would apply
(its mean, its largest value, and the share of tokens `--tis-clip` / `--tis-clip-low` clip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantization_mismatch(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]],
                          masks: Sequence[Sequence[int | bool]], tis_clip: float = 2.0,
                          tis_clip_low: float = 0.0, prefix: str = "fp8") -> dict[str, float]:
    """metrics.jsonl fields over every model token (mask true) of the samples:
    `<prefix>_logprob_abs_diff_mean` / `_max`, `<prefix>_tis_weight_mean` / `_max`,
    `<prefix>_tis_clip_frac`, `<prefix>_tokens`."""
    diffs: list[float] = []
    for engine_row, trainer_row, mask in zip(rollout, trainer, masks, strict=True):
        if not (len(engine_row) == len(trainer_row) == len(mask)):
            raise ValueError(f"a sample has {len(engine_row)} rollout log-probabilities, "
                             f"{len(trainer_row)} trainer ones and {len(mask)} mask entries")
        diffs += [t - e for e, t, m in zip(engine_row, trainer_row, mask, strict=True) if m]
    if not diffs:
        return {f"{prefix}_tokens": 0}
    weights = [math.exp(d) for d in diffs]
    clipped = sum(w > tis_clip or w < tis_clip_low for w in weights)
    return {f"{prefix}_logprob_abs_diff_mean": sum(abs(d) for d in diffs) / len(diffs),
            f"{prefix}_logprob_abs_diff_max": max(abs(d) for d in diffs),
            f"{prefix}_tis_weight_mean": sum(weights) / len(weights),
            f"{prefix}_tis_weight_max": max(weights),
            f"{prefix}_tis_clip_frac": clipped / len(weights),
            f"{prefix}_tokens": len(diffs)}
