"""SGLang 0.5.23's OpenAI-compatible routes over the native /generate path.

`/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template renders the
messages), `/v1/models` and `/v1/models/{model}`. As in sglang: `/v1/*` posts need
`Content-Type: application/json`; any `model` name is served (only a `base:adapter` LoRA
suffix means something, and this engine serves no adapters); errors use the ErrorResponse
envelope. Every field of sglang's request schema is implemented, has no effect in sglang
either, or is refused with a 400 naming it (`protocol/openai_struct.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from slime_like.protocol.openai_struct import ChatCompletionRequest, CompletionRequest
from slime_like.reference_engine.chat_prompt import ChatPrompter
from slime_like.reference_engine.client_watch import ClientGone, unless_client_gone
from slime_like.reference_engine.disaggregation import HandoffError
from slime_like.reference_engine.frontend import EngineUnavailable
from slime_like.reference_engine.generate_io import GenerateJob
from slime_like.reference_engine.openai_format import (
    DONE,
    StreamCursor,
    TokenText,
    answer,
    chat_chunk,
    chat_logprobs,
    completion_logprobs,
    finish_fields,
    sse,
    stream_delta,
    usage,
)
from slime_like.reference_engine.sampling import SchemaError

_SERVING_ERRORS = (ValueError, EngineUnavailable, HandoffError)


def error_response(message: str, status: int = 400, err_type: str = "BadRequest") -> JSONResponse:
    """sglang's ErrorResponse envelope."""
    return JSONResponse({"object": "error", "message": message, "type": err_type, "param": None,
                         "code": status}, status_code=status)


def _serving_error(e: Exception) -> JSONResponse:
    if isinstance(e, EngineUnavailable):
        return error_response(str(e), 503, "ServiceUnavailable")
    if isinstance(e, HandoffError):
        return error_response(str(e), e.status_code, "InternalServerError")
    return error_response(str(e))


def _stream_error(e: Exception) -> bytes:
    status = 503 if isinstance(e, EngineUnavailable) else getattr(e, "status_code", 400)
    return sse({"error": {"object": "error", "message": str(e), "type": "BadRequestError",
                          "param": None, "code": status}})


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _adapter_of(model: str, served: str) -> str | None:
    """sglang's `base:adapter` LoRA syntax (an exact served name never splits)."""
    if ":" not in model or model == served:
        return None
    if model.startswith(served + ":"):
        return model[len(served) + 1:].strip() or None
    return model.split(":", 1)[1].strip() or None


def register_openai_routes(app: FastAPI, engine) -> None:
    """Add the OpenAI routes to the engine's app."""
    frontend = engine.frontend
    token_text = TokenText(frontend.tokenizer)
    prompter = ChatPrompter(engine.tokenizer, engine.args.all_args.get("tokenizer_path")
                            or engine.model_path)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise RequestValidationError([{"loc": ("header", "content-type"), "type": "value_error",
                                           "msg": "Unsupported Media Type: Only 'application/json' is allowed"}])
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False, include_context=False)) from e

    def check(req: CompletionRequest | ChatCompletionRequest) -> JSONResponse | None:
        refused = req.refused()
        if refused:
            return error_response(f"{', '.join(refused)}: not supported by the reference engine "
                                  "(sglang implements it; this engine refuses rather than ignores it)")
        adapter = _adapter_of(req.model, engine.served_model_name)
        if adapter is not None:
            return error_response(f"model {req.model!r} asks for the LoRA adapter {adapter!r}; "
                                  "this server serves no LoRA adapters")
        return None

    def job_of(body: dict) -> GenerateJob:
        try:
            return frontend.parse(body)
        except SchemaError as e:  # the native gate's message names the field
            raise ValueError(str(e)) from e

    async def launch(request: Request, body: dict, stream: bool
                     ) -> tuple[list[dict] | None, AsyncIterator | None, tuple[int, dict] | None]:
        """(outputs, None, None), or (None, the stream, its first output): a stream is started
        before the answer begins, so a refusal is still an HTTP error (sglang does the same).
        A client that goes away before its answer has its request aborted (ClientGone)."""
        job = job_of(body)
        if not stream:
            outs = await unless_client_gone(request, frontend.generate(job))
            return ([outs] if isinstance(outs, dict) else outs), None, None
        events = frontend.run(job).__aiter__()
        return None, events, await events.__anext__()

    # ---- models ----------------------------------------------------------------------------

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(engine.started), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": engine.context_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(engine.served_model_name)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model != engine.served_model_name:
            return JSONResponse({"error": {"message": f"The model '{model}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        return card(model)

    # ---- completions -----------------------------------------------------------------------

    def echo_texts(req: CompletionRequest) -> list[str]:
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return list(prompt)
        rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        return [engine.tokenizer.decode(list(r), skip_special_tokens=True) for r in rows]

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions (text_completion objects, SSE chunks when streaming)."""
        req: CompletionRequest = await parse(request, CompletionRequest)
        prompt = req.prompt
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            return error_response("Prompt cannot be empty")
        if (refusal := check(req)) is not None:
            return refusal
        is_text = isinstance(prompt, str) or isinstance(prompt[0], str)
        sampling = {"temperature": req.temperature, "max_new_tokens": req.max_tokens,
                    "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
                    "repetition_penalty": req.repetition_penalty, **req.common_sampling()}
        prompt_logprobs = bool(req.echo and req.logprobs)
        body = {"text" if is_text else "input_ids": prompt, "sampling_params": _clean(sampling),
                "stream": req.stream, "return_logprob": req.logprobs is not None,
                "top_logprobs_num": req.logprobs or 0,
                "logprob_start_len": 0 if prompt_logprobs else -1,
                "return_text_in_logprobs": True, "return_prompt_token_ids": req.return_token_ids,
                **req.routing()}
        echoes = echo_texts(req) if req.echo else []
        try:
            outs, stream, first = await launch(request, body, req.stream)
        except _SERVING_ERRORS as e:
            return _serving_error(e)
        except ClientGone:
            return Response(status_code=499)
        created = int(time.time())

        def choice_logprobs(out: dict, rows: list, tops: list, first: bool, start: int) -> dict | None:
            if req.logprobs is None:
                return None
            meta = out["meta_info"]
            if first and prompt_logprobs:
                rows = meta.get("input_token_logprobs", []) + rows
                tops = meta.get("input_top_logprobs", []) + tops
            if not rows:
                return None
            return completion_logprobs(token_text, rows, tops, start)

        if not req.stream:
            choices = []
            for i, out in enumerate(outs):
                meta = out["meta_info"]
                reason, matched = finish_fields(meta)
                text = (echoes[i // req.n] if echoes else "") + out.get("text", "")
                lp = choice_logprobs(out, meta.get("output_token_logprobs", []),
                                     meta.get("output_top_logprobs", []), True, 0)
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                          "matched_stop": matched}
                if req.return_token_ids:
                    choice["token_ids"] = out["output_ids"]
                    choice["prompt_token_ids"] = out.get("prompt_token_ids")
                choices.append(choice)
            return answer("text_completion", outs, choices, req.model, req.n, created)

        tally = StreamTally(first[1]["meta_info"]["id"], req.stream_options)
        sent_chars: dict[int, int] = {}

        def completion_chunks(index: int, out: dict) -> list[bytes]:
            cur, reason, matched = tally.cursors[index], *finish_fields(out["meta_info"])
            is_first = not cur.started
            text, rows, tops, ids = stream_delta(out, cur, frontend.incremental_streaming)
            if is_first and echoes:
                text = echoes[index // req.n] + text
            start = sent_chars.get(index, 0)
            lp = choice_logprobs(out, rows, tops, is_first, start)
            sent_chars[index] = start + len(text)
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason,
                      "matched_stop": matched}
            if req.return_token_ids:
                choice["token_ids"] = ids
                if is_first:
                    choice["prompt_token_ids"] = out.get("prompt_token_ids")
            cur.started = True
            chunk = {"id": tally.cid, "object": "text_completion", "created": created,
                     "model": req.model, "choices": [choice]}
            if tally.continuous:
                chunk["usage"] = tally.usage_of(index)
            return [sse(chunk)]

        def completion_tail() -> list[bytes]:
            if not tally.include_usage:
                return []
            info = {k: v for k, v in tally.total_usage(req.n).items() if v is not None}
            return [sse({"id": tally.cid, "object": "text_completion", "created": created,
                         "model": req.model, "choices": [], "usage": info})]

        return StreamingResponse(_events(first, stream, tally, completion_chunks, completion_tail),
                                 media_type="text/event-stream")

    # ---- chat completions ------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions (chat.completion objects, chunks when streaming)."""
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        if not req.messages:
            return error_response("Messages cannot be empty.")
        if req.tool_choice == "required" and not req.tools:
            return error_response("Tools cannot be empty if tool choice is set to required.")
        if (refusal := check(req)) is not None:
            return refusal
        limit = req.max_new_tokens()
        if limit and limit > engine.context_len:
            return error_response(f"max_completion_tokens is too large: {limit}.This model "
                                  f"supports at most {engine.context_len} completion tokens.")
        if req.stream:
            for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if getattr(req, flag):
                    return error_response(f"{flag} is not supported with streaming. Please set "
                                          f"stream=false when using {flag}=true.")
        sampling = {"temperature": 1.0 if req.temperature is None else req.temperature,
                    "max_new_tokens": limit, "top_p": 1.0 if req.top_p is None else req.top_p,
                    "top_k": -1 if req.top_k is None else req.top_k,
                    "min_p": req.min_p or 0.0,
                    "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    **req.common_sampling()}
        sampling = _clean(sampling)
        sampling["max_new_tokens"] = limit  # null: up to the context, as in sglang
        try:
            ids = prompter.prompt_ids(req)
            body = {"input_ids": ids, "sampling_params": sampling, "stream": req.stream,
                    "return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs or 0,
                    "return_text_in_logprobs": True,
                    "return_prompt_token_ids": req.return_prompt_token_ids or req.return_token_ids,
                    **req.routing()}
            outs, stream, first = await launch(request, body, req.stream)
        except _SERVING_ERRORS as e:
            return _serving_error(e)
        except ClientGone:
            return Response(status_code=499)
        created = int(time.time())

        if not req.stream:
            choices = []
            for i, out in enumerate(outs):
                meta = out["meta_info"]
                reason, matched = finish_fields(meta)
                lp = (chat_logprobs(token_text, meta.get("output_token_logprobs", []),
                                    meta.get("output_top_logprobs"))
                      if req.logprobs else None)
                choice = {"index": i, "message": {"role": "assistant", "content": out.get("text", ""),
                                                  "reasoning_content": None},
                          "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
                if req.return_prompt_token_ids or req.return_token_ids:
                    choice["prompt_token_ids"] = out.get("prompt_token_ids")
                if req.return_token_ids:
                    choice["response_token_ids"] = out["output_ids"]
                if req.return_meta_info:
                    choice["meta_info"] = meta
                choices.append(choice)
            return answer("chat.completion", outs, choices, req.model, req.n, created)

        tally = StreamTally(first[1]["meta_info"]["id"], req.stream_options)
        finished: dict[int, tuple[str, Any]] = {}

        def chat_chunks(index: int, out: dict) -> list[bytes]:
            cur, reason, matched = tally.cursors[index], *finish_fields(out["meta_info"])
            chunks = []
            if not cur.started:
                cur.started = True
                chunks.append(sse(chat_chunk(tally.cid, created, req.model, index,
                                             delta={"role": "assistant", "content": ""})))
            text, rows, tops, _ = stream_delta(out, cur, frontend.incremental_streaming)
            lp = chat_logprobs(token_text, rows, tops) if req.logprobs and rows else None
            # Unlike sglang, a step whose tokens add no text (a special token, part of a
            # character) still sends its logprobs, so every token's logprob arrives.
            if text or lp:
                chunks.append(sse(chat_chunk(
                    tally.cid, created, req.model, index, delta={"content": text}, logprobs=lp,
                    usage_info=tally.usage_of(index) if tally.continuous else None)))
            if reason is not None:
                finished[index] = (reason, matched)
            return chunks

        def chat_tail() -> list[bytes]:
            chunks = [sse(chat_chunk(tally.cid, created, req.model, index, delta={},
                                     finish_reason=reason, matched_stop=matched))
                      for index, (reason, matched) in finished.items()]
            if tally.include_usage:
                chunks.append(sse({"id": tally.cid, "object": "chat.completion.chunk",
                                   "created": created, "model": req.model, "choices": [],
                                   "usage": tally.total_usage(req.n)}))
            return chunks

        return StreamingResponse(_events(first, stream, tally, chat_chunks, chat_tail),
                                 media_type="text/event-stream")


async def _events(first: tuple[int, dict], rest: AsyncIterator, tally: StreamTally,
                  chunks_of: Callable[[int, dict], list[bytes]],
                  tail: Callable[[], list[bytes]]) -> AsyncIterator[bytes]:
    """An OpenAI event stream: chunks per native output, the tail, `[DONE]`; a failure
    mid-stream is an `error` event, and a client that went away has its requests aborted."""
    try:
        async for index, out in _chain(first, rest):
            if (error := tally.see(index, out)) is not None:
                yield error
                break
            for chunk in chunks_of(index, out):
                yield chunk
        else:
            for chunk in tail():
                yield chunk
    except _SERVING_ERRORS as e:
        yield _stream_error(e)
    finally:
        await rest.aclose()
    yield DONE


async def _chain(first: tuple[int, dict], rest: AsyncIterator) -> AsyncIterator[tuple[int, dict]]:
    yield first
    async for item in rest:
        yield item


class StreamTally:
    """Per-choice cursors and token counts of one stream, and its usage options."""

    def __init__(self, cid: str, options: Any):
        self.cid = cid
        self.include_usage = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)
        self.cursors: dict[int, StreamCursor] = {}
        self.counts: dict[int, tuple[int, int]] = {}

    def see(self, index: int, out: dict) -> bytes | None:
        """Record a native output; the error event if the scheduler aborted it with a status."""
        meta = out["meta_info"]
        self.cid = meta["id"]
        self.counts[index] = (meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0))
        self.cursors.setdefault(index, StreamCursor())
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            return _stream_error(ValueError(reason.get("message", "Aborted")))
        return None

    def usage_of(self, index: int) -> dict:
        return usage(*self.counts[index])

    def total_usage(self, n: int) -> dict:
        prompt = sum(p for i, (p, _) in self.counts.items() if i % n == 0)
        return usage(prompt, sum(c for _, c in self.counts.values()))
