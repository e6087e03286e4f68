"""The chaos oracle: what users rely on, watched from outside while faults land.

No engine is in a router while it serves another version than the fleet's, or while it
cannot answer for longer than detection allows. `InvariantSampler` samples every router's
workers and every routed engine's `/model_info`, and records each violation.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

logger = logging.getLogger(__name__)


@dataclass
class InvariantSampler:
    """Samples every router's workers and every routed engine's /model_info from outside."""

    fleet: Any  # a Fleet: version, routers, engines, update_in_progress
    interval_s: float = 0.2
    unreachable_grace_s: float = 3.0
    samples: int = 0
    violations: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._down_since: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> InvariantSampler:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        return {"samples": self.samples, "violations": self.violations}

    def _run(self) -> None:
        session = requests.Session()
        session.trust_env = False
        while not self._stop.wait(self.interval_s):
            try:
                self._sample(session)
            except Exception:  # noqa: BLE001 - a sampler hiccup is not a finding
                logger.debug("sampler round failed", exc_info=True)

    def _sample(self, session: requests.Session) -> None:
        version = int(self.fleet.version)
        syncing = self.fleet.update_in_progress
        allowed = {str(version), str(version + 1)} if syncing else {str(version)}
        by_url = {e.url: e for e in self.fleet.engines if e.url}
        for model, router in self.fleet.routers.items():
            try:
                workers = router.client.list_workers()
            except Exception:  # noqa: BLE001 - router down: nothing is routed
                continue
            for w in workers:
                e = by_url.get(w.url)
                if e is None or not e.update_weights:
                    continue
                self.samples += 1
                try:
                    r = session.get(w.url + "/model_info", timeout=0.5,
                                    headers={"Authorization": f"Bearer {e.handle.api_key}"}
                                    if e.handle and e.handle.api_key else {})
                    served = str(r.json()["weight_version"])
                    self._down_since.pop(w.url, None)
                except Exception:  # noqa: BLE001 - unreachable right now
                    first = self._down_since.setdefault(w.url, time.time())
                    if time.time() - first > self.unreachable_grace_s:
                        self._violate("routed while not answering", model, e.engine_id,
                                      seconds=round(time.time() - first, 2))
                    continue
                if served not in allowed and served not in self._allowed_now() \
                        and self._still_routed(router, w.url):
                    self._violate("routed at another version", model, e.engine_id,
                                  served=served, fleet=version)

    def _allowed_now(self) -> set[str]:
        """The versions allowed at this instant: a sync may have started or settled since
        the round began (its engines stay routed, paused, while the new weights land)."""
        version = int(self.fleet.version)
        if self.fleet.update_in_progress:
            return {str(version), str(version + 1)}
        return {str(version)}

    @staticmethod
    def _still_routed(router, url: str) -> bool:
        """Whether `url` is still a worker: a failed sync unroutes its engines before it
        ends, possibly between this round's listing and its /model_info."""
        try:
            return any(w.url == url for w in router.client.list_workers())
        except Exception:  # noqa: BLE001 - router down: nothing is routed
            return False

    def _violate(self, what: str, model: str, engine: str, **details: Any) -> None:
        v = {"what": what, "model": model, "engine": engine, "time": time.time(), **details}
        logger.error("chaos invariant violated: %s", v)
        self.violations.append(v)
