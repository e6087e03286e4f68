"""Tensor payloads for `/update_weights_from_tensor`, compatible with sglang both ways.

The wire form is sglang's `MultiprocessingSerializer`: base64 of a `ForkingPickler` pickle,
so tensors travel as handles (CUDA IPC on GPU, shared memory on CPU), never as bytes.

- `serialize` writes our metadata classes under sglang's class paths (a real engine's
  `SafeUnpickler` allows those paths and nothing of ours) without importing sglang: a
  pickler whose `save_global` writes the sglang name for the handful of objects in
  `_WIRE_NAMES`. CUDA tensors carry the device UUID instead of its index, as sglang's
  patched reductions do, so sender and engine may see different `CUDA_VISIBLE_DEVICES`.
  CPU storages are shared by shm file name: the default fd passing authenticates with the
  multiprocessing authkey, which two unrelated processes (trainer, engine) do not share.
- `deserialize` accepts exactly the globals sglang's `SafeUnpickler` accepts, maps sglang's
  weight-sync classes to ours, and raises `UnsafePayloadError` for anything else.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reducers with ForkingPickler)
from torch.multiprocessing import reductions

from slime_like.errors import UnsafePayloadError
from slime_like.protocol.buckets import FlattenedTensorBucket, FlattenedTensorMetadata

SGLANG_TENSOR_BUCKET = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
SGLANG_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
SGLANG_PATCH_TORCH = "sglang.srt.utils.patch_torch"
#: ours, in /server_info: the engine keeps a plain payload sent with `keep_ipc_mapping` and
#: recognizes the same bytes sent again (reference_engine/ipc_mappings.py)
KEPT_PAYLOADS_KEY = "kept_tensor_payloads"


@dataclass
class LocalSerializedTensor:
    """One tensor as per-TP-rank payloads (sglang's class of this name): rank r reads values[r]."""

    values: list[bytes]

    def get(self, rank: int) -> Any:
        return deserialize(self.values[rank])


# ---- CUDA tensors by device UUID ----------------------------------------------------------

_CUDA_DEVICE_ARG = 6  # position of the device in torch's rebuild_cuda_tensor arguments
_uuid_to_index: dict[str, int] = {}


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    if not _uuid_to_index:
        _uuid_to_index.update({_device_uuid(i): i for i in range(torch.cuda.device_count())})
    if device not in _uuid_to_index:
        raise UnsafePayloadError(f"CUDA tensor payload names device {device}, which this "
                                 f"process cannot see (visible: {sorted(_uuid_to_index)})")
    return _uuid_to_index[device]


def _torch_rebuild_cuda_tensor() -> Callable:
    # sglang's monkey patch (if applied in this process) keeps torch's original aside.
    return getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)


#: seconds the CUDA IPC rebuilds of this process took (the engine's debug log reads it)
cuda_rebuild_seconds = 0.0


def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """Open a CUDA IPC tensor whose device is given by UUID (or, from old senders, index)."""
    global cuda_rebuild_seconds
    start = time.perf_counter()
    args = list(args)
    args[_CUDA_DEVICE_ARG] = _device_index(args[_CUDA_DEVICE_ARG])
    tensor = _torch_rebuild_cuda_tensor()(*args)
    cuda_rebuild_seconds += time.perf_counter() - start
    return tensor


# ---- pickling -----------------------------------------------------------------------------

# Our objects, and the global name each is written under on the wire.
_WIRE_NAMES: dict[int, tuple[str, str]] = {
    id(FlattenedTensorMetadata): (SGLANG_TENSOR_BUCKET, "FlattenedTensorMetadata"),
    id(FlattenedTensorBucket): (SGLANG_TENSOR_BUCKET, "FlattenedTensorBucket"),
    id(LocalSerializedTensor): (SGLANG_WEIGHT_UPDATER, "LocalSerializedTensor"),
    id(rebuild_cuda_tensor): (SGLANG_PATCH_TORCH, "_rebuild_cuda_tensor_modified"),
}


def _reduce_tensor(tensor: torch.Tensor):
    fn, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = list(args)
        if isinstance(args[_CUDA_DEVICE_ARG], int):
            args[_CUDA_DEVICE_ARG] = _device_uuid(args[_CUDA_DEVICE_ARG])
        return rebuild_cuda_tensor, tuple(args)
    return fn, args


def _reduce_cpu_storage(storage: torch.UntypedStorage):
    """Share by shm file name: any process on the host can open it, no authkey needed."""
    if storage.device.type != "cpu" or storage.size() == 0:
        return reductions.reduce_storage(storage)
    try:
        manager, handle, size = storage._share_filename_cpu_()
    except RuntimeError:  # already shared by fd (someone else pickled it first)
        return reductions.reduce_storage(storage)
    storage._shared_incref()  # the receiver's rebuild drops this reference
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _Pickler(pickle._Pickler):
    """ForkingPickler's reducers plus sglang global names for our weight-sync classes.

    The pure-Python pickler is used because only its `save_global` can be overridden;
    payloads hold handles and metadata, never tensor bytes, so its speed does not matter.
    """

    def __init__(self, file: io.BytesIO, protocol: int = 4):
        super().__init__(file, protocol=protocol)
        # The base class dispatches plain functions straight to its own save_global, which
        # would bypass ours and put our module path for rebuild_cuda_tensor on the wire.
        self.dispatch = {**pickle._Pickler.dispatch, types.FunctionType: type(self).save_global}
        self.dispatch_table = dict(ForkingPickler._copyreg_dispatch_table)
        self.dispatch_table.update(ForkingPickler._extra_reducers)
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = _reduce_tensor
        self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage

    def save_global(self, obj: Any, name: str | None = None) -> None:
        wire = _WIRE_NAMES.get(id(obj))
        if wire is None:
            return super().save_global(obj, name)
        module, qualname = wire
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def serialize_bytes(obj: Any) -> bytes:
    """The raw pickle of `obj` (tensors as IPC / shared-memory handles)."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def serialize(obj: Any) -> str:
    """base64 of `serialize_bytes(obj)`: one entry of `serialized_named_tensors`."""
    return base64.b64encode(serialize_bytes(obj)).decode("ascii")


class FlattenedPayloads:
    """`serialize({"flattened_tensor": t, "metadata": m})`, with m's pickle made once.

    The metadata of a bucket is the same every sync, and pickling it with the pure-Python
    pickler costs ~20 µs per tensor (7 ms for a 367-tensor request). The pieces are pickled
    at protocol 3 (no frames) and joined into one dict: the same objects as `serialize`
    gives, for any unpickler, sglang's included. Only the metadata piece keeps a memo, so
    its memo slots cannot collide with another piece's; with it, the class, `torch.Size` and
    each dtype are written once per request rather than once per tensor, which makes the
    payload a third of the size and the engine's unpickling several times faster.
    """

    _PROTO, _EMPTY_DICT, _MARK, _SETITEMS, _STOP = b"\x80\x03", b"}", b"(", b"u", b"."

    def __init__(self, max_cached: int = 256):
        self._metadata: dict[Any, bytes] = {}
        self._max = max_cached
        self._keys = {k: self._piece(k) for k in ("flattened_tensor", "metadata")}

    @classmethod
    def _piece(cls, obj: Any, memo: bool = False) -> bytes:
        buf = io.BytesIO()
        pickler = _Pickler(buf, protocol=3)
        pickler.fast = not memo  # without memo the piece refers to nothing outside itself
        pickler.dump(obj)
        raw = buf.getvalue()
        assert raw.startswith(cls._PROTO) and raw.endswith(cls._STOP)
        return raw[len(cls._PROTO):-len(cls._STOP)]

    def serialize(self, flat: torch.Tensor, key: Any,
                  metadata: Callable[[], list[FlattenedTensorMetadata]]) -> str:
        """base64 payload; `key` identifies the metadata, which `metadata()` builds on the
        first sight of a key (equal keys, equal metadata)."""
        meta = self._metadata.get(key)
        if meta is None:
            if len(self._metadata) >= self._max:
                self._metadata.clear()
            meta = self._metadata[key] = self._piece(metadata(), memo=True)
        raw = b"".join((self._PROTO, self._EMPTY_DICT, self._MARK,
                        self._keys["flattened_tensor"], self._piece(flat),
                        self._keys["metadata"], meta, self._SETITEMS, self._STOP))
        return base64.b64encode(raw).decode("ascii")


# ---- unpickling ---------------------------------------------------------------------------

def _names(module: str, *names: str) -> set[tuple[str, str]]:
    return {(module, n) for n in names}


_INT_FLOAT_TYPES = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int",
                    "Long", "Short")
# dtype objects are plain data; every one this torch defines is allowed (sglang lists them).
_DTYPES = [n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)]
_CPU_STORAGES = [f"{t}Storage" for t in _INT_FLOAT_TYPES] + [
    "ComplexDoubleStorage", "ComplexFloatStorage", "QInt32Storage", "QInt8Storage",
    "QUInt2x4Storage", "QUInt4x2Storage", "QUInt8Storage"]
_CUDA_STORAGES = [f"{t}Storage" for t in _INT_FLOAT_TYPES] + [
    "ComplexDoubleStorage", "ComplexFloatStorage"]
_LEGACY_TENSORS = [f"{t}Tensor" for t in _INT_FLOAT_TYPES]
_SPARSE_TENSORS = [f"{t}Tensor" for t in _INT_FLOAT_TYPES if t != "Bool"]

# The globals sglang 0.5.23's SafeUnpickler allows and that resolve to themselves here.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    _names("builtins", "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset",
           "int", "list", "range", "set", "slice", "str", "tuple")
    | _names("collections", "OrderedDict", "defaultdict", "deque", "Counter")
    | _names("copyreg", "__newobj__", "__newobj_ex__")
    | _names("functools", "partial")
    | _names("itertools", "chain", "repeat")
    | _names("multiprocessing.reduction", "_rebuild_partial", "_rebuild_socket")
    | _names("multiprocessing.resource_sharer", "DupFd")
    | _names("types", "SimpleNamespace")
    | _names("_codecs", "encode")
    | _names("torch", "Tensor", "Size", "device", "dtype", "UntypedStorage", *_LEGACY_TENSORS,
             *_DTYPES, *_CPU_STORAGES, "per_tensor_affine", "per_tensor_symmetric",
             "per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams")
    | _names("torch.cuda", *_LEGACY_TENSORS, *_CUDA_STORAGES)
    | _names("torch.sparse", *_SPARSE_TENSORS)
    | _names("torch.cuda.sparse", *_SPARSE_TENSORS)
    | _names("torch.nn.parameter", "Parameter")
    | _names("torch.serialization", "_get_layout")
    | _names("torch._utils", "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
             "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
             "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
             "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
             "_rebuild_device_tensor_from_cpu_tensor")
    | _names("torch._tensor", "_rebuild_from_type_v2")
    | _names("torch.storage", "UntypedStorage", "_UntypedStorage", "TypedStorage")
    | _names("torch.multiprocessing.reductions", "rebuild_tensor", "rebuild_meta_tensor",
             "rebuild_nested_tensor", "rebuild_sparse_coo_tensor",
             "rebuild_sparse_compressed_tensor", "rebuild_storage_fd",
             "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
             "rebuild_typed_storage_child")
)


def _load_storage_from_bytes(data: bytes) -> torch.UntypedStorage | torch.TypedStorage:
    """torch's `_load_from_bytes` runs an unrestricted torch.load; use the weights-only one."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.UntypedStorage | torch.TypedStorage):
        raise UnsafePayloadError(f"expected a torch storage in the payload, got "
                                 f"{type(storage).__name__}", "torch.storage._load_from_bytes")
    return storage


# sglang class paths (and torch functions sglang patches) -> our objects.
MAPPED_GLOBALS: dict[tuple[str, str], Any] = {
    (SGLANG_TENSOR_BUCKET, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    (SGLANG_TENSOR_BUCKET, "FlattenedTensorBucket"): FlattenedTensorBucket,
    (SGLANG_WEIGHT_UPDATER, "LocalSerializedTensor"): LocalSerializedTensor,
    (SGLANG_MODEL_RUNNER, "LocalSerializedTensor"): LocalSerializedTensor,
    (SGLANG_PATCH_TORCH, "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
}

# Allowed by sglang but meaningless for a weight payload here: refused with this reason.
NOT_WEIGHT_PAYLOAD: dict[tuple[str, str], str] = {
    **dict.fromkeys(
        [("sglang.srt.managers.io_struct", "GenerateReqInput"),
         ("sglang.srt.managers.io_struct", "EmbeddingReqInput"),
         ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
         ("sglang.srt.managers.schedule_batch", "Modality"),
         ("sglang.srt.multimodal.modality", "Modality")],
        "an sglang request object, not part of a weight payload"),
    **dict.fromkeys(
        [("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"),
         (SGLANG_PATCH_TORCH, "_rebuild_npu_tensor_modified")],
        "an Ascend NPU tensor, which this engine cannot open"),
}


class SafeUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals; sglang's weight-sync class paths map to ours."""

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in MAPPED_GLOBALS:
            return MAPPED_GLOBALS[key]
        if key in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        reason = NOT_WEIGHT_PAYLOAD.get(key, "not on the allowlist")
        raise UnsafePayloadError(
            f"Blocked unsafe global ({module}.{name}) during pickle deserialization: {reason}",
            f"{module}.{name}")


def _raw_pickle(data: str | bytes | bytearray | memoryview) -> bytes:
    """Accept base64 text, base64 bytes or raw pickle bytes (sglang 0.5.23 accepts all three)."""
    if isinstance(data, str):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise UnsafePayloadError(f"tensor payload is not valid base64: {e}") from e
    data = bytes(data)
    if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UnsafePayloadError(
            f"tensor payload is neither a pickle nor base64: {e}") from e


def deserialize(data: str | bytes | bytearray | memoryview) -> Any:
    """Rebuild a payload made by `serialize` or by sglang's `MultiprocessingSerializer`."""
    raw = _raw_pickle(data)
    try:
        return SafeUnpickler(io.BytesIO(raw)).load()
    except UnsafePayloadError:
        raise
    except AuthenticationError as e:
        raise UnsafePayloadError(
            "the payload shares a CPU tensor by file descriptor, which only a process holding "
            "the sender's multiprocessing authkey can receive; serialize CPU tensors with "
            "torch.multiprocessing.set_sharing_strategy('file_system') or with "
            "slime_like.protocol.tensor_payload.serialize") from e
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as e:
        raise UnsafePayloadError(f"malformed tensor payload: {type(e).__name__}: {e}") from e
    except (RuntimeError, OSError) as e:  # e.g. the sender freed its shared memory
        raise UnsafePayloadError(
            f"tensor payload could not be opened: {type(e).__name__}: {e}") from e
