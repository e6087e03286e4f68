"""sampling_params: sglang 0.5.23's schema gate, its value checks, and batched sampling.

Two kinds of 400 exist in sglang and callers tell them apart: a schema violation (unknown
key, wrong JSON type) answers `{"error": "<serde message>"}`, a bad value answers
`{"error": {"message": ...}}`. `SchemaError` and `ValueError` keep them apart here.

Logprobs are those of the chosen token under the temperature-scaled distribution, before
top-k/top-p (sglang's default); greedy counts as temperature 1.0, as sglang normalises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_like.protocol.io_struct import SamplingParams

TOP_K_ALL = 1 << 30
GREEDY_EPS = 1e-6
SAMPLING_KEYS: tuple[str, ...] = tuple(SamplingParams.model_fields)

# JSON types of the keys the gate checks (serde names as sglang's Rust-side schema prints them).
_INT_KEYS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed",
             "beam_width")
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
               "repetition_penalty")
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR_OR_LIST_KEYS = ("stop", "stop_regex")


class SchemaError(ValueError):
    """A /generate body breaks sglang 0.5.23's JSON contract (answered as `{"error": str}`)."""


def _json_desc(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return "null"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_sampling_schema(raw: Any) -> None:
    """The contract gate: unknown keys and JSON type errors raise SchemaError."""
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise SchemaError(f"invalid type: {_json_desc(raw)}, expected struct SamplingParams")
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise SchemaError(f"unknown field `{key}`, expected one of {expected}")
        if value is None:
            continue
        if key in _INT_KEYS and not _is_int(value):
            raise SchemaError(f"invalid type: {_json_desc(value)}, expected i64")
        if key in _FLOAT_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise SchemaError(f"invalid type: {_json_desc(value)}, expected f64")
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise SchemaError(f"invalid type: {_json_desc(value)}, expected a boolean")
        if key in _STR_OR_LIST_KEYS and not (
                isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))):
            raise SchemaError(f"invalid type: {_json_desc(value)}, expected a value or an array of "
                              "values for StringOrList")
        if key == "stop_token_ids":
            if not isinstance(value, list):
                raise SchemaError(f"invalid type: {_json_desc(value)}, expected a sequence")
            for item in value:
                if not _is_int(item):
                    raise SchemaError(f"invalid type: {_json_desc(item)}, expected i64")


@dataclass
class SamplingSpec:
    """One request's resolved sampling parameters (defaults applied, greedy normalised)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_new_tokens: int = 0
    stop_strs: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change this request's logits before sampling."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """sglang's greedy: top-k 1 at temperature 1."""
        return self.top_k == 1


def resolve_sampling_params(raw: dict | None, vocab_size: int) -> SamplingSpec:
    """Defaults + sglang's normalisation and `verify`; a bad value raises ValueError (400)."""
    # A null means "unset" (max_new_tokens: null means "up to the context length").
    given = {k: v for k, v in (raw or {}).items() if v is not None or k == "max_new_tokens"}
    p = SamplingParams(**given)
    temperature, top_k = p.temperature, p.top_k
    if 0 <= temperature < GREEDY_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
    if top_k < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p.repetition_penalty}.")
    if p.min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
    if p.max_new_tokens is not None:
        if p.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
        if p.min_new_tokens > p.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], "
                             f"got {p.min_new_tokens}.")
    if p.n < 1:
        raise ValueError(f"n must be at least 1, got {p.n}.")
    if p.sampling_seed is not None and not -(2**63) <= p.sampling_seed <= 2**63 - 1:
        raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {p.sampling_seed}.")
    for tid in p.stop_token_ids or []:
        if not 0 <= tid < vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {tid}.")
    logit_bias = _logit_bias(p.logit_bias, vocab_size)
    # custom_params feed a custom logit processor; without one sglang ignores them, and so
    # does this engine (slime sends {"return_top_p_token_ids": true} with --rollout-top-p).
    # Features this engine does not implement are refused rather than silently ignored.
    unsupported = [k for k in ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex",
                               "beam_width", "watermark", "choice")
                   if getattr(p, k) not in (None, {}, [])]
    if unsupported:
        raise ValueError(f"sampling_params {unsupported} are not supported by the reference engine.")
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    return SamplingSpec(
        max_new_tokens=p.max_new_tokens, temperature=temperature, top_p=p.top_p, top_k=top_k,
        min_new_tokens=p.min_new_tokens, stop_strs=[s for s in stops if s],
        stop_token_ids=set(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens, no_stop_trim=p.no_stop_trim, n=p.n,
        sampling_seed=p.sampling_seed, min_p=p.min_p, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty,
        logit_bias=logit_bias,
    )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """sglang's logit_bias: {"<token id>": bias}; a key that is no token id is a 400."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not a token id.") from None
        if not 0 <= tid < vocab_size:
            raise ValueError(f"logit_bias key {key!r} is outside the vocabulary [0, {vocab_size}).")
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias of token {key} must be finite, got {bias}.")
        out[tid] = float(bias)
    return out


@torch.no_grad()
def adjust_logits(logits: torch.Tensor, specs: list[SamplingSpec],
                  outputs: list[list[int]]) -> torch.Tensor:
    """sglang's penalties over each request's generated tokens, then its logit bias.

    frequency: minus penalty x count; presence: minus penalty once a token appeared;
    repetition: logits of tokens that appeared are divided by it (multiplied when negative).
    Reported logprobs are those of the adjusted distribution, as in sglang.
    """
    logits = logits.float().clone()
    for b, (spec, out) in enumerate(zip(specs, outputs, strict=True)):
        if not spec.adjusts_logits:
            continue
        row = logits[b]
        if out and (spec.frequency_penalty or spec.presence_penalty or spec.repetition_penalty != 1.0):
            ids = torch.tensor(out, dtype=torch.long, device=logits.device)
            counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
            seen = counts > 0
            row -= spec.frequency_penalty * counts + spec.presence_penalty * seen.float()
            if spec.repetition_penalty != 1.0:
                rp = spec.repetition_penalty
                row[seen] = torch.where(row[seen] < 0, row[seen] * rp, row[seen] / rp)
        for tid, bias in spec.logit_bias.items():
            row[tid] += bias
    return logits


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream (sglang's sampling_seed makes sampling reproducible)."""
    # torch.Generator seeds must be non-negative 64-bit; fold negatives into that range.
    return torch.Generator(device=device).manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


@torch.no_grad()
def sample_batch(logits: torch.Tensor, specs: list[SamplingSpec],
                 generators: list[torch.Generator], want_logprobs: bool
                 ) -> tuple[list[int], list[float] | None, torch.Tensor]:
    """logits [B, V] -> (token per row, its logprob, all logprobs [B, V]).

    Logprobs are under the temperature-scaled softmax, before top-k/top-p filtering.
    Greedy rows take the argmax; the other rows are filtered by top-k/top-p and drawn from
    their own generator, so a seeded request draws the same numbers whatever its batch.
    """
    logits = logits.float()
    b, vocab = logits.shape
    temps = torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=logits.device)
    scaled = logits / temps[:, None] if bool((temps != 1.0).any()) else logits
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    chosen = torch.argmax(scaled, dim=-1)
    sampled_rows = [i for i, s in enumerate(specs) if not s.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = logprobs_all[rows].exp()
        top_k = torch.tensor([min(specs[i].top_k, vocab) for i in sampled_rows], device=logits.device)
        top_p = torch.tensor([specs[i].top_p for i in sampled_rows], dtype=torch.float32,
                             device=logits.device)
        min_p = torch.tensor([specs[i].min_p for i in sampled_rows], dtype=torch.float32,
                             device=logits.device)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()) or bool((min_p > 0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device)[None, :]
            drop = rank >= top_k[:, None]
            drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
            # min_p (sglang's): drop tokens below min_p x the most likely token's probability
            drop |= sorted_p < sorted_p[:, :1] * min_p[:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Rows sharing a
        # generator draw their noise in one call; a seeded row draws from its own stream,
        # so its tokens do not depend on the rest of the batch (and nothing syncs per row).
        noise = torch.empty_like(probs)
        by_generator: dict[int, list[int]] = {}
        for j, i in enumerate(sampled_rows):
            by_generator.setdefault(id(generators[i]), []).append(j)
        for js in by_generator.values():
            gen = generators[sampled_rows[js[0]]]
            if len(js) == 1:
                noise[js[0]].exponential_(generator=gen)
            elif len(js) == len(sampled_rows):
                noise.exponential_(generator=gen)
            else:
                noise[torch.tensor(js, device=logits.device)] = torch.empty(
                    (len(js), vocab), device=logits.device).exponential_(generator=gen)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    tokens = chosen.tolist()
    if not want_logprobs:
        return tokens, None, logprobs_all
    return tokens, logprobs_all.gather(1, chosen[:, None])[:, 0].tolist(), logprobs_all
