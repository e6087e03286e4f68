"""A WeightSync's engines coming and going: added back, removed, replaced by the caller's
set, and dropped when they stop answering (handed to whoever recovers them).

Apart from the transaction (`sync.py`), which only asks who still answers after a failure
(a second, longer ping for those silent to the first) and drops the rest; the weight
group is rebuilt for the living at the next sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from slime_like.engine.fanout import each
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, WeightSyncError
from slime_like.weights.attach import EngineLike, session_for
from slime_like.weights.sync_config import WeightSyncConfig
from slime_like.weights.transport import Transport

log = logging.getLogger(__name__)

#: an engine silent to the first liveness ping after a failure gets one this many times
#: longer before it is dropped (a loaded host, not a dead one)
LATE_PING_FACTOR = 3


class Members:
    """The engines of a WeightSync, and the ones it dropped (mixed into `WeightSync`)."""

    config: WeightSyncConfig
    engines: list[EngineSession]
    dropped: list[EngineSession]
    transport: Transport | None
    _lock: threading.Lock
    _probed: set[str]

    def add_engine(self, engine: EngineLike) -> None:
        """An engine (recovered, added) joins; the next sync rebuilds the group with it."""
        with self._lock:
            self._add(session_for(engine))

    def remove_engine(self, url: str) -> None:
        """An engine (drained) leaves; the next sync regroups and it leaves the old group."""
        with self._lock:
            self._remove(url.rstrip("/"))

    def take_dropped(self) -> list[str]:
        """URLs of engines dropped after they stopped answering (for recovery), once each."""
        with self._lock:
            out, self.dropped = [e.url for e in self.dropped], []
            return out

    def _add(self, target: EngineSession) -> None:
        target.timeout = self.config.http_timeout_s
        if any(e.url == target.url for e in self.engines):
            raise ConfigError("engines", f"engine {target.url} is already synced")
        self.dropped = [e for e in self.dropped if e.url != target.url]
        self._probed.discard(target.url)
        self.engines.append(target)
        if self.transport is not None:
            self.transport.forget([target.url])

    def _remove(self, url: str) -> None:
        self.engines = [e for e in self.engines if e.url != url]

    def _set_engines(self, engines: Sequence[EngineLike]) -> None:
        """The update's engines as membership changes (leavers removed, joiners added); an
        engine still synced keeps its session (it remembers the groups it joined)."""
        new = [session_for(e) for e in engines]
        kept = {e.url: e for e in self.engines}
        for e in new:  # where an engine is routed is the caller's news: the smg RL plane
            if e.url in kept and kept[e.url] is not e:  # that reaches it once it is routed
                kept[e.url].rl_plane = e.rl_plane
        if [e.url for e in new] == [e.url for e in self.engines]:
            return
        wanted = {e.url for e in new}
        for e in [e for e in self.engines if e.url not in wanted]:
            self._remove(e.url)
        for e in new:
            if all(have.url != e.url for have in self.engines):
                self._add(e)
        order = {e.url: i for i, e in enumerate(new)}
        self.engines.sort(key=lambda e: order[e.url])

    def _answering(self, engines: list[EngineSession], patience: float = 1.0
                   ) -> list[EngineSession]:
        """Those of `engines` that answer a ping of `patience` x the liveness timeout."""
        def alive(engine: EngineSession) -> bool:
            return engine.ping(timeout=patience * self.config.liveness_timeout_s)

        if not engines:
            return []
        return [e for e, (ok, _) in zip(engines, each(engines, alive), strict=True) if ok]

    def _with_dead_dropped(self, err: WeightSyncError,
                           silent: list[EngineSession] | None = None) -> WeightSyncError:
        """Drop engines that stopped answering (`silent`, when known) and say so in the error."""
        dead = self._drop_dead(silent)
        if dead:
            if err.engine is None:
                err.engine = dead[0]
            err.args = (f"{err.args[0]}; dropped engines that stopped answering: "
                        f"{', '.join(dead)} (the next sync rebuilds the group without them)",)
        return err

    def _drop_dead(self, silent: list[EngineSession] | None = None) -> list[str]:
        dead = silent if silent is not None else [
            e for e in self.engines if e not in self._answering(self.engines)]
        dead = [e for e in dead if e in self.engines]
        if dead:
            self.engines = [e for e in self.engines if e not in dead]
            self.dropped += dead
            if self.transport is not None:
                self.transport.forget([e.url for e in dead])
            log.error("dropped engines that stopped answering: %s", [e.url for e in dead])
        return [e.url for e in dead]
