"""The seed's public API: torchrl's SGLang weight sync (`torchrl.weight_update.llm`) over
`WeightSync`.

A torchrl user switches by changing one import:

    from slime_like.weights.torchrl import SGLangWeightSyncScheme, get_sglang_model_metadata

    scheme = SGLangWeightSyncScheme(server_url, num_gpus=2, pause_mode="retract")
    sender = scheme.create_sender()
    sender.register_model(policy)
    sender.register_collector(collector)     # its version goes up after every update
    sender.init_all_workers_group(get_sglang_model_metadata(policy))
    sender.update_weights()                  # bucketed broadcast, version checked, resumed

Every name torchrl's SGLang module exports is here (`SGLangWeightSyncScheme`,
`SGLangWeightSender`, `SGLangCollectiveTransport`, `get_model_metadata` and its alias
`get_sglang_model_metadata`), it reads the same two `TORCHRL_SGLANG_*` environment
variables, and its failures are `RuntimeError`s (bad input: `ValueError`s) as torchrl's
are. Where it differs on purpose (no `NCCL_P2P_DISABLE`, begin/end sessions, the flush
rule...): docs/WEIGHT_SYNC.md, "The seed's API".
"""

from slime_like.weights.packing import get_model_metadata
from slime_like.weights.torchrl.scheme import SGLangWeightSyncScheme
from slime_like.weights.torchrl.sender import SGLangWeightSender
from slime_like.weights.torchrl.settings import FLUSH_CACHE_ENV, PAUSE_MODE_ENV
from slime_like.weights.torchrl.transport import SGLangCollectiveTransport

# torchrl exports the SGLang module's metadata function under this name.
get_sglang_model_metadata = get_model_metadata

__all__ = ["FLUSH_CACHE_ENV", "PAUSE_MODE_ENV", "SGLangCollectiveTransport", "SGLangWeightSender",
           "SGLangWeightSyncScheme", "get_model_metadata", "get_sglang_model_metadata"]
