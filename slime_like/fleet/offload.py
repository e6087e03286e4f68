"""Colocated engines give their memory back around a train step.

`with fleet.offloaded():` moves every colocated engine REGISTERED -> OFFLOADED (out of the
router), releases its memory by tag, runs the body (the train step), resumes the memory and
routes the engine again if its weights came back; see the lifecycle table. An engine whose
memory cannot be released or resumed is recovered like any dead one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from slime_like.engine.session import each
from slime_like.fleet.events import EngineState
from slime_like.fleet.lifecycle import ManagedEngine
from slime_like.protocol.io_struct import ALL_MEMORY_TAGS

if TYPE_CHECKING:
    from slime_like.fleet.fleet import Fleet

logger = logging.getLogger(__name__)
S = EngineState
HELD_FOR_SYNC = "memory resumed; out of the router until the sync"


class Offload:
    """Memory release and resume of the fleet's colocated engines (`--offload-rollout`)."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        # The last release and resume: wall seconds over all engines (they run concurrently)
        # and the engines that took part; the job's step metrics read it.
        self.last: dict[str, float] = {}

    def applies_to(self, e: ManagedEngine) -> bool:
        return self.fleet.settings.engine.offload_rollout and e.colocated

    @contextlib.contextmanager
    def offloaded(self, tags: Sequence[str] | None = None, *,
                  hold_for_sync: bool = False) -> Iterator[list[str]]:
        """Colocated engines release their memory (by `tags`; all by default) for the body.

        Each leaves the router (OFFLOADED: a released engine answers 503) and is probed with
        `/ping` meanwhile. On exit its memory is resumed; an engine whose weights came back
        (a weights backup, or `weights` not among the tags) is routed again if still at the
        fleet's version, otherwise it is STALE and the next full sync takes it along (no
        resync of its own: it would race that sync for the same engine).

        `hold_for_sync`: the caller syncs right after the body, so every resumed engine stays
        out of the router (STALE, taken along by that sync) instead of being routed at the
        old version, or probed while it has no weights (released without a backup). Nothing
        can reach it meanwhile, so the sync skips its pause and
        continue (two round trips each): the sync routes it at the new version.
        """
        fleet = self.fleet
        tag_list = list(tags) if tags else None
        with fleet.lock:
            chosen = [e for e in fleet.engines if e.state is S.REGISTERED and self.applies_to(e)
                      and e.handle is not None]
            for e in chosen:
                fleet.unroute(e)
                fleet.move(e, S.OFFLOADED, tags=tag_list or "all")
        t0 = time.perf_counter()
        engine_tags: dict[str, list[str] | None] = {}
        released = _each(chosen, lambda e: self._release(e, tag_list, engine_tags))
        self.last = {"engine_release_s": time.perf_counter() - t0}
        try:
            yield [e.engine_id for e in released]
        finally:
            t0 = time.perf_counter()
            resumed = _each(released, lambda e: e.handle.resume_memory_occupation(
                engine_tags.get(e.engine_id, tag_list)))
            self.last["engine_resume_s"] = time.perf_counter() - t0
            failed = []
            with fleet.lock:
                for e in chosen:
                    if e.state is not S.OFFLOADED:
                        continue  # died meanwhile: recovery owns it
                    if e not in resumed:
                        failed.append(e)
                        continue
                    tags = engine_tags.get(e.engine_id, tag_list)
                    kept = tags is not None and "weights" not in tags or \
                        bool(e.handle.server_info.get("enable_weights_cpu_backup"))
                    current = not e.update_weights or e.verified_version == fleet.version
                    if hold_for_sync and e.update_weights:
                        # the sync right after refills weights that were dropped, too
                        e.awaiting_full_sync = e.held_for_sync = True
                        fleet.move(e, S.STALE, reason=HELD_FOR_SYNC)
                    elif kept and current:
                        fleet.route(e)
                        fleet.move(e, S.REGISTERED, reason="memory resumed")
                    else:
                        e.awaiting_full_sync = True
                        fleet.move(e, S.STALE, reason="memory resumed without its weights")
                for e in failed:
                    fleet.recovery.start_recovery(e, "memory could not be released or resumed")

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
