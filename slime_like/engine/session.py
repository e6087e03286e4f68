"""EngineSession: every control call to one engine, and what this process did to it.

Built only from an `EngineAddress` (so the keys come along, always) and one HTTP client
(`EngineClient`). Beside the verbs, the session remembers what it changed on the engine:
whether it paused it (and in which mode), whether a weight-update session is open, which
weight groups it asked the engine to join. `undo()` puts all of that back, so a failed
update, a regroup or a close cannot leave an engine paused, inside an update, or in a group
nobody will use again. A session pickles as its address: what one process did belongs to
that process.

The session's calls can also be queued in its ordered lane (`submit`, `submit_steps`):
each call is sent once the one before it was sent and the futures it waits for are done
(by default: the one before was answered), by the process's engine-call loop (a call
written as steps: the sync's pause, begin, updates, end, continue, flush) or on its pool
(`engine/call_pool.py`); `engine/fanout.py` fans one call out to many sessions at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from slime_like.engine.address import EngineAddress
from slime_like.engine.call_pool import (  # noqa: F401 - re-exported
    CallCancelled,
    OrderedLane,
    cancel_all,
    engine_pool,
)
from slime_like.engine.client import DEFAULT_TIMEOUT_S, EngineClient
from slime_like.engine.steps import Steps, drive
from slime_like.errors import EngineError, WeightSyncError
from slime_like.protocol import io_struct as p
from slime_like.protocol.compat import (
    BEGIN_END_SINCE,
    FLATTENED_DISTRIBUTED_SINCE,
    FLUSH_AFTER_RETRACT_SINCE,
    try_parse_version,
)
from slime_like.protocol.modes import PauseMode

if TYPE_CHECKING:
    from slime_like.engine.rl_plane import PlaneCall, RlPlane

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item

# Whose requests survive a pause: a flush must never abort them.
RESUMABLE_PAUSE_MODES = (PauseMode.RETRACT, PauseMode.IN_PLACE)
# sglang 0.5.23's answer when the weights landed but the flush after them was refused.
FLUSH_REFUSED_MARK = "Weights were updated, but the cache was not flushed"


class EngineSession:
    """One engine's verbs, its ordered lane, and the undo of what this process did to it."""

    def __init__(self, address: EngineAddress, timeout: float = DEFAULT_TIMEOUT_S,
                 rl_plane: RlPlane | None = None):
        if not isinstance(address, EngineAddress):
            raise TypeError(f"an EngineSession is built from an EngineAddress, got {address!r}")
        self.address = address
        self.http = EngineClient(address.url, api_key=address.api_key,
                                 admin_api_key=address.admin_api_key, timeout=timeout)
        # Read from /server_info by `probe`; None until then.
        self.version: tuple[int, ...] | None = None
        # The smg RL control plane that reaches this engine (`engine/rl_plane.py`), set
        # while the engine is a worker of an smg started with `--enable-rl`.
        self.rl_plane = rl_plane
        self.server_info: dict = {}
        # What this process changed on the engine (undone by `undo`).
        self.paused: PauseMode | None = None
        self.in_update = False
        self.groups: list[str] = []
        self._lock = threading.Lock()
        self._lane = OrderedLane()

    def __reduce__(self) -> tuple:
        return (EngineSession, (self.address, self.http.timeout, self.rl_plane))

    def __repr__(self) -> str:
        return f"EngineSession({self.address.engine_id} at {self.url})"

    def __str__(self) -> str:
        return self.url  # engines are named by URL in every message

    # ---- the address -------------------------------------------------------------------------

    url = property(lambda self: self.address.url)
    tp_size = property(lambda self: self.address.tp_size)
    engine_id = property(lambda self: self.address.engine_id)
    worker_type = property(lambda self: self.address.worker_type)
    bootstrap_port = property(lambda self: self.address.bootstrap_port)
    api_key = property(lambda self: self.address.api_key)
    admin_api_key = property(lambda self: self.address.admin_api_key)

    @property
    def timeout(self) -> float:
        """The default timeout (seconds) of a verb called without one."""
        return self.http.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.http.timeout = seconds

    # ---- what this engine supports ----------------------------------------------------------

    def probe(self, timeout: float | None = None) -> None:
        """Read /server_info once: the sglang version and the TP size the engine really runs."""
        self.server_info = self.http.server_info(timeout) or {}
        info = p.ServerInfo.model_validate(self.server_info)
        self.version = try_parse_version(info.version)
        if info.tp_size is not None and info.tp_size != self.tp_size:
            raise WeightSyncError("attach", f"the engine runs tp_size={info.tp_size} but the "
                                  f"sync was configured with tp_size={self.tp_size}", self.url)
        if (info.dp_size or 1) > 1:
            raise WeightSyncError("attach", "weight updates need dp_size == 1 per engine "
                                  "(sglang asserts it); run one server per DP replica", self.url)
        if (info.pp_size or 1) > 1:
            raise WeightSyncError("attach", "weight groups place ranks at rank_offset + "
                                  "tp_rank only, so pp_size must be 1", self.url)

    def _at_least(self, since: tuple[int, ...], unknown: bool) -> bool:
        return unknown if self.version is None else self.version >= since

    @property
    def has_begin_end(self) -> bool:
        return self._at_least(BEGIN_END_SINCE, unknown=True)

    @property
    def has_flattened_distributed(self) -> bool:
        return self._at_least(FLATTENED_DISTRIBUTED_SINCE, unknown=True)

    @property
    def flushes_after_retract(self) -> bool:
        return self._at_least(FLUSH_AFTER_RETRACT_SINCE, unknown=False)

    @property
    def folds_flush(self) -> bool:
        """0.5.23 answers a refused post-update flush with 400 (weights kept); older engines
        crash on it, so they get a separate /flush_cache, which is refused harmlessly."""
        return self.version is not None and self.version >= FLUSH_AFTER_RETRACT_SINCE

    # ---- health and info ---------------------------------------------------------------------

    def ping(self, timeout: float = 5.0) -> bool:
        """GET /ping: True while the server answers, even paused (unlike /health)."""
        return self.http.ping(timeout)

    def health_generate(self, timeout: float = 30.0) -> bool:
        """One real generation step; raises EngineError on failure."""
        self.http.health_generate(timeout)
        return True

    def model_info(self, timeout: float | None = None) -> dict:
        return self.http.model_info(timeout)

    def weight_version(self, timeout: float | None = None) -> str:
        """The live weight version, from `/model_info` (`/get_weight_version` is gone)."""
        return self.http.weight_version(timeout)

    def weight_version_steps(self, timeout: float | None = None) -> Steps[str]:
        info = yield self.http.model_info_call(timeout)
        return p.ModelInfo.model_validate(info).weight_version

    def loads(self, timeout: float | None = None) -> dict:
        return self.http.loads(timeout)

    def in_flight(self, timeout: float | None = None) -> int | None:
        """Running plus waiting requests (what an abort-mode pause is about to abort, what
        a drain waits for); None when the engine does not answer."""
        with contextlib.suppress(EngineError, KeyError, TypeError, ValueError):
            return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                       for x in self.loads(timeout).get("loads") or [])
        return None

    def weights_checker(self, req: p.WeightsCheckerRequest | None = None,
                        timeout: float | None = None) -> dict:
        """Per-rank checksums (`action="checksum"` by default), snapshot or compare."""
        return self.http.weights_checker(req or p.WeightsCheckerRequest(), timeout)

    def get_weights_by_name(self, req: p.GetWeightsByNameRequest,
                            timeout: float | None = None) -> Any:
        return self.http.get_weights_by_name(req, timeout)

    def start_profile(self, req: p.ProfileRequest, timeout: float | None = None) -> str:
        return self.http.start_profile(req, timeout)

    def stop_profile(self, timeout: float | None = None) -> str:
        return self.http.stop_profile(timeout)

    # ---- generation control ------------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = PauseMode.RETRACT,
                         timeout: float | None = None, via: PlaneCall | None = None) -> dict:
        """Pause the engine; `via`: take its answer from that smg fan-out (`rl_plane.py`)
        when it reached the engine, else call the engine directly."""
        return drive(self.pause_steps(mode, timeout, via))

    def pause_steps(self, mode: PauseMode = PauseMode.RETRACT, timeout: float | None = None,
                    via: PlaneCall | None = None) -> Steps[dict]:
        """`pause_generation` as steps (`engine/steps.py`)."""
        self.paused = mode  # before the call: even one that timed out may have paused it
        if via is not None:
            yield via.future
            answer = via.answer_for(self)
            if answer is not None:
                return answer
        return (yield self.http.pause_call(mode, timeout))

    def continue_generation(self, timeout: float | None = None,
                            via: PlaneCall | None = None) -> dict:
        """Continue the engine (`via`: as in `pause_generation`)."""
        return drive(self.continue_steps(timeout, via))

    def continue_steps(self, timeout: float | None = None,
                       via: PlaneCall | None = None) -> Steps[dict]:
        out = None
        if via is not None:
            yield via.future
            out = via.answer_for(self)
        if out is None:
            out = yield self.http.continue_call(timeout=timeout)
        self.paused = None
        return out

    @staticmethod
    def record_paused(mode: PauseMode) -> Callable[[EngineSession], None]:
        """What a pause through smg records on each session it is sent to, before it is
        sent (as `pause_generation` does)."""
        def record(session: EngineSession) -> None:
            session.paused = mode
        return record

    @staticmethod
    def record_continued(session: EngineSession, _answer: Any) -> None:
        """What a continue through smg records on each session it reached."""
        session.paused = None

    def abort_request(self, rid: str = "", abort_all: bool = False,
                      timeout: float | None = None) -> None:
        self.http.abort_request(rid, abort_all, timeout)

    def try_flush_cache(self) -> bool:
        """One /flush_cache: True when flushed, False when the engine was not idle."""
        return drive(self.try_flush_steps())

    def try_flush_steps(self) -> Steps[bool]:
        try:
            yield self.http.flush_call()
        except EngineError as e:
            if e.status == 400:
                return False
            raise
        return True

    def flush_cache(self, attempts: int = 20, interval: float = 0.5, abort_first: bool = True) -> bool:
        """Flush the prefix cache, retrying while the engine is busy (bounded).

        Stuck requests are aborted first when that loses nothing the caller wants to resume:
        not while paused in `retract` or `in_place` mode, whose requests continue afterwards.
        """
        may_abort = abort_first and self.paused not in RESUMABLE_PAUSE_MODES
        for attempt in range(attempts):
            if self.http.flush_cache():
                return True
            if may_abort and attempt == 0:
                self.http.abort_request(abort_all=True)
            time.sleep(interval)
        raise EngineError(self.url, "/flush_cache", 400,
                          f"engine still busy after {attempts} attempts over "
                          f"{attempts * interval:.1f}s", reason="busy")

    def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout: float | None = None) -> None:
        self.http.release_memory_occupation(tags, timeout)

    def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout: float | None = None) -> None:
        self.http.resume_memory_occupation(tags, timeout)

    # ---- weights -----------------------------------------------------------------------------

    def init_weights_update_group(self, req: p.InitWeightsUpdateGroupRequest,
                                  timeout: float | None = None) -> dict:
        return drive(self.join_steps(req, timeout))

    def join_steps(self, req: p.InitWeightsUpdateGroupRequest,
                   timeout: float | None = None) -> Steps[dict]:
        """A group join as steps: at a regroup of 64 engines, a thread per join cost the
        trainer more than the joins' own sends."""
        with self._lock:  # before the call: a join that timed out may still have joined
            if req.group_name not in self.groups:
                self.groups.append(req.group_name)
        return (yield self.http.init_weights_update_group_call(req, timeout))

    def destroy_weights_update_group(self, group_name: str = p.DEFAULT_GROUP_NAME,
                                     timeout: float | None = None) -> dict:
        return drive(self.destroy_steps(group_name, timeout))

    def destroy_steps(self, group_name: str = p.DEFAULT_GROUP_NAME,
                      timeout: float | None = None) -> Steps[dict]:
        out = yield self.http.destroy_weights_update_group_call(group_name, timeout)
        self._forget_group(group_name)
        return out

    def _forget_group(self, group_name: str) -> None:
        with self._lock:
            self.groups = [g for g in self.groups if g != group_name]

    def leave_groups(self, timeout: float = 10.0) -> list[str]:
        """Destroy every group this session asked the engine to join; the names it could not
        reach the engine about (it is gone or hung) are returned. An engine that answers
        400 no longer has the group: that counts as left."""
        return drive(self.leave_steps(timeout))

    def leave_steps(self, timeout: float = 10.0) -> Steps[list[str]]:
        """`leave_groups` as steps, for the engine-call loop (a regroup's fan-out)."""
        unreached = []
        for name in list(self.groups):
            try:
                yield from self.destroy_steps(name, timeout)
            except EngineError as e:
                if e.status is None:
                    unreached.append(name)
                else:  # answered: the engine no longer has the group
                    self._forget_group(name)
        return unreached

    def begin_weight_update(self, timeout: float | None = None) -> dict | None:
        """Open an update session. An engine without sessions (sglang < 0.5.21, 404) is
        noted as such; one left open by an earlier failed update is closed and reopened."""
        return drive(self.begin_steps(timeout))

    def begin_steps(self, timeout: float | None = None) -> Steps[dict | None]:
        try:
            answer = yield self.http.begin_weight_update_call(timeout)
        except EngineError as e:
            if e.status == 404:
                self.version = self.version or (0, 5, 20)
                return None
            if e.status == 400 and "already open" in e.body:
                yield self.http.end_weight_update_call(timeout)
                answer = yield self.http.begin_weight_update_call(timeout)
            else:
                raise
        self.in_update = True
        return answer

    def end_weight_update(self, timeout: float | None = None) -> dict:
        return drive(self.end_steps(timeout))

    def end_steps(self, timeout: float | None = None) -> Steps[dict]:
        out = yield self.http.end_weight_update_call(timeout)
        self.in_update = False
        return out

    def update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest,
                                        timeout: float | None = None) -> dict:
        return drive(self.update_steps("update_weights_from_distributed", req, timeout))

    def update_weights_from_tensor(self, req: p.UpdateWeightsFromTensorRequest,
                                   timeout: float | None = None) -> dict:
        return drive(self.update_steps("update_weights_from_tensor", req, timeout))

    def update_weights_from_disk(self, req: p.UpdateWeightsFromDiskRequest,
                                 timeout: float | None = None) -> dict:
        return drive(self.update_steps("update_weights_from_disk", req, timeout))

    def update_steps(self, verb: str, req: Any, timeout: float | None) -> Steps[dict]:
        """An update (`verb`: one of the three above) as steps. One whose weights landed but
        whose folded flush was refused (sglang 0.5.23 answers 400) is a success with
        `flush_refused` set: the weights serve."""
        try:
            return (yield getattr(self.http, verb + "_call")(req, timeout))
        except EngineError as e:
            if getattr(req, "flush_cache", False) and e.status == 400 and \
                    FLUSH_REFUSED_MARK in e.body:
                return {"success": True, "message": e.body, "flush_refused": True}
            raise

    def update_weight_version(self, req: p.UpdateWeightVersionRequest,
                              timeout: float | None = None) -> dict:
        return self.http.update_weight_version(req, timeout)

    def verify_version(self, version: str) -> None:
        drive(self.verify_steps(version))

    def verify_steps(self, version: str) -> Steps[None]:
        got = yield from self.weight_version_steps()
        if got != version:
            raise WeightSyncError("verify_weight_version",
                                  f"engine reports weight_version {got!r}, expected {version!r}",
                                  self.url)

    # ---- undo --------------------------------------------------------------------------------

    def undo(self, *, resume: bool = True, timeout: float = 30.0) -> list[str]:
        """Close what this process left open on the engine: its update session, then (when
        `resume`) its pause. Problems are returned, never raised: an engine that cannot be
        reached is the fleet's to recover, and the others must still be put back."""
        problems = []
        if self.in_update:
            try:
                self.end_weight_update(timeout=min(timeout, self.timeout))
            except EngineError as e:
                if e.status is not None:  # answered: nothing is open any more
                    self.in_update = False
                problems.append(f"end_weight_update: {e}")
        if resume and self.paused is not None:
            for attempt in range(2):  # continue is idempotent: an error answer is retried once
                try:
                    self.continue_generation(timeout=min(timeout, self.timeout))
                    break
                except EngineError as e:
                    if e.status is None or attempt == 1:
                        problems.append(f"continue_generation: {e}")
                        break
                    time.sleep(0.2)
        return problems

    # ---- the ordered lane --------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any,
               after: Sequence[Future] | None = None) -> Future[T]:
        """Queue fn(*args) behind this session's earlier calls (`engine/call_pool.py`).

        Order matters: consecutive bucket updates describe consecutive broadcasts, so update
        k+1 must never reach an engine before update k. The call is sent once the previous
        one was sent and every future in `after` is done; by default `after` is the previous
        call, so it waits for its answer. A caller may name other futures that still imply
        the previous call was taken up, so the next travels while the engine works on it.
        The futures are data, not callbacks: nothing of the caller's runs on the lane.
        """
        return self._lane.submit(fn, args, after)

    def submit_steps(self, fn: Callable[..., Steps[T]], *args: Any,
                     after: Sequence[Future] | None = None) -> Future[T]:
        """As `submit`, for a call written as steps (`engine/steps.py`): the engine-call
        loop runs it (`engine/call_pool.py`), no thread of its own."""
        return self._lane.submit(fn, args, after, steps=True)

    def tail(self) -> Future | None:
        """The future of the last call queued in this session's lane (None: none queued)."""
        return self._lane.tail()

    def new_chain(self) -> None:
        """The next call starts a chain of its own: a call that failed earlier (in another
        update, or a join of another attempt) does not stop it. What is still queued keeps
        its place and is still sent."""
        self._lane.new_chain()

    def abort_waiting(self) -> int:
        """Fail every call still awaiting this engine's answer at once, its connection
        reset, so that none lands later (`EngineClient.abort_waiting`); how many."""
        return self.http.abort_waiting()

    def cancel_pending(self) -> None:
        """Every call still waiting for its gate fails with CallCancelled, never sent."""
        self._lane.cancel_pending()

    @staticmethod
    def cancel_all_pending(sessions: Sequence[EngineSession]) -> None:
        """`cancel_pending` on every session, every lane stopped before any call fails: a
        failed call may be a gate other lanes' calls wait on (`call_pool.cancel_all`)."""
        cancel_all(s._lane for s in sessions)
