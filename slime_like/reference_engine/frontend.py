"""The asyncio side of the engine (sglang's TokenizerManager): pause gate, update lock, rids.

Every /generate waits at the pause gate, then holds the reader side of a writer-preferring
lock until its answer is complete; a weight update on an un-paused engine takes the writer
side (drains in-flight requests, holds new ones), a paused engine's update skips it. The
scheduler thread reports progress through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.reference_engine.disaggregation import (
    BOOTSTRAP_TIMEOUT_ENV,
    WAITING_TIMEOUT_ENV,
    Bootstrap,
    Handoff,
    HandoffError,
    HandoffStore,
    env_timeout,
    fetch_handoff,
    requested_rooms,
)
from slime_like.reference_engine.generate_io import GenerateJob, build_output, parse_generate
from slime_like.reference_engine.scheduler import Req, Scheduler, finish_abort_waiting

logger = logging.getLogger(__name__)

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
WARMUP_TEXT = "The capital city of France is"


class EngineUnavailable(Exception):
    """The engine cannot serve now (e.g. weights released); answered 503."""


def _aborted(live: _Live) -> bool:
    finish = live.req.finish
    return finish is not None and finish.get("type") == "abort"


class RWLock:
    """asyncio reader/writer lock that prefers writers (sglang's model_update_lock)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def is_locked(self) -> bool:
        """True while any request or update holds the lock."""
        return self._readers > 0 or self._writer

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        """Held by a /generate from admission until its answer is complete."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        """Held by a weight update; waits for readers, blocks new ones."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            except BaseException:
                # Cancelled while waiting: the readers it held back must be woken, or they
                # wait for a writer that will never come.
                self._writers_waiting -= 1
                self._cond.notify_all()
                raise
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass(eq=False)
class _Live:
    """A request known to the frontend: its scheduler Req and where its updates arrive."""

    req: Req
    index: int
    updates: asyncio.Queue
    submitted: bool = False
    done: bool = False
    sent: int = 0  # tokens already streamed (incremental mode)
    last: tuple[int, bool, str] | None = field(default=None)
    bootstrap: Bootstrap | None = None  # PD: this request's room
    published: bool = False  # PD prefill: its hand-off (or failure) is in the store
    taken: asyncio.Event | None = None  # PD prefill: set when the decode engine took it
    transferring: bool = False  # PD decode: fetching its hand-off


class Frontend:
    """Request admission, pause/continue, aborts and the update lock, on the event loop."""

    def __init__(self, scheduler: Scheduler, *, context_len: int, skip_tokenizer_init: bool,
                 incremental_streaming: bool, vocab_size: int, disaggregation_mode: str = "null",
                 handoffs: HandoffStore | None = None,
                 tokenizer: Tokenizer | None = None):
        self.scheduler = scheduler
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer or ByteTokenizer()
        self.out_tokenizer = None if skip_tokenizer_init else self.tokenizer
        self.incremental_streaming = incremental_streaming
        self.disaggregation_mode = disaggregation_mode
        self.prefill_only = disaggregation_mode == "prefill"
        self.handoffs = handoffs  # the prefill engine's hand-off store
        self._fetch_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closing = False
        self.paused = False
        self.ready = False  # warm-up done (sglang's server_status == Up)
        self.live: dict[str, _Live] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pause_cond: asyncio.Condition | None = None
        self._lock: RWLock | None = None

    def bind_loop(self) -> None:
        """Create the loop-bound primitives (called from the running event loop)."""
        self.loop = asyncio.get_running_loop()
        self._pause_cond = asyncio.Condition()
        self._lock = RWLock()

    @property
    def weight_version(self) -> str:
        """The live weight version (changed by updates and /update_weight_version)."""
        return self.scheduler.weight_version

    # ---- generation ------------------------------------------------------------------------

    def parse(self, body: dict, internal: bool = False) -> GenerateJob:
        """A /generate body -> GenerateJob (SchemaError / ValueError on bad input).

        A PD prefill engine that refuses a request tells the decode side at once, so the
        decode engine fails now instead of after its waiting timeout."""
        try:
            return parse_generate(body, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                  context_len=self.context_len, internal=internal,
                                  prefill_only=self.prefill_only and not internal)
        except ValueError as e:  # SchemaError is a ValueError
            if self.prefill_only and not internal and self.handoffs is not None:
                for room in requested_rooms(body):
                    self.handoffs.put(Handoff(room, error=f"the prefill engine refused the request: {e}"))
            raise

    def _make_live(self, job: GenerateJob) -> list[_Live]:
        updates: asyncio.Queue = asyncio.Queue()
        lives = []
        for i, item in enumerate(job.items):
            req = Req(rid=item.rid, prompt_ids=item.prompt_ids, spec=item.spec, max_len=item.max_len,
                      return_logprob=item.return_logprob, top_logprobs_num=item.top_logprobs_num,
                      input_logprob_start=item.input_logprob_start, stream=job.stream,
                      log_metrics=job.log_metrics)
            live = _Live(req=req, index=i, updates=updates, bootstrap=item.bootstrap)
            req.sink = self._sink_for(live)
            if self.prefill_only and item.bootstrap is not None and self.handoffs is not None:
                live.taken = asyncio.Event()
                req.on_finish_kv = self._export_for(live)
            lives.append(live)
        return lives

    # ---- PD disaggregation -------------------------------------------------------------------

    def _export_for(self, live: _Live):
        """Prefill side: the scheduler-thread hook that parks the request's hand-off."""
        loop, store, scheduler = self.loop, self.handoffs, self.scheduler
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

    def _publish_failure(self, live: _Live, reason: str) -> None:
        """Prefill side: tell the decode engine at once that this room will not come."""
        if live.taken is not None and not live.published:
            live.published = True
            self.handoffs.put(Handoff(live.bootstrap.room, error=reason))

    async def _wait_taken(self, live: _Live) -> None:
        """Prefill side: like sglang, answer only after the decode engine took the KV."""
        timeout = env_timeout(BOOTSTRAP_TIMEOUT_ENV)
        try:
            await asyncio.wait_for(live.taken.wait(), timeout)
        except asyncio.TimeoutError:
            self.handoffs.discard(live.bootstrap.room)
            raise HandoffError(
                f"KVTransferError(bootstrap_room={live.bootstrap.room}): no decode engine took the "
                f"KV of request {live.req.rid} within {timeout:g}s ({BOOTSTRAP_TIMEOUT_ENV})") from None

    async def _receive(self, lives: list[_Live]) -> None:
        """Decode side: fetch every item's hand-off from its prefill engine (concurrently) and
        turn it into the request's state; HandoffError (HTTP 500) if one does not arrive."""
        wanted = [lv for lv in lives if lv.bootstrap is not None and not lv.done]
        if not wanted:
            return
        if self._fetch_pool is None:
            self._fetch_pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="pd-fetch")
        timeout = env_timeout(WAITING_TIMEOUT_ENV)
        for lv in wanted:
            lv.transferring = True
        try:
            results = await asyncio.gather(*[
                self.loop.run_in_executor(self._fetch_pool, fetch_handoff, lv.bootstrap, timeout,
                                          lambda lv=lv: lv.done or self._closing)
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
                self._apply_handoff(lv, handoff)

    def _apply_handoff(self, live: _Live, h: Handoff) -> None:
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

    def _sink_for(self, live: _Live):
        loop = self.loop
        scheduler = self.scheduler

        def sink(req: Req, n_out: int, finished: bool) -> None:
            # Runs on the scheduler thread: capture the version now, hand over to the loop.
            with contextlib.suppress(RuntimeError):  # the loop is gone: shutting down
                loop.call_soon_threadsafe(live.updates.put_nowait,
                                          (live, n_out, finished, scheduler.weight_version))
        return sink

    async def run(self, job: GenerateJob) -> AsyncIterator[tuple[int, dict]]:
        """Generate a parsed job; yields (item index, output) per update (final ones only
        unless streaming). Registers rids first so a duplicate live rid is refused."""
        lives = self._make_live(job)
        for live in lives:
            if live.req.rid in self.live:
                raise ValueError(f"Duplicate request ID detected: {live.req.rid}")
        for live in lives:
            self.live[live.req.rid] = live
        deferred: list[tuple[_Live, dict]] = []  # PD prefill answers waiting for the decode side
        try:
            async with self._pause_cond:
                await self._pause_cond.wait_for(
                    lambda: not self.paused or all(lv.done for lv in lives))
            if self.disaggregation_mode == "decode":
                await self._receive(lives)
                async with self._pause_cond:  # the engine may have paused during the transfer
                    await self._pause_cond.wait_for(
                        lambda: not self.paused or all(lv.done for lv in lives))
            answered: set[int] = set()
            for lv in lives:
                if lv.done:  # aborted while held at the pause gate
                    answered.add(lv.index)
                    yield lv.index, self._output(lv, lv.req.num_output, True, job)
            if len(answered) == len(lives):
                return
            async with self._lock.reader():
                for lv in lives:
                    if lv.done and lv.index not in answered:
                        answered.add(lv.index)
                        yield lv.index, self._output(lv, lv.req.num_output, True, job)
                if not self.scheduler.weights_ready:
                    raise EngineUnavailable(
                        "the weights were released by /release_memory_occupation and no weight "
                        "update has arrived since; refusing to serve stale or empty weights")
                if self.scheduler.pool.released:
                    raise EngineUnavailable(
                        "the KV cache was released by /release_memory_occupation; call "
                        "/resume_memory_occupation before generating")
                # No await between picking and marking: an abort cannot slip in between.
                pending = [lv for lv in lives if not lv.done]
                for lv in pending:
                    lv.submitted = True
                self.scheduler.submit([lv.req for lv in pending])
                remaining = len(pending)
                while remaining:
                    live, n_out, finished, version = await lives[0].updates.get()
                    if finished:
                        live.done = True
                        remaining -= 1
                    elif not job.stream:
                        continue
                    start = live.sent if self.incremental_streaming and job.stream else 0
                    out = build_output(live.req, n_out, finished, version, job=job,
                                       tokenizer=self.out_tokenizer, start=start)
                    live.sent = n_out
                    if finished and live.taken is not None and live.published and not _aborted(live):
                        deferred.append((live, out))
                        continue
                    yield live.index, out
            # Outside the update lock: a decode engine that is slow to take the KV must not
            # hold up a weight update or a pause of this engine.
            for live, out in deferred:
                await self._wait_taken(live)
                yield live.index, out
        finally:
            for lv in lives:
                if not lv.submitted:  # submitted ones are published by the scheduler
                    self._publish_failure(lv, "the prefill request was aborted before it ran")
                    lv.done = True  # a KV fetch still polling for it stops
                self.live.pop(lv.req.rid, None)
            unfinished = [lv.req.rid for lv in lives if lv.submitted and not lv.done]
            if unfinished:  # client went away: free the slots
                for rid in unfinished:
                    self.scheduler.abort(rid)

    def _output(self, live: _Live, n_out: int, finished: bool, job: GenerateJob) -> dict:
        return build_output(live.req, n_out, finished, self.weight_version, job=job,
                            tokenizer=self.out_tokenizer)

    async def generate(self, job: GenerateJob) -> dict | list:
        """A non-streaming job -> sglang's answer (one object, or an array prompt-major)."""
        results: list[dict | None] = [None] * len(job.items)
        async for index, out in self.run(job):
            results[index] = out
        return results[0] if job.is_single else results

    # ---- health ----------------------------------------------------------------------------

    async def health_generate(self) -> bool:
        """sglang's probe: one greedy token through the normal path (so it waits at the pause
        gate); any forward step the scheduler finishes meanwhile counts as healthy too, so a
        busy engine with every slot taken still answers at once."""
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        job = self.parse({"input_ids": [0], "rid": f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                         internal=True)
        job.log_metrics = False
        started = time.monotonic()
        task = asyncio.create_task(self.generate(job))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.05)
                if done:
                    return task.exception() is None
                if not self.paused and self.scheduler.last_step_at > started:
                    return True
                if time.monotonic() - started > timeout:
                    return False
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def warmup(self) -> None:
        """sglang's warm-up request; the server reports ready only after it succeeded."""
        job = self.parse({"text": WARMUP_TEXT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
                         internal=True)
        job.log_metrics = False
        await self.generate(job)

    # ---- pause / continue / abort ------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """/pause_generation: close the gate; abort drains, retract/in_place stop the scheduler."""
        async with self._pause_cond:
            self.paused = True
            if mode == "abort":
                # PD decode: requests still receiving their KV are in sglang's transfer
                # queue, which an abort pause empties too.
                for live in self.live.values():
                    if live.transferring and not live.done:
                        live.req.finish = finish_abort_waiting()
                        live.done = True
                # Like sglang: abort everything until no request holds the update lock.
                while True:
                    await asyncio.wrap_future(self.scheduler.abort(abort_all=True))
                    await asyncio.sleep(0)
                    if not self._lock.is_locked():
                        break
                    await asyncio.sleep(0.005)
            else:
                # Awaited (sglang forwards it and answers at once): readers that do not queue
                # behind the scheduler here, such as /v1/loads, must already see it paused.
                await asyncio.wrap_future(self.scheduler.pause(mode))

    async def continue_generation(self) -> None:
        """/continue_generation: resume the scheduler (forwarded, as in sglang), open the gate."""
        async with self._pause_cond:
            self.paused = False
            _report_failure(self.scheduler.resume(), "resume")
            self._pause_cond.notify_all()

    async def abort_request(self, rid: str, abort_all: bool) -> None:
        """Fire-and-forget like sglang: exact rid at the frontend, prefix match in the scheduler."""
        if abort_all:
            targets = list(self.live.values())
        elif rid:
            live = self.live.get(rid)
            if live is None:
                return
            targets = [live]
        else:
            logger.warning("abort_request without rid and abort_all=false: ignored")
            return
        for live in targets:
            if not live.submitted and not live.done:
                # Still held at the pause gate: answer it now, as the waiting queue would.
                live.req.finish = finish_abort_waiting()
                live.done = True
        if abort_all:
            self.scheduler.abort(abort_all=True)
        elif targets[0].submitted:
            self.scheduler.abort(rid)
        async with self._pause_cond:  # wake requests held at the gate that are now answered
            self._pause_cond.notify_all()

    @contextlib.asynccontextmanager
    async def model_update(self) -> AsyncIterator[None]:
        """The update lock of sglang §6.0: writer lock unless the engine is paused."""
        async with self._pause_cond:
            paused = self.paused
        if paused:
            yield
        else:
            async with self._lock.writer():
                yield

    def is_locked(self) -> bool:
        """True while any request or update holds the lock."""
        return self._lock is not None and self._lock.is_locked()

    def close(self) -> None:
        """Stop PD fetches still polling (the process is shutting down)."""
        self._closing = True
        if self._fetch_pool is not None:
            self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> dict[str, Any]:
        """Frontend state for diagnostics."""
        return {"paused": self.paused, "live_requests": len(self.live)}


def _report_failure(future: Any, what: str) -> None:
    """Log a forwarded scheduler command that failed (nobody awaits its future)."""
    def done(f: Any) -> None:
        if f.exception() is not None:
            logger.error("scheduler %s failed: %s", what, f.exception())
    future.add_done_callback(done)
