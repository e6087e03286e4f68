"""The OpenAI-compatible request bodies of SGLang 0.5.23: /v1/completions, /v1/chat/completions.

Field names and defaults are sglang's (`entrypoints/openai/protocol.py`), so a body that
sglang accepts parses here and means the same. Keys outside sglang's schema are ignored, as
sglang ignores them (the official client and sglang-router send such keys). Every field of
the schema is one of three kinds, listed per request class:

- implemented: it changes the answer as it does in sglang;
- `NO_EFFECT`: accepted, and it changes nothing in sglang either for a server like this
  one (request metadata, routing hints of a single-replica server, parsers not configured);
- `REFUSED`: not implemented here; a value other than the default is a 400 naming it.

sglang-router 0.3.2 re-serializes chat bodies with every default filled in, so "set" means
"differs from the default", never "present".
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator

DEFAULT_MODEL_NAME = "default"
MEDIA_PART_TYPES = ("image_url", "input_image", "video_url", "audio_url", "input_audio")


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]


class _OpenAIRequest(BaseModel):
    """Fields both routes share (sampling, PD routing, request metadata)."""

    model_config = ConfigDict(extra="ignore")

    model: str = DEFAULT_MODEL_NAME
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    custom_params: dict[str, Any] | None = None
    rid: str | list[str] | None = None
    # PD disaggregation (sglang-router's PD mode injects them)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    # not implemented here: refused unless left at the default
    stop_regex: str | list[str] | None = None
    regex: str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    lora_path: str | list[str | None] | None = None
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    watermark: dict[str, Any] | None = None
    return_hidden_states: bool | Literal["last"] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_cached_tokens_details: bool = False
    return_spec_tokens_details: bool = False
    images_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    NO_EFFECT: ClassVar[tuple[str, ...]] = (
        "user", "extra_key", "cache_salt", "priority", "custom_labels",
        # custom_params feed a custom logit processor; without one sglang ignores them
        "custom_params",
    )
    REFUSED: ClassVar[tuple[str, ...]] = (
        "stop_regex", "regex", "ebnf", "lora_path", "session_id", "session_params",
        "custom_logit_processor", "watermark", "return_hidden_states", "return_routed_experts",
        "routed_experts_start_len", "return_cached_tokens_details", "return_spec_tokens_details",
        "images_config", "mm_processor_kwargs", "disagg_prefill_dp_rank",
    )

    def refused(self) -> list[str]:
        """The fields set to something this engine does not implement."""
        out = [name for name in self.REFUSED
               if getattr(self, name) != type(self).model_fields[name].default]
        if self.response_format is not None and self.response_format.type != "text":
            out.append(f"response_format={self.response_format.type}")
        for name in ("routed_dp_rank", "data_parallel_rank"):
            if getattr(self, name) not in (None, 0):
                out.append(f"{name}={getattr(self, name)} (this server has one DP rank)")
        return out

    def common_sampling(self) -> dict[str, Any]:
        """sampling_params shared by both routes (the native /generate names)."""
        return {"min_new_tokens": self.min_tokens, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty, "n": self.n,
                "no_stop_trim": self.no_stop_trim, "ignore_eos": self.ignore_eos,
                "skip_special_tokens": self.skip_special_tokens, "logit_bias": self.logit_bias,
                "custom_params": self.custom_params, "sampling_seed": self.seed}

    def routing(self) -> dict[str, Any]:
        """The /generate body keys that carry the request's rid and PD hand-off."""
        keys = ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions."""

    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    return_token_ids: bool = False
    json_schema: str | None = None
    best_of: int | None = None
    suffix: str | None = None

    REFUSED: ClassVar[tuple[str, ...]] = (*_OpenAIRequest.REFUSED, "json_schema", "best_of", "suffix")

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message: text content (a string or text parts), tool calls and results."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "function", "developer",
                  "latest_reminder", "root"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | float | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_meta_info: bool = False
    input_ids: list[int] | None = None
    # not implemented here
    thinking: Any = None
    task: str | None = None
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None
    return_flat_raw_output_top_logprobs: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None

    # Without --reasoning-parser / --tool-call-parser sglang parses neither out of the text.
    NO_EFFECT: ClassVar[tuple[str, ...]] = (*_OpenAIRequest.NO_EFFECT, "parallel_tool_calls", "separate_reasoning",
                 "stream_reasoning")
    REFUSED: ClassVar[tuple[str, ...]] = (*_OpenAIRequest.REFUSED, "thinking", "task", "return_sampling_mask",
               "sampling_logprobs_mode", "return_flat_raw_output_top_logprobs",
               "return_input_ids_in_sglext", "return_output_ids_in_sglext", "max_dynamic_patch",
               "min_dynamic_patch", "use_audio_in_video", "video_config")

    def refused(self) -> list[str]:
        out = super().refused()
        choice = self.tool_choice
        if isinstance(choice, dict) or choice == "required":
            # sglang constrains the output to a tool call with a JSON-schema grammar
            out.append("tool_choice=" + ("required" if choice == "required" else "<named tool>"))
        return out

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens (null: up to the context)."""
        return self.max_completion_tokens or self.max_tokens

