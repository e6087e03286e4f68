"""The SGLang 0.5.23 HTTP protocol as typed bodies, shared by the client and the reference engine.

One definition per request so a field can never be spelled two ways. Field names and
defaults follow sglang's `io_struct.py` (docs/REFERENCE_ENGINE.md lists every endpoint). Unknown
keys are ignored (sglang's msgspec structs ignore them), except in `SamplingParams`, where
0.5.23's schema gate rejects them with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slime_like.protocol.modes import PauseMode
from slime_like.protocol.weight_delta import DeltaHeader

Selector = Literal["target", "draft", "all"]
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
ALL_MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")

DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"


class _Body(BaseModel):
    """A control-endpoint body: unknown keys ignored, lax coercion ("60000" -> 60000)."""

    model_config = ConfigDict(extra="ignore")


# ---- generation -------------------------------------------------------------------------

class SamplingParams(BaseModel):
    """sampling_params of /generate; an unknown key is a 400 in sglang 0.5.23."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 1 << 30
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    beam_width: int | None = None
    watermark: Any = None
    choice: Any = None


class GenerateRequest(_Body):
    """POST /generate. Exactly one of text / input_ids; a list means a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    log_metrics: bool = True


class FinishReason(BaseModel):
    """meta_info.finish_reason: always an object in sglang, never a string."""

    model_config = ConfigDict(extra="allow")
    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


class WeightVersionSpan(BaseModel):
    """meta_info.weight_versions: which output tokens were made at which weight version."""

    version: str
    start: int
    end: int


class MetaInfo(BaseModel):
    """meta_info of a /generate answer: the fields the orchestrator reads (others kept)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    finish_reason: FinishReason | None = None
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] = Field(default_factory=list)
    output_token_logprobs: list[list[Any]] = Field(default_factory=list)
    cached_tokens: int | None = None


class GenerateResponse(BaseModel):
    """One /generate answer (a batch answers a list of these)."""

    model_config = ConfigDict(extra="allow")
    output_ids: list[int] = Field(default_factory=list)
    text: str | None = None
    meta_info: MetaInfo


# ---- control -----------------------------------------------------------------------------

class PauseGenerationRequest(_Body):
    mode: PauseMode = PauseMode.ABORT  # sglang's default; the body carries the word


class ContinueGenerationRequest(_Body):
    torch_empty_cache: bool = True


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class ProfileRequest(_Body):
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None


class MemoryOccupationRequest(_Body):
    tags: list[MemoryTag] | None = None


# ---- weights -----------------------------------------------------------------------------

class InitWeightsUpdateGroupRequest(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: str = DEFAULT_GROUP_NAME


class BeginWeightUpdateRequest(_Body):
    selector: Selector = "all"


class EndWeightUpdateRequest(_Body):
    pass


class UpdateWeightsFromDistributedRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False
    # Ours, not sglang's: a delta bucket's base and result (load_format "xor_zstd"; sent
    # only to engines whose /server_info lists that format)
    weight_delta: DeltaHeader | None = None


class UpdateWeightsFromTensorRequest(_Body):
    serialized_named_tensors: list[str | bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False
    # Not sglang's (its schema ignores unknown keys; it closes every mapping after its
    # load): the sender will send this buffer again and keeps it allocated until then, so
    # the reference engine keeps its mapping past end_weight_update (ipc_mappings.py).
    keep_ipc_mapping: bool = False
    # Not sglang's either, sent only to engines advertising READY_EVENT_KEY: a CUDA IPC
    # event handle (base64) the sender recorded after its last write of the tensors; the
    # engine's copy waits for it on the GPU (protocol/ready_event.py), so the sender
    # need not synchronize its stream before the request.
    ready_event: str | None = None


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    is_async: bool = False
    keep_pause: bool = False
    token_step: int | None = None
    manifest: Any = None


class UpdateWeightVersionRequest(_Body):
    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameRequest(_Body):
    name: str
    truncate_size: int = 100


class WeightsCheckerRequest(_Body):
    action: Literal["checksum", "snapshot", "reset_tensors", "compare"] = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"


class SuccessMessage(BaseModel):
    """The (success, message) answer of weight and control operations."""

    model_config = ConfigDict(extra="allow")
    success: bool = True
    message: str = ""


# ---- errors ------------------------------------------------------------------------------

def validation_error_body(message: str) -> dict:
    """sglang's envelope for a pydantic validation failure (HTTP 400)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def http_exception_body(detail: str, status: int) -> dict:
    """sglang's envelope for an HTTPException."""
    return {"object": "error", "message": detail, "type": str(status), "param": None, "code": status}


def error_response_body(message: str) -> dict:
    """sglang's `_create_error_response` envelope (ValueError in /generate, etc.)."""
    return {"error": {"message": message}}


TORCH_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16",
                     "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")


class ServerInfo(BaseModel):
    """GET /server_info: the sglang version and the sizes the sender must match."""

    model_config = ConfigDict(extra="allow")
    version: str | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None
    disaggregation_mode: str | None = None


class ModelInfo(BaseModel):
    """GET /model_info."""

    model_config = ConfigDict(extra="allow")
    model_path: str
    served_model_name: str | None = None
    weight_version: str = "default"
    architectures: list[str] = Field(default_factory=list)
