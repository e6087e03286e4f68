"""User plug-ins the tests load by `module.func`, written as a user would write them."""

from __future__ import annotations

import asyncio

from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import post_generate

CALLS: list[str] = []
NOT_A_FUNCTION = 3


async def async_length_reward(args, sample, **kwargs) -> float:
    """An async reward (slime's signature): awaited concurrently over the batch."""
    await asyncio.sleep(0)
    return float(len(sample.response))


def label_reward(args, sample):
    """A plain reward without **kwargs; a bool counts as 0/1."""
    return sample.response == sample.label


def text_reward(args, sample, **kwargs):
    return "good"


async def router_generate(args, sample, sampling_params, *, router_url, api_key=None,
                          **kwargs) -> Sample:
    """A custom generate function: one /generate through the router (with the run's key),
    recorded in CALLS."""
    CALLS.append(sample.prompt)
    out = await post_generate(router_url, sample, sampling_params, api_key=api_key)
    out.metadata = {**out.metadata, "generated_by": "router_generate"}
    return out


def canned_rollout(args, rollout_id, prompts, *, n_samples_per_prompt, **kwargs):
    """A rollout function that answers each prompt with its label, prompts in reverse order."""
    out = []
    for i in reversed(range(len(prompts))):
        for _ in range(n_samples_per_prompt):
            ids = [ord(c) + 3 for c in str(prompts[i].label)]
            out.append(Sample(i, prompts[i].input_ids, ids, [-0.5] * len(ids), "4", "length"))
    return out


async def no_logprob_rollout(args, rollout_id, prompts, *, n_samples_per_prompt, **kwargs):
    return [Sample(i, p.input_ids, [5, 6], [], "1", "length")
            for i, p in enumerate(prompts) for _ in range(n_samples_per_prompt)]


def unversioned_rollout(args, rollout_id, prompts, *, n_samples_per_prompt, **kwargs):
    return [Sample(i, p.input_ids, [5], [-1.0], "", "length")
            for i, p in enumerate(prompts) for _ in range(n_samples_per_prompt)]


def short_rollout(args, rollout_id, prompts, **kwargs):
    return [Sample(0, prompts[0].input_ids, [5], [-1.0], "1", "length")]


AGENTIC: list[Sample] = []


async def recorded_calculator(args, sample, sampling_params, **kwargs) -> Sample:
    """The agentic example's generate function, keeping every episode it returns."""
    from examples.agentic import calculator

    out = await calculator.generate(args, sample, sampling_params, **kwargs)
    AGENTIC.append(out)
    return out
