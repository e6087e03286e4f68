"""`SGLangWeightSender`: the trainer's side of torchrl's scheme (a registered model, the
collectors whose policy version follows the updates, one transport).

The fast path is the registered model: its parameter walk and metadata are built once (at
`register_model`), so every `update_weights()` hands the transport the same source object
and `WeightSync` skips every check of metadata it has already checked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from slime_like.errors import WeightMetadataError, WeightSyncError
from slime_like.weights.packing import ModelWeights, unwrap_model
from slime_like.weights.sync import SyncReport, WeightSync
from slime_like.weights.torchrl.transport import Metadata, SGLangCollectiveTransport

log = logging.getLogger(__name__)

MODEL_ID = "sglang_model"  # how torchrl names the model to its transport


class TransportFactory(Protocol):
    """What a sender needs of its scheme (`SGLangWeightSyncScheme`)."""

    def create_transport(self, **overrides: Any) -> SGLangCollectiveTransport: ...


class SGLangWeightSender:
    """Pushes the registered model (or given weights) into the scheme's server."""

    def __init__(self, scheme: TransportFactory):
        self.scheme = scheme
        self.model: nn.Module | None = None
        self.collectors: list[Any] = []
        self.last_report: SyncReport | None = None
        self._transport: SGLangCollectiveTransport | None = None
        self._source: ModelWeights | None = None

    @property
    def transport(self) -> SGLangCollectiveTransport | None:
        """The transport made by `init_all_workers_group` (None before it and after
        `shutdown`)."""
        return self._transport

    @property
    def sync(self) -> WeightSync | None:
        """The `WeightSync` behind the transport (its last report, its engines)."""
        return None if self._transport is None else self._transport.sync

    def register_model(self, model: nn.Module) -> None:
        """The model `update_weights()` sends (HF names; a peft LoRA model merged)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"register_model: expected an nn.Module, got {type(model).__name__}")
        self.model = model
        self._source = ModelWeights(model)

    def register_collector(self, collector: Any) -> None:
        """A collector whose policy version goes up by one after every successful update
        (its `increment_version()`, or an int `policy_version`)."""
        if not (callable(getattr(collector, "increment_version", None))
                or isinstance(getattr(collector, "policy_version", None), int)):
            raise TypeError(f"register_collector: {type(collector).__name__} has neither "
                            "increment_version() nor an int policy_version")
        self.collectors.append(collector)

    def init_all_workers_group(self, model_metadata: Metadata) -> None:
        """Form the weight group with the server for weights of `model_metadata`
        ({name: (dtype, shape)}, e.g. `get_model_metadata(model)`); a second call starts over."""
        self.shutdown_transport()
        transport = self.scheme.create_transport()
        transport.init_all_workers_group(model_metadata)
        self._transport = transport

    def update_weights(self, weights: Any = None) -> SyncReport:
        """Push `weights` (default: the registered model; else a state dict, a TensorDict or
        a model) into the server, then bump every registered collector's version."""
        if self._transport is None:
            raise WeightSyncError("update_weights", "Transport not initialized: call "
                                  "init_all_workers_group(model_metadata) first")
        if weights is None:
            if self.model is None:
                raise WeightSyncError("update_weights", "No model registered and no weights "
                                      "given: call register_model(model) first or pass weights")
            source: Any = self._model_source(self.model)
        elif isinstance(weights, nn.Module):
            source = self._model_source(weights)
        else:
            source = _named_tensors(weights)
        self.last_report = self._transport.send_weights(MODEL_ID, source)
        self._bump_collectors()
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

    def _bump_collectors(self) -> None:
        """As torchrl: the weights landed, so one collector's failure is logged, not raised,
        and the others are still bumped."""
        for collector in self.collectors:
            try:
                if callable(getattr(collector, "increment_version", None)):
                    collector.increment_version()
                else:
                    collector.policy_version += 1
            except Exception as e:
                log.warning("the weights landed but %s's version bump failed: %s",
                            type(collector).__name__, e)

    def flush_cache(self) -> bool:
        """Flush the server's prefix cache now; False when it refused (busy) or is down."""
        transport = self._transport or self.scheme.create_transport()
        return transport.flush_cache()

    def shutdown_transport(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.shutdown()

    def shutdown(self) -> None:
        """Leave the weight group and forget the collectors (the model stays registered)."""
        self.shutdown_transport()
        self.collectors.clear()


def _named_tensors(weights: Any) -> dict[str, torch.Tensor]:
    """A TensorDict (keys joined with '.') or a state dict, as {name: tensor}."""
    if hasattr(weights, "flatten_keys"):  # a TensorDict, without importing tensordict
        return {str(k): v for k, v in weights.flatten_keys(".").items()}
    if isinstance(weights, Mapping):
        return {str(k): v for k, v in weights.items()}
    raise WeightMetadataError(f"update_weights: cannot read weights from a "
                              f"{type(weights).__name__}; pass a state dict, a TensorDict or "
                              "a model")
