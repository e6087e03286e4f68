"""OpenAI response objects built from native /generate outputs, in sglang 0.5.23's shapes.

Completions carry the legacy logprobs object (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); chat carries `logprobs.content` entries with `bytes`. Usage counts each
prompt once (every n-th output) and every completion token; `metadata` holds the first
output's `weight_version` and its `weight_versions` spans, as sglang's endpoints do.
Streams are tracked per choice index so a chunk carries only the new text and the new
tokens' logprobs, whether the engine streams cumulative or incremental outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.models.tokenizer import BYTE_OFFSET, VOCAB_SIZE, ByteTokenizer


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def finish_fields(meta: dict) -> tuple[str | None, Any]:
    """(finish_reason string, matched_stop) from a native finish_reason object."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason["type"], reason.get("matched")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """sglang's UsageInfo (no cache report, no reasoning parser)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
            "reasoning_tokens": 0, "completion_tokens_details": None}


def response_usage(outs: list[dict], n: int) -> dict:
    """Usage of a whole answer: each prompt once, every sample's completion tokens."""
    prompt = sum(outs[i]["meta_info"].get("prompt_tokens", 0) for i in range(0, len(outs), n))
    return usage(prompt, sum(o["meta_info"].get("completion_tokens", 0) for o in outs))


def weight_metadata(meta: dict) -> dict:
    """`metadata` of an answer: the weight version and its spans over the output tokens."""
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def answer(kind: str, outs: list[dict], choices: list[dict], model: str, n: int,
           created: int) -> dict:
    """A whole non-streamed answer (`text_completion` or `chat.completion`)."""
    return {"id": outs[0]["meta_info"]["id"], "object": kind, "created": created, "model": model,
            "choices": choices, "usage": response_usage(outs, n),
            "metadata": weight_metadata(outs[0]["meta_info"])}


class TokenText:
    """Per-token display text and bytes, lossless for byte-level vocabularies."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer, ByteTokenizer)

    def raw_bytes(self, tid: int, text: str | None) -> list[int]:
        if self.byte_level and BYTE_OFFSET <= tid < VOCAB_SIZE:
            return [tid - BYTE_OFFSET]
        if text is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
        return list(text.encode("utf-8"))

    def text(self, tid: int, text: str | None) -> str:
        """The token's text; a lone byte of a multi-byte character as its latin-1 char."""
        if text is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text and self.byte_level and BYTE_OFFSET <= tid < VOCAB_SIZE:
            return bytes([tid - BYTE_OFFSET]).decode("latin-1")
        return text


def completion_logprobs(tt: TokenText, token_rows: list, top_rows: list | None,
                        text_start: int = 0) -> dict:
    """The legacy logprobs object over native `[logprob, id, text]` rows."""
    tokens, lps, offsets = [], [], []
    pos = text_start
    for lp, tid, text in token_rows:
        tok = tt.text(tid, text)
        tokens.append(tok)
        lps.append(lp)
        offsets.append(pos)
        pos += len(tok)
    tops = [None if row is None else {tt.text(t, s): v for v, t, s in row} for row in (top_rows or [])]
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(tt: TokenText, token_rows: list, top_rows: list | None) -> dict:
    """`choices[].logprobs` of chat: one entry per token, with bytes and top alternatives."""
    content = []
    for k, (lp, tid, text) in enumerate(token_rows):
        tops = []
        row = top_rows[k] if top_rows and k < len(top_rows) else None
        for v, t, s in row or []:
            tops.append({"token": tt.text(t, s), "bytes": tt.raw_bytes(t, s), "logprob": v})
        content.append({"token": tt.text(tid, text), "bytes": tt.raw_bytes(tid, text),
                        "logprob": lp, "top_logprobs": tops})
    return {"content": content}


@dataclass
class StreamCursor:
    """What one choice of a stream has already sent."""

    text_len: int = 0
    tokens: int = 0
    ids: int = 0
    started: bool = False


def stream_delta(out: dict, cursor: StreamCursor, incremental: bool) -> tuple[str, list, list, list]:
    """(new text, new logprob rows, new top rows, new output ids) of one native chunk."""
    meta = out["meta_info"]
    text = out.get("text", "")
    rows = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs", [])
    ids = out.get("output_ids", [])
    if incremental:
        cursor.text_len += len(text)
        cursor.tokens += len(rows)
        cursor.ids += len(ids)
        return text, rows, tops, ids
    if meta.get("finish_reason") is None:
        # A character whose bytes have not all arrived decodes as U+FFFD for now: hold it
        # back until it is complete (sglang's detokenizer waits the same way).
        text = text.rstrip("\ufffd")
    delta = text[cursor.text_len:]
    new_rows, new_tops = rows[cursor.tokens:], tops[cursor.tokens:]
    new_ids = ids[cursor.ids:]
    cursor.text_len, cursor.tokens, cursor.ids = max(cursor.text_len, len(text)), len(rows), len(ids)
    return delta, new_rows, new_tops, new_ids


def chat_chunk(cid: str, created: int, model: str, index: int, *, delta: dict,
               logprobs: dict | None = None, finish_reason: str | None = None,
               matched_stop: Any = None, usage_info: dict | None = None) -> dict:
    """A `chat.completion.chunk` (the delta always carries `reasoning_content`, as sglang's)."""
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": {"reasoning_content": None, **delta},
                          "logprobs": logprobs, "finish_reason": finish_reason,
                          "matched_stop": matched_stop}]}
    if usage_info is not None:
        chunk["usage"] = usage_info
    return chunk
