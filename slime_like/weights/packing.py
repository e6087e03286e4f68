"""What a sync sends, and its bytes packed into flat buckets.

A `WeightSource` gives the full metadata cheaply (names, dtypes, shapes, in send order) and
the tensors lazily, so a LoRA model is merged one layer at a time, and a model is cast to
the engines' dtype one tensor at a time (`CastWeights`), while buckets stream out instead
of materialising a second copy of the model.

Packing pulls a bucket's tensors from the source and copies them into one of two rotating
flat buffers: bucket k+1 is packed while bucket k is still in use (on the wire, or being
read by a colocated engine). On GPU packing runs on its own CUDA stream, so it overlaps the
NCCL broadcast of the previous bucket. Buckets whose tensors already lie back to back in
the trainer's storage go out without a pack (`direct_view`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from slime_like.errors import WeightMetadataError
from slime_like.protocol.buckets import Bucket, TensorMeta, dtype_name


@runtime_checkable
class WeightSource(Protocol):
    """Tensors to sync, by HF name; `tensors()` yields them in `metadata()` order.

    Optional, read with getattr by the sync and its transports: `resident()` (the tensors
    themselves, when their bytes are what is sent), `storage_stays()` (they outlive the next
    sync), `begin_sync()` (called once at the start of every `WeightSync.update`: a source
    keeping a derived copy, like `Fp8Weights(keep=True)`, marks it stale there)."""

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

    def resident(self) -> list[torch.Tensor]:
        """The tensors, in send order (see `ModelWeights.resident`)."""
        return [t for _, t in self._items]


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

    def resident(self) -> list[torch.Tensor] | None:
        """The parameters themselves, in send order, when a sync sends exactly their bytes
        (no LoRA merge): where they live says whether last sync's requests still hold."""
        if any(lora is not None for _, _, lora in self._entries):
            return None
        return [param for _, param, _ in self._entries]


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


class CastWeights:
    """A model's weights (HF names, LoRA merged) as `dtype`: floating tensors cast lazily.

    The trainer keeps fp32 weights; engines serve the checkpoint's dtype (bf16 for most
    HF checkpoints) unless `--sglang-dtype` says otherwise, and a sync must send exactly
    theirs, one tensor at a time while buckets are packed, never as a second full copy.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.inner = ModelWeights(model)
        self.dtype = dtype
        self._metas = [TensorMeta(m.name, dtype if m.dtype.is_floating_point else m.dtype,
                                  m.shape) for m in self.inner.metadata()]

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.tensors():
            yield name, t.to(self.dtype) if t.is_floating_point() else t


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


# ---- packing ---------------------------------------------------------------------------------


def bucket_tensors(stream: Iterator[tuple[str, torch.Tensor]], bucket: Bucket,
                   ) -> list[torch.Tensor]:
    """Pull the bucket's tensors from the source (parameter order) into layout order."""
    got: dict[str, torch.Tensor] = {}
    for _ in bucket.metas:
        try:
            name, tensor = next(stream)
        except StopIteration:
            raise WeightMetadataError(f"the weight source ended before {bucket.names[-1]!r}; "
                                      "it yields fewer tensors than its metadata lists") from None
        got[name] = tensor
    out = []
    for m in bucket.metas:
        t = got.get(m.name)
        if t is None:
            raise WeightMetadataError(f"the weight source yielded {sorted(got)} where its "
                                      f"metadata promised {m.name!r}: tensors out of order")
        if t.dtype != m.dtype or tuple(t.shape) != m.shape:
            raise WeightMetadataError(f"{m.name!r} is {t.dtype}{list(t.shape)} but its metadata "
                                      f"said {m.dtype}{list(m.shape)}")
        out.append(t)
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-D uint8 tensor (a view when contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def storage_slice(storage: torch.UntypedStorage, start: int, end: int,
                  device: torch.device) -> torch.Tensor:
    """Bytes [start, end) of a storage as a uint8 tensor viewing it (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)[start:end]


def direct_view(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bucket's bytes without packing, when they already lie back to back in one storage.

    True of a one-tensor bucket, and of a trainer whose parameters live in flat buffers
    (Megatron-style) when the bucket follows their order: the bucket then goes out of the
    trainer's own storage, with no copy. Returns None when a pack is needed.
    """
    first = tensors[0]
    if first.device != device or not first.is_contiguous():
        return None
    if len(tensors) == 1:
        return flat_bytes(first)
    storage = first.untyped_storage()
    base = storage.data_ptr()
    start = first.data_ptr()
    end = start + first.numel() * first.element_size()
    for t in tensors[1:]:
        if t.data_ptr() != end or not t.is_contiguous() or t.untyped_storage().data_ptr() != base:
            return None
        end += t.numel() * t.element_size()
    return storage_slice(storage, start - base, end - base, device)


def in_shared_memory(view: torch.Tensor) -> bool:
    """Whether a CPU view may go to a colocated engine in place: only out of shared memory
    (any other storage is packed: sharing it would move the trainer's tensors into shared
    memory as a side effect)."""
    return view.untyped_storage().is_shared()


@dataclass
class SendGroup:
    """One update request's worth of tensors: a planned bucket, or direct buckets merged."""

    metas: list[TensorMeta]
    tensors: list[torch.Tensor]
    nbytes: int
    #: the group's bytes in the trainer's own storage (no pack), or None
    view: torch.Tensor | None
    buckets: int = 1
    #: the bytes, back to back in the trainer's storage, of a bucket that `allow_direct`
    #: refused: packed with one copy instead of one per tensor
    contiguous: torch.Tensor | None = None
    #: a hashable stand-in for `metas` (equal signatures, equal metas), or None
    signature: Any = None

    def pack_sources(self) -> list[torch.Tensor]:
        """What a pack copies: the contiguous bytes if known, else the tensors."""
        return self.tensors if self.contiguous is None else [self.contiguous]

    def joins(self, view: torch.Tensor | None, metas: Sequence[TensorMeta]) -> bool:
        """Whether a direct bucket (`view`, `metas`) continues this one's bytes exactly."""
        if self.view is None or view is None:
            return False
        if view.untyped_storage().data_ptr() != self.view.untyped_storage().data_ptr():
            return False
        if view.data_ptr() != self.view.data_ptr() + self.nbytes:
            return False
        offset = self.nbytes  # sglang's alignment rule, for the offsets in the joined layout
        for m in metas:
            if offset % m.dtype.itemsize:
                return False
            offset += m.nbytes
        return True

    def join(self, view: torch.Tensor, metas: Sequence[TensorMeta],
             tensors: list[torch.Tensor], nbytes: int) -> None:
        storage = self.view.untyped_storage()
        start = self.view.data_ptr() - storage.data_ptr()
        self.view = storage_slice(storage, start, start + self.nbytes + nbytes, view.device)
        self.metas += metas
        self.tensors += tensors
        self.nbytes += nbytes
        self.buckets += 1


def send_groups(stream: Iterator[tuple[str, torch.Tensor]], buckets: Sequence[Bucket],
                device: torch.device, *, merge_direct: bool,
                allow_direct: Callable[[torch.Tensor], bool] | None = None,
                ) -> Iterator[tuple[SendGroup, bool]]:
    """The buckets as update requests, each with whether it is the last one.

    With `merge_direct`, consecutive buckets whose tensors lie back to back in one storage
    (a trainer with flat parameter buffers) go as one request: the bucket size bounds the
    pack buffer, and a direct view needs none, so splitting it only adds round trips. At
    most one bucket is pulled from the source ahead of the group being sent.
    `allow_direct(view)` may refuse a direct view (it is packed instead).
    """
    pending: SendGroup | None = None
    for bucket in buckets:
        tensors = bucket_tensors(stream, bucket)
        view = direct_view(tensors, device) if merge_direct else None
        refused = None
        if view is not None and allow_direct is not None and not allow_direct(view):
            view, refused = None, view
        if pending is not None and pending.joins(view, bucket.metas):
            pending.join(view, bucket.metas, tensors, bucket.nbytes)
            continue
        if pending is not None:
            yield pending, False
        pending = SendGroup(list(bucket.metas), tensors, bucket.nbytes, view, contiguous=refused)
    if pending is not None:
        yield pending, True


class BucketPacker:
    """Rotating flat uint8 buffers on one device, reused across buckets and syncs."""

    def __init__(self, device: torch.device, capacity: int, slots: int = 2,
                 cpu_share: bool = False):
        self.device = torch.device(device)
        self.capacity = capacity
        self.cpu_share = cpu_share and self.device.type == "cpu"
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cpu_pack_s = 0.0

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def reserve(self, nbytes: int, buckets: int | None = None) -> None:
        """Allocate the slots now (at attach), sized for the largest planned bucket; with
        `buckets` packed buckets per sync, no more slots than that (one bucket, one buffer)."""
        self.capacity = min(self.capacity, max(1, nbytes))
        for slot in range(min(self.slots, buckets or self.slots)):
            self._buffer(slot, self.capacity)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.capacity), dtype=torch.uint8, device=self.device)
            if self.cpu_share:
                # Move into named shared memory once; later packs write into it in place.
                buf.untyped_storage()._share_filename_cpu_()
            self._buffers[slot] = buf
        return buf

    def begin(self) -> None:
        """Order packing after the trainer's pending work (e.g. its last optimizer step)."""
        self._events.clear()
        self.cpu_pack_s = 0.0
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def pack(self, slot: int, tensors: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor:
        """Copy tensors (layout order) into slot's buffer; returns the used uint8 prefix."""
        dst = self._buffer(slot, nbytes)[:nbytes]
        flat = [flat_bytes(t) for t in tensors]
        if self.stream is None:
            start = time.perf_counter()
            _copy_into(dst, flat)
            self.cpu_pack_s += time.perf_counter() - start
            return dst
        # Tensors a source made on the trainer's stream while this bucket was pulled (a
        # cast, an FP8 quantization) are read after they are written, and their memory is
        # not handed out again before this copy has read it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            _copy_into(dst, flat)
            ev1.record()
            self._events.append((ev0, ev1))
        return dst

    def wait_packed(self) -> None:
        """Block until every pack issued so far has landed (for readers outside our streams)."""
        if self._events:
            self._events[-1][1].synchronize()

    def pack_seconds(self) -> float:
        """Total packing time of this sync (synchronizes the GPU events it reads)."""
        if self.stream is None:
            return self.cpu_pack_s
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3

    def finish(self) -> None:
        """Later work on the trainer's stream (which may change parameters) waits for packing."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        self._buffers = [None] * len(self._buffers)


MEMCPY_MIN_AVG_BYTES = 1 << 20  # tensors this large on average: one memcpy each


def _copy_into(dst: torch.Tensor, flat: list[torch.Tensor]) -> None:
    """Many small tensors: one `cat` kernel. Large ones: a memcpy each, which runs at about
    twice a copy kernel's bandwidth on an H200 (2.1 against 1.1 TB/s, 15 GB dense7b pack)."""
    if all(f.device == dst.device for f in flat) and dst.numel() < MEMCPY_MIN_AVG_BYTES * len(flat):
        torch.cat(flat, out=dst)
        return
    offset = 0
    for f in flat:
        dst[offset:offset + f.numel()].copy_(f, non_blocking=True)
        offset += f.numel()


def metas_body(metas: Sequence[TensorMeta]) -> dict:
    """names / dtypes / shapes as sglang's update requests spell them."""

    return {"names": [m.name for m in metas], "dtypes": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas]}
