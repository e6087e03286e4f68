"""The job's three schedules: the same steps (`StepRollouts.make`, `Job.learn`) in three orders.

- `sync`: rollout k, then score, check, train and sync on it; the engines wait while the
  trainer works and the trainer waits while they generate.
- `one-step` (slime's `train_async.py`): rollout k+1 is generated while step k trains; the
  weight update waits until it is done (no request is in flight at a sync), so every
  sample is exactly one version behind the trained one after the first step.
- `fully-async`: a producer (`rollout/producer.py`) generates without pause; the trainer
  takes batches from its buffer and updates the weights while requests run
  (`--pause-generation-mode`); samples may span versions and are at most
  `--max-weight-staleness` versions behind.

See docs/ASYNC.md.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from slime_like.chaos import ChaosMonkey
from slime_like.config.slices import JobSettings
from slime_like.fleet.fleet import Fleet
from slime_like.job.inputs import JobInputs
from slime_like.job.rollouts import StepRollouts
from slime_like.job.samples import Rollout
from slime_like.observe.idle_causes import ClientView
from slime_like.protocol.modes import AsyncMode
from slime_like.rollout.dynamic_sampling import GroupFilter
from slime_like.rollout.producer import RolloutProducer

logger = logging.getLogger("slime_like.train")


class ScheduledJob(Protocol):
    """What a schedule drives: the job's steps and what the fully-async producer reads
    (`job.Job` is one; a schedule never builds or closes it)."""

    settings: JobSettings
    start_step: int
    fleet: Fleet | None
    chaos: ChaosMonkey | None
    inputs: JobInputs | None
    group_filter: GroupFilter
    out: Path
    notes: list[str]
    rollouts: StepRollouts | None
    producer: RolloutProducer | None

    def step(self, step: int) -> None: ...

    def learn(self, step: int, rollout: Rollout,
              before_sync: Callable[[], None] | None = None) -> None: ...



def client_view(job: ScheduledJob, engine: str) -> ClientView:
    """What the job's rollout client holds for `engine` now, which an idle engine is blamed
    on (observe/idle_causes.py): requests bound to it and waiting for a slot (admission
    dispatch), requests out, and whether the producer's staleness window is full."""
    fleet = job.fleet
    slots = fleet.routers.slots.get(fleet.updatable_model) if fleet is not None else None
    held = slots.view(engine) if slots is not None else None
    producer = job.producer
    return ClientView(bound=held[0] if held else None, waiting=held[2] if held else 0,
                      producer_full=producer is not None and producer.window_full(),
                      out=producer.generator.requests_out() if producer is not None else 0)


def run_schedule(job: ScheduledJob) -> None:
    """Every step of the job, in the order of its `--async-mode`."""
    mode = job.settings.asynchrony.mode
    freeze_startup_heap()
    try:
        {AsyncMode.SYNC: run_sync, AsyncMode.ONE_STEP: run_one_step,
         AsyncMode.FULLY_ASYNC: run_fully_async}[mode](job)
    finally:
        gc.unfreeze()  # shutting down frees start-up's objects as usual


def freeze_startup_heap() -> None:
    """Keep what start-up built (Ray, torch, the fleet) out of the garbage collector's scans.

    The driver runs the rollout producer, the engine sampler and the trainer's calls in one
    process. A full collection over every object start-up left stalls all of them at once:
    0.1 to 0.3 s on a CPU run, mid-step (engines wait for requests the producer cannot
    send). Frozen objects are not scanned for cycles while the steps run (reference
    counting still frees them); what the steps make still is.
    """
    gc.collect()
    gc.freeze()


def run_sync(job: ScheduledJob) -> None:
    for step in range(job.start_step, job.settings.num_steps):
        job.step(step)


def run_one_step(job: ScheduledJob) -> None:
    """Rollout k+1 overlaps step k's training; it is drained before step k's sync."""
    steps = range(job.start_step, job.settings.num_steps)
    with ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        pending: Future | None = pool.submit(job.rollouts.make, steps[0]) if steps else None
        for step in steps:
            t0 = time.time()
            rollout = pending.result()
            waited = time.time() - t0
            nxt = pool.submit(job.rollouts.make, step + 1) if step + 1 < steps.stop else None
            rollout.metrics.update({"async_mode": AsyncMode.ONE_STEP,
                                    "trainer_wait_s": round(waited, 4)})
            job.learn(step, rollout, before_sync=(lambda f=nxt: f.exception()) if nxt else None)
            pending = nxt


class _StepHooks:
    """The producer's per-sample callback, forwarded to each step's chaos hook.

    A step's hook counts the samples finished since it was armed: while the producer is a
    full staleness window ahead no sample finishes during a step, so a hook stays armed
    into the next steps until it has seen a batch's worth of samples.
    """

    def __init__(self, batch_samples: int):
        self.batch_samples = batch_samples
        self.armed: list[list] = []   # [hook, samples seen]
        self.lock = threading.Lock()

    def arm(self, hook) -> None:
        if hook is not None:
            with self.lock:
                self.armed.append([hook, 0])

    def __call__(self, _: int) -> None:
        with self.lock:
            for entry in self.armed:
                entry[1] += 1
            due = [(hook, seen) for hook, seen in self.armed]
            self.armed = [e for e in self.armed if e[1] < self.batch_samples]
        for hook, seen in due:
            hook(seen)


def run_fully_async(job: ScheduledJob) -> None:
    """A producer that never stops; the trainer takes batches and updates in flight."""
    settings, fleet = job.settings, job.fleet
    asynchrony, rollout_settings = settings.asynchrony, settings.rollout
    n, batch = rollout_settings.n_samples_per_prompt, rollout_settings.batch_size
    hook = _StepHooks(batch * n)
    with fleet.generator(keep_mixed_versions=True,
                         partial_rollout=asynchrony.partial_rollout) as generator:
        producer = RolloutProducer(
            generator, job.inputs.source.next_batch, n=n,
            sampling_params=job.rollouts.sampling_params(job.start_step * batch * n),
            batch_groups=batch, max_staleness=asynchrony.max_staleness, on_sample=hook,
            keep_group=job.rollouts.keep_group if job.group_filter.enabled else None,
            draw_size=settings.dynamic_sampling.draw_size(batch))
        producer.start()
        job.producer = producer  # what an idle engine is blamed on (observe/idle_causes.py)
        seen = {"aborted": 0, "partial": 0, "resubmitted": 0, "filtered": 0}
        try:
            for step in range(job.start_step, settings.num_steps):
                if job.chaos is not None:
                    hook.arm(job.chaos.rollout_hook(step, batch * n))
                version = int(fleet.version)
                taken = producer.take(version)
                rollout = job.rollouts.as_rollout(taken.groups, taken.waited_s)
                now = {"aborted": generator.aborted, "partial": generator.partial_resubmits,
                       "resubmitted": generator.resubmitted,
                       "filtered": producer.counts.filtered}
                rollout.metrics.update({
                    "async_mode": AsyncMode.FULLY_ASYNC,
                    "trainer_wait_s": round(taken.waited_s, 4),
                    "staleness": {str(k): v for k, v in sorted(taken.staleness.items())},
                    "samples_dropped_stale": taken.dropped_stale * n,
                    "samples_mixed_version": sum(s.mixed for s in rollout.samples),
                    "samples_partial": sum(s.partial_resubmits > 0 for s in rollout.samples),
                    "requests_aborted": now["aborted"] - seen["aborted"],
                    "partial_resubmits": now["partial"] - seen["partial"],
                    "requests_resubmitted": now["resubmitted"] - seen["resubmitted"],
                    "samples_resubmitted": (now["resubmitted"] - seen["resubmitted"]
                                            + now["partial"] - seen["partial"]),
                    "group_seqs": [g.seq for g in taken.groups],
                    "samples_filtered": (now["filtered"] - seen["filtered"]) * n,
                })
                seen = now

                def before_sync(metrics=rollout.metrics) -> None:
                    # What the weight update is about to pause: requests in flight.
                    metrics["groups_in_flight_at_sync"] = producer.in_flight()

                job.learn(step, rollout, before_sync=before_sync)
                producer.trained()
        finally:
            job.producer = None
            counts = producer.stop()
            summary = {"mode": AsyncMode.FULLY_ASYNC, "samples_per_group": n,
                       "groups": vars(counts), "balanced": counts.balanced()}
            (job.out / "async.json").write_text(json.dumps(summary, indent=1))
            job.notes.append(
                f"fully-async: {counts.admitted} groups admitted, {counts.taken} trained, "
                f"{counts.dropped_stale} dropped as stale, {counts.left_over} left over at "
                f"the end" + ("" if counts.balanced() else " (UNBALANCED)"))
