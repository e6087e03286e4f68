"""Plug-in points of the job, slime's flags: `module.func` paths loaded once at start.

- `--custom-rm-path`: the reward of one sample,
  ``reward_func(args, sample, **kwargs) -> float`` (a plain or an ``async def`` function;
  async ones run concurrently over the batch). Default: `toy_reward`.
- `--rollout-function-path`: the whole rollout of one step,
  ``generate_rollout(args, rollout_id, prompts, *, router_url, sampling_params,
  n_samples_per_prompt, **kwargs) -> list[Sample]`` (plain or async), n samples per prompt.
  Default: `generate_rollout` below.
- `--custom-generate-function-path`: one sample, used by the default rollout function,
  ``async def generate(args, sample, sampling_params, *, router_url, api_key, **kwargs)
  -> Sample`` (`api_key` is the router's key of the run: send it as a Bearer token);
  it gets a `Sample` with `prompt`, `prompt_ids`, `label`, `metadata` set and returns it
  with `output_ids`, `output_logprobs` and `weight_version` filled (SGLang's
  ``/generate`` with ``return_logprob: true`` gives all three; see `post_generate`).

Whatever a plug-in returns is checked: the job's train/infer log-probability check needs
token ids, one log-probability per token and the weight version of every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from slime_like.errors import ConfigError, PluginError
from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.rollout.generate import RouterGenerator, Sample, sample_params
from slime_like.rollout.prompts import PromptItem
from slime_like.rollout.task import letter_credit

logger = logging.getLogger(__name__)

DEFAULT_RM = "slime_like.rollout.plugins.toy_reward"
DEFAULT_ROLLOUT = "slime_like.rollout.plugins.generate_rollout"


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """`package.module.func` -> the function; ConfigError naming `flag` if it is not there."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(flag, f"expected module.function, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        raise ConfigError(flag, f"module {missing!r} not found (importing {module_name!r}; is "
                                "it on PYTHONPATH?)") from e
    except Exception as e:  # noqa: BLE001 - a user module failing at import
        raise ConfigError(flag, f"importing {module_name!r} failed: {type(e).__name__}: "
                                f"{e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(flag, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(flag, f"{path} is not callable ({type(fn).__name__})")
    return fn


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` can take (all of them if it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


async def call_plugin(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a plain or async plug-in; await what it returns when that is awaitable."""
    out = fn(*args, **_accepted(fn, kwargs))
    if inspect.isawaitable(out):
        out = await out
    return out


# ---- the default reward: the toy task ------------------------------------------------------------


def toy_reward(args: argparse.Namespace, sample: Sample, **kwargs: Any) -> float:
    """The toy task's score: per generated token, 1 for the label's letter, 0.25 for another.

    Mean over the generated tokens, 0 for an empty answer (see `rollout/task.py`).
    """
    return letter_credit(sample.response, str(sample.label), len(sample.output_ids))


# ---- the default rollout: through the router ----------------------------------------------------


async def post_generate(router_url: str, sample: Sample, sampling_params: dict[str, Any],
                        session: aiohttp.ClientSession | None = None,
                        api_key: str | None = None) -> Sample:
    """One SGLang /generate for `sample.prompt_ids`; fills output ids, logprobs, version.

    A building block for custom generate functions (no retries: an aborted or failed
    request raises PluginError).
    """
    body = {"input_ids": sample.prompt_ids, "sampling_params": sampling_params,
            "return_logprob": True}
    own = session is None
    session = session or aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    try:
        async with session.post(f"{router_url}/generate", json=body) as resp:
            if resp.status != 200:
                raise PluginError("--custom-generate-function-path",
                                  f"/generate via {router_url}: HTTP {resp.status}: "
                                  f"{(await resp.text())[:300]}")
            out = await resp.json(content_type=None)
    finally:
        if own:
            await session.close()
    parsed = RouterGenerator._parse(sample.prompt_index, sample.prompt_ids, out)
    if parsed is None:
        raise PluginError("--custom-generate-function-path",
                          "the request was aborted or spans two weight versions")
    return replace(sample, output_ids=parsed.output_ids, output_logprobs=parsed.output_logprobs,
                   weight_version=parsed.weight_version, finish_reason=parsed.finish_reason,
                   meta=parsed.meta)


def _concurrency(args: argparse.Namespace) -> int:
    engines = max(1, (args.rollout_num_gpus or 1) // max(1, args.rollout_num_gpus_per_engine))
    return args.sglang_server_concurrency * engines


def _blank(i: int, prompt: PromptItem) -> Sample:
    return Sample(prompt_index=i, prompt_ids=list(prompt.input_ids), output_ids=[],
                  output_logprobs=[], weight_version="", finish_reason="", prompt=prompt.text,
                  label=prompt.label, metadata=dict(prompt.metadata))


async def _custom_generate_all(args, prompts, n, sampling_params, router_url, generate_fn,
                               on_sample, api_key=None) -> list[Sample]:
    limit = asyncio.Semaphore(_concurrency(args))
    done = 0

    async def one(i: int, j: int, prompt: PromptItem) -> Sample:
        nonlocal done
        async with limit:
            out = await call_plugin(generate_fn, args, _blank(i, prompt),
                                    sample_params(sampling_params, i * n + j),
                                    router_url=router_url, api_key=api_key)
        done += 1
        if on_sample is not None:
            on_sample(done)
        return out

    return list(await asyncio.gather(*(one(i, j, p) for i, p in enumerate(prompts)
                                       for j in range(n))))


def generate_rollout(args: argparse.Namespace, rollout_id: int, prompts: list[PromptItem], *,
                     router_url: str, sampling_params: dict[str, Any],
                     n_samples_per_prompt: int,
                     on_sample: Callable[[int], None] | None = None,
                     api_key: str | None = None,
                     generate: Callable[..., list[Sample]] | None = None,
                     **kwargs: Any) -> list[Sample]:
    """The default `--rollout-function-path`: n samples per prompt through the router.

    With `--custom-generate-function-path` each sample is that function's; otherwise
    concurrent /generate calls, retried when an engine dies or a request is aborted
    (`generate` is the fleet's, which also resubmits requests stuck on a hung engine).
    """
    if getattr(args, "custom_generate_function_path", None):
        fn = load_function(args.custom_generate_function_path, "--custom-generate-function-path")
        return asyncio.run(_custom_generate_all(args, prompts, n_samples_per_prompt,
                                                sampling_params, router_url, fn, on_sample,
                                                api_key))
    if generate is not None:
        return generate([p.input_ids for p in prompts], n_samples_per_prompt, sampling_params,
                        on_sample)
    gen = RouterGenerator(router_url, api_key=api_key, concurrency=_concurrency(args))
    return gen.generate([p.input_ids for p in prompts], n_samples_per_prompt, sampling_params,
                        on_sample)


# ---- the job's view: load once, call per step, check what comes back -----------------------------


def _check_samples(samples: Any, n_prompts: int, n: int, flag: str) -> list[Sample]:
    """Samples grouped by prompt (n each, GRPO groups), each carrying what the job needs."""
    if not isinstance(samples, list | tuple):
        raise PluginError(flag, f"returned a {type(samples).__name__}, expected a list of Sample")
    for k, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise PluginError(flag, f"item {k} is a {type(s).__name__}, expected "
                                    "slime_like.rollout.generate.Sample")
        if len(s.output_logprobs) != len(s.output_ids):
            raise PluginError(flag, f"sample {k} (prompt {s.prompt_index}) has "
                                    f"{len(s.output_ids)} output_ids but "
                                    f"{len(s.output_logprobs)} output_logprobs")
        if s.loss_mask is not None and (len(s.loss_mask) != len(s.output_ids)
                                        or any(m not in (0, 1) for m in s.loss_mask)):
            raise PluginError(flag, f"sample {k} (prompt {s.prompt_index}) has a loss_mask of "
                                    f"{len(s.loss_mask)} entries for {len(s.output_ids)} "
                                    "output_ids; expected one 0 or 1 per output token")
        if s.weight_version in (None, "", "None"):
            raise PluginError(flag, f"sample {k} (prompt {s.prompt_index}) has no "
                                    "weight_version")
    ordered = sorted(samples, key=lambda s: s.prompt_index)
    counts = [0] * n_prompts
    for s in ordered:
        if not 0 <= s.prompt_index < n_prompts:
            raise PluginError(flag, f"prompt_index {s.prompt_index} is outside the batch of "
                                    f"{n_prompts} prompts")
        counts[s.prompt_index] += 1
    if any(c != n for c in counts):
        raise PluginError(flag, f"expected {n} samples per prompt, got {counts}")
    return ordered


def fill_from_prompts(samples: list[Sample], prompts: list[PromptItem], tokenizer: Tokenizer,
                      index_of: Callable[[Sample], int] = lambda s: s.prompt_index
                      ) -> list[Sample]:
    """Each sample's prompt text, label, metadata and decoded response (slime's fields the
    reward function reads), from the prompt at its `prompt_index` (or `index_of`)."""
    for s in samples:
        p = prompts[index_of(s)]
        s.prompt = s.prompt or p.text
        if s.label is None:
            s.label = p.label
        s.metadata = s.metadata or dict(p.metadata)
        if not s.response:
            s.response = tokenizer.decode(s.output_ids)
    return samples


@dataclass
class Plugins:
    """The job's reward, rollout and (optional) generate functions."""

    reward_fn: Callable[..., Any]
    rollout_fn: Callable[..., Any]
    rm_path: str
    rollout_path: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plugins:
        """Load every plug-in named by the flags; ConfigError naming the flag on failure."""
        if args.custom_generate_function_path:
            load_function(args.custom_generate_function_path, "--custom-generate-function-path")
        rm = args.custom_rm_path or DEFAULT_RM
        rollout = args.rollout_function_path or DEFAULT_ROLLOUT
        return cls(load_function(rm, "--custom-rm-path"),
                   load_function(rollout, "--rollout-function-path"), rm, rollout)

    def rollout(self, args: argparse.Namespace, rollout_id: int, prompts: list[PromptItem], *,
                router_url: str, sampling_params: dict[str, Any], n: int,
                tokenizer: Tokenizer,
                on_sample: Callable[[int], None] | None = None,
                api_key: str | None = None,
                generate: Callable[..., list[Sample]] | None = None) -> list[Sample]:
        """n samples per prompt, grouped by prompt, with prompt/response/label filled."""
        out = self.rollout_fn(args, rollout_id, prompts, **_accepted(self.rollout_fn, dict(
            router_url=router_url, sampling_params=dict(sampling_params),
            n_samples_per_prompt=n, on_sample=on_sample, api_key=api_key,
            generate=generate)))
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        flag = ("--custom-generate-function-path"
                if self.rollout_path == DEFAULT_ROLLOUT and args.custom_generate_function_path
                else "--rollout-function-path")
        return fill_from_prompts(_check_samples(out, len(prompts), n, flag), prompts, tokenizer)

    def rewards(self, args: argparse.Namespace, samples: list[Sample]) -> list[float]:
        """Score every sample (async reward functions concurrently); sets `sample.reward`."""
        async def all_rewards() -> list[Any]:
            return list(await asyncio.gather(*(call_plugin(self.reward_fn, args, s)
                                               for s in samples)))

        values = asyncio.run(all_rewards())
        out = []
        for k, (s, v) in enumerate(zip(samples, values, strict=True)):
            if not isinstance(v, numbers.Real):
                raise PluginError("--custom-rm-path", f"{self.rm_path} returned {v!r} for "
                                                      f"sample {k}; expected a number")
            s.reward = float(v)
            out.append(float(v))
        return out


async def _await(awaitable: Any) -> Any:
    return await awaitable
