"""A WeightSync's set-up, before any byte moves: its engines as sessions, the transport its
settings name, the bucket plan, and the engines' models checked against the trainer's.

None of it runs while a bucket travels: it is what `attach` (and the first `update`) does
once, and again only when the engines or the registered metadata change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from slime_like.engine.address import EngineAddress
from slime_like.engine.fanout import on_all
from slime_like.engine.session import EngineSession
from slime_like.protocol import modes
from slime_like.protocol.buckets import Bucket, TensorMeta, dtype_from_name, plan_buckets
from slime_like.weights.handshake import check_same_metadata, engine_model_metadata
from slime_like.weights.sync_config import WeightSyncConfig
from slime_like.weights.transport import Transport

EngineLike = EngineSession | EngineAddress | str | tuple[str, int] | Mapping


def session_for(engine: EngineLike) -> EngineSession:
    """A session of this process for the engine (a session from elsewhere arrives as its
    address, and starts with nothing done)."""
    if isinstance(engine, EngineSession):
        return engine
    if isinstance(engine, EngineAddress):
        return EngineSession(engine)
    if isinstance(engine, str):
        return EngineSession(EngineAddress(engine))
    if isinstance(engine, Mapping):
        return EngineSession(EngineAddress(engine["url"], int(engine.get("tp_size", 1))))
    url, tp = engine
    return EngineSession(EngineAddress(url, int(tp)))


def metadata_list(metadata: Any) -> list[TensorMeta]:
    """TensorMetas from a list of them or from {name: (dtype, shape)} (get_model_metadata)."""
    if isinstance(metadata, Mapping):
        out = []
        for name, (dtype, shape) in metadata.items():
            dt = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(str(dtype))
            out.append(TensorMeta(name, dt, tuple(int(d) for d in shape)))
        return out
    return list(metadata)


def pack_device(config: WeightSyncConfig) -> torch.device:
    """Where buckets are packed: the configured device, else this process's GPU, else CPU."""
    if config.device:
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            # "cuda" names the current GPU; with its index it compares equal to the
            # parameters' device, so flat trainer buffers go without a pack copy.
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available() and config.backend != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_transport(config: WeightSyncConfig) -> Transport:
    """The transport the settings name (imported on demand: each pulls its own stack)."""
    if config.update_weight_mode == "delta":
        from slime_like.weights.delta_transport import make_delta_transport

        return make_delta_transport(config, pack_device(config))
    if config.transport is modes.Transport.DISTRIBUTED:
        from slime_like.weights.distributed import DistributedTransport

        return DistributedTransport(
            device=pack_device(config), bucket_bytes=int(config.update_weight_buffer_size),
            load_format=config.load_format, backend=config.backend,
            master_address=config.master_address, master_port=config.master_port,
            group_timeout_s=config.group_timeout_s)
    if config.transport is modes.Transport.TENSOR:
        from slime_like.weights.tensor import TensorTransport

        return TensorTransport(device=pack_device(config),
                               bucket_bytes=int(config.update_weight_buffer_size))
    from slime_like.weights.disk import DiskTransport

    return DiskTransport(directory=config.disk_dir, model_dir=config.model_dir)


class BucketPlan:
    """The buckets of the registered metadata, planned once and reused while it is equal."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self._plan: tuple[list[TensorMeta], list[Bucket]] | None = None

    def __call__(self, metas: list[TensorMeta]) -> list[Bucket]:
        if self._plan is None or (self._plan[0] is not metas and self._plan[0] != metas):
            self._plan = (metas, plan_buckets(metas, self.bucket_bytes))
        elif self._plan[0] is not metas:
            self._plan = (metas, self._plan[1])  # equal: the next sync compares identities
        return self._plan[1]


class ModelChecks:
    """Each engine's own model (names, dtypes, shapes), read once per engine and model path,
    against which the trainer's metadata is checked before any engine is paused."""

    def __init__(self, warn_once: Callable[[str, str], None]):
        self.warn_once = warn_once
        self._expected: dict[tuple[str, str], list[TensorMeta] | None] = {}
        # the metadata last checked, and the engines of that sync (checked or known)
        self._verified: tuple[list[TensorMeta], frozenset[str]] | None = None

    def check_new(self, engines: list[EngineSession], metas: list[TensorMeta], *,
                  every: bool, enabled: bool = True) -> None:
        """Check the engines not checked against these metadata yet (all of them when
        `every`: a disk sync moves each engine's model path). A regroup after one engine
        left (dropped as hung, drained) must not ask every other engine again, nor wait on
        one that stopped answering since: `/model_info` has no deadline of its call type.
        An engine that leaves is checked again if it comes back."""
        same = self._verified is not None and (
            self._verified[0] is metas or self._verified[0] == metas)
        known = self._verified[1] if same and not every else frozenset()
        unchecked = [e for e in engines if e.url not in known]
        if enabled and unchecked:
            on_all(unchecked, "check_metadata", lambda e: self.check(e, metas))
        # equal or checked (the next sync compares identities)
        self._verified = (metas, frozenset(e.url for e in engines))

    def check(self, engine: EngineSession, metas: list[TensorMeta]) -> None:
        path = str(engine.model_info().get("model_path") or "")
        cache_key = (engine.url, path)
        if cache_key not in self._expected:
            expected, path, why = engine_model_metadata(engine)
            self._expected[cache_key] = expected
            if expected is None:
                self.warn_once(f"meta:{engine.url}", f"cannot check parameter names/shapes "
                               f"against engine {engine.url}'s model: {why}")
        expected = self._expected[cache_key]
        if expected is not None:
            check_same_metadata(expected, metas, where="the trainer's weights",
                                against=f"engine {engine.url}'s model ({path})", subset=True,
                                engine=engine.url)
