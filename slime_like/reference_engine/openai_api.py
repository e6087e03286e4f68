"""A minimal OpenAI-compatible `/v1/completions` over the native /generate path.

Only what rollout code calls: a prompt (text or token ids, single or batch), the sampling
fields `/generate` supports, `logprobs`, `n`, streaming. Like sglang, `/v1/*` routes
require `Content-Type: application/json` and answer errors in the ErrorResponse envelope.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from slime_like.protocol import io_struct as p
from slime_like.reference_engine.frontend import EngineUnavailable
from slime_like.reference_engine.sampling import SchemaError


class CompletionRequest(BaseModel):
    """The /v1/completions fields the reference engine honours (others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_token_ids: bool = False

    def generate_body(self) -> dict:
        """The equivalent native /generate body."""
        is_text = isinstance(self.prompt, str) or (
            isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str))
        body: dict[str, Any] = {"text" if is_text else "input_ids": self.prompt, "rid": self.rid,
                                "stream": self.stream}
        sp = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
              "top_k": self.top_k, "min_new_tokens": self.min_tokens, "stop": self.stop,
              "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
              "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
              "n": self.n, "sampling_seed": self.seed}
        body["sampling_params"] = {k: v for k, v in sp.items() if v is not None}
        if self.logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = self.logprobs
        return body


def _finish(reason: dict | None) -> tuple[str | None, Any]:
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def _logprobs(out: dict, tokenizer) -> dict | None:
    """OpenAI's legacy logprobs object from a native output's meta_info."""
    meta = out["meta_info"]
    if "output_token_logprobs" not in meta:
        return None
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for _, t, _ in meta["output_token_logprobs"]]
    top = [{tokenizer.decode([t], skip_special_tokens=False): lp for lp, t, _ in row}
           for row in meta.get("output_top_logprobs", [])]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
            "top_logprobs": top or None, "text_offset": offsets}


def register_openai_routes(app: FastAPI, engine) -> None:
    """Add /v1/completions to the engine's app."""
    frontend = engine.frontend

    def error(message: str, status: int, code: str | None = None) -> JSONResponse:
        body = p.http_exception_body(message, status)
        if code:
            body["code"] = code
        return JSONResponse(body, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions (text_completion objects, SSE chunks when streaming)."""
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise RequestValidationError([{"loc": ("header", "content-type"), "type": "value_error",
                                           "msg": "Unsupported Media Type: Only 'application/json' is allowed"}])
        try:
            req = CompletionRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        if req.model not in (None, engine.served_model_name, engine.model_path):
            return error(f"The model '{req.model}' does not exist.", 404, "model_not_found")
        if req.max_tokens <= 0:
            return error("max_tokens must be positive.", 400)
        try:
            job = frontend.parse(req.generate_body())
        except (SchemaError, ValueError) as e:
            return error(str(e), 400)
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"
        name = engine.served_model_name
        tok = frontend.tokenizer

        if req.stream:
            async def stream() -> AsyncIterator[bytes]:
                sent: dict[int, int] = {}
                try:
                    async for index, out in frontend.run(job):
                        # Native chunks are cumulative; OpenAI chunks carry the new text only.
                        text = out.get("text", "")
                        if frontend.incremental_streaming:
                            delta = text
                        else:
                            delta, sent[index] = text[sent.get(index, 0):], len(text)
                        reason, matched = _finish(out["meta_info"]["finish_reason"])
                        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": reason,
                                  "matched_stop": matched}
                        yield b"data: " + json.dumps({"id": cid, "object": "text_completion",
                                                      "created": created, "model": name,
                                                      "choices": [choice]}).encode() + b"\n\n"
                except (ValueError, EngineUnavailable) as e:
                    yield b"data: " + json.dumps({"error": {"message": str(e)}}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")

        try:
            outs = await frontend.generate(job)
        except ValueError as e:
            return error(str(e), 400)
        except EngineUnavailable as e:
            return error(str(e), 503)
        outs = [outs] if isinstance(outs, dict) else outs
        choices, completion_tokens, versions = [], 0, []
        for i, out in enumerate(outs):
            reason, matched = _finish(out["meta_info"]["finish_reason"])
            choice = {"index": i, "text": out.get("text", ""), "logprobs": _logprobs(out, tok),
                      "finish_reason": reason, "matched_stop": matched}
            if req.return_token_ids:
                choice["token_ids"] = out["output_ids"]
            choices.append(choice)
            completion_tokens += out["meta_info"]["completion_tokens"]
            versions.append(out["meta_info"]["weight_version"])
        prompt_tokens = sum(len(item.prompt_ids) for item in job.items[::max(1, req.n)])
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
                "metadata": {"weight_version": versions[-1] if versions else engine.scheduler.weight_version}}

