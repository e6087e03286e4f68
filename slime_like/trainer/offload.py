"""Trainer state off the GPU and back at the host link's limit (--offload-train).

The parameters and the optimizer state (AdamW's two moments) go to pinned host buffers that
are allocated once, one per dtype, and reused every step; gradients are freed, not copied
(each train step zeroes them before it uses them). Onload puts each dtype's state back into
one flat device buffer and makes every tensor a view of it (parameters first, in the
model's order), so from the second step on an
offload is one device-to-host copy per dtype and an onload one host-to-device copy per
dtype: the copies are batched by storage, not by tensor. Copies run on a side stream;
`onload` returns once they are enqueued and `ready()` makes the compute stream wait for
them, so the copy overlaps whatever the caller does before its next use of the model.

A memory saver that keeps virtual addresses (torch_memory_saver) would avoid the re-view,
but it needs an LD_PRELOAD'd allocator hook; plain pinned copies run everywhere and already
reach the link's limit (docs/COLOCATE.md has the figures).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

# Every tensor starts on a 16-byte boundary of its flat buffer (vector loads stay aligned).
# No wider: parameters whose sizes are multiples of 16 bytes then lie back to back, in the
# sync's order, so a weight sync sends them straight from the flat buffer (no pack copy).
ALIGN_BYTES = 16


@dataclass
class _Slot:
    """One tensor the offload moves: a parameter's data or one optimizer-state entry."""

    param: torch.nn.Parameter | None
    state: dict | None
    key: str | None
    tensor: torch.Tensor

    def assign(self, value: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = value
        else:
            self.state[self.key] = value


@dataclass
class _Group:
    """The tensors of one dtype and where each lives in that dtype's flat buffer."""

    dtype: torch.dtype
    slots: list[_Slot] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # in elements
    numel: int = 0


@dataclass
class MoveStats:
    """What one offload or onload moved and how long it took."""

    bytes: int = 0
    seconds: float = 0.0
    copies: int = 0

    def as_dict(self, prefix: str) -> dict[str, float]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {f"{prefix}_s": round(self.seconds, 4), f"{prefix}_gb": round(self.bytes / 1e9, 4),
                f"{prefix}_gbps": round(gbps, 3)}


class TrainerOffload:
    """Moves a model's parameters and its optimizer's state to the host and back."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.device: torch.device | None = None  # where the state lives while onloaded
        self.offloaded = False
        self._host: dict[torch.dtype, torch.Tensor] = {}  # reused pinned buffers
        self._flat: dict[torch.dtype, torch.Tensor] = {}  # device buffers the views share
        self._groups: list[_Group] = []
        self._stream: torch.cuda.Stream | None = None
        self._pending: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.last_offload = MoveStats()
        self.last_onload = MoveStats()
        self._drain: threading.Thread | None = None

    # ---- layout ------------------------------------------------------------------------------

    def _slots(self) -> list[_Slot]:
        """Parameters, then every optimizer-state tensor on the model's device."""
        slots: list[_Slot] = []
        seen: set[int] = set()
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                slots.append(_Slot(p, None, None, p.data))
        device = slots[0].tensor.device if slots else torch.device("cpu")
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW's `step` is a CPU scalar: only tensors on the model's device move.
                if torch.is_tensor(value) and value.device == device and value.dim() > 0:
                    slots.append(_Slot(None, state, key, value))
        return slots

    @staticmethod
    def _group(slots: list[_Slot]) -> list[_Group]:
        groups: dict[torch.dtype, _Group] = {}
        for s in slots:
            g = groups.setdefault(s.tensor.dtype, _Group(s.tensor.dtype))
            align = max(1, ALIGN_BYTES // s.tensor.element_size())
            g.numel = -(-g.numel // align) * align
            g.slots.append(s)
            g.offsets.append(g.numel)
            g.numel += s.tensor.numel()
        return list(groups.values())

    def _is_flat(self, g: _Group) -> bool:
        """True when every tensor of the group is still the view onload made of the flat
        buffer (then one copy moves the whole group)."""
        flat = self._flat.get(g.dtype)
        if flat is None or flat.numel() != g.numel:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        return all(s.tensor.is_contiguous() and s.tensor.data_ptr() == base + off * size
                   for s, off in zip(g.slots, g.offsets, strict=True))

    def _host_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The pinned host buffer for `dtype`, allocated once (again only if it grew)."""
        buf = self._host.get(dtype)
        if buf is None or buf.numel() < numel:
            pin = self.device is not None and self.device.type == "cuda"
            buf = torch.empty(numel, dtype=dtype, pin_memory=pin)
            self._host[dtype] = buf
        return buf[:numel]

    def _side_stream(self) -> torch.cuda.Stream | None:
        if self.device is None or self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    # ---- moves -------------------------------------------------------------------------------

    @torch.no_grad()
    def offload(self, wait: bool = True) -> MoveStats:
        """State to the pinned host buffers, the device memory given back once copied.

        With `wait=False` the call returns once the copies are enqueued and a thread gives
        the memory back when they end (the engines generate meanwhile: their memory is
        already theirs); `onload` waits for that first."""
        if self.offloaded:
            return MoveStats()
        self.ready()
        self.onload_stats()
        t0 = time.perf_counter()
        slots = self._slots()
        if not slots:
            return MoveStats()
        self.device = slots[0].tensor.device
        groups = self._group(slots)
        stream = self._side_stream()
        stats = MoveStats()
        events = None
        if stream is not None:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            events[0].record(stream)
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for g in groups:
                host = self._host_buffer(g.dtype, g.numel)
                if self._is_flat(g):
                    host.copy_(self._flat[g.dtype], non_blocking=True)
                    stats.copies += 1
                else:
                    for s, off in zip(g.slots, g.offsets, strict=True):
                        host[off:off + s.tensor.numel()].view(s.tensor.shape).copy_(
                            s.tensor, non_blocking=True)
                        stats.copies += 1
                stats.bytes += g.numel * host.element_size()
        # The device tensors stay alive until the copy has read them; nothing else holds
        # them once the slots point at the host.
        draining = [s.tensor for g in groups for s in g.slots] + list(self._flat.values())
        for g in groups:
            host = self._host[g.dtype]
            for s, off in zip(g.slots, g.offsets, strict=True):
                s.tensor = host[off:off + s.tensor.numel()].view(s.tensor.shape)
                s.assign(s.tensor)
        for p in self.model.parameters():
            p.grad = None  # freed: the next train step zeroes gradients before using them
        self._groups = groups
        self._flat = {}
        self.offloaded = True
        self.last_offload = stats
        if stream is None:
            stats.seconds = time.perf_counter() - t0
            return stats
        events[1].record(stream)
        self._drain = threading.Thread(target=self._give_back, args=(draining, events),
                                       name="trainer-offload", daemon=True)
        del draining
        self._drain.start()
        if wait:
            self._wait_drained()
        return stats

    def _give_back(self, draining: list[torch.Tensor], events) -> None:
        """Once the copy to the host ended: free the device memory, record the copy's time."""
        events[1].synchronize()
        draining.clear()
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()
        self.last_offload.seconds = events[0].elapsed_time(events[1]) / 1e3

    def _wait_drained(self) -> None:
        if self._drain is not None:
            self._drain.join()
            self._drain = None

    @torch.no_grad()
    def onload(self, wait: bool = True) -> MoveStats:
        """State back to the device, one flat buffer per dtype. With `wait=False` the call
        returns once the copies are enqueued; `ready()` (called by every use of the model)
        makes the compute stream wait for them."""
        if not self.offloaded:
            return MoveStats()
        self._wait_drained()  # the host has every byte, the device memory is back
        t0 = time.perf_counter()
        stream = self._side_stream()
        stats = MoveStats()
        flats = {g.dtype: torch.empty(g.numel, dtype=g.dtype, device=self.device)
                 for g in self._groups}
        if stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            start.record(stream)
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for g in self._groups:
                flats[g.dtype].copy_(self._host[g.dtype][:g.numel], non_blocking=True)
                stats.copies += 1
                stats.bytes += g.numel * flats[g.dtype].element_size()
        for g in self._groups:
            flat = flats[g.dtype]
            for s, off in zip(g.slots, g.offsets, strict=True):
                s.assign(flat[off:off + s.tensor.numel()].view(s.tensor.shape))
        self._flat = flats
        self.offloaded = False
        self._groups = []
        self.last_onload = stats
        if stream is None:
            stats.seconds = time.perf_counter() - t0
            return stats
        end.record(stream)
        self._pending = (start, end)
        if wait:
            self.ready()
            self.onload_stats()
        return stats

    def ready(self) -> None:
        """Make the compute stream wait for an onload still copying (no host wait)."""
        if self._pending is not None and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def onload_stats(self) -> MoveStats:
        """The last onload, its seconds read from the copy's events (waits for the copy)."""
        if self._pending is not None:
            start, end = self._pending
            self._pending = None
            end.synchronize()
            self.last_onload.seconds = start.elapsed_time(end) / 1e3
        return self.last_onload

    @property
    def used(self) -> bool:
        """True once the state has been offloaded (the trainer shares its GPU)."""
        return bool(self._host)

    def host_bytes(self) -> int:
        """Bytes of pinned host memory held for the offload."""
        return sum(b.numel() * b.element_size() for b in self._host.values())


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
