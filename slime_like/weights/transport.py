"""What every transport gets for one transfer, and what it must provide."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from slime_like.weights.buckets import Bucket
from slime_like.weights.engines import EngineCalls, EngineTarget
from slime_like.weights.source import WeightSource
from slime_like.weights.transfer import TransferStats, Watch


@dataclass
class TransferContext:
    """One sync's transfer: runs between begin_weight_update and end_weight_update."""

    engines: Sequence[EngineTarget]
    buckets: Sequence[Bucket]
    source: WeightSource
    weight_version: str
    watch: Watch
    calls: EngineCalls
    stats: TransferStats
    http_timeout_s: float


class Transport(ABC):
    """Moves the bytes of one sync into every engine; the transaction does the rest."""

    name: str = ""
    #: whether engines need begin/end_weight_update around it (sglang gates only some)
    gated: bool = True

    def attach(self, engines: Sequence[EngineTarget], calls: EngineCalls) -> None:  # noqa: B027
        """Prepare before the engines are paused (e.g. build a weight group)."""

    @abstractmethod
    def transfer(self, ctx: TransferContext) -> None:
        """Send every bucket; the last update to each engine carries `weight_version`."""

    def failed(self) -> None:  # noqa: B027
        """A transfer failed: stop pending I/O so engines stuck receiving fail fast."""

    def close(self, engines: Sequence[EngineTarget]) -> None:  # noqa: B027
        """Release groups and buffers."""
