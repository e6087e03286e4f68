"""`SGLangCollectiveTransport`: torchrl's transport (rank 0 of one server's weight group, and
the server's HTTP control plane) as the owner of one `WeightSync`.

Everything torchrl's transport does by hand (pause, one broadcast per tensor, continue) is
`WeightSync.update`: bucketed broadcasts, begin/end sessions, the flush rule, the version
checked, the server resumed after any failure. What this class adds is torchrl's contract:
its constructor and attributes, names checked against the registered metadata (extra keys
ignored, as torchrl does), its two environment variables followed at every update, and
every failure a `RuntimeError` (or a `ValueError` for bad input), as torchrl raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NoReturn

import torch

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, EngineError, WeightMetadataError, WeightSyncError
from slime_like.protocol.buckets import TensorMeta
from slime_like.protocol.modes import PauseMode
from slime_like.protocol.modes import Transport as TransportKind
from slime_like.weights.attach import metadata_list
from slime_like.weights.packing import NamedTensors, WeightSource
from slime_like.weights.sync import DEFAULT_BUFFER_BYTES, SyncReport, WeightSync, WeightSyncConfig
from slime_like.weights.torchrl.settings import (
    PAUSE_MODE_ENV,
    check_flush_needs_abort,
    device_index,
    pack_device,
    pause_mode_from,
    resolve_flush_cache,
    resolve_pause_mode,
)

log = logging.getLogger(__name__)

Metadata = Mapping[str, tuple[torch.dtype, torch.Size]]


class SGLangCollectiveTransport:
    """Rank 0 of the weight group of the server at `server_url` (`world_size` - 1 ranks)."""

    def __init__(self, server_url: str, master_address: str, master_port: int, rank: int,
                 world_size: int, device: torch.device | str | int | None = None,
                 timeout: float = 300.0, flush_cache_on_update: bool | None = None,
                 pause_mode: str | PauseMode | None = None, *,
                 update_weight_buffer_size: int = DEFAULT_BUFFER_BYTES):
        if int(world_size) < 2:
            raise ConfigError("world_size", f"expected the trainer plus >= 1 server rank, got "
                              f"{world_size!r}")
        if float(timeout) <= 0:
            raise ConfigError("timeout", f"expected a positive number of seconds, got {timeout!r}")
        self.server_url = server_url.rstrip("/")
        self.master_address = master_address
        self.master_port = master_port
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.device = device_index(device)  # torchrl's: a CUDA ordinal
        self.pack_device = pack_device(device)
        self.timeout = float(timeout)
        self.flush_cache_on_update = flush_cache_on_update
        self.pause_mode = None if pause_mode is None else pause_mode_from(pause_mode, "pause_mode")
        self.update_weight_buffer_size = int(update_weight_buffer_size)
        check_flush_needs_abort(flush_cache_on_update, self.resolved_pause_mode,
                                "" if pause_mode is not None else f" from {PAUSE_MODE_ENV} or "
                                "the default")
        self.model_metadata: Metadata | None = None
        self.sync: WeightSync | None = None
        self._metas: list[TensorMeta] | None = None
        self._address = EngineAddress(self.server_url, self.world_size - 1)

    # ---- settings --------------------------------------------------------------------------------

    @property
    def resolved_pause_mode(self) -> PauseMode:
        """The pause mode of the next update: the argument, else the environment's, else
        retract."""
        return resolve_pause_mode(self.pause_mode)

    @property
    def resolved_flush_cache(self) -> bool:
        """Whether the next update flushes the prefix cache where its pause mode allows."""
        return resolve_flush_cache(self.flush_cache_on_update)

    def _config(self) -> WeightSyncConfig:
        return WeightSyncConfig(
            transport=TransportKind.DISTRIBUTED, pause_mode=self.resolved_pause_mode,
            flush_cache=self.resolved_flush_cache, device=str(self.pack_device),
            master_address=self.master_address, master_port=self.master_port,
            http_timeout_s=self.timeout, group_timeout_s=self.timeout,
            update_weight_buffer_size=self.update_weight_buffer_size)

    # ---- the group -----------------------------------------------------------------------------

    def init_all_workers_group(self, model_metadata: Metadata) -> None:
        """Form the weight group with the server and register what every update sends
        (checked against the server's model now; the bucket buffers are built too)."""
        if self.rank != 0:
            raise WeightSyncError("init_all_workers_group", "Only rank 0 (the trainer) forms "
                                  f"the weight group; this transport has rank {self.rank}")
        self.shutdown()  # a second call starts over
        self._metas = metadata_list(model_metadata)
        self.model_metadata = model_metadata
        try:
            self._connect(self._config())
        except BaseException:
            self.shutdown()  # nothing half formed: the next update says so
            raise

    def _connect(self, config: WeightSyncConfig) -> None:
        sync = WeightSync([EngineSession(self._address)], config)
        try:
            sync.attach(metadata=self._metas)
        except Exception as e:
            sync.close()
            reraise_as_runtime_error("init_all_workers_group", e)
        self.sync = sync

    def _follow_settings(self) -> None:
        """torchrl reads its environment at every update: a changed pause mode or flush
        setting rebuilds the group once, under the new settings. A group whose rebuild
        failed is formed again, and a server dropped after a failed update is tried again."""
        config = self._config()
        if self.sync is None:
            self._connect(config)
            return
        current = self.sync.config
        if (config.pause_mode, config.flush_cache) != (current.pause_mode, current.flush_cache):
            log.info("weight sync settings changed (pause_mode %s, flush_cache %s): rebuilding "
                     "the weight group with %s", config.pause_mode, config.flush_cache,
                     self.server_url)
            self._leave()
            self._connect(config)
        elif not self.sync.engines:
            self.sync.add_engine(self._address)

    # ---- updates -------------------------------------------------------------------------------

    def send_weights(self, model_id: str, weights: Mapping[str, torch.Tensor] | WeightSource
                     ) -> SyncReport:
        """One update of the server: `weights` by name (every registered name, extra keys
        ignored) or a `WeightSource`. `model_id` only names the model in errors."""
        if self.rank != 0:
            raise WeightSyncError("send_weights", f"Only rank 0 sends weights; this transport "
                                  f"has rank {self.rank}")
        if self._metas is None:
            raise WeightSyncError("send_weights", "Communication group not initialized: call "
                                  "init_all_workers_group(model_metadata) first")
        source = weights if isinstance(weights, WeightSource) else self._in_metadata_order(
            weights, model_id)
        try:
            self._follow_settings()
            assert self.sync is not None
            return self.sync.update(source)
        except Exception as e:
            reraise_as_runtime_error("send_weights", e)

    def _in_metadata_order(self, weights: Mapping[str, torch.Tensor], model_id: str
                           ) -> NamedTensors:
        """The registered tensors out of `weights`, each checked against its metadata."""
        if not isinstance(weights, Mapping):
            raise WeightMetadataError(f"model {model_id!r}: expected {{name: tensor}}, got a "
                                      f"{type(weights).__name__}")
        metas = self._metas
        assert metas is not None
        missing = [m.name for m in metas if m.name not in weights]
        if missing:
            raise WeightMetadataError(
                f"model {model_id!r}: {len(missing)} registered weight(s) not in the weights "
                f"given, e.g. {missing[:5]} (given e.g. {list(weights)[:5]})")
        for m in metas:
            t = weights[m.name]
            if t.dtype != m.dtype or tuple(t.shape) != m.shape:
                raise WeightMetadataError(
                    f"model {model_id!r}: weight {m.name!r} is {t.dtype} {list(t.shape)}, "
                    f"registered at init_all_workers_group as {m.dtype} {list(m.shape)}")
        source = NamedTensors([(m.name, weights[m.name]) for m in metas])
        source.reuse_metadata(metas)  # the same list every update: checked once by WeightSync
        return source

    def check_connection(self) -> bool:
        """True once the weight group is formed (until `shutdown`)."""
        return self.sync is not None

    def flush_cache(self) -> bool:
        """Flush the server's prefix cache now; False when it refused (busy) or is down."""
        session = self.sync.engines[0] if self.sync is not None and self.sync.engines else \
            EngineSession(self._address, timeout=self.timeout)
        try:
            return session.try_flush_cache()
        except (EngineError, OSError) as e:
            log.warning("flush_cache on %s failed: %s", self.server_url, e)
            return False

    def shutdown(self) -> None:
        """Leave the weight group (the server destroys its side too) and forget the
        metadata: the next update needs `init_all_workers_group` again."""
        self._leave()
        self._metas = self.model_metadata = None

    def _leave(self) -> None:
        sync, self.sync = self.sync, None
        if sync is not None:
            sync.close()


def reraise_as_runtime_error(step: str, error: Exception) -> NoReturn:
    """Raise `error` (being handled) as torchrl's callers catch it: a RuntimeError (ours
    are) or a ValueError (bad input) as is; anything else (an OS or HTTP error) inside a
    WeightSyncError."""
    if isinstance(error, RuntimeError | ValueError):
        raise error
    raise WeightSyncError(step, f"{type(error).__name__}: {error}") from error
