"""What a sync sends: tensors by HF name, with their metadata known before any byte moves.

A `WeightSource` gives the full metadata cheaply (names, dtypes, shapes, in send order) and
the tensors lazily, so a LoRA model is merged one layer at a time while buckets stream out
instead of materialising a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from slime_like.errors import WeightMetadataError
from slime_like.protocol.buckets import TensorMeta, dtype_name


@runtime_checkable
class WeightSource(Protocol):
    """Tensors to sync, by HF name; `tensors()` yields them in `metadata()` order."""

    def metadata(self) -> list[TensorMeta]: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class NamedTensors:
    """A list or dict of (HF name, tensor)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]):
        items = list(named.items() if isinstance(named, Mapping) else named)
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise WeightMetadataError(f"tensor names are not unique: {dup[:5]}")
        self._items = [(n, t.detach()) for n, t in items]
        # The detached views cannot change shape or dtype: one metadata list serves every
        # sync (and lets WeightSync skip re-checking it).
        self._metas = [TensorMeta.of(n, t) for n, t in self._items]

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def reuse_metadata(self, metas: list[TensorMeta]) -> None:
        """Adopt an equal metadata list from an earlier sync (so it is not checked again)."""
        if metas != self._metas:
            raise WeightMetadataError("reuse_metadata: the metadata differs")
        self._metas = metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel-like wrappers (not a peft model's base)."""
    # DistributedDataParallel and similar wrappers keep the real model in `.module`.
    while isinstance(getattr(model, "module", None), nn.Module) and not _is_peft(model):
        model = model.module
    return model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


class ModelWeights:
    """A model's parameters under HF checkpoint names (tied lm_head left out, as HF does).

    For a peft LoRA model every adapted layer is sent as its merged weight
    (base + the adapter's delta) under the base model's name; adapter tensors are not sent
    and the trainer's model is not modified.
    """

    def __init__(self, model: nn.Module):
        self.model = unwrap_model(model)
        self._entries = list(self._walk())
        # Built once: the same list object every sync lets WeightSync skip re-checking it.
        self._metas = [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p, _ in self._entries]

    def _walk(self) -> Iterator[tuple[str, torch.Tensor, Any]]:
        model = self.model
        if not _is_peft(model):
            tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
            for name, param in model.named_parameters(remove_duplicate=True):
                if tied and name == "lm_head.weight":
                    continue
                yield name, param, None
            return
        yield from _peft_entries(model)

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, param, lora in self._entries:
                yield name, (param.detach() if lora is None else _merged(param, *lora))


def _peft_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(base name, base parameter, (lora layer, adapters) or None) for a peft model."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError as e:  # a peft model without peft importable cannot happen; be clear
        raise WeightMetadataError(f"peft is needed to merge this LoRA model: {e}") from e
    base = model.base_model.model  # the wrapped transformers / slime_like model
    lora_layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    tied = bool(getattr(getattr(base, "config", None), "tie_word_embeddings", False))
    seen: set[str] = set()
    for name, param in base.named_parameters(remove_duplicate=True):
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter tensors, and the frozen twin of a modules_to_save copy
        hf_name = name.replace(".base_layer.", ".")
        if ".modules_to_save." in hf_name:
            head, _, tail = hf_name.partition(".modules_to_save.")
            hf_name = f"{head}.{tail.partition('.')[2]}"
        if tied and hf_name == "lm_head.weight":
            continue
        if hf_name in seen:
            raise WeightMetadataError(f"two parameters of the LoRA model map to {hf_name!r}")
        seen.add(hf_name)
        owner = name.rpartition(".")[0].removesuffix(".base_layer")
        layer = lora_layers.get(owner)
        if layer is not None and name.endswith(".base_layer.weight"):
            adapters = [a for a in layer.active_adapters if a in getattr(layer, "lora_A", {})]
            if any(layer.use_dora.get(a, False) for a in adapters):
                raise WeightMetadataError(f"{hf_name}: DoRA adapters cannot be merged for a sync")
            if getattr(layer, "merged", False):
                adapters = []  # already merged into the base weight by the user
            yield hf_name, param, ((layer, adapters) if adapters else None)
        else:
            yield hf_name, param, None


def _merged(param: torch.Tensor, layer: Any, adapters: list[str]) -> torch.Tensor:
    """base weight + every active adapter's delta, in the base weight's dtype."""
    out = param.detach().clone()
    for adapter in adapters:
        out += layer.get_delta_weight(adapter).to(out.dtype)
    return out


def as_source(weights: Any) -> WeightSource:
    """A WeightSource from a model, a list/dict of named tensors, or a source itself."""
    if isinstance(weights, nn.Module):
        return ModelWeights(weights)
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping | list | tuple):
        return NamedTensors(weights)
    raise TypeError(f"cannot sync weights from a {type(weights).__name__}; pass an nn.Module, "
                    "a dict or list of (name, tensor), or a WeightSource")


def get_model_metadata(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """{HF name: (dtype, shape)} of what a sync of `model` sends (LoRA merged)."""
    return {m.name: (m.dtype, torch.Size(m.shape)) for m in ModelWeights(model).metadata()}


def check_same_metadata(expected: list[TensorMeta], actual: list[TensorMeta],
                        where: str = "the weights passed to this sync",
                        against: str = "the registered metadata", subset: bool = False,
                        engine: str | None = None) -> None:
    """Raise WeightMetadataError listing every difference (missing, extra, dtype, shape).

    Order does not matter (buckets are planned from `actual`); with `subset`, names of
    `expected` that `actual` lacks are fine (a sync may update part of a model).
    """
    exp = {m.name: m for m in expected}
    act = {m.name: m for m in actual}
    problems = [] if subset else [f"missing {n!r}" for n in exp if n not in act]
    problems += [f"unexpected {n!r}" for n in act if n not in exp]
    for n, m in act.items():
        e = exp.get(n)
        if e is not None and e.dtype != m.dtype:
            problems.append(f"{n!r}: dtype {dtype_name(m.dtype)}, expected {dtype_name(e.dtype)}")
        if e is not None and e.shape != m.shape:
            problems.append(f"{n!r}: shape {list(m.shape)}, expected {list(e.shape)}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightMetadataError(f"{where} disagree with {against}: "
                                  + "; ".join(problems[:8]) + more, engine=engine)
