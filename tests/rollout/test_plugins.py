"""Plug-ins by `module.func` (slime's flags): loading errors, reward calls, rollout checks."""

from __future__ import annotations

import argparse

import pytest

from slime_like.config.parse import parse_args
from slime_like.errors import ConfigError, PluginError
from slime_like.models import ByteTokenizer
from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import Plugins, load_function, toy_reward
from slime_like.rollout.prompts import PromptItem

TOK = ByteTokenizer()
M = "tests.job.rl_plugins"


def _args(*flags: str) -> argparse.Namespace:
    return parse_args(["--engine", "reference", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "1", *flags])


def _prompts(*labels: str) -> list[PromptItem]:
    return [PromptItem(f"q{i}", TOK.encode(f"q{i}"), label) for i, label in enumerate(labels)]


def _sample(i: int, text: str, label=None) -> Sample:
    return Sample(i, [5], TOK.encode(text), [-1.0] * len(text), "1", "length", response=text,
                  label=label)


@pytest.mark.parametrize(("path", "message"), [
    ("nodots", "expected module.function, got 'nodots'"),
    ("no_such_pkg.mod.fn", "module 'no_such_pkg' not found (importing 'no_such_pkg.mod'; is it on "
                           "PYTHONPATH?)"),
    (f"{M}.missing", f"module '{M}' has no attribute 'missing'"),
    (f"{M}.NOT_A_FUNCTION", f"{M}.NOT_A_FUNCTION is not callable (int)"),
])
def test_a_bad_plugin_path_is_one_line_naming_the_flag(path, message):
    with pytest.raises(ConfigError) as err:
        load_function(path, "--custom-rm-path")
    assert str(err.value) == f"--custom-rm-path: {message}"
    assert "\n" not in str(err.value)


def test_every_plugin_flag_is_checked_when_the_job_loads_them():
    for flag in ("--custom-rm-path", "--rollout-function-path", "--custom-generate-function-path"):
        with pytest.raises(ConfigError, match=f"^{flag}: module '{M}' has no attribute 'nope'"):
            Plugins.from_args(_args(flag, f"{M}.nope"))


def test_defaults_are_the_toy_task():
    plugins = Plugins.from_args(_args())
    assert plugins.reward_fn is toy_reward
    samples = [_sample(0, "aab!", label="a")]
    assert plugins.rewards(_args(), samples) == [pytest.approx((1 + 1 + 0.25) / 4)]


def test_sync_async_and_bool_rewards_are_scored_and_kept_on_the_sample():
    samples = [_sample(0, "7", "7"), _sample(0, "12", "7")]
    got = Plugins.from_args(_args("--custom-rm-path", f"{M}.async_length_reward"))
    assert got.rewards(_args(), samples) == [1.0, 2.0]
    assert [s.reward for s in samples] == [1.0, 2.0]
    plain = Plugins.from_args(_args("--custom-rm-path", f"{M}.label_reward"))
    assert plain.rewards(_args(), samples) == [1.0, 0.0]


def test_a_reward_that_is_not_a_number_names_the_flag_and_sample():
    plugins = Plugins.from_args(_args("--custom-rm-path", f"{M}.text_reward"))
    with pytest.raises(PluginError, match=r"^--custom-rm-path: .*text_reward returned 'good' for "
                                          r"sample 0; expected a number$"):
        plugins.rewards(_args(), [_sample(0, "x")])


def test_a_custom_rollout_is_grouped_by_prompt_and_filled_for_the_reward():
    args = _args("--rollout-function-path", f"{M}.canned_rollout")
    plugins = Plugins.from_args(args)
    prompts = _prompts("1", "22")
    samples = plugins.rollout(args, 0, prompts, router_url="http://unused", sampling_params={},
                              n=2, tokenizer=TOK)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]  # GRPO groups, whatever order
    assert [(s.prompt, s.label, s.response) for s in samples[1:3]] == [
        ("q0", "1", "1"), ("q1", "22", "22")]


@pytest.mark.parametrize(("fn", "message"), [
    ("no_logprob_rollout", r"sample 0 \(prompt 0\) has 2 output_ids but 0 output_logprobs"),
    ("unversioned_rollout", r"sample 0 \(prompt 0\) has no weight_version"),
    ("short_rollout", r"expected 2 samples per prompt, got \[1, 0\]"),
])
def test_a_rollout_that_breaks_the_logprob_check_is_refused(fn, message):
    args = _args("--rollout-function-path", f"{M}.{fn}")
    with pytest.raises(PluginError, match=f"^--rollout-function-path: {message}"):
        Plugins.from_args(args).rollout(args, 0, _prompts("a", "b"), router_url="http://unused",
                                        sampling_params={}, n=2, tokenizer=TOK)


def test_the_math_example_reward():
    from examples.math_rl.reward import reward_func

    assert reward_func(None, _sample(0, " 7 and more", "7")) == 1.0
    assert reward_func(None, _sample(0, "17", "7")) == pytest.approx(0.2)
    assert reward_func(None, _sample(0, "abc", "7")) == 0.0
