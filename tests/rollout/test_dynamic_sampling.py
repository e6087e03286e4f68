"""Dynamic sampling: the group filter (slime's signature), the built-in zero-std filter, the
round loop that over-samples until a batch of kept groups, and the preflight check."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch

from slime_like.config import parse_args
from slime_like.config.slices import job_settings
from slime_like.errors import ConfigError, PluginError
from slime_like.job.inputs import preflight
from slime_like.rollout.dynamic_sampling import (
    DynamicFilterOutput,
    GroupFilter,
    collect_groups,
)
from slime_like.rollout.filters import check_reward_nonzero_std
from slime_like.rollout.generate import Sample

ARGS = argparse.Namespace()
BUILT_IN = "slime_like.rollout.filters.check_reward_nonzero_std"


def _group(prompt: int, rewards: list[float | None]) -> list[Sample]:
    return [Sample(prompt_index=prompt, prompt_ids=[1], output_ids=[2], output_logprobs=[-0.1],
                   weight_version="1", finish_reason="length", reward=r) for r in rewards]


# Filters a user could write, loaded by path below.
def legacy_bool_filter(args, samples):
    return samples[0].prompt_index % 2 == 1


@dataclass
class SlimeStyleOutput:  # what slime's own filter returns: keep is a 0-d tensor
    keep: torch.Tensor
    reason: str | None = None


def tensor_filter(args, samples, **kwargs):
    keep = torch.tensor([s.reward for s in samples]).std() > 0
    return SlimeStyleOutput(keep=keep, reason=None if keep else "flat")


def broken_filter(args, samples):
    raise KeyError("label")


def wrong_type_filter(args, samples):
    return "yes"


def test_the_built_in_filter_drops_groups_whose_rewards_are_all_equal():
    assert check_reward_nonzero_std(ARGS, _group(0, [0.0, 1.0, 1.0])) == DynamicFilterOutput(True)
    assert check_reward_nonzero_std(ARGS, _group(0, [1.0, 1.0, 1.0])) == DynamicFilterOutput(
        False, "zero_std_1.0")
    assert check_reward_nonzero_std(ARGS, _group(0, [0.25, 0.25])).reason == "zero_std_0.2"
    assert not check_reward_nonzero_std(ARGS, _group(0, [0.5])).keep  # one sample: no spread
    with pytest.raises(PluginError, match="sample 1 of prompt 3 has no reward yet"):
        check_reward_nonzero_std(ARGS, _group(3, [1.0, None]))


def test_without_a_path_the_filter_keeps_every_group_and_counts_nothing_dropped():
    f = GroupFilter.from_args(argparse.Namespace(dynamic_sampling_filter_path=None))
    assert not f.enabled
    assert f.keep(ARGS, _group(0, [1.0, 1.0])).keep
    assert f.metrics() == {"dynamic_sampling_kept": 1, "dynamic_sampling_dropped": 0}


@pytest.mark.parametrize(("path", "message"), [
    ("no_such_pkg.f", "--dynamic-sampling-filter-path: module 'no_such_pkg' not found"),
    ("slime_like.rollout.filters.nope", "--dynamic-sampling-filter-path: module "
                                        "'slime_like.rollout.filters' has no attribute 'nope'"),
    ("filter", "--dynamic-sampling-filter-path: expected module.function, got 'filter'"),
])
def test_a_bad_path_names_the_flag(path, message):
    with pytest.raises(ConfigError) as err:
        GroupFilter.from_args(argparse.Namespace(dynamic_sampling_filter_path=path))
    assert str(err.value).startswith(message)


def test_filters_of_every_kind_are_counted_by_reason():
    here = __name__
    built_in = GroupFilter.from_args(argparse.Namespace(dynamic_sampling_filter_path=BUILT_IN))
    for rewards in ([1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]):
        built_in.keep(ARGS, _group(0, rewards))
    assert built_in.metrics() == {"dynamic_sampling_kept": 1, "dynamic_sampling_dropped": 3,
                                  "dynamic_sampling_drop_zero_std_0.0": 1,
                                  "dynamic_sampling_drop_zero_std_1.0": 2}
    legacy = GroupFilter.from_args(argparse.Namespace(
        dynamic_sampling_filter_path=f"{here}.legacy_bool_filter"))
    assert [legacy.keep(ARGS, _group(p, [1.0])).keep for p in range(4)] == [False, True] * 2
    assert legacy.dropped == {"filtered": 2}
    tensors = GroupFilter.from_args(argparse.Namespace(
        dynamic_sampling_filter_path=f"{here}.tensor_filter"))
    assert tensors.keep(ARGS, _group(0, [0.0, 1.0])) == DynamicFilterOutput(True, None)
    assert tensors.keep(ARGS, _group(0, [1.0, 1.0])) == DynamicFilterOutput(False, "flat")
    legacy.reset()
    assert legacy.metrics() == {"dynamic_sampling_kept": 0, "dynamic_sampling_dropped": 0}


def test_a_failing_or_wrong_filter_names_the_flag_and_the_prompt():
    broken = GroupFilter.from_args(argparse.Namespace(
        dynamic_sampling_filter_path=f"{__name__}.broken_filter"))
    with pytest.raises(PluginError, match=r"--dynamic-sampling-filter-path: .*broken_filter "
                                          r"failed on prompt 7: KeyError: 'label'"):
        broken.keep(ARGS, _group(7, [1.0]))
    wrong = GroupFilter.from_args(argparse.Namespace(
        dynamic_sampling_filter_path=f"{__name__}.wrong_type_filter"))
    with pytest.raises(PluginError, match=r"returned 'yes' for prompt 2; expected a "
                                          r"DynamicFilterOutput\(keep, reason\) or a bool"):
        wrong.keep(ARGS, _group(2, [1.0]))


class Prompts:
    """A prompt source handing out consecutive prompt numbers."""

    def __init__(self):
        self.next = 0
        self.draws: list[int] = []

    def draw(self, n: int) -> list[int]:
        self.draws.append(n)
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _flat_when_even(prompts: list[int]) -> list[list[Sample]]:
    """Even prompts: every sample right (no advantage); odd ones: one right, one wrong."""
    return [_group(p, [1.0, 1.0] if p % 2 == 0 else [0.0, 1.0]) for p in prompts]


def test_collect_groups_over_samples_until_the_batch_is_full():
    prompts = Prompts()
    f = GroupFilter.from_args(argparse.Namespace(dynamic_sampling_filter_path=BUILT_IN))
    got = collect_groups(prompts.draw, _flat_when_even, f, ARGS, batch_size=4,
                         over_sampling_batch_size=6)
    assert prompts.draws == [6, 6]  # round 1 keeps 3 of 6 prompts: a second round
    assert [g[0].prompt_index for g in got.groups] == [1, 3, 5, 7]
    assert [g[0].prompt_index for g in got.surplus] == [9, 11]
    assert got.metrics() == {"dynamic_sampling_rounds": 2, "dynamic_sampling_prompts_drawn": 12,
                             "dynamic_sampling_kept": 6, "dynamic_sampling_dropped": 6,
                             "dynamic_sampling_surplus": 2,
                             "dynamic_sampling_drop_zero_std_1.0": 6}
    # without a filter one round of batch_size prompts is the step, as without the flags
    plain = collect_groups(Prompts().draw, _flat_when_even, GroupFilter(), ARGS, batch_size=4)
    assert [g[0].prompt_index for g in plain.groups] == [0, 1, 2, 3]
    assert (plain.rounds, plain.surplus) == (1, [])


def test_a_filter_that_keeps_nothing_fails_instead_of_sampling_forever():
    f = GroupFilter.from_args(argparse.Namespace(dynamic_sampling_filter_path=BUILT_IN))
    with pytest.raises(PluginError) as err:
        collect_groups(Prompts().draw, lambda ps: [_group(p, [1.0, 1.0]) for p in ps], f, ARGS,
                       batch_size=2, over_sampling_batch_size=3, max_rounds=4)
    assert str(err.value) == (
        "--dynamic-sampling-filter-path: slime_like.rollout.filters.check_reward_nonzero_std "
        "kept 0 of 2 groups in 4 rounds of 3 prompts (dropped by reason: zero_std_1.0: 12)")
    with pytest.raises(ValueError, match="over_sampling_batch_size 1 < batch_size 2"):
        collect_groups(Prompts().draw, _flat_when_even, f, ARGS, batch_size=2,
                       over_sampling_batch_size=1)


BASE = ["--engine", "reference", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1"]


def test_preflight_loads_the_filter_before_anything_starts():
    ok = preflight(job_settings(parse_args([*BASE, "--dynamic-sampling-filter-path",
                                            BUILT_IN])), dry_run=True)
    assert ok.group_filter.enabled and ok.group_filter.path == BUILT_IN
    assert not preflight(job_settings(parse_args(BASE)), dry_run=True).group_filter.enabled
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path: module "
                                          "'my_filters' not found"):
        preflight(job_settings(parse_args([*BASE, "--dynamic-sampling-filter-path",
                                           "my_filters.keep"])), dry_run=True)
