"""Chaos runs: real faults at seeded moments of the real job, and the invariants checked.

`--chaos-seed N` turns it on. Each fault is real — a SIGKILL of an engine's server during a
rollout or at a named step of a weight sync (armed in the trainer, fired through the
engine's actor so it lands before the step goes on), a SIGSTOP (a hang), a SIGKILL of the
router — and the `InvariantSampler` watches, from outside, what users rely on: no engine
is in a router while it serves another version than the fleet's, or while it cannot
answer for longer than detection allows.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from slime_like.config.flags import CHAOS_FAULTS
from slime_like.rollout.fleet import Fleet
from slime_like.rollout.lifecycle import EngineState

logger = logging.getLogger(__name__)

# fault -> the WeightSync step at whose start it fires (None: during the rollout)
FAULTS: dict[str, str | None] = {
    "kill_rollout": None,
    "kill_pause": "pause",
    "kill_transfer": "transfer",
    "kill_end": "end",
    "kill_continue": "continue",
    "stop_engine": None,
    "kill_router": None,
}
assert tuple(FAULTS) == CHAOS_FAULTS, "the flag's choices and the faults must agree"


@dataclass
class Fault:
    """One planned fault: at rollout step `step` (or the sync after it), on engine `engine`."""

    step: int
    kind: str
    engine: int
    fired_at: float | None = None
    target: str | None = None


def plan_faults(seed: int, kinds: list[str], num_steps: int, num_engines: int) -> list[Fault]:
    """One fault per chosen step, spread over the run; the last two steps stay quiet so every
    recovery finishes before the end."""
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise ValueError(f"unknown chaos fault(s) {unknown}; expected some of {list(FAULTS)}")
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    usable = list(range(1, max(2, num_steps - 2)))
    if len(order) > len(usable):
        raise ValueError(f"{len(order)} faults need at least {len(order) + 3} steps, got {num_steps}")
    stride = len(usable) / len(order)
    return [Fault(usable[int(i * stride)], kind, rng.randrange(num_engines))
            for i, kind in enumerate(order)]


class ChaosMonkey:
    """Fires the planned faults at their moments during the job."""

    def __init__(self, fleet: Fleet, faults: list[Fault], trainer: Any = None):
        self.fleet = fleet
        self.faults = faults
        self.trainer = trainer  # TrainerGroup: sync faults are armed in its rank 0

    def _target(self, fault: Fault):
        live = [e for e in self.fleet.engines if e.update_weights
                and e.state in (EngineState.REGISTERED, EngineState.UPDATING)]
        engines = live or self.fleet.engines
        return engines[fault.engine % len(engines)]

    def _at(self, step: int, sync: bool) -> list[Fault]:
        return [f for f in self.faults if f.step == step and (FAULTS[f.kind] is not None) == sync]

    def rollout_hook(self, step: int, total: int):
        """An `on_sample` hook that fires this step's rollout fault a quarter of the way in."""
        faults = self._at(step, sync=False)
        if not faults:
            return None

        def on_sample(done: int) -> None:
            if done == max(1, total // 4):
                for f in faults:
                    threading.Thread(target=self._fire, args=(f,), daemon=True).start()
        return on_sample

    def _fire(self, f: Fault) -> None:
        f.fired_at = time.time()
        if f.kind == "kill_router":
            f.target = "router"
            self.fleet.kill_router()
            return
        e = self._target(f)
        f.target = e.engine_id
        if f.kind == "stop_engine":
            self.fleet.stop_engine(self.fleet.engines.index(e))
        else:
            self.fleet.kill_engine(self.fleet.engines.index(e))
        logger.warning("chaos: %s on %s at step %d", f.kind, f.target, f.step)

    def arm_sync(self, step: int) -> None:
        """Before the sync that follows `step`: arm its fault in the trainer (fired there)."""
        for f in self._at(step, sync=True):
            e = self._target(f)
            f.target, f.fired_at = e.engine_id, time.time()
            self.trainer.arm_fault(FAULTS[f.kind], e.actors[0])
            logger.warning("chaos: %s armed on %s for the sync after step %d", f.kind,
                           e.engine_id, step)

    def summary(self) -> list[dict]:
        """Each fault with what it caused: the death (and recovery) of its target seen after
        it was fired or armed, or the router's restart."""
        out = []
        for f in self.faults:
            row = asdict(f)
            if f.kind == "kill_router":
                row["effect"] = [r for r in self.fleet.router_restarts
                                 if f.fired_at and r.get("at", 0) >= f.fired_at]
            else:
                row["effect"] = [r for r in self.fleet.recoveries if r["engine"] == f.target
                                 and f.fired_at and (r.get("dead_at") or 0) >= f.fired_at]
            out.append(row)
        return out


@dataclass
class InvariantSampler:
    """Samples every router's workers and every routed engine's /model_info from outside."""

    fleet: Fleet
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
        syncing = self.fleet._full_update.is_set()
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
        if self.fleet._full_update.is_set():
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
