"""smg's RL control plane as one more way for engine sessions to reach their engines.

smg 1.13 started with `--enable-rl` fans one `POST /v1/rl/engine/<path>?selector=...` out
to every worker the selector matches and answers each worker's status (`results`), the
failures (`failed`) and 207 when some failed. One such request per step replaces one
request per engine from this process: at 16 and 32 engines it took a third to a quarter
of the time and a tenth of this process's CPU (docs/COMPATIBILITY.md).

smg calls a worker with the key it was registered with, so the fleet starts the engines
with the admin key only and registers them with it (`--router-enable-rl`).

A `PlaneCall` is one step for many sessions. The sessions still own what they did: the
call records each reached session's outcome on it (`on_sent` before the request, e.g.
"paused", `on_answer` after), and a session's own verb (`pause_generation(via=...)`)
takes the engine's answer from it, or calls its engine directly when smg did not reach it
(not smg's worker, failed, or the whole request failed). The request is sent only when
every worker smg would reach is one of the call's sessions: a fan-out must never touch an
engine no session records.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests

from slime_like.cluster.polling import poll_intervals
from slime_like.engine.call_pool import engine_pool


class PlaneMember(Protocol):
    """What the plane needs of an engine session (`session.EngineSession`): its engine's
    URL. A protocol, not the class, so the session module can use the plane without a
    circle."""

    rl_plane: RlPlane | None

    @property
    def url(self) -> str: ...

log = logging.getLogger(__name__)

DEFAULT_SELECTOR = "engine=sglang"  # every sglang worker (smg labels each with its engine)
DEFAULT_TIMEOUT_S = 10.0


def _norm(url: str) -> str:
    return url.rstrip("/")


@dataclass(frozen=True)
class RlPlane:
    """Where one smg's RL control plane is, and the key to call it (smg's own)."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    selector: str = DEFAULT_SELECTOR
    timeout_s: float = DEFAULT_TIMEOUT_S

    def _http(self) -> requests.Session:
        http = requests.Session()
        http.trust_env = False  # a proxy between us and our own router only breaks things
        if self.api_key:
            http.headers["Authorization"] = f"Bearer {self.api_key}"
        return http

    def worker_urls(self, timeout: float | None = None) -> set[str]:
        """The URLs of the workers the selector would reach (`GET /v1/rl/workers`)."""
        resp = self._http().get(f"{_norm(self.url)}/v1/rl/workers",
                                timeout=timeout or self.timeout_s)
        resp.raise_for_status()
        return {_norm(w["url"]) for w in resp.json().get("workers") or []
                if _matches(w, self.selector)}

    def wait_listed(self, url: str, timeout: float) -> bool:
        """Whether the selector reaches `url` within `timeout`: smg lists a worker under
        `/workers` at once, but learns its engine (the selector's label) from the worker
        afterwards, so a step sent right after a registration could miss it."""
        deadline = time.monotonic() + timeout
        waits = poll_intervals()
        while True:
            with contextlib.suppress(requests.RequestException, ValueError):
                if _norm(url) in self.worker_urls(timeout):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(next(waits))

    def fan_out(self, path: str, body: dict, timeout: float | None = None
                ) -> tuple[dict[str, Any], dict[str, str]]:
        """One step to every selected worker: ({url: answer body} of those that answered
        200, {url: why} of those that did not)."""
        resp = self._http().post(f"{_norm(self.url)}/v1/rl/engine/{path}", json=body,
                                 params={"selector": self.selector},
                                 timeout=timeout or self.timeout_s)
        try:
            out = resp.json()
        except ValueError:
            out = {}
        if not isinstance(out, dict) or "results" not in out:
            raise RuntimeError(f"smg {self.url} /v1/rl/engine/{path}: HTTP "
                               f"{resp.status_code}: {resp.text[:300]}")
        answered: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for r in (out.get("results") or {}).values():
            if r.get("status") == 200:
                answered[_norm(r["url"])] = r.get("body")
            else:
                failed[_norm(r["url"])] = f"HTTP {r.get('status')}: {r.get('body')}"
        for f in out.get("failed") or []:
            if f.get("url"):
                failed[_norm(f["url"])] = f"{f.get('status')} {f.get('error')}"
        return answered, failed


def _matches(worker: dict, selector: str) -> bool:
    """smg's label selector (`key=value[,key=value]`) on a `/v1/rl/workers` entry."""
    labels = {**(worker.get("labels") or {}), "engine": worker.get("engine")}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if str(labels.get(key.strip())) != value.strip():
            return False
    return True


class PlaneCall:
    """One step (`path`, `body`) sent to `sessions`' engines in one smg request.

    `start()` sends it on the engine-call pool once every `gate` future succeeded (a gate
    that failed sends nothing: each session then does what it does today). Reached
    sessions get `on_answer(session, body)`; `on_sent(session)` runs on every session
    before the request (what a call that timed out may still have done)."""

    def __init__(self, plane: RlPlane, path: str, body: dict,
                 sessions: Sequence[PlaneMember], *,
                 on_sent: Callable[[PlaneMember], None] | None = None,
                 on_answer: Callable[[PlaneMember, Any], None] | None = None,
                 timeout: float | None = None):
        self.plane = plane
        self.path = path
        self.body = body
        self.sessions = list(sessions)
        self.on_sent = on_sent
        self.on_answer = on_answer
        self.timeout = timeout
        self.future: Future[dict[str, Any]] = Future()
        self.failed: dict[str, str] = {}  # url -> why smg did not reach it

    def start(self, gate: Sequence[Future] = ()) -> PlaneCall:
        engine_pool().submit(self._run, tuple(gate))
        return self

    def run(self) -> dict[str, Any]:
        """Send it in the caller's thread; {url: answer} of the engines it reached."""
        self._run(())
        return self.future.result()

    def _run(self, gate: tuple[Future, ...]) -> None:
        answered: dict[str, Any] = {}
        try:
            answered = self._send(gate)
        except Exception as err:  # noqa: BLE001 - every session falls back to its own call
            log.warning("smg RL plane %s: %s failed (%s); each engine is called directly",
                        self.plane.url, self.path, err)
        self.future.set_result(answered)

    def _send(self, gate: tuple[Future, ...]) -> dict[str, Any]:
        if gate:
            wait_futures(gate)
            if any(f.cancelled() or f.exception() is not None for f in gate):
                return {}
        mine = {_norm(s.url): s for s in self.sessions}
        workers = self.plane.worker_urls(self.timeout)
        strangers = workers - set(mine)
        if strangers:
            log.warning("smg RL plane %s: %s not sent through smg: it would also reach "
                        "%s, which this step does not cover", self.plane.url, self.path,
                        sorted(strangers))
            return {}
        reached = [s for url, s in mine.items() if url in workers]
        if not reached:
            return {}  # none is smg's worker (yet): each session calls its engine
        if self.on_sent is not None:
            for s in reached:
                self.on_sent(s)
        answered, self.failed = self.plane.fan_out(self.path, self.body, self.timeout)
        if self.on_answer is not None:
            for url, body in answered.items():
                self.on_answer(mine[url], body)
        return answered

    def answer_for(self, session: PlaneMember) -> Any | None:
        """The engine's answer through smg (waits for the request), or None when smg did not
        reach it: the session then calls its engine itself."""
        answered = self.future.result()
        url = _norm(session.url)
        if url not in answered:
            return None
        return answered[url] if answered[url] is not None else {}


def plane_calls(sessions: Sequence[PlaneMember], path: str, body: dict, *,
                min_engines: int = 2, **kw: Any) -> dict[str, PlaneCall]:
    """One PlaneCall per RL plane the sessions are reached by (at least `min_engines` of
    them on it), by session URL; sessions without a plane are not in it."""
    by_plane: dict[RlPlane, list[PlaneMember]] = {}
    for s in sessions:
        if s.rl_plane is not None:
            by_plane.setdefault(s.rl_plane, []).append(s)
    out: dict[str, PlaneCall] = {}
    for plane, members in by_plane.items():
        if len(members) >= min_engines:
            call = PlaneCall(plane, path, body, members, **kw)
            out.update((s.url, call) for s in members)
    return out


def start_all(calls: dict[str, PlaneCall], gate: Sequence[Future] = ()) -> None:
    """Start each distinct PlaneCall of `plane_calls` once."""
    for call in {id(c): c for c in calls.values()}.values():
        call.start(gate)
