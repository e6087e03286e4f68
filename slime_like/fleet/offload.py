"""Colocated engines give their memory back around a train step.

`with fleet.offloaded():` moves every colocated engine REGISTERED -> OFFLOADED (out of the
router, probed with `/ping` meanwhile: a released engine answers 503), releases its memory
by tag, runs the body (the train step), resumes the memory and moves each engine where
`after_resume` advises: routed again if its weights came back (a weights backup, or
`weights` not among the tags) and it is still at the fleet's version; otherwise
AWAITING_SYNC (STALE until the next full sync takes it along: a resync of its own would
race that sync for the same engine). With `hold_for_sync` (the caller syncs right after
the body) every resumed engine is HELD instead: out of the router, neither routed at the
old version nor probed while it has no weights; nothing can reach it, so that sync skips
its pause and continue (two round trips each) and routes it at the new version. An engine
whose memory cannot be released or resumed is recovered like any dead one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from slime_like.config.fleet_slices import FleetSettings
from slime_like.engine.fanout import each
from slime_like.fleet.lifecycle import ManagedEngine, Phase
from slime_like.protocol.io_struct import ALL_MEMORY_TAGS

logger = logging.getLogger(__name__)
HELD_FOR_SYNC = "memory resumed; out of the router until the sync"


class Offload:
    """Memory release and resume of the fleet's colocated engines (`--offload-rollout`);
    the fleet moves them."""

    def __init__(self, settings: FleetSettings):
        self.settings = settings
        # The last release and resume: wall seconds over all engines (they run concurrently)
        # and the engines that took part; the job's step metrics read it.
        self.last: dict[str, float] = {}
        self._tags: dict[str, list[str] | None] = {}  # what each engine released

    def applies_to(self, e: ManagedEngine) -> bool:
        return self.settings.engine.offload_rollout and e.colocated

    def release(self, engines: list[ManagedEngine],
                tags: list[str] | None) -> list[ManagedEngine]:
        """Release every engine's memory by `tags` (all by default); those that did."""
        t0 = time.perf_counter()
        self._tags = {}
        released = _each(engines, lambda e: self._release(e, tags, self._tags))
        self.last = {"engine_release_s": time.perf_counter() - t0}
        return released

    def resume(self, engines: list[ManagedEngine]) -> list[ManagedEngine]:
        """Resume what each engine released; those that did."""
        t0 = time.perf_counter()
        resumed = _each(engines, lambda e: e.handle.resume_memory_occupation(
            self._tags.get(e.engine_id)))
        self.last["engine_resume_s"] = time.perf_counter() - t0
        return resumed

    def after_resume(self, e: ManagedEngine, *, current: bool,
                     hold_for_sync: bool) -> tuple[Phase, str]:
        """Where a resumed engine goes (and why): `current` if it was verified at the
        fleet's version (or serves a frozen model)."""
        tags = self._tags.get(e.engine_id)
        kept = tags is not None and "weights" not in tags or \
            bool(e.handle.server_info.get("enable_weights_cpu_backup"))
        if hold_for_sync and e.update_weights:
            return Phase.HELD, HELD_FOR_SYNC  # the sync right after refills dropped weights
        if kept and current:
            return Phase.REGISTERED, "memory resumed"
        return Phase.AWAITING_SYNC, "memory resumed without its weights"

    @staticmethod
    def _release(e: ManagedEngine, tags: list[str] | None,
                 engine_tags: dict[str, list[str] | None]) -> None:
        if not e.handle.server_info:
            e.handle.probe()
        if not e.update_weights and not e.handle.server_info.get("enable_weights_cpu_backup"):
            # No sync ever refills a frozen model (a KL reference): without a backup it
            # gives back everything but its weights.
            tags = [t for t in (tags or ALL_MEMORY_TAGS) if t != "weights"]
        engine_tags[e.engine_id] = tags
        for attempt in range(20):  # a probe's one-token generation may still be running
            try:
                e.handle.release_memory_occupation(tags)
                return
            except Exception:  # noqa: BLE001 - busy: retry a few times, then report
                if attempt == 19:
                    raise
                time.sleep(0.1)


def _each(engines: list[ManagedEngine], fn: Callable[[ManagedEngine], Any]) -> list[ManagedEngine]:
    """Run `fn` on every engine concurrently; the engines it succeeded on."""
    outcomes = each(engines, fn)
    for e, (_, err) in zip(engines, outcomes, strict=True):
        if err is not None:
            logger.warning("%s: %s", e.engine_id, err)
    return [e for e, (_, err) in zip(engines, outcomes, strict=True) if err is None]
