"""Weight sync from the trainer into every engine: buckets, transports, the transaction."""

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.weights.packing import CastWeights, ModelWeights, NamedTensors, get_model_metadata
from slime_like.weights.sharded import ShardedWeights
from slime_like.weights.sync import SyncReport, WeightSync, WeightSyncConfig
from slime_like.weights.torchrl import (
    SGLangCollectiveTransport,
    SGLangWeightSender,
    SGLangWeightSyncScheme,
    get_sglang_model_metadata,
)

__all__ = ["CastWeights", "EngineAddress", "EngineSession", "ModelWeights", "NamedTensors",
           "SGLangCollectiveTransport", "SGLangWeightSender", "SGLangWeightSyncScheme",
           "ShardedWeights", "SyncReport", "WeightSync", "WeightSyncConfig", "get_model_metadata",
           "get_sglang_model_metadata"]
