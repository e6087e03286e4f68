"""The decision rule of the log-probability check (pure numbers, no engine).

The neighbour test's promise is statistical: an engine at the claimed version is called
stale with probability <= alpha whatever the noise (heavy tails included), and an engine at
the previous version is found once the versions differ by more than the noise. Both are
checked here on drawn noise; the real engines' side is tests/job/test_logprob_rule_job.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from slime_like.rollout.logprob_rule import (
    Leaning,
    NoiseSummary,
    TokenDiff,
    neighbour_test,
    span_deviation,
)


def _versions(rng: np.random.Generator, n: int, separation: float):
    claimed = rng.uniform(-6.0, -0.1, n)
    previous = claimed + rng.normal(0.0, separation, n)
    return claimed, previous


@pytest.mark.parametrize("noise", ["gaussian", "cauchy"])
def test_an_engine_at_the_claimed_version_is_never_called_stale(noise):
    """2,000 probes of 256 tokens at separations from far below to far above the noise:
    no false 'previous', even with Cauchy noise whose tail dwarfs the separation."""
    rng = np.random.default_rng(0)
    leanings = []
    for _ in range(2000):
        separation = 10.0 ** rng.uniform(-8, -2)
        claimed, previous = _versions(rng, 256, separation)
        draw = rng.standard_cauchy(256) if noise == "cauchy" else rng.normal(size=256)
        engine = claimed + 1e-6 * draw
        leanings.append(neighbour_test(engine, claimed, previous).leaning)
    assert Leaning.PREVIOUS not in leanings
    assert leanings.count(Leaning.CLAIMED) > 500  # separations above the noise confirm it


def test_an_engine_one_version_behind_is_found_once_versions_differ_more_than_noise():
    rng = np.random.default_rng(1)
    for separation, expected in ((1e-4, Leaning.PREVIOUS), (1e-5, Leaning.PREVIOUS),
                                 (1e-9, Leaning.UNDECIDED)):
        claimed, previous = _versions(rng, 256, separation)
        engine = previous + 1e-6 * rng.normal(size=256)
        test = neighbour_test(engine, claimed, previous)
        assert test.leaning is expected, (separation, test)


def test_identical_versions_are_undecided_not_stale():
    claimed = np.linspace(-3, -1, 64)
    test = neighbour_test(claimed + 1e-7, claimed, claimed.copy())
    assert test.threshold == 0.0 and test.leaning is Leaning.UNDECIDED


def test_mismatched_lengths_are_refused_by_name():
    with pytest.raises(ValueError, match="3 engine, 2 claimed and 2 previous"):
        neighbour_test([0.0] * 3, [0.0] * 2, [0.0] * 2)
    with pytest.raises(ValueError, match="sample 4, version 7: 1 engine and 2 trainer"):
        span_deviation(4, "7", [-1.0], [-1.0, -2.0])


def test_noise_summary_reports_quantiles_and_every_token_over_the_tolerance():
    diffs = [TokenDiff(0, i, "1", -1.0 - d, -1.0) for i, d in
             enumerate([0.0] * 90 + [1e-6] * 8 + [2e-4, 5e-4])]
    summary = NoiseSummary.of(diffs, 1e-4)
    assert summary.tokens == 100 and summary.median == 0.0
    assert summary.over_tolerance == 2
    assert [w.position for w in summary.worst] == [99, 98]
    assert summary.max == pytest.approx(5e-4)
    quiet = NoiseSummary.of(diffs[:98], 1e-4)
    assert quiet.over_tolerance == 0 and len(quiet.worst) == 1  # the worst one, always


def test_versions_far_apart_on_a_few_tokens_are_told_apart_by_the_votes():
    """A step that moved a few tokens a lot and the rest a little: the sum's bound is set by
    the few, the sign test counts every token (a healthy 300-step run met this)."""
    rng = np.random.default_rng(2)
    claimed = rng.uniform(-6.0, -0.1, 256)
    shift = np.where(np.arange(256) < 8, 0.5, 1e-5) * rng.choice([-1.0, 1.0], 256)
    previous = claimed + shift
    noise = 1e-7 * rng.normal(size=256)
    fresh = neighbour_test(claimed + noise, claimed, previous)
    assert fresh.score > -fresh.threshold  # the sum alone cannot decide here
    assert fresh.leaning is Leaning.CLAIMED and fresh.votes_previous == 0
    assert neighbour_test(previous + noise, claimed, previous).leaning is Leaning.PREVIOUS
