"""The seed's public API (torchrl's SGLang weight-sync scheme) over `WeightSync`.

A torchrl user switches by changing one import:

    from slime_like.weights import SGLangWeightSyncScheme, get_model_metadata

    scheme = SGLangWeightSyncScheme(server_url, num_gpus=2, pause_mode="retract")
    sender = scheme.create_sender()
    sender.register_model(policy)
    sender.init_all_workers_group(get_model_metadata(policy))
    sender.update_weights()          # bucketed broadcast, version checked, engine resumed

Behind it is the whole transaction (bucketed broadcast instead of one per tensor, no
`NCCL_P2P_DISABLE`/`NCCL_SHM_DISABLE`, begin/end sessions, version verification, every
engine resumed on failure).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, WeightSyncError
from slime_like.protocol.buckets import TensorMeta
from slime_like.protocol.modes import DEFAULT_PAUSE_MODE, PauseMode
from slime_like.protocol.modes import Transport as TransportKind
from slime_like.weights.packing import (
    ModelWeights,
    NamedTensors,
    get_model_metadata,
    unwrap_model,
)
from slime_like.weights.sync import (
    DEFAULT_BUFFER_BYTES,
    SyncReport,
    WeightSync,
    WeightSyncConfig,
)

__all__ = ["SGLangWeightSender", "SGLangWeightSyncScheme", "get_model_metadata"]

STRATEGIES = ("tensordict", "state_dict")


class SGLangWeightSyncScheme:
    """Weight sync into one SGLang server (`num_gpus` = its TP size) over a weight group."""

    def __init__(self, server_url: str, master_address: str | None = None,
                 master_port: int | None = None, num_gpus: int = 1,
                 strategy: str = "tensordict", device: int | str | torch.device = 0,
                 flush_cache_on_update: bool | None = None, pause_mode: str | None = None,
                 update_weight_buffer_size: int = DEFAULT_BUFFER_BYTES):
        if (pause_mode or DEFAULT_PAUSE_MODE) not in list(PauseMode):
            raise ConfigError("pause_mode", f"expected one of {[str(m) for m in PauseMode]}, "
                              f"got {pause_mode!r}")
        pause_mode = PauseMode(pause_mode or DEFAULT_PAUSE_MODE)
        if flush_cache_on_update and pause_mode is not PauseMode.ABORT:
            # sglang flushes only an idle scheduler; with retract/in_place requests stay queued.
            raise ConfigError("flush_cache_on_update", f"True needs pause_mode='abort' (got "
                              f"{pause_mode!r}): sglang refuses to flush while paused requests "
                              "are kept; leave it None to flush wherever the pause mode allows")
        if strategy not in STRATEGIES:
            raise ConfigError("strategy", f"expected one of {list(STRATEGIES)}, got {strategy!r}")
        if int(num_gpus) < 1:
            raise ConfigError("num_gpus", f"expected >= 1, got {num_gpus!r}")
        self.server_url = server_url.rstrip("/")
        self.master_address = master_address
        self.master_port = master_port
        self.num_gpus = int(num_gpus)
        self.strategy = strategy
        self.device = _resolve_device(device)
        self.flush_cache_on_update = flush_cache_on_update
        self.pause_mode = pause_mode
        self.update_weight_buffer_size = int(update_weight_buffer_size)

    def create_sender(self) -> SGLangWeightSender:
        config = WeightSyncConfig(
            transport=TransportKind.DISTRIBUTED, pause_mode=self.pause_mode, device=str(self.device),
            master_address=self.master_address, master_port=self.master_port,
            flush_cache=self.flush_cache_on_update is not False,
            update_weight_buffer_size=self.update_weight_buffer_size)
        return SGLangWeightSender(self, WeightSync([EngineSession(EngineAddress(self.server_url, self.num_gpus))],
                                                   config))


def _resolve_device(device: int | str | torch.device) -> torch.device:
    """An int is a CUDA ordinal; on a machine without CUDA the sync runs on CPU over gloo."""
    if isinstance(device, int):
        return torch.device("cuda", device) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class SGLangWeightSender:
    """The trainer side: registered model, collectors to notify, one WeightSync.

    The fast path is the registered model: its parameter walk and metadata are built once
    (at `register_model`), so every `update_weights()` hands WeightSync the same source
    object and WeightSync skips every check of metadata it has already checked.
    """

    def __init__(self, scheme: SGLangWeightSyncScheme, sync: WeightSync):
        self.scheme = scheme
        self.sync = sync
        self.model: nn.Module | None = None
        self.collectors: list[Any] = []
        self.last_report: SyncReport | None = None
        self._source: ModelWeights | None = None
        self._dict_metas: list[TensorMeta] | None = None

    def register_model(self, model: nn.Module) -> None:
        self.model = model
        self._source = ModelWeights(model)

    def register_collector(self, collector: Any) -> None:
        """A collector whose policy version goes up by one after every successful update."""
        self.collectors.append(collector)

    def init_all_workers_group(self, model_metadata: Mapping[str, tuple[torch.dtype, torch.Size]]
                               ) -> None:
        """Register the metadata every update must match, build the weight group and the
        bucket buffers (so the first update does not pay for them)."""
        self.sync.attach(metadata=model_metadata)

    def update_weights(self, weights: Any = None) -> SyncReport:
        """Push `weights` (default: the registered model) into the server."""
        if weights is None:
            if self.model is None:
                raise WeightSyncError("update_weights", "no weights given and no model "
                                      "registered; call register_model(model) first")
            weights = self._model_source(self.model)
        elif isinstance(weights, nn.Module):
            weights = self._model_source(weights)
        else:
            weights = self._dict_source(_named_tensors(weights, self.scheme.strategy))
        self.last_report = self.sync.update(weights)
        for collector in self.collectors:
            _increment_version(collector)
        return self.last_report

    def _model_source(self, model: nn.Module) -> ModelWeights:
        """The walk of the model made at register_model (or now, for another model).

        It holds the Parameter objects, so new values (even `param.data = ...`) are sent;
        a dtype or shape change is caught while packing. Replacing a Parameter object
        needs `register_model` again.
        """
        source = self._source
        if source is None or source.model is not unwrap_model(model):
            source = self._source = ModelWeights(model)
        return source

    def _dict_source(self, named: dict[str, torch.Tensor]) -> NamedTensors:
        """Named tensors; metadata equal to the last call's is reused (checked once)."""
        source = NamedTensors(named)
        metas = source.metadata()
        if self._dict_metas is not None and metas == self._dict_metas:
            source.reuse_metadata(self._dict_metas)
        else:
            self._dict_metas = metas
        return source

    def flush_cache(self) -> bool:
        """Flush the server's prefix cache now; False when it refused (not idle)."""
        return self.sync.engines[0].try_flush_cache() if self.sync.engines else False

    def shutdown(self) -> None:
        self.sync.close()


def _named_tensors(weights: Any, strategy: str) -> dict[str, torch.Tensor]:
    """A TensorDict (keys joined with '.') or a state dict, as {HF name: tensor}."""
    if hasattr(weights, "flatten_keys"):  # a TensorDict, without importing tensordict
        flat = weights.flatten_keys(".")
        return {str(k): v for k, v in flat.items()}
    if isinstance(weights, Mapping):
        return {str(k): v for k, v in weights.items()}
    raise WeightSyncError("update_weights", f"strategy {strategy!r}: cannot read weights from a "
                          f"{type(weights).__name__}; pass a TensorDict, a state dict or a model")


def _increment_version(collector: Any) -> None:
    if hasattr(collector, "increment_version"):
        collector.increment_version()
    elif isinstance(getattr(collector, "policy_version", None), int):
        collector.policy_version += 1
    else:
        raise WeightSyncError("register_collector", f"{type(collector).__name__} has neither "
                              "increment_version() nor an int policy_version")
