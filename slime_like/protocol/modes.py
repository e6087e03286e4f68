"""The four modes as types: how engines pause, how weights travel, which schedule runs, what
an engine serves.

Each is a `StrEnum`, so a member *is* its wire and flag string: sglang's HTTP body takes
`mode: "retract"`, the flags say `--pause-generation-mode retract`, and JSON, YAML and the
report write the same word. Code compares members, never the strings
(`tests/architecture/test_layers.py` refuses a mode spelled as a string literal).
"""

from __future__ import annotations

from enum import StrEnum


class PauseMode(StrEnum):
    """What an engine does with running requests while its weights change (sglang's
    `/pause_generation` modes)."""

    ABORT = "abort"        # end them (finish_reason abort); the caller resubmits
    RETRACT = "retract"    # back to the queue: their KV is recomputed under the new weights
    IN_PLACE = "in_place"  # stay where they are: their KV, from the old weights, is kept


class Transport(StrEnum):
    """How a weight update's bytes reach the engines."""

    DISTRIBUTED = "distributed"  # broadcast over a weight group (NCCL on GPU, gloo on CPU)
    TENSOR = "tensor"            # colocated: CUDA IPC / shared-memory payloads
    DISK = "disk"                # safetensors in a shared directory, then a load from disk


class AsyncMode(StrEnum):
    """The job's schedule (docs/ASYNC.md)."""

    SYNC = "sync"                # rollout, train, sync in turn
    ONE_STEP = "one-step"        # rollout k+1 while step k trains (slime's train_async.py)
    FULLY_ASYNC = "fully-async"  # a producer that never pauses; updates while requests run


class Dispatch(StrEnum):
    """Which engine a rollout request goes to, and who decides (`--rollout-dispatch`)."""

    ROUTER = "router"        # the router's policy (--router-policy), when the request is sent
    ADMISSION = "admission"  # the client: a routed engine's free slot, then straight to it


class WorkerType(StrEnum):
    """What a server group's engines are (slime's `worker_type`)."""

    REGULAR = "regular"
    PREFILL = "prefill"          # PD disaggregation: prefill side, has a bootstrap port
    DECODE = "decode"            # PD disaggregation: decode side
    PLACEHOLDER = "placeholder"  # reserves GPU slots; no engine is started
    ENCODER = "encoder"          # multimodal encoder only (EPD); never in a router

    @property
    def is_pd(self) -> bool:
        """One side of a prefill/decode pair (the router runs in PD mode)."""
        return self in (WorkerType.PREFILL, WorkerType.DECODE)


#: Worker types an engine can be started as (a placeholder starts nothing).
ENGINE_WORKER_TYPES: tuple[WorkerType, ...] = (WorkerType.REGULAR, WorkerType.PREFILL,
                                               WorkerType.DECODE, WorkerType.ENCODER)
#: Worker types a router takes (an encoder is reached through its regular/prefill peers).
ROUTED_WORKER_TYPES: tuple[WorkerType, ...] = (WorkerType.REGULAR, WorkerType.PREFILL,
                                               WorkerType.DECODE)

#: The one default of each (flags, settings and WeightSyncConfig all take these).
DEFAULT_PAUSE_MODE = PauseMode.RETRACT
DEFAULT_TRANSPORT = Transport.DISTRIBUTED

MODES: tuple[type[StrEnum], ...] = (PauseMode, Transport, AsyncMode, WorkerType)
