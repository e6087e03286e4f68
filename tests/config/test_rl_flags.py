"""The off-policy and dynamic-sampling flags: slime's defaults, the settings slice, refusals."""

from __future__ import annotations

import pytest

from slime_like.config import parse_args
from slime_like.config.slices import job_settings
from slime_like.errors import ConfigError

BASE = ["--engine", "reference", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "4"]


def test_defaults_are_on_policy_and_no_over_sampling():
    settings = job_settings(parse_args(BASE))
    assert not settings.off_policy.enabled
    assert settings.dynamic_sampling.draw_size(4) == 4
    assert settings.dynamic_sampling.filter_path is None


def test_flags_reach_the_job_settings_with_slimes_defaults():
    s = job_settings(parse_args([*BASE, "--use-rollout-logprobs", "--use-tis",
                                 "--eps-clip-high", "0.28", "--over-sampling-batch-size", "6",
                                 "--dynamic-sampling-filter-path",
                                 "slime_like.rollout.filters.check_reward_nonzero_std"]))
    off = s.off_policy
    assert (off.use_rollout_logprobs, off.use_tis, off.tis_clip, off.tis_clip_low) == (
        True, True, 2.0, 0.0)
    assert (off.eps_clip, off.clip_high) == (0.2, 0.28)
    assert s.dynamic_sampling.draw_size(4) == 6
    assert s.dynamic_sampling.filter_path == "slime_like.rollout.filters.check_reward_nonzero_std"
    tis = job_settings(parse_args([*BASE, "--use-tis", "--tis-clip", "3",
                                   "--tis-clip-low", "0.5"])).off_policy
    assert (tis.tis_clip, tis.tis_clip_low, tis.clip_high) == (3.0, 0.5, 0.2)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--use-tis", "--tis-clip", "1", "--tis-clip-low", "1"],
     "--tis-clip-low: must be < --tis-clip (1), got 1"),
    (["--use-tis", "--tis-clip-low", "2.5"], "--tis-clip-low: must be < --tis-clip (2), got 2.5"),
    (["--use-tis", "--tis-clip", "0"], "--tis-clip: must be > 0, got 0"),
    (["--use-tis", "--tis-clip-low", "-0.1"], "--tis-clip-low: must be >= 0, got -0.1"),
    (["--tis-clip", "3"], "--tis-clip: has no effect without --use-tis (it bounds the TIS "
                          "weight)"),
    (["--eps-clip", "0.1", "--use-tis"],
     "--eps-clip: has no effect without --use-rollout-logprobs (the trainer's own "
     "log-probabilities make the PPO ratio 1)"),
    (["--use-rollout-logprobs", "--eps-clip", "1.5"],
     "--eps-clip: must be < 1 (the ratio's lower bound is 1 - eps-clip), got 1.5"),
    (["--use-rollout-logprobs", "--eps-clip-high", "0"], "--eps-clip-high: must be > 0, got 0"),
    (["--over-sampling-batch-size", "3"],
     "--over-sampling-batch-size: must be >= --rollout-batch-size (4), got 3"),
])
def test_bad_values_are_refused_naming_the_flag(argv, expected):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *argv])
    assert str(err.value) == expected
