"""The scheduler thread: continuous batching, pause modes, aborts, flushes, exclusive ops.

Like sglang's scheduler process, one thread owns the model and the KV storage. Requests
join and leave between steps: each step prefills the requests admitted from the waiting
queue (one padded forward) and then decodes every other running request (one batched
forward). Control operations (pause, abort, flush, weight updates) are closures run on the
same thread between steps, in arrival order, so they never race a forward pass.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.protocol.modes import PauseMode
from slime_like.reference_engine.kv_cache import BatchKV, KVPool, PrefixCache, extend_mask
from slime_like.reference_engine.metrics import EngineMetrics
from slime_like.reference_engine.request import Req, finish_abort, finish_abort_waiting
from slime_like.reference_engine.sampling import adjust_logits, make_generator, sample_batch
from slime_like.reference_engine.served_log import ServedLog
from slime_like.reference_engine.step_outputs import append_token, prompt_logprobs, stop_reason

logger = logging.getLogger(__name__)

FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")
FLUSH_FAILED = "Flush cache failed.\n"
STALL_REPORT_S = 20.0  # a command or step this long gets its stack logged


class Scheduler:
    """Owns the model, the KV pool and the prefix cache; everything runs on its thread."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str, context_len: int,
                 max_running: int, prefix_cache_tokens: int, weight_version: str, seed: int,
                 metrics: EngineMetrics, tokenizer: Tokenizer | None = None,
                 stall_report_s: float | None = None, min_step_s: float = 0.0,
                 served_log: ServedLog | None = None):
        self.model = model
        # What was served at which version (served_log.py); None: not kept.
        self.served_log = served_log
        # Finished requests' answers held until their served lines are written: a client
        # (or the chaos check) that reads the log after its answer finds its line.
        self._after_log: list[Callable[[], None]] = []
        # A floor on each forward step's length, waited off the CPU: the step time of a
        # GPU engine, whose decode does not compete with a trainer for CPU cores.
        self.min_step_s = min_step_s
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.context_len = context_len
        self.pool = KVPool(self.config, max_running, context_len, self.device, self.dtype)
        self.cache = PrefixCache(prefix_cache_tokens)
        self.metrics = metrics
        self.tokenizer = tokenizer or ByteTokenizer()
        self.eos_id = self.config.eos_token_id
        self.weight_version = weight_version
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.paused_mode: str | None = None  # "retract" | "in_place" while the engine is paused
        self.weights_ready = True  # False between a weights release and the next update
        self.forward_steps = 0
        self.last_step_at = 0.0  # time.monotonic() at the end of the last forward step
        self.last_step_tokens_per_s = 0.0
        self._shared_gen = make_generator(seed, self.device)
        self._cmds: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._pending_flush: tuple[float, concurrent.futures.Future] | None = None
        self._thread = threading.Thread(target=self._loop, name="reference-scheduler", daemon=True)
        self.step_hooks: list[Callable[[], None]] = []  # run before every forward (profiler steps)
        # When the thread entered its current command or step (None while it waits): a
        # stall is then visible in the log with its stack, as sglang's soft watchdog shows.
        self.busy_since: float | None = None
        self.stall_report_s = stall_report_s or STALL_REPORT_S
        self._stall_thread = threading.Thread(target=self._report_stalls,
                                              name="reference-scheduler-stalls", daemon=True)

    # ---- thread-safe entry points --------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()
        self._stall_thread.start()

    def _report_stalls(self) -> None:
        """Log the scheduler thread's stack once per command or step that runs too long."""
        reported: float | None = None
        while not self._stopping:
            time.sleep(1.0)
            since = self.busy_since
            if since is None or since == reported or time.monotonic() - since < self.stall_report_s:
                continue
            reported = since
            frame = sys._current_frames().get(self._thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            logger.warning("scheduler busy for %.0fs with one command or step; its stack:\n%s",
                           time.monotonic() - since, stack)

    def stop(self) -> None:
        """Stop the thread after the current step."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)
        if self.served_log is not None and not self._thread.is_alive():
            self.served_log.close()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the scheduler thread between two steps; its result lands in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        with self._cv:
            self._cmds.append(run)
            self._cv.notify()
        return fut

    def submit(self, reqs: list[Req]) -> concurrent.futures.Future:
        """Queue requests for admission (in order)."""
        return self.call(lambda: self._add(reqs))

    def abort(self, rid: str = "", abort_all: bool = False) -> concurrent.futures.Future:
        """Abort requests whose rid starts with `rid`, or all of them."""
        return self.call(lambda: self._abort(rid, abort_all))

    def pause(self, mode: str) -> concurrent.futures.Future:
        """Apply a pause mode (retract frees KV, in_place freezes)."""
        return self.call(lambda: self._pause(mode))

    def resume(self) -> concurrent.futures.Future:
        """Leave the paused state."""
        return self.call(self._resume)

    def set_weight_version(self, new_version: str) -> concurrent.futures.Future:
        """Record a new weight version between two steps (`record_weight_version`)."""
        return self.call(functools.partial(self.record_weight_version, new_version))

    def flush(self, timeout_s: float = 0.0) -> concurrent.futures.Future:
        """Future of (flushed, message); waits up to timeout_s for the engine to become idle."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.call(lambda: self._flush(timeout_s, fut))
        return fut

    def load(self) -> dict:
        """Counters for /v1/loads and /get_load (read without locking; they are ints)."""
        running = list(self.running)
        waiting = list(self.waiting)
        used = sum(r.kv_len for r in running)
        total = self.pool.num_slots * self.pool.slot_len
        return {
            "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
            "num_waiting_uncached_tokens": sum(len(r.ids) for r in waiting),
            "num_used_tokens": used, "num_total_tokens": total,
            "num_active_tokens": used + sum(len(r.ids) for r in waiting),
            "max_total_num_tokens": total, "max_running_requests": self.pool.num_slots,
            "token_usage": used / total if total else 0.0,
            "gen_throughput": self.last_step_tokens_per_s,
            "cache_hit_rate": self.cache.hits / self.cache.queries if self.cache.queries else 0.0,
            "num_cached_tokens": self.cache.num_tokens,
            "num_retracted_reqs": sum(1 for r in waiting if r.num_retractions),
        }

    # ---- scheduler-thread state changes (called via `call`) ------------------------------

    def is_idle(self) -> bool:
        """sglang's flush rule: nothing running; waiting requests count unless paused (no KV)."""
        if self.running:
            return False
        if self.paused_mode is not None:
            return all(r.slot is None for r in self.waiting)
        return not self.waiting

    def record_weight_version(self, new_version: str) -> None:
        """New tokens now belong to `new_version`; live requests remember where it changed."""
        if new_version == self.weight_version:
            return
        for r in [*self.running, *self.waiting]:
            if r.num_output:
                r.version_events.append((self.weight_version, r.num_output))
        self.weight_version = new_version

    def _add(self, reqs: list[Req]) -> None:
        for r in reqs:
            if r.spec.sampling_seed is not None:
                r.generator = make_generator(r.spec.sampling_seed, self.device)
                if r.generator_state is not None:  # PD: continue the prefill's random stream
                    try:
                        r.generator.set_state(r.generator_state)
                    except (RuntimeError, TypeError) as e:  # e.g. a CPU prefill, a CUDA decode
                        logger.warning("request %s: cannot continue the prefill engine's random "
                                       "stream (%s); sampling from a fresh one", r.rid, e)
            else:
                r.generator = self._shared_gen
            r.generator_state = None
            if r.num_output:  # PD decode: the handed-over first token may already finish it
                reason = stop_reason(r, r.ids[-1], self.eos_id, self.context_len, self.tokenizer)
                if reason is not None:
                    self._finish(r, reason)
                    continue
            self.waiting.append(r)

    def _abort(self, rid: str, abort_all: bool) -> None:
        def hit(r: Req) -> bool:
            return abort_all or (bool(rid) and r.rid.startswith(rid))

        for r in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(r)
            self._finish(r, finish_abort_waiting())
        for r in [r for r in self.running if hit(r)]:
            self._finish(r, finish_abort())

    def _pause(self, mode: str) -> None:
        if mode == PauseMode.RETRACT:
            retracted = self.running
            for r in retracted:
                self.pool.free(r.slot)
                r.slot, r.kv_len = None, 0
                r.num_retractions += 1
            self.running = []
            self.waiting.extendleft(reversed(retracted))
            self.metrics.retracted(len(retracted))
        self.paused_mode = mode if mode in (PauseMode.RETRACT, PauseMode.IN_PLACE) else None

    def _resume(self) -> None:
        self.paused_mode = None

    def _flush(self, timeout_s: float, fut: concurrent.futures.Future) -> None:
        if self.is_idle():
            self.flush_now()
            fut.set_result((True, FLUSH_OK))
        elif timeout_s <= 0:
            logger.warning("cache not flushed: %d running, %d waiting requests",
                           len(self.running), len(self.waiting))
            fut.set_result((False, FLUSH_FAILED))
        elif self._pending_flush is not None:
            fut.set_result((False, "Another flush_cache is already in progress."))
        else:
            self._pending_flush = (time.monotonic() + timeout_s, fut)

    def flush_now(self) -> None:
        """Drop every cached prefix (the caller checked the engine is idle)."""
        self.cache.reset()

    def _check_pending_flush(self) -> None:
        if self._pending_flush is None:
            return
        deadline, fut = self._pending_flush
        if self.is_idle():
            self._pending_flush = None
            self.flush_now()
            fut.set_result((True, FLUSH_OK))
        elif time.monotonic() >= deadline:
            self._pending_flush = None
            fut.set_result((False, "Timed out waiting for idle state."))

    # ---- the loop --------------------------------------------------------------------------

    def _can_step(self) -> bool:
        return (self.paused_mode is None and self.weights_ready and not self.pool.released
                and bool(self.waiting or self.running))

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        with torch.no_grad():
            while True:
                with self._cv:
                    while not (self._cmds or self._stopping or self._can_step()):
                        wait = None
                        if self._pending_flush is not None:
                            wait = max(0.0, self._pending_flush[0] - time.monotonic()) + 1e-3
                        self._cv.wait(timeout=wait)
                        if wait is not None:
                            break
                    if self._stopping:
                        return
                    cmds, self._cmds = self._cmds, []
                for cmd in cmds:
                    self.busy_since = time.monotonic()
                    cmd()
                    self.busy_since = None
                self._check_pending_flush()
                if self._can_step():
                    self.busy_since = time.monotonic()
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001 - a broken step must not kill the server
                        logger.exception("scheduler step failed; aborting the batch")
                        for r in [*self.running]:
                            self._finish(r, {"type": "abort", "message": f"Internal error: {e}",
                                             "status_code": 500, "err_type": "InternalError"})
                    finally:
                        self.busy_since = None
                    # A deferred flush fires as soon as the step that emptied the engine ends.
                    self._check_pending_flush()
                if self.served_log is not None:
                    self.served_log.flush()
                    answers, self._after_log = self._after_log, []
                    for answer in answers:
                        answer()
                self.metrics.set_queue(len(self.running), len(self.waiting),
                                       len(self.waiting) if self.paused_mode else 0,
                                       (self.pool.num_slots - self.pool.num_free) / self.pool.num_slots)

    def _step(self) -> None:
        for hook in self.step_hooks:
            hook()
        t0 = time.perf_counter()
        admitted: list[Req] = []
        while self.waiting and self.pool.num_free:
            r = self.waiting.popleft()
            self._admit(r)
            admitted.append(r)
        n_tokens = 0
        if admitted:
            self._forward(admitted)
        decoding = [r for r in self.running if r.finish is None and r not in admitted]
        if decoding:
            self._forward(decoding)
            n_tokens = len(decoding)
        self.running = [r for r in self.running if r.finish is None]
        if self.min_step_s > 0:
            time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - t0)))
        self.forward_steps += 1
        self.last_step_at = time.monotonic()
        dt = time.perf_counter() - t0
        if n_tokens:
            self.last_step_tokens_per_s = n_tokens / dt
            self.metrics.step(n_tokens, dt)

    def _admit(self, r: Req) -> None:
        slot = self.pool.alloc()
        assert slot is not None
        r.slot = slot
        if r.kv_import is not None:  # PD decode: the prefill engine's KV of the prompt
            n = r.kv_import.shape[3]
            self.pool.kv[:, :, slot, :, :n] = r.kv_import.to(self.pool.kv.device, self.pool.kv.dtype)
            r.kv_import = None
            r.kv_len = n
            self.running.append(r)
            return
        # Keep one token to compute: its logits choose the next token. Prompt logprobs
        # need the logits of every position from the window's start, so no reuse past it.
        limit = len(r.ids) - 1
        if r.input_logprob_start is not None and not r.input_logprobs:
            limit = min(limit, max(r.input_logprob_start - 1, 0))
        matched, pieces = self.cache.match(r.ids[:limit])
        pos = 0
        kv = self.pool.kv
        for piece in pieces:
            n = piece.shape[3]
            kv[:, :, slot, :, pos:pos + n] = piece
            pos += n
        r.kv_len = matched
        if r.num_retractions == 0:
            r.cached_tokens = matched
        self.running.append(r)

    def _forward(self, rows: list[Req]) -> None:
        starts = [r.kv_len for r in rows]
        pending = [r.ids[r.kv_len:] for r in rows]
        lens = [len(p) for p in pending]
        t_max = max(lens)
        ids = torch.zeros((len(rows), t_max), dtype=torch.long)
        for b, p in enumerate(pending):
            ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device, non_blocking=True)
        mask, positions = extend_mask(starts, lens, self.device)
        kv = BatchKV(self.pool, [r.slot for r in rows], starts, lens)
        logits = self.model(ids, positions, mask, kv)
        if t_max == 1:
            last = logits[:, 0]
        else:
            last = logits[torch.arange(len(rows), device=self.device),
                          torch.tensor(lens, device=self.device) - 1]
        if any(r.spec.adjusts_logits for r in rows):
            last = adjust_logits(last, [r.spec for r in rows],
                                 [r.ids[len(r.prompt_ids):] for r in rows])
        tokens, logprobs, logprobs_all = sample_batch(last, [r.spec for r in rows],
                                                      [r.generator for r in rows],
                                                      any(r.return_logprob for r in rows))
        now = time.perf_counter()
        for b, r in enumerate(rows):
            if r.input_logprob_start is not None and not r.input_logprobs:
                prompt_logprobs(r, logits[b, :lens[b]], starts[b])
            r.kv_len += lens[b]
            if r.spec.max_new_tokens == 0:  # prefill only (sglang's cache warm-up request)
                self._finish(r, {"type": "length", "length": 0})
                continue
            tok = tokens[b]
            append_token(r, tok, logprobs[b] if r.return_logprob else None,
                         logprobs_all[b] if r.return_logprob else None)
            if r.first_token_at is None:
                r.first_token_at = now
                if r.log_metrics:
                    self.metrics.first_token(now - r.created)
            reason = stop_reason(r, tok, self.eos_id, self.context_len, self.tokenizer)
            if reason is not None:
                self._finish(r, reason)
            elif r.stream and r.sink is not None:
                r.sink(r, r.num_output, False)

    def _finish(self, r: Req, reason: dict) -> None:
        r.finish = reason
        if r.on_finish_kv is not None:
            export, r.on_finish_kv = r.on_finish_kv, None
            kv = state = None
            if reason["type"] != "abort" and r.slot is not None and not self.pool.released:
                kv = self.pool.kv[:, :, r.slot, :, :r.kv_len].to("cpu", copy=True)
                if r.generator is not None and r.generator is not self._shared_gen:
                    state = r.generator.get_state()
            export(r, kv, state)
        if r.slot is not None:
            if r.kv_len and not self.pool.released:
                self.cache.insert(r.ids[:r.kv_len], self.pool, r.slot)
            self.pool.free(r.slot)
            r.slot = None
        if r in self.running:
            self.running.remove(r)
        if r.log_metrics:
            self.metrics.finished(len(r.prompt_ids), r.num_output, r.cached_tokens,
                                  time.perf_counter() - r.created, reason["type"] == "abort")
            if self.served_log is not None:
                self.served_log.record(r.rid, self.weight_version, reason["type"], r.num_output)
        if r.sink is not None:
            if self.served_log is not None and r.log_metrics:  # answered once it is logged
                self._after_log.append(functools.partial(r.sink, r, r.num_output, True))
            else:
                r.sink(r, r.num_output, True)
