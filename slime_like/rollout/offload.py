"""Colocated engines give their memory back around a train step (part of the Fleet).

`with fleet.offloaded():` moves every colocated engine REGISTERED -> OFFLOADED (out of the
router), releases its memory by tag, runs the body (the train step), resumes the memory and
routes the engine again if its weights came back; see `Fleet`'s lifecycle table. Only the
fleet moves engines: this is a mixin of `Fleet`, split out to keep each file to one concern.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slime_like.rollout.lifecycle import EngineState, ManagedEngine

logger = logging.getLogger(__name__)
S = EngineState


class OffloadMixin:
    """`offloaded()` and its helpers; relies on the Fleet's lock, engines, _move and route."""

    def _colocated(self, e: ManagedEngine) -> bool:
        return (self.settings.engine.offload_rollout and e.external_address is None
                and bool(e.placements) and e.placements[0].shares_trainer_gpus)

    @contextlib.contextmanager
    def offloaded(self, tags: Sequence[str] | None = None) -> Iterator[list[str]]:
        """Colocated engines release their memory (by `tags`; all by default) for the body.

        Each leaves the router (OFFLOADED: a released engine answers 503) and is probed with
        `/ping` meanwhile. On exit its memory is resumed; an engine whose weights came back
        (a weights backup, or `weights` not among the tags) is routed again if still at the
        fleet's version, otherwise it is STALE and the next full sync takes it along (no
        resync of its own: it would race that sync for the same engine).
        """
        tag_list = list(tags) if tags else None
        with self._lock:
            chosen = [e for e in self.engines if e.state is S.REGISTERED and self._colocated(e)
                      and e.handle is not None]
            for e in chosen:
                self._unroute(e)
                self._move(e, S.OFFLOADED, tags=tag_list or "all")
        released = self._each(chosen, lambda e: self._release(e, tag_list))
        try:
            yield [e.engine_id for e in released]
        finally:
            resumed = self._each(released, lambda e: e.handle.resume_memory_occupation(tag_list))
            with self._lock:
                for e in chosen:
                    if e.state is not S.OFFLOADED:
                        continue  # died meanwhile: recovery owns it
                    if e not in resumed:
                        self._move(e, S.DEAD, reason="memory could not be released or resumed")
                        continue
                    kept = tag_list is not None and "weights" not in tag_list or \
                        bool(e.handle.server_info.get("enable_weights_cpu_backup"))
                    if kept and (not e.update_weights or e.verified_version == self.version):
                        self.route(e)
                        self._move(e, S.REGISTERED, reason="memory resumed")
                    else:
                        self._awaiting_full_sync.add(e.engine_id)
                        self._move(e, S.STALE, reason="memory resumed without its weights")
            for e in chosen:
                if e.state is S.DEAD:
                    self._on_dead_after_offload(e)

    def _release(self, e: ManagedEngine, tags: list[str] | None) -> None:
        if not e.handle.server_info:
            e.handle.probe()
        for attempt in range(20):  # a probe's one-token generation may still be running
            try:
                e.handle.release_memory_occupation(tags)
                return
            except Exception:  # noqa: BLE001 - busy: retry a few times, then report
                if attempt == 19:
                    raise
                time.sleep(0.1)

    def _each(self, engines: list[ManagedEngine],
              fn: Callable[[ManagedEngine], Any]) -> list[ManagedEngine]:
        """Run `fn` on every engine concurrently; the engines it succeeded on."""
        def one(e: ManagedEngine) -> bool:
            try:
                fn(e)
                return True
            except Exception as err:  # noqa: BLE001 - the caller decides what a failure means
                logger.warning("%s: %s", e.engine_id, err)
                return False
        if not engines:
            return []
        with ThreadPoolExecutor(len(engines)) as pool:
            ok = list(pool.map(one, engines))
        return [e for e, good in zip(engines, ok, strict=True) if good]

    def _on_dead_after_offload(self, e: ManagedEngine) -> None:
        with self._lock:
            if e.engine_id in self._recovering:
                return
            self._recovering.add(e.engine_id)
            if self.monitor is not None:
                self.monitor.unwatch(e.engine_id)
        threading.Thread(target=self._recover, args=(e, "memory release/resume failed"),
                         name=f"recover-{e.engine_id}", daemon=True).start()
