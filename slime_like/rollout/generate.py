"""Rollout generation through the router: many concurrent /generate calls, retried on failure.

A sample is only kept when its tokens were produced at one weight version (its
`weight_versions` spans name a single version), so the trainer can recompute its
log-probabilities at that version. A request that fails (its engine died, the router had no
worker for a moment) or that came back aborted is sent again, up to `max_attempts` times;
while the router cannot be reached at all (it crashed and is being relaunched) requests
wait and retry until `router_down_s` has passed, so a router restart loses no sample.
`resubmit_in_flight()` (called by the fleet when an engine stops answering probes) sends
every request still in flight again at once: one of them may be stuck on the hung engine,
and the first answer wins, so each requested sample still comes back exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slime_like.protocol import io_struct as p

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One completion of one prompt, as the engine produced it.

    The job fills `prompt`, `response`, `label` and `metadata` (slime's names) before the
    reward function sees the sample; `reward` holds its score. A multi-turn sample
    (`rollout/multiturn.py`) has `loss_mask`: 1 per output token the model produced
    (trained on, log-probability checked), 0 per token an environment or tool inserted
    (logprob 0.0, never trained on); None means every output token is the model's.
    """

    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: str
    finish_reason: str
    attempts: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    prompt: str = ""
    response: str = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    loss_mask: list[int] | None = None

    def model_token_mask(self) -> list[int]:
        """1 per output token the model produced (all of them unless `loss_mask` says)."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.output_ids)


# sglang-router's error code when no worker is routed (or every one is unhealthy).
NO_WORKERS = "no_available_workers"
ROUTER_DOWN_S = 120.0  # how long a router that is down, or has no engine routed, is waited for


def no_engine_routed(status: int | None, body: Any) -> bool:
    """The router's answer while every engine is out of it (recovering, or being resynced):
    not the request's failure, so callers wait (bounded) instead of spending a retry."""
    return status == 503 and NO_WORKERS in str(body)


class RouterOutage:
    """One request's bounded wait while its router is down or has no engine routed.

    Such an answer is not the request's failure: the caller tries again without counting
    an attempt while `waiting` says so, and counts one once the outage outlasts `bound_s`.
    """

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self._since: float | None = None

    def waiting(self, unavailable: bool) -> bool:
        """After each answer: True to wait and try again uncounted (the outage is within
        its bound); False to go on as usual (it ended, or outlasted the bound)."""
        if unavailable:
            now = time.monotonic()
            self._since = self._since or now
            if now - self._since < self.bound_s:
                return True
        self._since = None
        return False


class GenerationError(RuntimeError):
    """A request kept failing after every retry."""


@dataclass(eq=False)
class RouterGenerator:
    """Sends prompts to a router's /generate and gathers samples."""

    router_url: str
    api_key: str | None = None
    concurrency: int = 64
    max_attempts: int = 6
    retry_backoff_s: float = 0.5
    request_timeout_s: float = 300.0
    #: how long a router that is down, or has no engine routed, is waited for
    router_down_s: float = ROUTER_DOWN_S

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict[str, Any],
                 on_sample: Callable[[int], None] | None = None) -> list[Sample]:
        """n samples per prompt (n separate requests, each abortable by its own rid).

        `on_sample(k)` is called after the k-th sample arrived (e.g. to inject a fault while
        the rest are in flight).
        """
        self._on_sample = on_sample
        self._done = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Task] = set()
        self.resubmitted = 0
        return asyncio.run(self._generate_all(prompts, n, sampling_params))

    def resubmit_in_flight(self) -> None:
        """Thread-safe: cancel every request in flight; each is sent again at once."""
        loop = self._loop if hasattr(self, "_loop") else None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        for task in list(self._inflight):
            task.cancel("resubmit")

    async def _generate_all(self, prompts, n, sampling_params) -> list[Sample]:
        self._loop = asyncio.get_running_loop()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limit = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            tasks = [self._one(session, limit, i, ids, dict(sampling_params))
                     for i, ids in enumerate(prompts) for _ in range(n)]
            return list(await asyncio.gather(*tasks))

    async def _one(self, session: aiohttp.ClientSession, limit: asyncio.Semaphore, index: int,
                   prompt_ids: list[int], sampling_params: dict[str, Any]) -> Sample:
        body = {"input_ids": prompt_ids, "sampling_params": sampling_params,
                "return_logprob": True}
        last = ""
        attempt = 0
        outage = RouterOutage(self.router_down_s)
        while attempt < self.max_attempts:
            attempt += 1
            unavailable: str | None = None
            async with limit:
                task = asyncio.ensure_future(self._post(session, body))
                self._inflight.add(task)
                try:
                    status, out = await task
                except asyncio.CancelledError:
                    if task.cancelled() and not _cancelling(asyncio.current_task()):
                        self.resubmitted += 1
                        attempt -= 1  # a resubmission is not a failure of this request
                        continue
                    raise
                except aiohttp.ClientConnectorError as e:
                    # Nothing listens: the router is down (being relaunched).
                    status, out, unavailable = None, None, f"router unreachable: {e}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    status, out, last = None, None, f"{type(e).__name__}: {e}"
                finally:
                    self._inflight.discard(task)
            if no_engine_routed(status, out):
                # Every engine is out of the router for now (recovering, or being resynced
                # after a failed sync).
                unavailable = f"HTTP 503: {str(out)[:300]}"
            if unavailable is not None:
                last = unavailable
            if outage.waiting(unavailable is not None):
                # Not this request's failure: wait (bounded) for the router, or an engine in
                # it, to come back.
                attempt -= 1
                await asyncio.sleep(self.retry_backoff_s)
                continue
            if status == 200:
                sample = self._parse(index, prompt_ids, out)
                if sample is not None:
                    sample.attempts = attempt
                    self._done += 1
                    if self._on_sample is not None:
                        self._on_sample(self._done)
                    return sample
                last = "aborted or produced at more than one weight version"
            elif status is not None:
                last = f"HTTP {status}: {str(out)[:300]}"
            logger.info("generate retry %d/%d for prompt %d: %s", attempt, self.max_attempts,
                        index, last)
            await asyncio.sleep(self.retry_backoff_s * attempt)
        raise GenerationError(f"prompt {index}: /generate via {self.router_url} failed "
                              f"{self.max_attempts} times; last: {last}")

    async def _post(self, session: aiohttp.ClientSession, body: dict) -> tuple[int, Any]:
        async with session.post(f"{self.router_url}/generate", json=body) as resp:
            if resp.status != 200:
                return resp.status, await resp.text()
            return 200, await resp.json(content_type=None)

    @staticmethod
    def _parse(index: int, prompt_ids: list[int], out: Any) -> Sample | None:
        if isinstance(out, list):
            out = out[0]
        answer = p.GenerateResponse.model_validate(out)
        meta = answer.meta_info
        finish = meta.finish_reason.type if meta.finish_reason else "unknown"
        if finish == "abort":
            return None
        if len({s.version for s in meta.weight_versions}) > 1:
            return None
        logprobs = [float(entry[0]) for entry in meta.output_token_logprobs]
        return Sample(index, list(prompt_ids), list(answer.output_ids), logprobs,
                      str(meta.weight_version), finish,
                      meta={"id": meta.id, "cached_tokens": meta.cached_tokens})


def _cancelling(task: asyncio.Task | None) -> int:
    """Whether the task itself is being cancelled (Python 3.11+; 0 before)."""
    return getattr(task, "cancelling", lambda: 0)() if task is not None else 0
