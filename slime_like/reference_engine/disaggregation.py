"""PD disaggregation: the prefill engine's hand-off store and bootstrap server, the decode fetch.

sglang-router in PD mode posts every `/generate` to a prefill and a decode engine at once,
with `bootstrap_host`/`bootstrap_port` (the prefill engine's bootstrap server) and a random
`bootstrap_room` in the body. Here the prefill engine runs the prompt, samples the first
token, and parks a *hand-off* under the room: the prompt's KV (every layer, copied off the
slot), the first token with its logprob and top logprobs, the request generator's state
after that draw, the weight version and the cached-prefix length. Its bootstrap server (a
small HTTP server on `--disaggregation-bootstrap-port`) hands it out once, by room. The
decode engine long-polls for the room, copies the KV into a slot and continues decoding
from the first token, so nothing is recomputed and seeded sampling continues the same
random stream. Like sglang, the prefill engine answers its `/generate` only after the
decode engine took the hand-off, and a decode request whose room never arrives fails with
HTTP 500 after `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from slime_like.reference_engine.request import Req
    from slime_like.reference_engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# sglang's names: how long a prefill engine keeps a hand-off nobody took, and how long a
# decode engine waits for the KV of its room (both 300 s in sglang).
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
_DEFAULT_TIMEOUT_S = 300.0
_POLL_ROUND_S = 1.0  # one long-poll round; between rounds the decode side checks for aborts
_ROOM_MODULUS = 1 << 63


def env_timeout(name: str) -> float:
    """A timeout in seconds from the environment (sglang's variable names), default 300."""
    return float(os.environ.get(name, _DEFAULT_TIMEOUT_S))


class HandoffError(Exception):
    """A PD hand-off failed (never arrived, prefill gone, prefill aborted): HTTP 500 as in sglang."""

    status_code = 500


@dataclass(frozen=True)
class Bootstrap:
    """Where one request's hand-off lives: the prefill engine's bootstrap server and room."""

    host: str
    port: int
    room: int


def bootstrap_items(body: dict, n_prompts: int, n: int) -> list[Bootstrap | None]:
    """Per item (prompt-major, n samples each) bootstrap of a /generate body; None without one.

    sglang-router sends scalars for one prompt and lists for a batch; a scalar room with a
    batch gives item k the room `room + k` (both engines of the pair derive the same).
    """
    room = body.get("bootstrap_room")
    if room is None:
        return [None] * (n_prompts * n)

    def per_prompt(value: Any, name: str) -> list:
        if isinstance(value, list):
            if len(value) != n_prompts:
                raise ValueError(f"{name} has {len(value)} entries for a batch of {n_prompts}")
            return value
        return [value] * n_prompts

    hosts = per_prompt(body.get("bootstrap_host"), "bootstrap_host")
    ports = per_prompt(body.get("bootstrap_port"), "bootstrap_port")
    rooms = room if isinstance(room, list) else [room + i * n for i in range(n_prompts)]
    if len(rooms) != n_prompts:
        raise ValueError(f"bootstrap_room has {len(rooms)} entries for a batch of {n_prompts}")
    out: list[Bootstrap | None] = []
    for i in range(n_prompts):
        if hosts[i] is None or ports[i] is None or rooms[i] is None:
            raise ValueError("bootstrap_room needs bootstrap_host and bootstrap_port (the prefill "
                             "engine's --disaggregation-bootstrap-port)")
        for j in range(n):
            out.append(Bootstrap(str(hosts[i]).strip("[]"), int(ports[i]),
                                 (int(rooms[i]) + j) % _ROOM_MODULUS))
    return out


def requested_rooms(body: object) -> list[int]:
    """Best effort: the rooms a (possibly invalid) /generate body names, one sample each."""
    if not isinstance(body, dict):
        return []
    room = body.get("bootstrap_room")
    try:
        if isinstance(room, list):
            return [int(r) % _ROOM_MODULUS for r in room if r is not None]
        if room is None:
            return []
        prompts = body.get("input_ids") if body.get("text") is None else body.get("text")
        batch = len(prompts) if isinstance(prompts, list) and prompts and \
            isinstance(prompts[0], list | str) else 1
        return [(int(room) + i) % _ROOM_MODULUS for i in range(batch)]
    except (TypeError, ValueError):
        return []


@dataclass
class Handoff:
    """What the prefill engine hands to the decode engine for one room."""

    room: int
    prompt_ids: list[int] = field(default_factory=list)
    first_token: int = -1
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, prompt_len, head_dim]
    generator_state: torch.Tensor | None = None  # seeded requests: state after the first draw
    weight_version: str = "default"
    cached_tokens: int = 0
    error: str | None = None  # the prefill side failed (aborted, ...)

    def to_bytes(self) -> bytes:
        """torch.save of plain types and tensors (read back with weights_only=True)."""
        buf = io.BytesIO()
        torch.save({"room": self.room, "prompt_ids": self.prompt_ids, "first_token": self.first_token,
                    "logprob": self.logprob, "top_logprobs": self.top_logprobs, "kv": self.kv,
                    "generator_state": self.generator_state, "weight_version": self.weight_version,
                    "cached_tokens": self.cached_tokens, "error": self.error}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Handoff:
        d = torch.load(io.BytesIO(data), weights_only=True)
        if d.get("top_logprobs") is not None:
            d["top_logprobs"] = [tuple(x) for x in d["top_logprobs"]]
        return cls(**d)


@dataclass
class _Entry:
    handoff: Handoff
    expires: float
    on_taken: Callable[[], None] | None = None


class HandoffStore:
    """Hand-offs by room on the prefill engine: put once, taken once, dropped when stale."""

    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self._entries: dict[int, _Entry] = {}
        self._cv = threading.Condition()

    def put(self, handoff: Handoff, on_taken: Callable[[], None] | None = None) -> None:
        """Park a hand-off (scheduler thread) and wake a decode engine polling for it;
        `on_taken` runs (on a bootstrap-server thread) once the decode engine took it."""
        with self._cv:
            self._expire()
            self._entries[handoff.room] = _Entry(handoff, time.monotonic() + self.keep_s, on_taken)
            self._cv.notify_all()

    def take(self, room: int, wait_s: float) -> Handoff | None:
        """The hand-off of `room`, waiting up to wait_s for it; None if it did not arrive."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while room not in self._entries:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            entry = self._entries.pop(room)
        if entry.on_taken is not None:
            entry.on_taken()
        return entry.handoff

    def discard(self, room: int) -> None:
        """Forget a room nobody will take."""
        with self._cv:
            self._entries.pop(room, None)

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        for room in [r for r, e in self._entries.items() if e.expires < now]:
            logger.warning("PD hand-off for bootstrap_room %d was never taken; dropped", room)
            del self._entries[room]


class BootstrapServer:
    """The prefill engine's bootstrap port: `GET /handoff/<room>?wait=<s>` long-polls for a room.

    200 with the hand-off (`application/octet-stream`, see `Handoff.to_bytes`) or 404 with
    a JSON reason when it did not arrive within `wait` seconds (at most 5 per call).
    """

    def __init__(self, host: str, port: int, store: HandoffStore):
        self.store = store
        store_ref = store

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per poll otherwise
                logger.debug("bootstrap: " + fmt, *args)

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path, _, query = self.path.partition("?")
                params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
                if path == "/health":
                    self._send(200, b"{}", "application/json")
                    return
                parts = path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "handoff" or not parts[1].isdigit():
                    self._send(404, json.dumps({"error": f"unknown path {path}"}).encode(),
                               "application/json")
                    return
                wait = min(max(float(params.get("wait", 0) or 0), 0.0), 5.0)
                handoff = store_ref.take(int(parts[1]), wait)
                if handoff is None:
                    self._send(404, json.dumps({"error": f"bootstrap_room {parts[1]} not here yet"}).encode(),
                               "application/json")
                    return
                self._send(200, handoff.to_bytes(), "application/octet-stream")

        bind_host = "" if host in ("0.0.0.0", "::") else host.strip("[]")
        self._server = ThreadingHTTPServer((bind_host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-bootstrap",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._server.shutdown()
            self._server.server_close()


def fetch_handoff(bootstrap: Bootstrap, timeout_s: float,
                  cancelled: Callable[[], bool] = lambda: False) -> Handoff | None:
    """Decode side: long-poll the prefill engine's bootstrap server for a room.

    Returns None if `cancelled()` became true (the request was aborted meanwhile); raises
    HandoffError when the room did not arrive within timeout_s or the prefill side failed.
    """
    host = f"[{bootstrap.host}]" if ":" in bootstrap.host else bootstrap.host
    started = time.monotonic()
    deadline = started + timeout_s
    last_error = "the prefill engine never published it"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    while True:
        if cancelled():
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandoffError(
                f"KVTransferError(bootstrap_room={bootstrap.room}): timed out after "
                f"{timeout_s:g}s ({WAITING_TIMEOUT_ENV}) waiting for the KV cache from the prefill "
                f"engine's bootstrap server {host}:{bootstrap.port}: {last_error}")
        wait = min(_POLL_ROUND_S, left)
        url = f"http://{host}:{bootstrap.port}/handoff/{bootstrap.room}?wait={wait:.3f}"
        try:
            with opener.open(url, timeout=wait + 10) as resp:
                handoff = Handoff.from_bytes(resp.read())
            break
        except urllib.error.HTTPError as e:
            if e.code != 404:
                last_error = f"bootstrap server answered HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            # The prefill engine is down or restarting: keep trying until the deadline.
            last_error = f"Failed to get kvcache from prefill instance, it might be dead ({e})"
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    if handoff.error is not None:
        raise HandoffError(f"KVTransferError(bootstrap_room={bootstrap.room}): the prefill engine "
                           f"failed the request: {handoff.error}")
    return handoff


# ---- the frontend's two sides of a hand-off -------------------------------------------------


class PrefillHandoffs:
    """The prefill engine's side: each request's hand-off parked by room (from the
    scheduler thread), its answer held until the decode engine took it."""

    def __init__(self, store: HandoffStore, scheduler: Scheduler):
        self.store = store
        self.scheduler = scheduler

    def refused(self, body: dict, error: Exception) -> None:
        """A request the prefill engine refused: its decode side hears it at once, instead
        of after its waiting timeout."""
        for room in requested_rooms(body):
            self.store.put(Handoff(room, error=f"the prefill engine refused the request: {error}"))

    def watch(self, live: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Park `live`'s hand-off when its prompt is done (the scheduler-thread hook)."""
        live.taken = asyncio.Event()
        live.req.on_finish_kv = self._export_for(live, loop)

    def _export_for(self, live: Any, loop: asyncio.AbstractEventLoop):
        store, scheduler = self.store, self.scheduler
        room = live.bootstrap.room

        def on_taken() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: shutting down
                loop.call_soon_threadsafe(live.taken.set)

        def export(req: Req, kv: torch.Tensor | None, state: torch.Tensor | None) -> None:
            if kv is None:
                handoff = Handoff(room, error=f"request {req.rid} ended before its KV was handed "
                                              f"over: {req.finish}")
            else:
                n = len(req.prompt_ids)
                first = req.ids[n] if req.num_output else -1
                handoff = Handoff(
                    room, prompt_ids=list(req.prompt_ids), first_token=first,
                    logprob=req.output_logprobs[0] if req.output_logprobs else None,
                    top_logprobs=req.output_top_logprobs[0] if req.output_top_logprobs else None,
                    kv=kv, generator_state=state, weight_version=scheduler.weight_version,
                    cached_tokens=req.cached_tokens)
            live.published = True
            store.put(handoff, on_taken if kv is not None else None)
        return export

    def publish_failure(self, live: Any, reason: str) -> None:
        """Tell the decode engine at once that this room will not come."""
        if live.taken is not None and not live.published:
            live.published = True
            self.store.put(Handoff(live.bootstrap.room, error=reason))

    async def wait_taken(self, live: Any) -> None:
        """Like sglang, answer only after the decode engine took the KV."""
        timeout = env_timeout(BOOTSTRAP_TIMEOUT_ENV)
        try:
            await asyncio.wait_for(live.taken.wait(), timeout)
        except asyncio.TimeoutError:
            self.store.discard(live.bootstrap.room)
            raise HandoffError(
                f"KVTransferError(bootstrap_room={live.bootstrap.room}): no decode engine took the "
                f"KV of request {live.req.rid} within {timeout:g}s ({BOOTSTRAP_TIMEOUT_ENV})") from None


class DecodeHandoffs:
    """The decode engine's side: every item's hand-off fetched from its prefill engine
    (concurrently) and turned into the request's state."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def receive(self, lives: list[Any], loop: asyncio.AbstractEventLoop,
                      closing: Callable[[], bool]) -> None:
        """HandoffError (HTTP 500) if one does not arrive within the waiting timeout."""
        wanted = [lv for lv in lives if lv.bootstrap is not None and not lv.done]
        if not wanted:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="pd-fetch")
        timeout = env_timeout(WAITING_TIMEOUT_ENV)
        for lv in wanted:
            lv.transferring = True
        try:
            results = await asyncio.gather(*[
                loop.run_in_executor(self._pool, fetch_handoff, lv.bootstrap, timeout,
                                     lambda lv=lv: lv.done or closing())
                for lv in wanted])
        except BaseException:
            for lv in wanted:  # the other fetches stop at their next poll round
                lv.done = True
            raise
        finally:
            for lv in wanted:
                lv.transferring = False
        for lv, handoff in zip(wanted, results, strict=True):
            if handoff is not None and not lv.done:
                self._apply(lv, handoff)

    def _apply(self, live: Any, h: Handoff) -> None:
        req = live.req
        if list(h.prompt_ids) != req.prompt_ids:
            raise HandoffError(f"KVTransferError(bootstrap_room={h.room}): the hand-off is for "
                               f"another prompt ({len(h.prompt_ids)} tokens, this request has "
                               f"{len(req.prompt_ids)})")
        if h.first_token < 0:  # the prefill produced no token (max_new_tokens 0): run it here
            return
        req.ids = [*req.prompt_ids, h.first_token]
        if req.return_logprob and h.logprob is not None:
            req.output_logprobs = [h.logprob]
            if req.top_logprobs_num and h.top_logprobs is not None:
                req.output_top_logprobs = [list(h.top_logprobs)]
        req.kv_import = h.kv
        req.generator_state = h.generator_state
        req.cached_tokens = h.cached_tokens
        req.input_logprob_start = None  # the prefill engine answers those; the router merges them
        if h.weight_version != self.scheduler.weight_version:
            req.version_events.append((h.weight_version, 1))
        req.first_token_at = time.perf_counter()

    def close(self) -> None:
        """Stop fetches still polling (the process is shutting down)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
