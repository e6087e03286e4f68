"""Chat messages -> prompt token ids, as sglang 0.5.23's /v1/chat/completions builds them.

The checkpoint's Jinja chat template renders the conversation (`models/chat_template.py`),
then the text is encoded without adding special tokens (the template carries them).
sglang's message rules are kept: a null content is "", text parts are joined with a space,
a trailing assistant message is continued (`continue_final_message`) or, as sglang does,
turned into a user message; media parts are refused on a text-only model. A checkpoint
without a chat template gets a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from slime_like.models.chat_template import ChatTemplateError, read_chat_template, render_chat
from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.protocol.openai_struct import MEDIA_PART_TYPES, ChatCompletionRequest


class ChatPromptError(ValueError):
    """The conversation cannot be turned into a prompt (answered 400)."""


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` without BOS/EOS added (a rendered template has its own)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return list(hf.encode(text, add_special_tokens=False))
    return tokenizer.encode(text)


def special_token_names(tokenizer: Tokenizer) -> dict[str, str]:
    """bos_token / eos_token / pad_token as the template sees them."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return {k: getattr(hf, k) for k in ("bos_token", "eos_token", "pad_token")
                if isinstance(getattr(hf, k, None), str)}
    from slime_like.models.tokenizer import SPECIAL_TOKEN_NAMES

    return dict(SPECIAL_TOKEN_NAMES)


class ChatPrompter:
    """Renders requests with the chat template of the checkpoint the engine serves."""

    def __init__(self, tokenizer: Tokenizer, template_dir: str):
        self.tokenizer = tokenizer
        self.template_dir = template_dir
        self.template = read_chat_template(template_dir)

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt of a chat request: its `input_ids` as given, or the rendered messages."""
        if req.input_ids is not None:  # sglang: pre-computed ids bypass the template
            if not req.input_ids:
                raise ChatPromptError("input_ids cannot be empty.")
            return list(req.input_ids)
        if self.template is None:
            raise ChatPromptError(
                f"The checkpoint {self.template_dir} has no chat template (no 'chat_template' in "
                "its tokenizer_config.json, no chat_template.jinja): /v1/chat/completions "
                "cannot render messages; use /v1/completions or /generate with a prompt.")
        messages, prefix = self._messages(req)
        kwargs: dict[str, Any] = {}
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
            kwargs.setdefault("thinking", req.reasoning_effort != "none")
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        kwargs.update(req.chat_template_kwargs or {})
        if "chat_template" in kwargs:  # sglang without --trust-request-chat-template
            raise ChatPromptError("Request-supplied chat_template is not allowed. Start the "
                                  "server with --trust-request-chat-template to permit it.")
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:
            text = render_chat(self.template, messages, add_generation_prompt=True, tools=tools,
                               special_tokens=special_token_names(self.tokenizer), **kwargs)
        except ChatTemplateError as e:
            raise ChatPromptError(str(e)) from e
        ids = encode_plain(self.tokenizer, text)
        if prefix:
            ids += encode_plain(self.tokenizer, prefix)
        return ids

    def _messages(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str | None]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(req.messages):
            msg = {k: v for k, v in m.model_dump().items() if v is not None}
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type in MEDIA_PART_TYPES:
                        raise ChatPromptError("Model only supports text input; received "
                                              f"unsupported content type '{part.type}'.")
                    if part.type in ("text", "input_text"):
                        texts.append(part.text or "")
                content = " ".join(texts)
            msg["content"] = content or ""
            for call in msg.get("tool_calls") or []:
                _parse_arguments(call, i)
            out.append(msg)
        prefix = None
        if out and out[-1]["role"] == "assistant":
            if req.continue_final_message:
                prefix = out.pop()["content"]
            else:  # sglang: the conversation always ends on a user turn
                out[-1] = {"role": "user", "content": out[-1]["content"]}
        return out, prefix


def _parse_arguments(call: dict[str, Any], index: int) -> None:
    """sglang hands templates assistant tool-call arguments as JSON objects, not strings."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            args = json.loads(function["arguments"])
        except ValueError:
            raise ChatPromptError(f"messages[{index}]: assistant tool call function.arguments "
                                  "must be valid JSON.") from None
        if not isinstance(args, dict):
            raise ChatPromptError(f"messages[{index}]: assistant tool call function.arguments "
                                  "must be a JSON object.")
        function["arguments"] = args
