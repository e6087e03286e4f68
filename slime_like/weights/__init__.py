"""Weight sync from the trainer into every engine: buckets, transports, the transaction."""

from slime_like.engine.handle import EngineHandle
from slime_like.weights.scheme import SGLangWeightSender, SGLangWeightSyncScheme
from slime_like.weights.source import ModelWeights, NamedTensors, get_model_metadata
from slime_like.weights.sync import SyncReport, WeightSync, WeightSyncConfig

__all__ = ["EngineHandle", "ModelWeights", "NamedTensors", "SGLangWeightSender",
           "SGLangWeightSyncScheme", "SyncReport", "WeightSync", "WeightSyncConfig",
           "get_model_metadata"]
