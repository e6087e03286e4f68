"""FP8 rollout from a full-precision trainer: what a quantized sync sends, and the weights
the engines then compute with.

`Fp8Weights` is the sync's source when the engines run `--quantization fp8`: every quantized
projection (`protocol/fp8.py`) is block-quantized on the trainer's device as the buckets
are packed, one tensor at a time (the previous bucket is on the wire meanwhile), and sent
as sglang's two tensors, `<name>` (e4m3) and `<name>_scale_inv` (float32); the other
tensors go in the engines' dtype, as `CastWeights` sends them. No second copy of the model
is made for the send.

With `keep=True` (the job's choice for the colocated `tensor` transport) the quantized
tensors are instead written into a copy kept between syncs (values, scales, and the casts
of tensors whose dtype differs): about half the trainer's bf16 bytes more on its device.
The sent tensors then stay where they are, so from the second sync on the `tensor`
transport sends them all in place, one request whose handles each engine keeps mapped
(`shared_params.py`), as it does an unquantized model's parameters; the quantizing is then
one pass before that request rather than overlapped with the packs; on CUDA that pass is one
captured CUDA graph, replayed (`fp8_graph.py`: one launch instead of one per tensor, captured
again when a parameter or the copy moved). `begin_sync` (called by
`WeightSync` at the start of every sync) marks the copy stale; the first read of the
sync rewrites it, once. The copy is kept only while the source says what it sends stays
until the next sync (`storage_stays`: the trainer's offloader vouches for its weights only
with `--no-offload-train-weights`); otherwise it could not go in place, so it is not held
and each sync quantizes afresh. An offload of the trainer's weights frees it (`release`).

`ServedWeights` is what the trainer checks the engines against: a frozen copy of the model
holding exactly what the engines hold after the sync, dequantized (values x block scale,
in the trainer's dtype, as the engine's matmul does) and the unquantized tensors cast to the
engines' dtype and back. Quantization is deterministic (same weights, same function, same
device: the same bytes), so the copy is rebuilt from the trainer's weights after the sync
rather than kept from the send.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from slime_like.protocol import fp8
from slime_like.protocol.buckets import TensorMeta
from slime_like.weights import fp8_graph
from slime_like.weights.fp8_graph import CapturedRewrite
from slime_like.weights.packing import ModelWeights

log = logging.getLogger(__name__)


class Fp8Weights:
    """A model's weights in sglang's FP8 block layout: a `WeightSource`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype,
                 block: tuple[int, int] = fp8.BLOCK, keep: bool = False,
                 fused: bool | None = None, graph: bool | None = None):
        self.inner = ModelWeights(model)
        if self.inner.resident() is None:
            raise ValueError("FP8 syncs of a LoRA model are not supported: merge the adapters "
                             "first (the quantized weight must be the merged one)")
        self.dtype = dtype
        self.block = block
        self.keep = keep
        self.fused = fused  # fp8.quantize's: None uses the fused GPU kernel where it runs
        # keep on CUDA: rewrite the copy by replaying one captured CUDA graph (fp8_graph);
        # None: where a capture works (a failed one is said once, then eager passes), False:
        # never, True: a capture that fails raises
        self.graph = graph
        self._rewrite: CapturedRewrite | None = None
        self._graph_failure: str | None = None
        self._metas = fp8.quantized_metadata(self.inner.metadata(), dtype, block)
        self.quantize_s = 0.0  # the last sync's time spent quantizing (trainer's clock)
        self._kept: list[torch.Tensor] | None = None  # keep: what is sent, in send order
        self._current = False  # keep: the copy holds the trainer's weights of this sync

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def begin_sync(self) -> None:
        """A sync starts: the trainer's weights may have changed since the kept copy."""
        self._current = False

    def keeping(self) -> bool:
        """Whether this sync keeps the copy: `keep`, and the source's word (`storage_stays`,
        set by the trainer to its offloader's) that what is sent stays until the next sync;
        without it the copy could not go in place and would only hold memory."""
        stays = getattr(self, "storage_stays", None)
        return self.keep and (stays is None or bool(stays()))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        keep = self.keeping()
        if not keep:
            self._kept, self._current, self._rewrite = None, False, None  # nothing held
        elif self._current or (self._kept is not None and self._replayed()):
            # current, or rewritten in place by one graph replay: the kept tensors as they are
            yield from zip((m.name for m in self._metas), self._kept, strict=True)
            return
        self.quantize_s = 0.0
        yield from self._write(self._kept if keep else None, keep, self.fused)

    def _write(self, kept: list[torch.Tensor] | None, keep: bool, fused: bool | None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize and cast one tensor at a time, yielding each as it is made (the previous
        bucket is on the wire meanwhile); with `keep`, into `kept` (made here if None)."""
        fill: list[torch.Tensor] = []
        for name, t in self.inner.tensors():
            if fp8.is_quantized(name) and t.dim() == 2:
                started = time.perf_counter()
                out = None
                if keep:
                    out = (kept[len(fill)], kept[len(fill) + 1]) if kept is not None else (
                        _like(t, fp8.FP8_DTYPE, tuple(t.shape)),
                        _like(t, fp8.SCALE_DTYPE, fp8.scale_shape(tuple(t.shape), self.block)))
                values, scale = fp8.quantize(t, self.block, out=out, fused=fused)
                self.quantize_s += time.perf_counter() - started
                fill += [values, scale]
                yield name, values
                yield fp8.scale_name(name), scale
            elif keep and t.is_floating_point() and t.dtype != self.dtype:
                # a cast: kept too, so it stays where it is (copy_ casts, with no temporary)
                sent = (kept[len(fill)] if kept is not None else _like(
                    t, self.dtype, tuple(t.shape))).copy_(t)
                fill.append(sent)
                yield name, sent
            else:
                sent = t.to(self.dtype) if t.is_floating_point() else t
                fill.append(sent)
                yield name, sent
        if keep:
            self._kept, self._current = fill, True

    def _replayed(self) -> bool:
        """Rewrite the kept copy by one graph replay (captured now if nothing valid is);
        False where no graph runs here, and the caller rewrites it eagerly."""
        kept = self._kept
        if self.graph is False or self._graph_failure is not None or not kept[0].is_cuda:
            return False
        started = time.perf_counter()
        key = fp8_graph.addresses(self.inner.resident()) + fp8_graph.addresses(kept)
        if self._rewrite is None or self._rewrite.key != key:
            self._rewrite = None
            # the kernel choice made explicit: a launch the capture refuses must fail the
            # capture, not make quantize give up the fused kernel for the whole process
            fused = self.fused if self.fused is not None else fp8.fused_by_default()
            try:
                self._rewrite = fp8_graph.capture(
                    lambda: collections.deque(self._write(kept, True, fused), maxlen=0), key,
                    kept[0].device)
            except Exception as e:  # an op here cannot be captured (a torch or driver limit)
                if self.graph:
                    raise
                self._graph_failure = f"{type(e).__name__}: {e}"
                log.warning("the kept FP8 copy cannot be rewritten by a CUDA graph here, so "
                            "each sync rewrites it in one launch per tensor: %s",
                            self._graph_failure)
                return False
        self._rewrite.replay()
        self._current = True
        self.quantize_s = time.perf_counter() - started
        return True

    @property
    def graph_replays(self) -> int:
        """Syncs whose kept copy the current captured graph rewrote."""
        return 0 if self._rewrite is None else self._rewrite.replays

    def release(self) -> None:
        """Free the kept copy (the trainer offloads: the device's memory goes to the
        engines); the next sync makes it again, at new places, so it is shared afresh."""
        self._kept, self._current, self._rewrite = None, False, None

    def resident(self) -> list[torch.Tensor] | None:
        """While `keeping`: the kept tensors (rewritten first if stale), in send order, which
        stay where they are across syncs; else None (each sync's tensors are new)."""
        if not self.keeping():
            return None
        if not self._current:
            for _ in self.tensors():
                pass
        return self._kept


def _like(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A kept tensor beside `t`: on its device, and in named shared memory where `t` is in
    shared memory (so a colocated engine on CPU maps it as it maps the model's own shared
    tensors; named now, as the `tensor` transport shares it, so sharing never moves it)."""
    out = torch.empty(shape, dtype=dtype, device=t.device)
    if t.device.type == "cpu" and t.untyped_storage().is_shared():
        out.untyped_storage()._share_filename_cpu_()
    return out


class ServedWeights:
    """A frozen copy of the model with the weights the engines serve after an FP8 sync."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, block: tuple[int, int] = fp8.BLOCK):
        self.source = ModelWeights(model)
        self.dtype = dtype
        self.block = block
        self._copy: nn.Module | None = None

    @torch.no_grad()
    def refresh(self, sent: Fp8Weights | None = None) -> nn.Module:
        """The copy, set to what the engines hold for the trainer's current weights.

        `sent`: the sync's source, read right after the sync: its tensors are what the
        engines were sent, so they are dequantized as they are (a kept copy is not
        quantized a second time)."""
        if self._copy is None:
            self._copy = copy.deepcopy(self.source.model)
            self._copy.requires_grad_(False)
            self._copy.eval()
        params = dict(self._copy.named_parameters())
        if sent is not None and sent.dtype == self.dtype and sent.block == self.block:
            values: tuple[str, torch.Tensor] | None = None
            for name, t in sent.tensors():
                if values is not None:  # the scales of the values just before them
                    target = params[values[0]]
                    target.copy_(fp8.dequantize(values[1], t, target.dtype, self.block))
                    values = None
                elif t.dtype == fp8.FP8_DTYPE:
                    values = (name, t)
                elif t.is_floating_point():
                    params[name].copy_(t.to(params[name].dtype))
            return self._copy
        for name, t in self.source.tensors():
            target = params[name]
            if fp8.is_quantized(name) and t.dim() == 2:
                values, scale = fp8.quantize(t, self.block)
                target.copy_(fp8.dequantize(values, scale, target.dtype, self.block))
            elif t.is_floating_point():
                target.copy_(t.to(self.dtype).to(target.dtype))
        return self._copy
