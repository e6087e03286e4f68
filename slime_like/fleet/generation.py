"""Generation and scoring through the models' routers, apart from the engines' supervision.

The fleet decides which engines a router holds; everything here only sends requests to a
router's URL, or, with admission dispatch, to a free slot of an engine the router holds
(`Routers.slots`, kept in step with the router). What it owes the supervision is one call: when an engine stops answering,
`resubmit_in_flight()` sends the requests every open generator has in flight again (the
first answer wins), so nothing waits on an engine that was just taken out of its router.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from slime_like.config.fleet_slices import FleetSettings
from slime_like.fleet.lifecycle import ManagedEngine
from slime_like.fleet.routers import Routers
from slime_like.rollout.generate import RouterGenerator, Sample
from slime_like.rollout.scoring import token_logprobs


class Generation:
    """Requests through the routers of one fleet, and the generators open now."""

    def __init__(self, settings: FleetSettings, routers: Routers, engines: list[ManagedEngine],
                 updatable_model: str):
        self.settings = settings
        self.routers = routers
        self.updatable_model = updatable_model
        self._engines = engines
        self._generators: set[RouterGenerator] = set()
        self._lock = threading.Lock()
        self.last: dict = {}  # the last `generate`: requested, returned, resubmitted

    def _concurrency(self, model: str) -> int:
        count = sum(1 for e in self._engines if e.model_name == model)
        return self.settings.engine.server_concurrency * max(1, count)

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict,
                 on_sample: Callable[[int], None] | None = None,
                 model: str | None = None) -> list[Sample]:
        """Generate through the model's router (n samples per prompt, with logprobs)."""
        with self.generator(model) as gen:
            samples = gen.generate(prompts, n, sampling_params, on_sample)
        self.last = {"requested": len(prompts) * n, "returned": len(samples),
                     "resubmitted": gen.resubmitted}
        return samples

    @contextlib.contextmanager
    def generator(self, model: str | None = None, **options: Any) -> Iterator[RouterGenerator]:
        """A generator through the model's router, known here while it is open: the
        requests it has in flight are resubmitted when an engine stops answering.
        `options` are RouterGenerator's (e.g. keep_mixed_versions, partial_rollout)."""
        model = model or self.updatable_model
        gen = RouterGenerator(self.routers.url(model), api_key=self.settings.router.api_key,
                              concurrency=self._concurrency(model),
                              request_timeout_s=self.settings.router.request_timeout_s,
                              slots=self.routers.slots.get(model), **options)
        with self._lock:
            self._generators.add(gen)
        try:
            yield gen
        finally:
            with self._lock:
                self._generators.discard(gen)

    def resubmit_in_flight(self) -> None:
        """Requests that may be stuck on an engine that stopped answering go out again."""
        with self._lock:
            generators = list(self._generators)
        for gen in generators:
            gen.resubmit_in_flight()

    def token_logprobs(self, pairs: Sequence[tuple[list[int], list[int]]],
                       model: str) -> list[list[float]]:
        """log p(output tokens | prompt) under `model` through its router: per pair
        (prompt_ids, output_ids), one logprob per output token."""
        return token_logprobs(self.routers.url(model), pairs,
                              api_key=self.settings.router.api_key,
                              concurrency=self._concurrency(model),
                              timeout_s=self.settings.router.request_timeout_s)
