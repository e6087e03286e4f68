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

import aiohttp

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
