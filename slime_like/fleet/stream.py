"""RolloutStream: the fully-async producer for a trainer of your own.

    with fleet.stream(prompts, n=4, sampling_params=..., batch_size=8, max_staleness=1) as s:
        for step in range(steps):
            batch = s.next_batch()        # GRPO groups, at most max_staleness versions old
            ...                           # your loss, your optimizer
            weights.push(model)           # an in-flight update: generation keeps going

Generation never waits for your loop: the stream keeps requests going through the router
and your pushes update the engines while they run (`FleetWeights`' pause mode decides what
happens to them). Each successful push (the fleet's `Happening.VERSION`) lets the producer
run one more batch ahead; at most `max_staleness + 1` batches are ever ahead of you.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from slime_like.fleet.events import EventSink, FleetEvent, Happening
from slime_like.fleet.generation import Generation
from slime_like.protocol.weight_version import WeightVersion
from slime_like.rollout.producer import Batch, ProducerCounts, RolloutProducer
from slime_like.rollout.prompts import PromptItem


class RolloutStream:
    """Batches of groups generated without pause, within a staleness bound.

    Made by `fleet.stream(...)`: `generation` is the fleet's, `version()` its current
    weight version, `subscribe` its event subscription."""

    def __init__(self, generation: Generation, version: Callable[[], WeightVersion],
                 subscribe: Callable[[EventSink], None], prompts: Iterable[list[int]], *,
                 n: int, sampling_params: dict[str, Any], batch_size: int,
                 max_staleness: int = 1, partial_rollout: bool = False,
                 model: str | None = None, on_sample: Callable[[int], None] | None = None):
        self._version = version
        self._prompts: Iterator[list[int]] = iter(prompts)
        self._stack = contextlib.ExitStack()
        generator = self._stack.enter_context(generation.generator(
            model, keep_mixed_versions=True, partial_rollout=partial_rollout))
        self.generator = generator
        self.producer = RolloutProducer(generator, self._next_prompts, n=n,
                                        sampling_params=sampling_params,
                                        batch_groups=batch_size, max_staleness=max_staleness,
                                        on_sample=on_sample)
        self._closed = False
        subscribe(self._on_event)
        self.producer.start()

    def _next_prompts(self, k: int) -> list[PromptItem]:
        return [PromptItem("", list(ids)) for ids in itertools.islice(self._prompts, k)]

    def _on_event(self, event: FleetEvent) -> None:
        if event.kind is Happening.VERSION and not self._closed:
            self.producer.trained()

    def next_batch(self, timeout: float = 600.0) -> Batch:
        """The next `batch_size` groups in admission order; groups whose oldest token is
        more than `max_staleness` versions behind the fleet's are dropped and replaced."""
        return self.producer.take(int(self._version()), timeout)

    @property
    def counts(self) -> ProducerCounts:
        """Where every admitted group went so far."""
        return self.producer.counts

    def close(self) -> ProducerCounts:
        """Stop generating; groups in flight or not taken count as left over."""
        if self._closed:
            return self.producer.counts
        self._closed = True
        try:
            return self.producer.stop()
        finally:
            self._stack.close()

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
