"""Rollout generation through the router: many concurrent /generate calls, retried on failure.

By default (the sync schedule) a sample is only kept when its tokens were produced at one
weight version (its `weight_versions` spans name a single version). The asynchronous
schedules keep samples whose tokens span several versions (`keep_mixed_versions`): each
sample carries the engine's spans, and the trainer checks every token at its own span's
version. With `partial_rollout` a request aborted by a weight update is sent again as
prompt + the tokens it already has, with `max_new_tokens` reduced, and the two answers'
tokens, log-probabilities and spans are joined. A request that fails (its engine died, the router had no
worker for a moment) or that came back aborted is sent again, up to `max_attempts` times;
while the router cannot be reached at all (it crashed and is being relaunched) requests
wait and retry until `router_down_s` has passed, so a router restart loses no sample.
`resubmit_in_flight()` (called by the fleet when an engine stops answering probes) sends
every request still in flight again at once: one of them may be stuck on the hung engine,
and the first answer wins, so each requested sample still comes back exactly once.
With `slots` (`--rollout-dispatch admission`, `rollout/dispatch.py`) a request waits in the
client for a free slot of a routed engine and goes straight to that engine instead.
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
from slime_like.rollout.dispatch import EngineSlots, NoEngineRouted, Slot

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
    #: (version, start, end) over output token positions, as the engine reported them
    #: (`meta_info.weight_versions`); empty means every token is `weight_version`'s.
    weight_spans: list[tuple[str, int, int]] = field(default_factory=list)
    #: how often the sample was resubmitted as prompt + partial output (--partial-rollout)
    partial_resubmits: int = 0

    def model_token_mask(self) -> list[int]:
        """1 per output token the model produced (all of them unless `loss_mask` says)."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.output_ids)

    def spans(self) -> list[tuple[str, int, int]]:
        """(version, start, end) covering every output token."""
        return list(self.weight_spans) or [(self.weight_version, 0, len(self.output_ids))]

    def versions(self) -> list[str]:
        """The distinct versions the sample's tokens were made at, oldest first."""
        return sorted({v for v, _, _ in self.spans()}, key=_version_key)

    @property
    def mixed(self) -> bool:
        """Its tokens were made at more than one weight version."""
        return len(self.versions()) > 1


def _version_key(version: str) -> tuple[int, int | str]:
    return (0, int(version)) if version.isdigit() else (1, version)


def join_spans(spans: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Adjacent spans of one version merged, empty spans dropped."""
    out: list[tuple[str, int, int]] = []
    for version, start, end in spans:
        if end <= start:
            continue
        if out and out[-1][0] == version and out[-1][2] == start:
            out[-1] = (version, out[-1][1], end)
        else:
            out.append((version, start, end))
    return out


def continue_sample(partial: Sample, more: Sample) -> Sample:
    """`partial`'s tokens followed by those of `more` (the answer to prompt + partial)."""
    offset = len(partial.output_ids)
    spans = join_spans(partial.spans()
                       + [(v, a + offset, b + offset) for v, a, b in more.spans()])
    return Sample(partial.prompt_index, list(partial.prompt_ids),
                  partial.output_ids + more.output_ids,
                  partial.output_logprobs + more.output_logprobs, more.weight_version,
                  more.finish_reason, attempts=partial.attempts, meta=more.meta,
                  weight_spans=spans, partial_resubmits=partial.partial_resubmits + 1)


# sglang-router's error code when no worker is routed (or every one is unhealthy); smg
# answers it only while it has workers and none can take the request.
NO_WORKERS = "no_available_workers"
# smg's answer when it has no worker at all (its pool for the request's model is empty).
SMG_NO_WORKER = ("model_not_found", "No worker available for model")
ROUTER_DOWN_S = 120.0  # how long a router that is down, or has no engine routed, is waited for


def no_engine_routed(status: int | None, body: Any) -> bool:
    """The router's answer while every engine is out of it (recovering, or being resynced):
    not the request's failure, so callers wait (bounded) instead of spending a retry."""
    text = str(body)
    return (status == 503 and NO_WORKERS in text) or \
        (status == 404 and all(part in text for part in SMG_NO_WORKER))


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


def sample_params(sampling_params: dict[str, Any], index: int) -> dict[str, Any]:
    """One sample's parameters: a `sampling_seed` in the batch's parameters is its base, and
    sample `index` gets base + index (slime's rule under deterministic inference), so what
    is sampled does not depend on which engine serves it."""
    params = dict(sampling_params)
    if params.get("sampling_seed") is not None:
        params["sampling_seed"] = int(params["sampling_seed"]) + index
    return params


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
    #: keep samples whose tokens span weight versions (the asynchronous schedules)
    keep_mixed_versions: bool = False
    #: an aborted request goes out again as prompt + its partial output (--partial-rollout)
    partial_rollout: bool = False
    #: the largest number of times one sample is aborted and continued or restarted
    max_aborts: int = 1000
    #: admission dispatch: bind each request to a routed engine's free slot, sent to it
    #: directly (None: every request through the router)
    slots: EngineSlots | None = None

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Task] = set()
        self._on_sample: Callable[[int], None] | None = None
        self._done = 0
        self.resubmitted = 0      # requests sent again because their engine stopped answering
        self.aborted = 0          # answers that came back aborted (e.g. by a weight update)
        self.partial_resubmits = 0

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict[str, Any],
                 on_sample: Callable[[int], None] | None = None) -> list[Sample]:
        """n samples per prompt (n separate requests, each abortable by its own rid).

        `on_sample(k)` is called after the k-th sample arrived (e.g. to inject a fault while
        the rest are in flight).
        """
        self._on_sample = on_sample
        self._done = 0
        return asyncio.run(self._generate_all(prompts, n, sampling_params))

    def session(self) -> aiohttp.ClientSession:
        """A client session with the router's key, bound to the running loop (which
        `resubmit_in_flight` then reaches): for callers that send `sample()`s themselves."""
        self._loop = asyncio.get_running_loop()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # aiohttp's default pool holds 100 connections: more requests than that would wait
        # in the client while engines have slots free (admission with 6+ engines of 16).
        return aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.concurrency))

    def requests_out(self) -> int:
        """Requests sent and not answered yet (read from any thread; a set's length)."""
        return len(self._inflight)

    def resubmit_in_flight(self) -> None:
        """Thread-safe: cancel every request in flight; each is sent again at once."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        for task in list(self._inflight):
            task.cancel("resubmit")

    async def _generate_all(self, prompts, n, sampling_params) -> list[Sample]:
        limit = asyncio.Semaphore(self.concurrency)
        async with self.session() as session:
            tasks = [self.sample(session, limit, i, ids, sample_params(sampling_params, i * n + j))
                     for i, ids in enumerate(prompts) for j in range(n)]
            return list(await asyncio.gather(*tasks))

    async def sample(self, session: aiohttp.ClientSession, limit: asyncio.Semaphore, index: int,
                     prompt_ids: list[int], sampling_params: dict[str, Any]) -> Sample:
        """One sample of `prompt_ids`: retried on failure, continued or restarted when a
        weight update aborts it, until it finishes."""
        budget = sampling_params.get("max_new_tokens")
        partial: Sample | None = None
        aborts = 0
        while True:
            params = dict(sampling_params)
            ids = list(prompt_ids)
            if partial is not None:
                ids += partial.output_ids
                if budget is not None:
                    params["max_new_tokens"] = budget - len(partial.output_ids)
            answer = await self._request(session, limit, index, ids, params)
            answer.prompt_ids = list(prompt_ids)
            if answer.finish_reason != "abort":
                done = answer if partial is None else continue_sample(partial, answer)
                done.attempts = max(done.attempts, answer.attempts)
                self._done += 1
                if self._on_sample is not None:
                    self._on_sample(self._done)
                return done
            aborts += 1
            self.aborted += 1
            if aborts > self.max_aborts:
                raise GenerationError(f"prompt {index}: aborted {aborts} times via "
                                      f"{self.router_url}")
            if self.partial_rollout and answer.output_ids:
                partial = answer if partial is None else continue_sample(partial, answer)
                self.partial_resubmits += 1
                if budget is not None and len(partial.output_ids) >= budget:
                    partial.finish_reason = "length"
                    self._done += 1
                    if self._on_sample is not None:
                        self._on_sample(self._done)
                    return partial
            elif not self.partial_rollout:
                partial = None  # generated again from its prompt

    async def _request(self, session: aiohttp.ClientSession, limit: asyncio.Semaphore,
                       index: int, input_ids: list[int],
                       sampling_params: dict[str, Any]) -> Sample:
        """One answer for `input_ids` (aborted ones included), retried on failure."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": True}
        last = ""
        attempt = 0
        outage = RouterOutage(self.router_down_s)
        while attempt < self.max_attempts:
            attempt += 1
            unavailable: str | None = None
            async with limit:
                slot = await self._bind()
                task = asyncio.ensure_future(self._post(session, body, slot))
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
                    # Nothing listens: the router is down (being relaunched), or the engine
                    # died (the fleet unroutes it as soon as it sees the death).
                    where = "router" if slot is None else f"engine {slot.engine}"
                    status, out, unavailable = None, None, f"{where} unreachable: {e}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    status, out, last = None, None, f"{type(e).__name__}: {e}"
                finally:
                    self._inflight.discard(task)
                    if slot is not None:
                        self.slots.release(slot)
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
                sample = self.parse_answer(index, input_ids, out)
                sample.attempts = attempt
                if sample.finish_reason == "abort" and self.keep_mixed_versions:
                    return sample  # a weight update's abort: continued or restarted above
                if sample.finish_reason != "abort" and (self.keep_mixed_versions
                                                        or not sample.mixed):
                    return sample
                last = "aborted or produced at more than one weight version"
            elif status is not None:
                last = f"HTTP {status}: {str(out)[:300]}"
            logger.info("generate retry %d/%d for prompt %d: %s", attempt, self.max_attempts,
                        index, last)
            await asyncio.sleep(self.retry_backoff_s * attempt)
        raise GenerationError(f"prompt {index}: /generate via {self.router_url} failed "
                              f"{self.max_attempts} times; last: {last}")

    async def _bind(self) -> Slot | None:
        """A free slot of a routed engine (admission dispatch), else None: the router."""
        if self.slots is None:
            return None
        try:
            return await self.slots.acquire(self.router_down_s)
        except NoEngineRouted as e:
            raise GenerationError(str(e)) from e

    async def _post(self, session: aiohttp.ClientSession, body: dict,
                    slot: Slot | None = None) -> tuple[int, Any]:
        if slot is None:
            url, headers = f"{self.router_url}/generate", None
        else:  # the engine's own key instead of the router's
            url, headers = f"{slot.url}/generate", slot.headers
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return resp.status, await resp.text()
            return 200, await resp.json(content_type=None)

    @staticmethod
    def parse_answer(index: int, prompt_ids: list[int], out: Any) -> Sample:
        """A /generate answer as a Sample (aborted and mixed-version ones too)."""
        if isinstance(out, list):
            out = out[0]
        answer = p.GenerateResponse.model_validate(out)
        meta = answer.meta_info
        finish = meta.finish_reason.type if meta.finish_reason else "unknown"
        logprobs = [float(entry[0]) for entry in meta.output_token_logprobs]
        spans = join_spans([(str(s.version), s.start, s.end) for s in meta.weight_versions])
        return Sample(index, list(prompt_ids), list(answer.output_ids), logprobs,
                      str(meta.weight_version), finish,
                      meta={"id": meta.id, "cached_tokens": meta.cached_tokens},
                      weight_spans=spans if len(spans) > 1 else [])

    @classmethod
    def _parse(cls, index: int, prompt_ids: list[int], out: Any) -> Sample | None:
        """A finished single-version answer, or None (aborted, or spans versions)."""
        sample = cls.parse_answer(index, prompt_ids, out)
        return None if sample.finish_reason == "abort" or sample.mixed else sample


def _cancelling(task: asyncio.Task | None) -> int:
    """Whether the task itself is being cancelled (Python 3.11+; 0 before)."""
    return getattr(task, "cancelling", lambda: 0)() if task is not None else 0
