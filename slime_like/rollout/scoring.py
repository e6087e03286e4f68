"""Log-probabilities of given tokens under a model served behind a router (no sampling).

A frozen reference model's log-probabilities of the tokens the policy sampled give the KL
term of `--use-kl-loss` / `--kl-coef`. Each pair is one `/generate` with `input_ids =
prompt + output`, `return_logprob` and `logprob_start_len = len(prompt)`: sglang answers
the prompt window's `input_token_logprobs`, which are exactly log p_ref(output_t | prefix).
One token is generated and dropped (sglang needs `max_new_tokens >= 1` to run the request).
Requests are retried a bounded number of times, and while the router is down or has no
engine routed (its only engine being recovered) they wait, bounded, as rollouts do: an
engine recovering behind the router costs a wait, not the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from slime_like.engine.session import EngineSession
from slime_like.errors import SlimeLikeError
from slime_like.rollout.generate import ROUTER_DOWN_S, RouterOutage, no_engine_routed


class ScoringError(SlimeLikeError):
    """The reference model's router kept failing for one pair."""


async def _score_one(session: aiohttp.ClientSession, url: str, limit: asyncio.Semaphore,
                     prompt: list[int], output: list[int], attempts: int,
                     router_down_s: float) -> list[float]:
    body = {"input_ids": list(prompt) + list(output), "return_logprob": True,
            "logprob_start_len": len(prompt),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    last, attempt, outage = "", 0, RouterOutage(router_down_s)
    while attempt < attempts:
        attempt += 1
        unavailable = False  # the router down or without engines: waited for, not a failure
        async with limit:
            try:
                async with session.post(f"{url}/generate", json=body) as resp:
                    if resp.status == 200:
                        out = await resp.json(content_type=None)
                        out = out[0] if isinstance(out, list) else out
                        window = out["meta_info"]["input_token_logprobs"]
                        # The window starts at len(prompt); with prompt == [] its first entry
                        # is the first token, which has no logprob.
                        lps = [lp for lp, _tok, *_ in window][-len(output):] if output else []
                        if len(lps) == len(output) and all(lp is not None for lp in lps):
                            return [float(lp) for lp in lps]
                        last = f"expected {len(output)} logprobs, got {len(window)}"
                    else:
                        text = await resp.text()
                        unavailable = no_engine_routed(resp.status, text)
                        last = f"HTTP {resp.status}: {text[:200]}"
            except aiohttp.ClientConnectorError as e:
                unavailable, last = True, f"router unreachable: {e}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
        if outage.waiting(unavailable):
            attempt -= 1
            await asyncio.sleep(0.5)
            continue
        await asyncio.sleep(0.5 * attempt)
    raise ScoringError(f"log-probabilities via {url} failed {attempts} times; last: {last}")


async def _score_all(url: str, pairs: Sequence[tuple[list[int], list[int]]], api_key: str | None,
                     concurrency: int, timeout_s: float, attempts: int,
                     router_down_s: float) -> list[list[float]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return list(await asyncio.gather(*[_score_one(session, url, limit, p, o, attempts,
                                                      router_down_s)
                                           for p, o in pairs]))


@dataclass(frozen=True)
class EngineScores:
    """One engine's log-probabilities of the given pairs, and the version it claimed."""

    engine_id: str
    url: str
    version: str
    logprobs: list[list[float]]


def score_on_engines(engines: Sequence[EngineSession], pairs: Sequence[tuple[list[int], list[int]]],
                     *, timeout_s: float = 60.0, attempts: int = 2
                     ) -> tuple[list[EngineScores], dict[str, str]]:
    """Each engine scores `pairs` itself (not through a router), all engines at once: what
    the log-probability check asks of every serving engine (`rollout/probe.py`). Returns the
    engines that answered, and `{engine_id: why}` for those that did not (an engine dying
    meanwhile is the health monitor's business, not the check's). An engine whose answers
    name more than one weight version (an update landed between them) is left out too."""
    if not engines or not pairs:
        return [], {}
    return asyncio.run(_score_engines(list(engines), list(pairs), timeout_s, attempts))


async def _score_engines(engines: list[EngineSession], pairs: list[tuple[list[int], list[int]]],
                         timeout_s: float, attempts: int
                         ) -> tuple[list[EngineScores], dict[str, str]]:
    body = {"input_ids": [list(p) + list(o) for p, o in pairs], "return_logprob": True,
            "logprob_start_len": [len(p) for p, _ in pairs],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}

    async def one(engine: EngineSession) -> EngineScores:
        """The whole probe as one batched /generate (one prefill on the engine)."""
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        last = ""
        async with aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            for attempt in range(attempts):
                try:
                    async with session.post(f"{engine.url}/generate", json=body) as resp:
                        if resp.status == 200:
                            return _engine_scores(engine, pairs, await resp.json(content_type=None))
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    last = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.2 * (attempt + 1))
        raise ScoringError(f"{engine.url}/generate failed {attempts} times; last: {last}")

    results = await asyncio.gather(*[one(e) for e in engines], return_exceptions=True)
    answered, failed = [], {}
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException):
            failed[str(engine.engine_id)] = f"{type(result).__name__}: {result}"
        else:
            answered.append(result)
    return answered, failed


def _engine_scores(engine: EngineSession, pairs: list[tuple[list[int], list[int]]],
                   answer: list | dict) -> EngineScores:
    """A batched answer as one engine's scores; refused if it spans weight versions."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(pairs):
        raise ScoringError(f"{engine.url}/generate answered {len(items)} items for "
                           f"{len(pairs)} sequences")
    versions, logprobs = set(), []
    for item, (_, output) in zip(items, pairs, strict=True):
        window = item["meta_info"]["input_token_logprobs"]
        lps = [lp for lp, _tok, *_ in window][-len(output):]
        if len(lps) != len(output) or any(lp is None for lp in lps):
            raise ScoringError(f"{engine.url}/generate: expected {len(output)} log-"
                               f"probabilities, got {len(window)}")
        logprobs.append([float(lp) for lp in lps])
        versions.add(str(item["meta_info"].get("weight_version", "")))
    if len(versions) != 1:
        raise ScoringError(f"{engine.url}: answers at several weight versions {sorted(versions)}")
    return EngineScores(str(engine.engine_id), engine.url, versions.pop(), logprobs)


def token_logprobs(router_url: str, pairs: Sequence[tuple[list[int], list[int]]], *,
                   api_key: str | None = None, concurrency: int = 64, timeout_s: float = 300.0,
                   attempts: int = 6, router_down_s: float = ROUTER_DOWN_S) -> list[list[float]]:
    """Per pair (prompt_ids, output_ids): log p(output_t | prompt, output_<t) under the model
    behind `router_url`. A router that is down or has no engine routed (its engine being
    recovered) is waited for, up to `router_down_s`, as rollouts do."""
    if not pairs:
        return []
    return asyncio.run(_score_all(router_url, pairs, api_key, concurrency, timeout_s, attempts,
                                  router_down_s))
