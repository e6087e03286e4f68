"""--logprob-check-tolerance: the per-step check of engine vs trainer log-probabilities."""

from __future__ import annotations

import pytest

from slime_like.job.checks import LogprobMismatch, check_logprobs
from slime_like.rollout.generate import Sample


class _Trainer:
    """The trainer's answer for the check: fixed log-probabilities (pure function test)."""

    def __init__(self, lps):
        self.lps, self.calls = lps, []

    def span_logprobs(self, rows, temperature=1.0, kv_kept=False):
        self.calls.append(([spans for _, _, spans in rows], temperature))
        return self.lps


def _sample(lps, version="3"):
    return Sample(0, [1, 2], [3, 4], lps, version, "length")


def test_tolerance_bounds_each_samples_mean_difference():
    trainer = _Trainer([[-1.0, -2.0]])
    checked = check_logprobs([_sample([-1.0, -2.001])], trainer, 3, 1e-2)
    assert checked.worst == pytest.approx(1e-3)           # the worst token, reported
    assert checked.worst_sample == pytest.approx(5e-4)    # the sample's mean decides
    with pytest.raises(LogprobMismatch, match="differ by 0.0005 per token on average"):
        check_logprobs([_sample([-1.0, -2.001])], trainer, 3, 1e-4)
    assert trainer.calls[-1] == ([[(3, 0, 2)]], 1.0)  # asked at the samples' version


def test_one_token_over_the_tolerance_does_not_fail_the_step_and_is_reported():
    """Rounding puts one token of a long sample over the tolerance now and then: reported
    (count, position, both probabilities), never the step's verdict alone."""
    lps = [-1.0] * 16
    engine = list(lps)
    engine[7] = -1.0 - 3e-4
    checked = check_logprobs([Sample(0, [1, 2], list(range(16)), engine, "3", "length")],
                             _Trainer([lps]), 3, 1e-4)
    assert checked.noise.over_tolerance == 1 and checked.noise.max == pytest.approx(3e-4)
    worst = checked.metrics()["logprob_diff_worst"][0]
    assert worst["position"] == 7 and worst["p_trainer"] == pytest.approx(0.3679, rel=1e-3)
    assert checked.worst_sample == pytest.approx(3e-4 / 16)


def test_a_sample_from_another_version_is_a_stale_serve():
    with pytest.raises(LogprobMismatch, match="stale serve"):
        check_logprobs([_sample([-1.0, -2.0], version="2")], _Trainer([[-1.0, -2.0]]), 3, 1e-4)


def _spanned(lps, spans, version="3"):
    return Sample(0, [1, 2], [3, 4, 5], lps, version, "length",
                  weight_spans=[(v, a, b) for v, a, b in spans])


def test_a_mixed_sample_is_asked_span_by_span_and_checked_token_by_token():
    sample = _spanned([-1.0, -2.0, -3.0], [("2", 0, 1), ("3", 1, 3)])
    trainer = _Trainer([[-1.0, -2.0, -3.5]])
    with pytest.raises(LogprobMismatch, match=r"differ by 0.167 per token.*\['2', '3'\]"):
        check_logprobs([sample], trainer, 3, 1e-4, staleness=1)
    assert trainer.calls[-1] == ([[(2, 0, 1), (3, 1, 3)]], 1.0)
    # two versions back is outside a staleness bound of 1: a stale serve
    with pytest.raises(LogprobMismatch, match="stale serve.*'1'.*accepted: 2..3"):
        check_logprobs([_spanned([-1.0] * 3, [("1", 0, 1), ("3", 1, 3)])], trainer, 3, 1e-4,
                       staleness=1)


def test_check_fraction_draws_that_share_of_the_samples_by_seed():
    samples = [_sample([-1.0, -2.0]) for _ in range(10)]
    trainer = _Trainer([[-1.0, -2.0]] * 3)
    result = check_logprobs(samples, trainer, 3, 1e-4, fraction=0.3, seed=5)
    assert result.samples == 3 and result.tokens == 6
    assert len(trainer.calls[-1][0]) == 3
