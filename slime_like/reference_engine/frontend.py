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

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.protocol.modes import PauseMode, WorkerType
from slime_like.reference_engine.disaggregation import (
    Bootstrap,
    DecodeHandoffs,
    HandoffStore,
    PrefillHandoffs,
)
from slime_like.reference_engine.generate_io import GenerateJob, build_output, parse_generate
from slime_like.reference_engine.request import Req, finish_abort_waiting
from slime_like.reference_engine.scheduler import Scheduler

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
        self.prefill_only = disaggregation_mode == WorkerType.PREFILL
        # PD: the prefill engine parks hand-offs, the decode engine fetches them.
        self.prefill = PrefillHandoffs(handoffs, scheduler) \
            if self.prefill_only and handoffs is not None else None
        self.decode = DecodeHandoffs(scheduler) if disaggregation_mode == WorkerType.DECODE \
            else None
        self._closing = False
        self.paused = False
        # The last retract/in_place pause forwarded to the scheduler (answered at once).
        self._forwarded: concurrent.futures.Future | None = None
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
            if self.prefill is not None and not internal:
                self.prefill.refused(body, e)
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
            if self.prefill is not None and item.bootstrap is not None:
                self.prefill.watch(live, self.loop)
            lives.append(live)
        return lives

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
            if self.decode is not None:
                await self.decode.receive(lives, self.loop, lambda: self._closing)
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
                await self.prefill.wait_taken(live)
                yield live.index, out
        finally:
            for lv in lives:
                if not lv.submitted and self.prefill is not None:  # else the scheduler publishes
                    self.prefill.publish_failure(lv, "the prefill request was aborted before it ran")
                if not lv.submitted:
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
            if mode == PauseMode.ABORT:
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
                # Forwarded and answered at once, as sglang does: the scheduler applies it
                # before any later control message (its calls run in order), and readers
                # that do not queue behind it (/v1/loads, internal_states) read the gate.
                self._forwarded = self.scheduler.pause(mode)
                _report_failure(self._forwarded, "pause")

    async def settled(self) -> None:
        """Wait for the last forwarded pause to be applied: a read of the scheduler's state
        (/v1/loads) queues behind it in sglang (both go through the scheduler in order);
        no wait when it already was, the common case."""
        forwarded = self._forwarded
        if forwarded is not None and not forwarded.done():
            with contextlib.suppress(Exception):  # its failure is logged where it is sent
                await asyncio.wrap_future(forwarded)

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
        """sglang's update lock: the writer side unless the engine is paused (docs/REFERENCE_ENGINE.md,
        "Weights": locking)."""
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
        if self.decode is not None:
            self.decode.close()

    def snapshot(self) -> dict[str, Any]:
        """Frontend state for diagnostics."""
        return {"paused": self.paused, "live_requests": len(self.live)}


def _report_failure(future: Any, what: str) -> None:
    """Log a forwarded scheduler command that failed (nobody awaits its future)."""
    def done(f: Any) -> None:
        if f.exception() is not None:
            logger.error("scheduler %s failed: %s", what, f.exception())
    future.add_done_callback(done)
