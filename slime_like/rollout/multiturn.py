"""Multi-turn (agentic) episodes, token in and token out through the router.

One episode per sample: the model generates a turn (`/generate` on the whole context so far,
as token ids), an environment reads it and answers with text (a tool's result, the next
observation) or ends the episode, and the model's next turn is generated on the context with
the answer appended, up to `max_turns` model turns. Nothing the model produced is ever
re-tokenized: its turns stay the exact ids and logprobs the engine returned, and only the
environment's text is tokenized (with the checkpoint's tokenizer). The sample this gives
(slime's and verl's layout):

- `output_ids`: every token after the prompt, the model's and the environment's in order;
- `loss_mask`: 1 for the model's tokens, 0 for the environment's, so the trainer trains on
  the model's only and the job's log-probability check covers every model turn;
- `output_logprobs`: the engine's for the model's tokens, 0.0 for the environment's;
- `meta["weight_versions"]`: the engine's `meta_info.weight_versions` spans of each turn,
  moved to the turn's place in `output_ids` (environment tokens lie between spans);
  `weight_version` is their version. An episode whose turns came from two weight versions
  is played again (at most `max_attempts` times), as single-turn samples are.

Use it from a `--custom-generate-function-path` plug-in (slime's signature); see
`examples/agentic/`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from slime_like.errors import PluginError
from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.protocol import io_struct as p
from slime_like.rollout.generate import ROUTER_DOWN_S, RouterOutage, Sample, no_engine_routed

logger = logging.getLogger(__name__)

FLAG = "--custom-generate-function-path"
# What an environment does with a model turn: the text to insert before the next model
# turn, or None to end the episode. Plain or async.
EnvStep = Callable[[Sample, "Episode"], "str | None | Awaitable[str | None]"]


@dataclass
class ModelTurn:
    """One model turn as the engine returned it."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    spans: list[dict[str, Any]]  # weight_versions of this turn, relative to its first token


@dataclass
class Episode:
    """The episode so far: what the environment sees when it is asked to answer."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    turns: list[ModelTurn] = field(default_factory=list)
    env_texts: list[str] = field(default_factory=list)

    @property
    def last(self) -> ModelTurn:
        """The model's latest turn."""
        return self.turns[-1]

    def add_model_turn(self, turn: ModelTurn) -> None:
        offset = len(self.output_ids)
        self.output_ids += turn.ids
        self.output_logprobs += turn.logprobs
        self.loss_mask += [1] * len(turn.ids)
        self.spans += [{**s, "start": s["start"] + offset, "end": s["end"] + offset}
                       for s in turn.spans]
        self.turns.append(turn)

    def add_env_tokens(self, text: str, ids: list[int]) -> None:
        self.output_ids += ids
        self.output_logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.env_texts.append(text)

    def versions(self) -> list[str]:
        return sorted({s["version"] for s in self.spans})


class EpisodeRetry(Exception):
    """This attempt cannot make a sample (aborted turn, mixed weight versions): play again."""


async def _post_turn(session: aiohttp.ClientSession, router_url: str, body: dict,
                     outage: RouterOutage, retry_s: float) -> dict:
    """One turn's /generate, waiting (bounded) while the router has no engine or is down."""
    while True:
        try:
            async with session.post(f"{router_url}/generate", json=body) as resp:
                status = resp.status
                out = await (resp.json(content_type=None) if status == 200 else resp.text())
        except aiohttp.ClientConnectorError as e:
            status, out = None, f"router unreachable: {e}"
        unavailable = status is None or no_engine_routed(status, out)
        if outage.waiting(unavailable):
            await asyncio.sleep(retry_s)
            continue
        if status != 200:
            raise EpisodeRetry(f"/generate via {router_url}: HTTP {status}: {str(out)[:300]}")
        return out


async def _model_turn(session, router_url, context, sampling_params, outage, retry_s) -> ModelTurn:
    body = {"input_ids": context, "sampling_params": sampling_params, "return_logprob": True}
    answer = p.GenerateResponse.model_validate(await _post_turn(session, router_url, body, outage,
                                                                retry_s))
    meta = answer.meta_info
    finish = meta.finish_reason.type if meta.finish_reason else "unknown"
    if finish == "abort":  # an engine died or paused mid-turn: the episode is played again
        raise EpisodeRetry("a model turn was aborted")
    logprobs = [float(row[0]) for row in meta.output_token_logprobs]
    if len(logprobs) != len(answer.output_ids):
        raise PluginError(FLAG, f"/generate returned {len(answer.output_ids)} tokens but "
                                f"{len(logprobs)} logprobs")
    spans = [s.model_dump() for s in meta.weight_versions] or [
        {"version": str(meta.weight_version), "start": 0, "end": len(answer.output_ids)}]
    return ModelTurn(list(answer.output_ids), logprobs, answer.text or "", finish, spans)


async def run_episode(sample: Sample, *, router_url: str, sampling_params: dict[str, Any],
                      env_step: EnvStep, tokenizer: Tokenizer, max_turns: int,
                      context_len: int | None = None, api_key: str | None = None,
                      max_attempts: int = 4, router_down_s: float = ROUTER_DOWN_S,
                      retry_s: float = 0.5,
                      session: aiohttp.ClientSession | None = None) -> Sample:
    """Play one episode for `sample.prompt_ids`; the sample comes back with output ids,
    logprobs, loss mask and weight version filled (see the module docstring)."""
    own = session is None
    session = session or aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        timeout=aiohttp.ClientTimeout(total=300))
    last = ""
    try:
        for attempt in range(1, max_attempts + 1):
            try:
                episode = await _play(session, sample, router_url, sampling_params, env_step,
                                      tokenizer, max_turns, context_len,
                                      RouterOutage(router_down_s), retry_s)
            except EpisodeRetry as e:
                last = str(e)
                logger.info("episode of prompt %d: attempt %d/%d: %s", sample.prompt_index,
                            attempt, max_attempts, last)
                await asyncio.sleep(retry_s * attempt)
                continue
            versions = episode.versions()
            if len(versions) != 1:
                last = f"its turns came from weight versions {versions}"
                continue
            return replace(
                sample, output_ids=episode.output_ids, output_logprobs=episode.output_logprobs,
                loss_mask=episode.loss_mask, weight_version=versions[0],
                finish_reason=episode.last.finish_reason, attempts=attempt,
                meta={**sample.meta, "weight_versions": episode.spans,
                      "model_turns": len(episode.turns), "env_texts": episode.env_texts,
                      "turn_texts": [t.text for t in episode.turns]})
        raise PluginError(FLAG, f"prompt {sample.prompt_index}: no episode after {max_attempts} "
                                f"attempts; last: {last}")
    finally:
        if own:
            await session.close()


async def _play(session, sample, router_url, sampling_params, env_step, tokenizer, max_turns,
                context_len, outage, retry_s) -> Episode:
    episode = Episode(list(sample.prompt_ids))
    budget = sampling_params.get("max_new_tokens") or 0
    for turn in range(max_turns):
        context = episode.prompt_ids + episode.output_ids
        episode.add_model_turn(await _model_turn(session, router_url, context, sampling_params,
                                                 outage, retry_s))
        if turn == max_turns - 1:
            break
        reply = env_step(sample, episode)
        if asyncio.iscoroutine(reply) or isinstance(reply, asyncio.Future):
            reply = await reply
        if reply is None:
            break
        ids = tokenizer.encode(reply)
        if context_len is not None and (len(episode.prompt_ids) + len(episode.output_ids)
                                        + len(ids) + budget > context_len):
            break  # no room for another turn: the episode ends on the model's last turn
        episode.add_env_tokens(reply, ids)
    return episode
