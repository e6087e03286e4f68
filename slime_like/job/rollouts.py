"""How a step's samples are made: prompts through the rollout function, dynamic sampling's
rounds, the sampling parameters, and the fully-async producer's groups as a step's batch.

Apart from `job.py` (the job's life: start, steps, end) because the three schedules use it
differently: `sync` and `one-step` call `make` per step, `fully-async` hands
`sampling_params` and `keep_group` to a producer and turns its batches into rollouts with
`as_rollout`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from slime_like.config.slices import JobSettings
from slime_like.fleet.fleet import Fleet
from slime_like.job.inputs import JobInputs
from slime_like.job.samples import Rollout, kept_batch
from slime_like.rollout.dynamic_sampling import GroupFilter, collect_groups
from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import Plugins, fill_from_prompts
from slime_like.rollout.prompts import PromptItem
from slime_like.trainer.group import TrainerGroup

# (step, samples in the step) -> the hooks to call with each finished sample's count
FaultHooks = Callable[[int, int], list[Callable[[int], Any]]]


class StepRollouts:
    """The rollout side of a job, built once its fleet and trainer run."""

    def __init__(self, settings: JobSettings, plugins: Plugins, group_filter: GroupFilter,
                 inputs: JobInputs, fleet: Fleet, trainer: TrainerGroup,
                 fault_hooks: FaultHooks):
        self.settings = settings
        self.plugins = plugins
        self.group_filter = group_filter
        self.inputs = inputs
        self.fleet = fleet
        self.trainer = trainer
        self.fault_hooks = fault_hooks

    def make(self, step: int) -> Rollout:
        """The step's prompts through the rollout function (the trainer offloaded meanwhile
        with --offload-train); a planned fault fires a quarter of the way in. With a
        dynamic-sampling filter, rounds of prompts until a batch of kept groups. Its
        `seconds` are generation only."""
        settings = self.settings
        batch, n = settings.rollout.batch_size, settings.rollout.n_samples_per_prompt
        total = batch * n
        hooks = self.fault_hooks(step, total)  # the demo crash and a chaos fault: both fire
        hook = (lambda done: [h(done) for h in hooks]) if hooks else None
        offloaded = (self.trainer.offload(keep_weights=not settings.trainer.offload_train_weights)
                     if settings.trainer.offload_train else {})
        metrics: dict[str, Any] = {}
        t0 = time.perf_counter()
        if not self.group_filter.enabled:
            prompts = self.inputs.source.next_batch(batch)
            samples = self.generate(step, step * total, prompts, hook)
        else:
            rounds = 0

            def generate_and_score(drawn: list[PromptItem]) -> list[list[Sample]]:
                nonlocal rounds
                out = self.generate(step, step * total + rounds * len(drawn) * n, drawn, hook)
                rounds += 1
                self.plugins.rewards(settings.plugin_args, out)
                return [out[i * n:(i + 1) * n] for i in range(len(drawn))]

            collected = collect_groups(
                self.inputs.source.next_batch, generate_and_score, self.group_filter,
                settings.plugin_args, batch_size=batch,
                over_sampling_batch_size=settings.dynamic_sampling.over_sampling_batch_size)
            prompts, samples = kept_batch(collected.groups)
            metrics.update(collected.metrics())
        generation_s = time.perf_counter() - t0
        if settings.trainer.offload_train:
            self.trainer.onload()  # enqueued: the copy overlaps scoring until the next use
        return Rollout(prompts, samples, generation_s, offloaded, metrics)

    def generate(self, step: int, first_sample: int, prompts: list[PromptItem],
                 hook) -> list[Sample]:
        """n samples of each prompt through the rollout function (default: the fleet's
        routers), grouped by prompt; `first_sample`: the run-wide index of the first."""
        settings, fleet = self.settings, self.fleet
        return self.plugins.rollout(
            settings.plugin_args, step, prompts, router_url=fleet.router_url(),
            sampling_params=self.sampling_params(first_sample),
            n=settings.rollout.n_samples_per_prompt, tokenizer=self.inputs.tokenizer,
            on_sample=hook, api_key=fleet.settings.router.api_key, generate=fleet.generate)

    def sampling_params(self, first_sample: int) -> dict[str, Any]:
        """The rollout's sampling parameters; under deterministic inference (sglang's
        --enable-deterministic-inference, slime's rule) sample i of the run is seeded with
        --rollout-seed + i, whichever schedule or engine makes it."""
        params = dict(self.settings.rollout.sampling_params)
        if self.settings.rollout.deterministic:
            params["sampling_seed"] = self.settings.prompts.rollout_seed + first_sample
        return params

    def as_rollout(self, groups: list, waited_s: float) -> Rollout:
        """A batch of the fully-async producer's groups as one step's rollout."""
        prompts, samples = [], []
        for i, group in enumerate(groups):
            prompts.append(group.prompt)
            for s in group.samples:
                s.prompt_index = i
                samples.append(s)
        return Rollout(prompts, fill_from_prompts(samples, prompts, self.inputs.tokenizer),
                       waited_s)

    def keep_group(self, group) -> bool:
        """The fully-async producer's verdict on a finished group: scored, then the
        dynamic-sampling filter (runs in the producer's thread)."""
        samples = fill_from_prompts(group.samples, [group.prompt] * len(group.samples),
                                    self.inputs.tokenizer, index_of=lambda s: 0)
        self.plugins.rewards(self.settings.plugin_args, samples)
        return self.group_filter.keep(self.settings.plugin_args, samples).keep
