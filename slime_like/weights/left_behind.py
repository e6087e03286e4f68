"""An engine found hung before any weights moved is left behind, and the sync goes on.

A sync the fleet settles (`resume_on_failure=False`) that finds an engine past its pause's
or begin's deadline while the others answered has not sent an update request yet: the
first one waits for every engine's pause and begin. So no engine's weights moved, and the
others sit paused with their update sessions open, which is where a retry would take them
after continuing them, pinging them, checking their models and pausing them again (six
rounds over every engine, at 64 engines most of the step). Instead the sync drops the hung
engines, rebuilds the weight group without them where the transport has one, and sends
the weights to the others in the same transaction. The report names the engines left
behind and why (`SyncReport.hung`); the fleet holds them out as SUSPECT, as it does an
engine a failed sync found hung.

Not for a standalone sync (it fails naming the hung engine, as before: nobody would hold
that engine out of a router), a source that gathers its buckets with other ranks in
lockstep (`buckets_in_wire_layout`: they cannot start over), or a hang after an update went
out (partial weights: the sync fails and the fleet resyncs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from slime_like.engine.deadlines import CallClock
from slime_like.engine.session import EngineSession
from slime_like.errors import WeightSyncError
from slime_like.weights.sync_config import SyncReport, WeightSyncConfig
from slime_like.weights.watch import EngineCall, Watch

log = logging.getLogger(__name__)


class Leaving(Protocol):
    """What the sync gives this module (`WeightSync` is one)."""

    config: WeightSyncConfig
    clock: CallClock

    def _drop_dead(self, silent: list[EngineSession] | None = None) -> list[str]: ...


def leave_behind(sync: Leaving, err: WeightSyncError, engines: list[EngineSession],
                 sent: list[EngineCall], updates: list[EngineCall], source: Any,
                 report: SyncReport) -> list[EngineSession] | None:
    """After engines were found hung before any update went out: the others, paused with
    their sessions open, to go on with (the hung ones dropped from `sync`, named in the
    report); or None, and the sync fails. The caller regroups them."""
    hung = hung_before_updates(err, sync.config, source, updates)
    rest = others_ready(hung, engines, sent, sync.config.http_timeout_s, sync.clock) \
        if hung else None
    if rest is None:
        return None
    log.warning("left out of weight sync %s as hung, going on with the %d other "
                "engines: %s", report.weight_version, len(rest), err)
    report.hung.update({url: str(err) for url in sorted(hung)})
    report.engines = [e.url for e in rest]
    updates.clear()  # cancelled, never sent
    sync._drop_dead([e for e in engines if e.url in hung])
    return rest


def hung_before_updates(err: BaseException, config: WeightSyncConfig, source: Any,
                        updates: Sequence[EngineCall]) -> set[str]:
    """The URLs to leave behind after `err`, or an empty set (the sync fails as before)."""
    if config.resume_on_failure or not isinstance(err, WeightSyncError) or not err.hung:
        return set()
    if getattr(source, "buckets_in_wire_layout", False):
        return set()
    if any(getattr(c.future, "sent_at", None) is not None for c in updates):
        return set()  # an update reached an engine: its weights may be partly new
    return set(err.hung)


def others_ready(hung: set[str], engines: Sequence[EngineSession], sent: list[EngineCall],
                 timeout_s: float, clock: CallClock) -> list[EngineSession] | None:
    """The engines other than `hung`, once every pause and begin sent to them answered
    (each within its deadline); None if one failed or hung too (then the sync fails). The
    queued update calls are cancelled, and only then the hung engines' calls cut: a failed
    pause opens the gate the others' first update waits on. `sent` keeps the others'."""
    rest = [e for e in engines if e.url not in hung]
    mine = [c for c in sent if c.engine.url not in hung]
    watch = Watch(timeout_s, clock)  # not the hung engines' calls: they would raise again
    for call in mine:
        watch.add(call)
    try:
        watch.wait_calls(mine)
    except WeightSyncError:
        return None
    EngineSession.cancel_all_pending(engines)
    for engine in engines:
        if engine.url in hung:
            engine.abort_waiting()
            engine.paused = None  # handed over: its recovery or resync undoes it
    if not rest or any(c.future.exception() is not None for c in mine):
        return None
    for engine in rest:
        engine.new_chain()  # the cancelled update does not stop the next one
    sent[:] = mine
    return rest
