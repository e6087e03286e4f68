"""The FP8 rollout's gap to the trainer, as metrics.jsonl reports it (`rollout/quant_mismatch.py`)."""

from __future__ import annotations

import math

import pytest

from slime_like.rollout.quant_mismatch import quantization_mismatch


def test_only_model_tokens_count_and_clipped_weights_are_those_outside_the_tis_bounds():
    rollout = [[-1.0, -2.0, -3.0], [-0.5, -9.0]]
    trainer = [[-1.0, -1.0, -3.5], [-0.5 + math.log(3.0), -1.0]]
    masks = [[1, 1, 1], [1, 0]]  # the environment's token (-9 vs -1) is left out
    m = quantization_mismatch(rollout, trainer, masks, tis_clip=2.0, tis_clip_low=0.7)
    assert m["fp8_tokens"] == 4
    assert m["fp8_logprob_abs_diff_mean"] == pytest.approx((0 + 1 + 0.5 + math.log(3.0)) / 4)
    assert m["fp8_logprob_abs_diff_max"] == pytest.approx(math.log(3.0))
    weights = [1.0, math.e, math.exp(-0.5), 3.0]
    assert m["fp8_tis_weight_mean"] == pytest.approx(sum(weights) / 4)
    assert m["fp8_tis_weight_max"] == pytest.approx(3.0)
    assert m["fp8_tis_clip_frac"] == pytest.approx(3 / 4)  # e and 3 above 2, e^-0.5 below 0.7


def test_rows_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="2 rollout log-probabilities, 1 trainer ones"):
        quantization_mismatch([[-1.0, -1.0]], [[-1.0]], [[1, 1]])
