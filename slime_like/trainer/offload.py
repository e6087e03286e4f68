"""Trainer state off the GPU and back at the host link's limit (--offload-train).

The parameters and the optimizer state (AdamW's two moments) go to pinned host buffers that
are allocated once, one per dtype, and reused every step; gradients are freed, not copied
(each train step zeroes them before it uses them). Onload puts each dtype's state back into
one flat device buffer and makes every tensor a view of it (parameters first, in the
model's order), so from the second step on an offload is one device-to-host copy per dtype
and an onload two host-to-device copies per dtype, batched by storage, not by tensor: the
parameters first, then the optimizer state. Copies run on a side stream; `onload` returns
once they are enqueued. `ready_weights()` makes the compute stream wait for the parameters
only (a forward and backward need nothing else), `ready()` for everything (the optimizer
step), so the optimizer state's copy runs under the forward and backward.

`keep_weights` (--no-offload-train-weights) leaves the parameters on the GPU: only the
optimizer state moves. The parameters then live in one flat device buffer per dtype that
survives every offload, so a colocated weight sync sends them in place (one request, no
pack copy, an IPC mapping the engine opened once). That costs one copy of the weights in
device memory while the engines generate.

A memory saver that keeps virtual addresses (torch_memory_saver) would avoid the re-view,
but it needs an LD_PRELOAD'd allocator hook; plain pinned copies run everywhere and already
reach the link's limit (docs/COLOCATE.md has the figures).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

# Every tensor starts on a 16-byte boundary of its flat buffer (vector loads stay aligned).
# No wider: parameters whose sizes are multiples of 16 bytes then lie back to back, in the
# sync's order, so a weight sync sends them straight from the flat buffer (no pack copy).
ALIGN_BYTES = 16
# Offloads between fresh resident weight buffers: torch wraps a storage in one more
# reference-counting layer every time it is shared over CUDA IPC (each sync shares it).
WEIGHTS_RENEW_EVERY = 64


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
        self._weights: dict[torch.dtype, torch.Tensor] = {}  # resident parameters (keep_weights)
        self._weight_offloads = 0
        self._groups: list[_Group] = []
        self._stream: torch.cuda.Stream | None = None
        # An onload still copying: (start, parameters copied, everything copied).
        self._pending: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None
        self.last_offload = MoveStats()
        self.last_onload = MoveStats()
        self._drain: threading.Thread | None = None

    # ---- layout ------------------------------------------------------------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        return [p for p in self.model.parameters() if not (id(p) in seen or seen.add(id(p)))]

    def _slots(self, keep_weights: bool = False) -> list[_Slot]:
        """Parameters (unless kept), then every optimizer-state tensor on the model's
        device."""
        params = self._params()
        slots = [] if keep_weights else [_Slot(p, None, None, p.data) for p in params]
        device = params[0].device if params else torch.device("cpu")
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

    def _is_flat(self, g: _Group, flats: dict[torch.dtype, torch.Tensor] | None = None) -> bool:
        """True when every tensor of the group is still the view onload made of the flat
        buffer (then one copy moves the whole group)."""
        flat = (self._flat if flats is None else flats).get(g.dtype)
        if flat is None or flat.numel() != g.numel:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        return all(s.tensor.is_contiguous() and s.tensor.data_ptr() == base + off * size
                   for s, off in zip(g.slots, g.offsets, strict=True))

    def _keep_weights_flat(self) -> None:
        """Make the parameters views of one resident flat buffer per dtype, in the model's
        order, once (again every WEIGHTS_RENEW_EVERY offloads: a fresh storage)."""
        groups = self._group([_Slot(p, None, None, p.data) for p in self._params()])
        self._weight_offloads += 1
        renew = self._weight_offloads % WEIGHTS_RENEW_EVERY == 0
        if not renew and all(self._is_flat(g, self._weights) for g in groups):
            return
        weights: dict[torch.dtype, torch.Tensor] = {}
        for g in groups:
            weights[g.dtype] = torch.empty(g.numel, dtype=g.dtype, device=g.slots[0].tensor.device)
            _view_into(g, weights[g.dtype], copy=True)
        self._weights = weights

    def _moments_to_come(self) -> int:
        """Tensors per parameter the optimizer adds at its first step (Adam's and AdamW's
        two moments, three with amsgrad); 0 once it has state or for other optimizers."""
        if self.optimizer.state or not isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            return 0
        return 3 if any(g.get("amsgrad") for g in self.optimizer.param_groups) else 2

    def _host_buffer(self, dtype: torch.dtype, numel: int, reserve: int = 0) -> torch.Tensor:
        """The pinned host buffer for `dtype`, allocated once (again only if it grew), with
        room for `reserve` elements: page-locking takes seconds per ten GB, and a buffer
        replaced stays pinned in torch's host cache for the rest of the run."""
        buf = self._host.get(dtype)
        if buf is None or buf.numel() < numel:
            pin = self.device is not None and self.device.type == "cuda"
            buf = torch.empty(max(numel, reserve), dtype=dtype, pin_memory=pin)
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
    def offload(self, wait: bool = True, keep_weights: bool = False) -> MoveStats:
        """State to the pinned host buffers, the device memory given back once copied.

        With `wait=False` the call returns once the copies are enqueued and a thread gives
        the memory back when they end (the engines generate meanwhile: their memory is
        already theirs); `onload` waits for that first. `keep_weights`: the parameters stay
        on the device, in a flat buffer that outlives the offload; only the optimizer state
        moves."""
        if self.offloaded:
            return MoveStats()
        self.ready()
        self.onload_stats()
        t0 = time.perf_counter()
        if keep_weights:
            self._keep_weights_flat()
        else:
            self._weights = {}  # the parameters move with the rest (and from it, next time)
        slots = self._slots(keep_weights)
        if not slots:
            return MoveStats()
        self.device = slots[0].tensor.device
        groups = self._group(slots)
        moments = 0 if keep_weights else self._moments_to_come()
        stream = self._side_stream()
        stats = MoveStats()
        events = None
        if stream is not None:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            events[0].record(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for g in groups:
                # Before the first train step only the weights move; room for the moments
                # the optimizer is about to add, so the next offload reuses this buffer.
                reserve = (1 + moments) * (g.numel + len(g.slots) * ALIGN_BYTES) if moments else 0
                host = self._host_buffer(g.dtype, g.numel, reserve)
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
        """State back to the device, one flat buffer per dtype: the parameters' part first,
        then the optimizer state's. With `wait=False` the call returns once the copies are
        enqueued; `ready_weights()` (a forward) and `ready()` (the optimizer step) make the
        compute stream wait for them."""
        if not self.offloaded:
            return MoveStats()
        self._wait_drained()  # the host has every byte, the device memory is back
        t0 = time.perf_counter()
        stream = self._side_stream()
        stats = MoveStats()
        flats = {g.dtype: torch.empty(g.numel, dtype=g.dtype, device=self.device)
                 for g in self._groups}
        if stream is not None:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            events[0].record(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ranges = [(g, 0, _weights_end(g)) for g in self._groups]
            ranges += [(g, end, g.numel) for g, _, end in list(ranges)]
            for i, (g, start, end) in enumerate(ranges):
                if i == len(self._groups) and stream is not None:
                    events[1].record(stream)  # every parameter is back
                if end > start:
                    flats[g.dtype][start:end].copy_(self._host[g.dtype][start:end],
                                                    non_blocking=True)
                    stats.copies += 1
            stats.bytes = sum(g.numel * flats[g.dtype].element_size() for g in self._groups)
        for g in self._groups:
            _view_into(g, flats[g.dtype])
        self._flat = flats
        self.offloaded = False
        self._groups = []
        self.last_onload = stats
        if stream is None:
            stats.seconds = time.perf_counter() - t0
            return stats
        events[2].record(stream)
        self._pending = (events[0], events[1], events[2])
        if wait:
            self.ready()
            self.onload_stats()
        return stats

    def ready_weights(self) -> None:
        """Make the compute stream wait for the parameters of an onload still copying (a
        forward and backward need nothing else; the optimizer state may still be copying)."""
        if self._pending is not None and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending[1])

    def ready(self) -> None:
        """Make the compute stream wait for an onload still copying (no host wait)."""
        if self._pending is not None and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def onload_stats(self) -> MoveStats:
        """The last onload, its seconds read from the copy's events (waits for the copy)."""
        if self._pending is not None:
            start, _, end = self._pending
            self._pending = None
            end.synchronize()
            self.last_onload.seconds = start.elapsed_time(end) / 1e3
        return self.last_onload

    def weights_stay(self) -> bool:
        """Whether the parameters keep their storage until after the next offload: so a
        colocated engine may keep the buffer a sync sends in place mapped until the next
        sync (`weights/tensor.py`). Only the weights kept on the device in their flat
        buffer (`keep_weights`) are vouched for, except before the offload that renews
        that buffer; otherwise False: offloaded with the rest, the next offload frees them,
        and before any offload it may move them (or none may come: the engines then open
        them again every sync, as they did before mappings were kept)."""
        if not self._weights:
            return False
        return (self._weight_offloads + 1) % WEIGHTS_RENEW_EVERY != 0

    @property
    def used(self) -> bool:
        """True once the state has been offloaded (the trainer shares its GPU)."""
        return bool(self._host)

    def host_bytes(self) -> int:
        """Bytes of pinned host memory held for the offload."""
        return sum(b.numel() * b.element_size() for b in self._host.values())


def _view_into(g: _Group, flat: torch.Tensor, copy: bool = False) -> None:
    """Make every tensor of the group its view of `flat` (copying its bytes in first)."""
    for s, off in zip(g.slots, g.offsets, strict=True):
        view = flat[off:off + s.tensor.numel()].view(s.tensor.shape)
        if copy:
            view.copy_(s.tensor)
        s.assign(view)


def _weights_end(g: _Group) -> int:
    """Where the group's parameters end in its flat buffer (they come first)."""
    return max((off + s.tensor.numel() for s, off in zip(g.slots, g.offsets, strict=True)
                if s.param is not None), default=0)
