"""The weights of recent versions, and each sampled token's log-probability at its own version.

An asynchronous schedule trains on samples made at older weight versions, and a sample's
tokens may span several versions (an update happened while it was generated). To check
that the engines served what they claim, the trainer keeps a frozen copy of the weights of
the last K versions it pushed (`VersionedWeights`) and recomputes every token under the
version of its span (`span_logprobs`):

- after `retract` or a partial resubmission (`abort`) the engine recomputed the whole
  prefix under the new weights, so a span's tokens are one forward pass of that version
  over prompt + output;
- after `in_place` the engine kept the KV of the prefix computed by the old weights, so the
  recomputation does the same (`kv_kept=True`): prompt and output up to a span's first
  token minus one go through the earlier version into a KV cache, and the span's tokens
  are scored by the new version attending to that cache.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

Span = tuple[int, int, int]  # (version, start, end) over output token positions


class VersionedWeights:
    """Frozen copies of the weights of the last `keep` versions pushed to the engines."""

    def __init__(self, keep: int):
        self.keep = keep
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()

    def put(self, version: int, model: torch.nn.Module) -> None:
        """Keep a copy of `model` as `version` (dropping the oldest beyond `keep`)."""
        if self.keep <= 0:
            return
        frozen = copy.deepcopy(model)
        frozen.requires_grad_(False)
        frozen.eval()
        self._models[version] = frozen
        self._models.move_to_end(version)
        while len(self._models) > self.keep:
            self._models.popitem(last=False)

    def get(self, version: int) -> torch.nn.Module | None:
        return self._models.get(version)

    def versions(self) -> list[int]:
        return list(self._models)


class _ConcatCache:
    """A KV cache for one sequence: each layer's keys and values appended in order."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> list[float]:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, targets[:, None]).squeeze(-1).tolist()


@torch.no_grad()
def kv_kept_logprobs(models: Callable[[int], torch.nn.Module], prompt: list[int],
                     output: list[int], spans: Sequence[Span], temperature: float,
                     device: str = "cpu") -> list[float]:
    """Log-probabilities of `output` as an engine that kept its KV across updates made them.

    The KV of every position is computed by the version in force when the engine computed
    it: the token sampled first in a span is scored by a forward pass of that span's
    version over the position before it, attending to the cache of all earlier positions.
    """
    ids = torch.tensor(prompt + output, dtype=torch.long, device=device)
    cache = _ConcatCache()
    done = 0   # positions whose KV is in the cache
    out: list[float] = []
    for version, start, end in spans:
        # Positions that score output tokens start..end-1: len(prompt)+start-1 .. +end-2.
        first, last = len(prompt) + start - 1, len(prompt) + end - 1
        model = models(version)
        chunk = ids[done:last][None]
        positions = torch.arange(done, last, device=device)[None]
        total = last
        mask = None
        if done > 0:
            q = torch.arange(done, last, device=device)[:, None]
            mask = (torch.arange(total, device=device)[None, :] <= q)[None, None]
        logits = model(chunk, position_ids=positions, attn_mask=mask, kv_cache=cache)[0]
        rows = logits[first - done:]
        out += _logprobs_of(rows, ids[first + 1:last + 1], temperature)
        done = last
    return out


@torch.no_grad()
def span_logprobs(models: Callable[[int], torch.nn.Module],
                  full_logprobs: Callable[[torch.nn.Module, list[tuple[list[int], list[int]]]],
                                          list[list[float]]],
                  samples: Sequence[tuple[list[int], list[int], Sequence[Span]]], *,
                  kv_kept: bool, temperature: float, device: str = "cpu") -> list[list[float]]:
    """Every output token's log-probability under the version of its span.

    `models(v)` gives the weights of version v; `full_logprobs(model, pairs)` scores whole
    samples under one model (batched). Samples of one version need one batched pass; a
    mixed sample needs one pass per version (or, with `kv_kept`, one KV-faithful pass).
    """
    out: list[list[float] | None] = [None] * len(samples)
    by_version: dict[int, list[int]] = {}
    for i, (prompt, output, spans) in enumerate(samples):
        if kv_kept and len(spans) > 1:
            out[i] = kv_kept_logprobs(models, prompt, output, spans, temperature, device)
            continue
        for version, _, _ in spans:
            by_version.setdefault(version, []).append(i)
    partial: dict[tuple[int, int], list[float]] = {}
    for version, rows in by_version.items():
        rows = sorted(set(rows))
        scored = full_logprobs(models(version), [(samples[i][0], samples[i][1]) for i in rows])
        for i, lp in zip(rows, scored, strict=True):
            partial[(i, version)] = lp
    for i, (_, output, spans) in enumerate(samples):
        if out[i] is not None:
            continue
        row = [0.0] * len(output)
        for version, start, end in spans:
            row[start:end] = partial[(i, version)][start:end]
        out[i] = row
    return [r if r is not None else [] for r in out]
