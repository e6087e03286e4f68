"""FleetWeights: push a model or state dict from this process into a fleet's engines.

For users with a trainer of their own (a torchrl loop, Megatron, FSDP) who drive the fleet
from their own Ray driver: `push(model)` runs one full update (`fleet.sync_attempts`), so the
fleet's routing invariant and failure handling apply unchanged. It is also the fleet's
weight source for replacement engines: a replacement gets the weights of the last push,
but only while they are still unchanged since (no optimizer step touched them); otherwise
it waits for the next push, which takes it along.

An FSDP2 (`fully_shard`) module, or a state dict of DTensors, is pushed collectively: every
rank of the shards' process group calls `push` (rank 0 with the fleet, the others with
`FleetWeights(None)`); rank 0 gathers the shards bucket by bucket while it broadcasts
(`weights/sharded.py`). A replacement engine then waits for the next push (the other ranks
are not there to gather for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slime_like.errors import WeightSyncError
from slime_like.fleet.attempts import Update
from slime_like.fleet.fleet import Fleet
from slime_like.protocol.modes import Transport
from slime_like.weights.sharded import ShardedWeights, is_sharded
from slime_like.weights.sync import SyncReport, WeightSync, WeightSyncConfig


def _stamp(weights: Any) -> tuple:
    """Identity and in-place version of every tensor: changes when an optimizer steps."""
    if isinstance(weights, nn.Module):
        tensors = list(weights.state_dict(keep_vars=True).values())
    elif isinstance(weights, Mapping):
        tensors = list(weights.values())
    else:
        return (id(weights),)
    return tuple((id(t), t._version) for t in tensors if isinstance(t, torch.Tensor))


class FleetWeights:
    """Weight pushes from this process into the fleet's updatable engines (any transport)."""

    def __init__(self, fleet: Fleet | None, config: WeightSyncConfig | None = None,
                 **settings: Any):
        """`fleet=None`: a rank other than 0 of a sharded (FSDP2) trainer; its `push` only
        serves rank 0's gathers. `config` must then match rank 0's bucket size."""
        settings.setdefault("resume_on_failure", False)  # the fleet unroutes, then resumes
        self.fleet = fleet
        self.config = config or WeightSyncConfig(**settings)
        if self.config.resume_on_failure:
            raise WeightSyncError("attach", "FleetWeights needs resume_on_failure=False: the "
                                  "fleet takes unverified engines out of the router first")
        self.sync = WeightSync([], self.config)
        self._pushed: Any = None
        self._stamp: tuple | None = None
        self._sharded: tuple[int, ShardedWeights] | None = None
        if fleet is not None:
            fleet.set_weight_source(self._resync)

    def push(self, weights: Any) -> SyncReport | dict:
        """One full update of `weights` (nn.Module, state dict or named tensors).

        Sharded weights (an FSDP2 module, DTensors): call it on every rank of their group.
        """
        if is_sharded(weights):
            return self._push_sharded(weights)
        if self.fleet is None:
            raise WeightSyncError("attach", "FleetWeights(None) only takes part in pushes of "
                                  "sharded weights (FSDP2 / DTensor); these are not sharded")
        for attempt in self.fleet.sync_attempts():
            with attempt as update:
                update.report = self.sync.update(weights, update.version.wire,
                                                 engines=update.targets,
                                                 quiet=update.quiet).as_dict()
        report = update.report
        self._pushed, self._stamp = weights, _stamp(weights)
        return report

    def _push_sharded(self, weights: Any) -> dict:
        """Rank 0 runs the fleet's attempts, one gather session each; the others serve them."""
        if self._sharded is None or self._sharded[0] != id(weights):
            self._sharded = (id(weights), ShardedWeights(
                weights, bucket_bytes=int(self.config.update_weight_buffer_size),
                copies=self.config.transport != Transport.DISTRIBUTED))
        source = self._sharded[1]
        if source.rank != 0:
            return {"served_buckets": source.serve(until_done=True)}
        if self.fleet is None:
            raise WeightSyncError("attach", "rank 0 of the sharded weights' group pushes: "
                                  "give it FleetWeights(fleet)")
        try:
            for attempt in self.fleet.sync_attempts():
                with attempt as update:
                    try:
                        update.report = self.sync.update(source, update.version.wire,
                                                         engines=update.targets,
                                                         quiet=update.quiet).as_dict()
                    finally:
                        source.finish()
                    update.report["gather"] = source.stats.as_dict()
        finally:
            source.done()
        self._pushed, self._stamp = None, None  # replacements wait for the next push
        return update.report

    def _resync(self, update: Update) -> dict:
        if update.full:
            raise WeightSyncError("attach", "full updates go through FleetWeights.push")
        if self._sharded is not None and self._pushed is None:
            raise WeightSyncError("attach", "the last push was sharded (every rank gathers); "
                                  "the replacement is synced by the next push")
        if self._pushed is None or _stamp(self._pushed) != self._stamp:
            raise WeightSyncError("attach", "the weights changed since the last push; the "
                                  "replacement is synced by the next push")
        one = WeightSync(update.targets, self.config)
        try:
            return one.update(self._pushed, update.version.wire).as_dict()
        finally:
            one.close()

    def close(self) -> None:
        self.sync.close()
