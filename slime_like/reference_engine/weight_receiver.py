"""The per-TP-rank half of sglang's weight API: receives, loads, checksums (groups in
`weight_groups.py`, memory release and resume in `weight_memory.py`).

One `WeightReceiver` lives on every TP rank (rank 0 in the HTTP process, the others in
their own processes); the engine fans each operation (`rank_ops`) out to all of them and
`run` runs it by its type. Loading always
goes by HF parameter name, and every name and shape is checked before the first byte of a
parameter changes, so a bad request never leaves a half-written model.

A flattened bucket goes into one uint8 buffer and lands through a load plan cached per
bucket signature (`load_plan.py`): the parameters live in flat per-dtype arenas, so a
bucket is a few byte copies, with no per-tensor Python work after the first sync. On CUDA
the copy runs on a side stream and the caller gets a `Completion` as soon as it is
enqueued, so the receive of the next bucket can start while this one is unpacked. The
per-tensor format stays sglang's: each tensor received into a fresh tensor, then loaded.
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from slime_like.models.loading import iter_checkpoint
from slime_like.models.transformer import hf_named_parameters
from slime_like.protocol.buckets import TensorMeta, dtype_from_name
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from slime_like.protocol.io_struct import FLATTENED_BUCKET
from slime_like.protocol.ready_event import OpenedEvents
from slime_like.reference_engine import rank_ops as op
from slime_like.reference_engine.ipc_mappings import KEPT, SESSION, IpcMappings
from slime_like.reference_engine.load_plan import (
    LoadPlan,
    ParamArena,
    PlanCache,
    build_plan,
    copy_planned,
    copy_tensors,
    distributed_entries,
    request_key,
)
from slime_like.reference_engine.weight_delta import WeightDeltas
from slime_like.reference_engine.weight_groups import WeightGroups
from slime_like.reference_engine.weight_memory import Released, WeightMemory

logger = logging.getLogger(__name__)

_SKIP_CHECK_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis")
MAX_BUCKETS_IN_FLIGHT = 2
# A flattened bucket's signature, tensor by tensor (sglang's FlattenedTensorMetadata fields)
_METADATA_KEY = operator.attrgetter("name", "dtype", "shape", "start_idx", "end_idx")


class Completion:
    """The outcome of a rank operation; on CUDA its copy may still be running on a stream."""

    def __init__(self, ok: bool, message: str, event: Any = None, keep: Any = None):
        self.ok, self.message = ok, message
        self._event = event
        self._keep = keep  # buffers that must outlive the asynchronous copy

    def wait(self) -> tuple[bool, str]:
        """Block until the copy finished; (success, message)."""
        if self._event is not None:
            self._event.synchronize()
            self._event, self._keep = None, None
        return self.ok, self.message


class WeightReceiver(WeightGroups, WeightMemory, WeightDeltas):
    """Weight operations on one TP rank's copy of the model."""

    def __init__(self, model: torch.nn.Module, *, tp_rank: int, tp_size: int, device: torch.device,
                 model_path: str, load_format: str, seed: int = 0, cpu_backup: bool = False):
        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.model_path = model_path
        self.load_format = load_format
        self.seed = seed
        self.cpu_backup = cpu_backup
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.freeing: list[threading.Thread] = []  # groups left, being freed
        self.released: Released | None = None
        self._backup: list[torch.Tensor] = []  # pinned host segments, reused every release
        self._load_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Receive buffers whose copy may still run. Updates are answered before their copy
        # ends, so a fast sender could make the engine allocate one buffer per bucket; at
        # most MAX_BUCKETS_IN_FLIGHT stay outstanding (the oldest is waited for first).
        self._in_flight: collections.deque = collections.deque()
        self.plans = PlanCache()
        # Storages opened from tensor payloads (CUDA IPC, shared memory), kept for the
        # session or beyond as each request asks, so a buffer the sender sends again is
        # not opened again (torch's rebuild finds a live storage in its cache).
        self.mappings = IpcMappings()
        self._ready_events: OpenedEvents | None = None  # senders' CUDA IPC events, opened
        self._refresh_params()
        self.arena: ParamArena | None = None
        self._rehome(copy=True)
        # Every rank operation, by its type (the engine sends rank_ops messages).
        self._handlers: dict[type, Callable[[Any], Any]] = dict([
            (op.InitGroup, lambda o: self.init_group(o.master_address, o.master_port,
                                                     o.rank_offset, o.world_size, o.group_name,
                                                     o.backend)),
            (op.DestroyGroup, lambda o: self.destroy_group(o.group_name)),
            (op.ReceiveDistributed, lambda o: self.receive_distributed(
                list(o.names), list(o.dtypes), [list(s) for s in o.shapes], o.group_name,
                o.load_format)),
            (op.LoadTensorPayload, lambda o: self.load_tensor_payload(
                o.payload, o.load_format, o.mapping, o.ready_event)),
            (op.LoadFromDisk, lambda o: self.load_from_disk(o.model_path, o.load_format)),
            (op.Checksums, lambda o: self.checksums(
                list(o.skip_tensor_list) if o.skip_tensor_list is not None else None)),
            (op.ReleaseWeights, lambda o: self.release_weights()),
            (op.ResumeWeights, lambda o: self.resume_weights()),
            (op.EndSession, lambda o: self.end_session()),
        ])
        self._handlers.update(self.delta_handlers())

    def run(self, operation: op.RankOp) -> Any:
        """Run one rank operation (a `rank_ops` message) by its type."""
        handler = self._handlers.get(type(operation))
        if handler is None:
            raise TypeError(f"no rank operation {type(operation).__name__}; expected one of "
                            f"{sorted(t.__name__ for t in self._handlers)}")
        return handler(operation)

    def _refresh_params(self) -> None:
        self.params: dict[str, torch.nn.Parameter] = dict(hf_named_parameters(self.model))
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))

    def _rehome(self, copy: bool) -> None:
        """Move the parameters into flat arenas; cached plans pointed at the old storage."""
        self.arena = ParamArena(list(self.params.values()), copy=copy)
        self.plans.clear()

    # ---- loading ---------------------------------------------------------------------------

    def check_loadable(self, named: Iterable[tuple[str, torch.Size | tuple[int, ...]]]) -> list[str]:
        """Problems that would stop a load (unknown name, wrong shape), named per tensor."""
        problems = []
        for name, shape in named:
            if self.tied and name == "lm_head.weight":
                continue
            param = self.params.get(name)
            if param is None:
                problems.append(f"unknown parameter {name!r} for {self.model.config.architecture}")
            elif tuple(param.shape) != tuple(shape):
                problems.append(f"shape mismatch for {name!r}: model has {tuple(param.shape)}, "
                                f"got {tuple(shape)}")
        return problems

    def _copy_in(self, named: list[tuple[str, torch.Tensor]], stream: Any = None) -> None:
        """Copy tensors into the parameters of the same name (one foreach copy)."""
        pairs = [(self.params[n], t) for n, t in named if not (self.tied and n == "lm_head.weight")]
        if not pairs:
            return
        dsts = [p.data for p, _ in pairs]
        srcs = [t if t.device == p.device else t.to(p.device, non_blocking=True) for p, t in pairs]
        if stream is None:
            torch._foreach_copy_(dsts, srcs)
        else:
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dsts, srcs)

    def load_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Check every name and shape, then copy all tensors in."""
        self._check_named(named)
        self._copy_in(named)

    def _check_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        problems = self.check_loadable((n, t.shape) for n, t in named)
        if problems:
            raise ValueError("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    # ---- distributed -----------------------------------------------------------------------

    def receive_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                            group_name: str, load_format: str | None) -> Completion:
        """Join the trainer's broadcast(s) for one update request, then load by name.

        A receive that fails leaves the group at once (sglang keeps it): gloo relays a
        broadcast along a tree, so ranks below this one wait on it, not on the trainer, and
        only closing this rank's connections ends their wait before the group timeout. The
        trainer builds a fresh group for its next attempt either way.
        """
        if group_name not in self.groups:
            return Completion(False, f"Failed to receive weights: Group {group_name} not in "
                                     f"{list(self.groups)}. Please call `init_weights_update_group` first.")
        try:
            return self._receive_distributed(names, dtypes, shapes, group_name, load_format)
        except Exception as e:  # noqa: BLE001 - answered as sglang's 400 message
            message = f"Failed to receive weights: {e}"
            # The frames hold the pending works, which hold the group's connections open.
            traceback.clear_frames(e.__traceback__)
        self.abandon_group(group_name)
        return Completion(False, message)

    def _receive_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                             group_name: str, load_format: str | None) -> Completion:
        pg = self.groups[group_name]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes "
                             f"({len(shapes)}) must have the same length")
        if load_format == FLATTENED_BUCKET:
            plan = self._plan(request_key(names, dtypes, shapes))
            self._bound_in_flight()
            buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=0, group=pg, async_op=True).wait()
            if plan.problems:
                return self._refused(plan.problems)
            return self._load_async(lambda: copy_planned(plan, buffer), [buffer])
        if load_format not in (None, "direct"):
            raise ValueError(f"unknown load_format {load_format!r}; expected null or 'flattened_bucket'")
        # sglang's per-tensor path, kept as it is there: a fresh tensor per broadcast,
        # then a load by name.
        metas = [TensorMeta(n, dtype_from_name(d), tuple(int(x) for x in s))
                 for n, d, s in zip(names, dtypes, shapes, strict=True)]
        self._bound_in_flight()
        named = [(m.name, torch.empty(m.shape, dtype=m.dtype, device=self.device)) for m in metas]
        works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
        for w in works:
            w.wait()
        problems = self.check_loadable((n, t.shape) for n, t in named)
        if problems:
            return self._refused(problems)
        return self._load_async(lambda: self._copy_in(named), [t for _, t in named])

    def _plan(self, key: tuple) -> LoadPlan:
        """The cached plan of a distributed bucket's signature (built on its first sync)."""
        return self.plans.get(key) or self.plans.put(key, build_plan(
            distributed_entries(key), self.params, self.arena, tied=self.tied,
            architecture=self.model.config.architecture))

    @staticmethod
    def _refused(problems: list[str]) -> Completion:
        return Completion(False, f"Failed to update parameter online: {'; '.join(problems[:5])}. "
                                 "The full weights of the ModelRunner are partially updated. "
                                 "Please discard the whole weights.")

    def _load_async(self, copy, keep: list[torch.Tensor]) -> Completion:
        """Run `copy` (CPU: now; CUDA: on the load stream, after the receive) and say so."""
        if self._load_stream is None:
            copy()
            return Completion(True, "Succeeded to update parameter online.")
        # CUDA: the copy waits for the broadcast on a side stream; the caller may already
        # launch the next receive (its stream does not wait for this copy).
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._load_stream):
            copy()
        for t in keep:
            t.record_stream(self._load_stream)
        event = torch.cuda.Event()
        event.record(self._load_stream)
        self._in_flight.append(event)
        return Completion(True, "Succeeded to update parameter online.", event, keep)

    def _bound_in_flight(self) -> None:
        while len(self._in_flight) >= MAX_BUCKETS_IN_FLIGHT:
            self._in_flight.popleft().synchronize()

    def wait_loads(self) -> None:
        """Make the compute stream wait for every enqueued weight copy (before a forward)."""
        if self._load_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._load_stream)

    # ---- tensor (IPC) ----------------------------------------------------------------------

    def load_tensor_payload(self, payload: str | bytes, load_format: str | None,
                            mapping: str = SESSION, ready_event: str | None = None
                            ) -> tuple[bool, str]:
        """Deserialize this rank's payload (allowlisting unpickler) and load it; a flattened
        bucket's buffer stays open for `mapping` (`ipc_mappings.py`). With `ready_event`,
        the copies wait on the GPU for the sender's event (`protocol/ready_event.py`)."""
        from slime_like.protocol import tensor_payload
        from slime_like.protocol.tensor_payload import LocalSerializedTensor, deserialize

        t0, opened = time.perf_counter(), tensor_payload.cuda_rebuild_seconds
        if ready_event is not None:
            if self.device.type != "cuda":
                raise ValueError("ready_event was sent to an engine on "
                                 f"{self.device.type}: it is a CUDA IPC event handle")
            if self._ready_events is None:
                self._ready_events = OpenedEvents(self.device)
            self._ready_events.wait(ready_event)
        if mapping == KEPT and load_format in (None, "direct"):
            named = self.mappings.kept_payload(payload)
            if named is not None:  # the same share again: its tensors are open here
                self._copy_kept(named)
                return True, "Success"
        obj = deserialize(payload)
        if load_format == FLATTENED_BUCKET:
            if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
                raise ValueError("a flattened_bucket payload must be a dict with 'flattened_tensor' "
                                 f"and 'metadata', got {type(obj).__name__}")
            t1 = time.perf_counter()
            flat = obj["flattened_tensor"]
            runs, t2 = self._load_flattened(flat, obj["metadata"])
            reused = self.mappings.hold(flat, mapping) if isinstance(flat, torch.Tensor) else False
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("flattened update on rank %d: %d bytes of payload unpickled in "
                             "%.2f ms (opening the CUDA IPC tensor %.2f ms, %s), plan %.2f ms, "
                             "%d copies done in %.2f ms; mapping kept for: %s", self.tp_rank,
                             len(payload), (t1 - t0) * 1e3,
                             (tensor_payload.cuda_rebuild_seconds - opened) * 1e3,
                             "already open" if reused else "opened", (t2 - t1) * 1e3, runs,
                             (time.perf_counter() - t2) * 1e3, mapping)
            return True, "Success"
        if load_format in (None, "direct"):
            if not isinstance(obj, list | tuple):
                raise ValueError(f"a tensor payload must be a list of (name, tensor), got {type(obj).__name__}")
            named = []
            for item in obj:
                if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
                    raise ValueError("every payload entry must be a (name, tensor) pair")
                name, value = item
                if isinstance(value, LocalSerializedTensor):
                    value = value.get(self.tp_rank)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"payload entry {name!r} is a {type(value).__name__}, not a tensor")
                named.append((name, value))
        else:
            raise ValueError(f"unknown load_format {load_format!r}; expected null, 'direct' or "
                             "'flattened_bucket' (custom loaders are not supported)")
        if mapping != KEPT:
            self.load_named(named)
            return True, "Success"
        self._check_named(named)
        self._copy_kept(named)
        self.mappings.keep_payload(payload, named)
        return True, "Success"

    def _copy_kept(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy a kept payload's tensors (the trainer's own parameters, mapped here) into
        ours; done when this returns, since the trainer writes them again once we answer.
        (`load_plan.copy_tensors`)."""
        pairs = [(self.params[n].data, t) for n, t in named
                 if not (self.tied and n == "lm_head.weight")]
        copy_tensors([d for d, _ in pairs], [t for _, t in pairs])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _load_flattened(self, flat: torch.Tensor, metadata: list) -> tuple[int, float]:
        """A flattened payload through the cached plan; done when this returns. Returns
        the plan's copy count and when the copies started (for the debug log).

        Done, not only enqueued: a sender may reuse the buffer once we answer. (A received
        IPC storage that is dropped synchronizes the same way in torch's deleter.)
        """
        if flat.dtype != torch.uint8:
            raise ValueError(f"a flattened bucket must be uint8, got {flat.dtype}")
        # The signature is built at C speed (a 3B model's 255 tensors: tens of µs); every
        # check on its values runs once, when its plan is built.
        key = tuple(map(_METADATA_KEY, metadata))
        plan = self.plans.get(("payload", key)) or self.plans.put(("payload", key), build_plan(
            key, self.params, self.arena, tied=self.tied,
            architecture=self.model.config.architecture))
        if plan.problems:
            raise ValueError("; ".join(plan.problems[:5]))
        if flat.numel() < plan.nbytes:
            raise ValueError(f"flattened bucket holds {flat.numel()} bytes, layout needs "
                             f"{plan.nbytes}")
        if flat.device != self.device:
            flat = flat.to(self.device)
        started = time.perf_counter()
        copy_planned(plan, flat)
        if flat.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return len(plan.runs) + len(plan.converts), started

    def end_session(self) -> int:
        """At end_weight_update: close every mapping the session opened, except the buffers
        it asked to keep (`keep_ipc_mapping`); a kept buffer it did not send again is closed
        too (the trainer's buffer moved). Returns how many stay open.

        So a sender that frees a buffer it sent (an offloading trainer's flat weights, which
        it never asks to keep) frees the memory for real: torch keeps an exported block
        until every importer let go of it. Opening a mapping costs well under a millisecond
        (a 12 GB buffer: 0.9 ms against 0.2 ms for one kept open, on an H200).
        """
        return self.mappings.end_session()

    # ---- disk ------------------------------------------------------------------------------

    def load_from_disk(self, model_path: str, load_format: str | None) -> tuple[bool, str]:
        """Load a safetensors checkpoint; on any failure roll back to the weights before."""
        fmt = load_format or self.load_format
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            if fmt == "dummy":
                from slime_like.models.loading import init_dummy_weights

                init_dummy_weights(self.model, self.seed)
            elif fmt in ("auto", "safetensors"):
                seen: set[str] = set()
                for name, tensor in iter_checkpoint(model_path):
                    self.load_named([(name, tensor)])
                    seen.add(name)
                missing = [n for n in self.params if n not in seen]
                if missing:
                    raise ValueError(f"checkpoint lacks parameters {missing[:5]}")
            else:
                raise ValueError(f"load_format {fmt!r} is not supported (auto, safetensors, dummy)")
        except Exception as e:  # noqa: BLE001 - rolled back and answered success=false
            self._copy_in(list(backup.items()))
            return False, (f"Failed to update weights: {e}.\nRolling back to original weights.")
        self.model_path = model_path
        return True, "Succeeded to update model weights."

    # ---- inspection ------------------------------------------------------------------------

    def checksums(self, skip_tensor_list: list[str] | None = None) -> dict:
        """One entry of /weights_checker's `ranks` for this TP rank."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        skip = tuple(skip_tensor_list or ())
        sums = {n: tensor_checksum(p) for n, p in self.params.items()
                if not any(s in n for s in _SKIP_CHECK_PATTERNS + skip)}
        return {
            "checksums": sums,
            "per_gpu_checksum": overall_checksum(sums),
            "ipc_mappings": self.mappings.stats(),  # ours: what this rank keeps mapped
            # ours: tensor loads that waited for the sender's ready event on the GPU
            "ready_events_waited": self._ready_events.waited if self._ready_events else 0,
            "parallelism_info": [{"role": "target", "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                                  "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                                  "rank": self.tp_rank, "size": self.tp_size}],
        }

    def get_weights_by_name(self, name: str, truncate_size: int) -> list | None:
        """First `truncate_size` rows of a parameter as float32 lists, or None."""
        param = self.params.get(name)
        if param is None and self.tied and name == "lm_head.weight":
            param = self.params.get("model.embed_tokens.weight")
        if param is None:
            return None
        return param.detach()[:truncate_size].float().cpu().tolist()

    def describe(self) -> dict:
        """Rank state for diagnostics."""
        return {"tp_rank": self.tp_rank, "groups": sorted(self.groups), "model_path": self.model_path,
                "released": self.released is not None, "time": time.time()}
