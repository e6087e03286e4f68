"""RolloutProducer: generation that never waits for training (the fully-async schedule).

A thread of its own keeps /generate requests going through the router, one GRPO group (n
samples of one prompt) at a time, and puts finished groups into a buffer the trainer takes
batches from. Weight updates happen while its requests run; each sample keeps the engine's
`weight_versions` spans (and, with `partial_rollout`, aborted samples are continued from
their partial output).

Admission is bounded as AReaL's staleness manager bounds it: with staleness bound N, batch
size B (groups) and t batches trained, at most (N + t + 1)·B groups are ever accepted or
running, so the producer runs at most N + 1 batches ahead of the trainer. At `take()` a
group whose oldest token is more than N versions behind the trained version is dropped
(counted) and its place is given to a new group. With N = 0 the producer generates exactly
one batch per trained step, at the version the trainer just pushed: the sync schedule.

Every group admitted ends exactly once: taken for training, dropped for staleness, or left
over when the producer stops (`ProducerCounts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime_like.rollout.generate import RouterGenerator, Sample, sample_params
from slime_like.rollout.prompts import PromptItem

logger = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt's n samples, in admission order (`seq`)."""

    seq: int
    prompt: PromptItem
    samples: list[Sample]

    def oldest_version(self) -> int:
        return min(int(v) for s in self.samples for v in s.versions())


@dataclass
class ProducerCounts:
    """Where every admitted group went (samples = groups x n)."""

    admitted: int = 0
    taken: int = 0
    dropped_stale: int = 0
    filtered: int = 0           # dropped by the dynamic-sampling filter
    left_over: int = 0          # in flight or buffered when the producer stopped
    failed: int = 0             # a request that kept failing (GenerationError)

    def balanced(self) -> bool:
        """Every admitted group ended exactly once."""
        return self.admitted == (self.taken + self.dropped_stale + self.filtered
                                 + self.left_over + self.failed)


def admission_capacity(max_staleness: int, batch_groups: int, trained: int, accepted: int,
                       running: int) -> int:
    """Groups that may start now: (N + t + 1)·B − (accepted + running)."""
    return (max_staleness + trained + 1) * batch_groups - (accepted + running)


@dataclass
class Batch:
    """What `take()` hands the trainer: the groups, and what it dropped to get them."""

    groups: list[Group]
    dropped_stale: int = 0          # groups
    waited_s: float = 0.0           # how long the trainer waited for the batch
    staleness: dict[int, int] = field(default_factory=dict)  # span age -> samples

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


MAX_FILTERED_IN_A_ROW = 100  # batches' worth of groups the filter may drop in a row


class ProducerError(RuntimeError):
    """The producer stopped on an error (a request that kept failing)."""


class RolloutProducer:
    """Streams GRPO groups through a router into a buffer, within a staleness bound.

    `next_prompts(k)` gives the next k prompts (the job's prompt source); `sampling_params`
    may hold `sampling_seed`: each sample then gets seed + its index over the run (slime's
    deterministic-inference rule), so samples do not depend on which engine served them.
    """

    def __init__(self, generator: RouterGenerator, next_prompts: Callable[[int], list[PromptItem]],
                 *, n: int, sampling_params: dict[str, Any], batch_groups: int,
                 max_staleness: int, on_sample: Callable[[int], None] | None = None,
                 keep_group: Callable[[Group], bool] | None = None, draw_size: int | None = None):
        self.generator = generator
        self.next_prompts = next_prompts
        self.n = n
        self.sampling_params = dict(sampling_params)
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.counts = ProducerCounts()
        self._on_sample = on_sample
        # The dynamic-sampling filter (scores the group first); a dropped group's place
        # goes to a new one. Prompts are drawn `draw_size` at a time (over-sampling).
        self._keep_group = keep_group
        self._draw_size = draw_size or batch_groups
        self._filtered_in_a_row = 0
        self._lock = threading.Condition()
        self._ready: list[Group] = []
        self._running = 0
        self._accepted = 0        # groups finished and not dropped (taken or buffered)
        self._trained = 0
        self._seq = 0
        self._prompts: list[PromptItem] = []
        self._stopping = False
        self._exhausted = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    # ---- the trainer's side -------------------------------------------------------------------

    def start(self) -> RolloutProducer:
        self._thread.start()
        return self

    def take(self, trained_version: int, timeout: float = 3600.0) -> Batch:
        """The next `batch_groups` finished groups (admission order), after dropping those
        more than `max_staleness` versions behind `trained_version`."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        dropped = 0
        with self._lock:
            while True:
                if self._error is not None:
                    raise ProducerError(f"the rollout producer stopped: {self._error}") \
                        from self._error
                fresh = []
                for g in self._ready:
                    if trained_version - g.oldest_version() > self.max_staleness:
                        dropped += 1
                        self.counts.dropped_stale += 1
                        self._accepted -= 1  # its place goes to a new group
                    else:
                        fresh.append(g)
                if len(fresh) != len(self._ready):
                    self._ready = fresh
                    self._wake_loop()
                if len(self._ready) >= self.batch_groups:
                    self._ready.sort(key=lambda g: g.seq)
                    groups = self._ready[:self.batch_groups]
                    del self._ready[:self.batch_groups]
                    self.counts.taken += len(groups)
                    break
                if self._exhausted and self._running == 0:
                    raise ProducerError(f"the prompts ran out: {len(self._ready)} groups "
                                        f"ready, fewer than a batch of {self.batch_groups}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProducerError(f"no batch of {self.batch_groups} groups within "
                                        f"{timeout:.0f} s ({len(self._ready)} ready, "
                                        f"{self._running} running)")
                self._lock.wait(min(left, 1.0))
        staleness: dict[int, int] = {}
        for g in groups:
            for s in g.samples:
                age = trained_version - min(int(v) for v in s.versions())
                staleness[age] = staleness.get(age, 0) + 1
        return Batch(groups, dropped, time.monotonic() - t0, staleness)

    def trained(self) -> None:
        """One more batch trained and its weights pushed: room for one more batch."""
        with self._lock:
            self._trained += 1
        self._wake_loop()

    def stop(self, timeout: float = 60.0) -> ProducerCounts:
        """Stop admitting, cancel what runs; whatever was not taken counts as left over."""
        with self._lock:
            self._stopping = True
        self._wake_loop()
        self._thread.join(timeout)
        with self._lock:
            self.counts.left_over += len(self._ready) + self._running
            self._ready.clear()
            self._running = 0
        return self.counts

    def in_flight(self) -> int:
        """Groups being generated now."""
        with self._lock:
            return self._running

    def window_full(self) -> bool:
        """The staleness window admits no new group now: the producer waits for the
        trainer (or its prompts ran out)."""
        with self._lock:
            return self._exhausted or admission_capacity(
                self.max_staleness, self.batch_groups, self._trained, self._accepted,
                self._running) <= 0

    # ---- the producer's thread ----------------------------------------------------------------

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's next take()
            logger.exception("the rollout producer failed")
            with self._lock:
                self._error = e
                self._lock.notify_all()

    async def _produce(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        limit = asyncio.Semaphore(self.generator.concurrency)
        tasks: set[asyncio.Task] = set()
        async with self.generator.session() as session:
            try:
                while True:
                    with self._lock:
                        if self._stopping:
                            break
                        room = 0 if self._exhausted else admission_capacity(
                            self.max_staleness, self.batch_groups, self._trained,
                            self._accepted, self._running)
                        self._running += max(0, room)
                    for _ in range(max(0, room)):
                        task = asyncio.ensure_future(self._group(session, limit))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    self._wake.clear()
                    with self._lock:
                        if self._error is not None:
                            break
                    await self._wake.wait()
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _next_prompt(self) -> tuple[int, PromptItem] | None:
        if not self._prompts:
            # A batch's worth at a time: the same prompts in the same order as the sync job.
            self._prompts = list(self.next_prompts(self._draw_size))
            if not self._prompts:
                self._exhausted = True
                return None
        seq = self._seq
        self._seq += 1
        self.counts.admitted += 1
        return seq, self._prompts.pop(0)

    async def _group(self, session, limit: asyncio.Semaphore) -> None:
        with self._lock:
            drawn = self._next_prompt()
            if drawn is None:  # the prompts ran out
                self._running -= 1
                self._lock.notify_all()
                return
            seq, prompt = drawn
        calls = [self.generator.sample(session, limit, seq, prompt.input_ids,
                                       sample_params(self.sampling_params, seq * self.n + j))
                 for j in range(self.n)]
        try:
            samples = list(await asyncio.gather(*calls))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            with self._lock:
                self._running -= 1
                self.counts.failed += 1
                self._error = e
                self._lock.notify_all()
            self._wake_loop()
            return
        group = Group(seq, prompt, samples)
        keep = True
        if self._keep_group is not None:
            try:
                keep = await asyncio.to_thread(self._keep_group, group)
            except Exception as e:  # noqa: BLE001 - a failing reward or filter plug-in
                with self._lock:
                    self._running -= 1
                    self.counts.failed += 1
                    self._error = e
                    self._lock.notify_all()
                return
        with self._lock:
            self._running -= 1
            if keep:
                self._accepted += 1
                self._ready.append(group)
                self._filtered_in_a_row = 0
            else:
                self.counts.filtered += 1
                self._filtered_in_a_row += 1
                if self._filtered_in_a_row > MAX_FILTERED_IN_A_ROW * self.batch_groups:
                    self._error = ProducerError(
                        f"the dynamic-sampling filter dropped {self._filtered_in_a_row} groups "
                        "in a row")
            self._lock.notify_all()
        if not keep:
            self._wake_loop()
        if self._on_sample is not None:
            for _ in samples:
                self._on_sample(1)
