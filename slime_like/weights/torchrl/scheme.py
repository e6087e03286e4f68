"""`SGLangWeightSyncScheme`: torchrl's description of one server's weight sync, and the
factory of its transport and sender."""

from __future__ import annotations

import logging

import torch

from slime_like.cluster.ports import free_port
from slime_like.errors import ConfigError
from slime_like.protocol.modes import PauseMode
from slime_like.weights.sync import DEFAULT_BUFFER_BYTES
from slime_like.weights.torchrl.sender import SGLangWeightSender
from slime_like.weights.torchrl.settings import (
    check_flush_needs_abort,
    check_strategy,
    local_address_for,
    pause_mode_from,
)
from slime_like.weights.torchrl.transport import SGLangCollectiveTransport

log = logging.getLogger(__name__)


class SGLangWeightSyncScheme:
    """Weight sync into one SGLang server whose `num_gpus` ranks (tp × dp) join the group.

    `master_address` defaults to this host's address as the server reaches it, and
    `master_port` to a port free now. `update_weight_buffer_size` (ours) is the bucket size.
    """

    def __init__(self, server_url: str, master_address: str | None = None,
                 master_port: int | None = None, num_gpus: int = 1,
                 strategy: str = "tensordict", device: torch.device | str | int = 0,
                 flush_cache_on_update: bool | None = None,
                 pause_mode: str | PauseMode | None = None,
                 update_weight_buffer_size: int = DEFAULT_BUFFER_BYTES):
        if int(num_gpus) < 1:
            raise ConfigError("num_gpus", f"expected >= 1, got {num_gpus!r}")
        if int(update_weight_buffer_size) <= 0:
            raise ConfigError("update_weight_buffer_size", "expected a positive number of "
                              f"bytes, got {update_weight_buffer_size!r}")
        self.pause_mode = None if pause_mode is None else pause_mode_from(pause_mode, "pause_mode")
        if self.pause_mode is not None:  # an unset mode is resolved (and checked) per transport
            check_flush_needs_abort(flush_cache_on_update, self.pause_mode)
        self.strategy_name = check_strategy(strategy)
        self.server_url = server_url.rstrip("/")
        self.master_address = master_address or local_address_for(self.server_url)
        self.master_port = int(master_port) if master_port else free_port()
        self.num_gpus = int(num_gpus)
        self.device = device
        self.flush_cache_on_update = flush_cache_on_update
        self.update_weight_buffer_size = int(update_weight_buffer_size)

    @property
    def world_size(self) -> int:
        """The weight group's size: the trainer (rank 0) and the server's `num_gpus` ranks."""
        return 1 + self.num_gpus

    def create_transport(self, **overrides) -> SGLangCollectiveTransport:
        """The trainer's (rank 0) transport; `overrides` replace its arguments (`timeout=`...)."""
        kwargs = dict(server_url=self.server_url, master_address=self.master_address,
                      master_port=self.master_port, rank=0, world_size=self.world_size,
                      device=self.device, flush_cache_on_update=self.flush_cache_on_update,
                      pause_mode=self.pause_mode,
                      update_weight_buffer_size=self.update_weight_buffer_size)
        kwargs.update(overrides)
        return SGLangCollectiveTransport(**kwargs)

    def create_sender(self) -> SGLangWeightSender:
        return SGLangWeightSender(self)

    def create_receiver(self, *args, **kwargs) -> None:
        """None: the server's ranks are the receivers, started by the server itself."""
        log.info("SGLang receives weights in its own workers: no receiver to create")
        return None
