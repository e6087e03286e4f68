"""/generate bodies in and out: sglang 0.5.23's contract gate, batch/n expansion, meta_info.

Parsing turns one HTTP body into `GenerateItem`s (a batch of B prompts with n samples is
B*n items, prompt-major); building turns a request's state into sglang's output dict.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.reference_engine.disaggregation import Bootstrap, bootstrap_items
from slime_like.reference_engine.request import Req, weight_version_spans
from slime_like.reference_engine.sampling import (
    SamplingSpec,
    SchemaError,
    _json_desc,
    check_sampling_schema,
    resolve_sampling_params,
)

# One request expands into prompts x n sequences up front; past this it is refused rather
# than allocated (sglang has no bound and would try).
MAX_SEQUENCES_PER_REQUEST = 4096


def _check_or_list(body: dict, key: str, ok, list_name: str, item_type: str) -> None:
    """serde-style type check of a field that is either a value or a list of values."""
    if key not in body or body[key] is None:
        return
    value = body[key]
    if isinstance(value, list):
        for v in value:
            if not ok(v):
                raise SchemaError(f"invalid type: {_json_desc(v)}, expected {item_type}")
    elif not ok(value):
        raise SchemaError(f"invalid type: {_json_desc(value)}, expected a value or an array of "
                          f"values for {list_name}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_generate_schema(body: Any) -> None:
    """The JSON contract sglang 0.5.23 checks before dispatch (answered 400 `{"error": str}`)."""
    if not isinstance(body, dict):
        raise SchemaError(f"invalid type: {_json_desc(body)}, expected struct GenerateRequest")
    _check_or_list(body, "text", lambda v: isinstance(v, str), "StringOrList", "a string")
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise SchemaError(f"invalid type: {_json_desc(ids)}, expected a value or an array of "
                              "values for TokenIdsOrList")
        for row in ids:
            for v in (row if isinstance(row, list) else [row]):
                if not _is_int(v):
                    raise SchemaError(f"invalid type: {_json_desc(v)}, expected i64")
    _check_or_list(body, "rid", lambda v: isinstance(v, str), "StringOrList", "a string")
    _check_or_list(body, "return_logprob", lambda v: isinstance(v, bool), "BoolOrList", "a boolean")
    _check_or_list(body, "logprob_start_len", _is_int, "Int64OrList", "i64")
    _check_or_list(body, "top_logprobs_num", _is_int, "Int64OrList", "i64")
    for key in ("stream", "return_text_in_logprobs", "return_prompt_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise SchemaError(f"invalid type: {_json_desc(body[key])}, expected a boolean")
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, dict | list):
        raise SchemaError(f"invalid type: {_json_desc(sp)}, expected a value or an array of values "
                          "for SamplingParamsOrList")
    for item in sp if isinstance(sp, list) else [sp]:
        check_sampling_schema(item)


@dataclass
class GenerateItem:
    """One sequence to generate: a prompt, its resolved sampling, its rid and logprob options."""

    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    return_logprob: bool
    top_logprobs_num: int
    max_len: int
    input_logprob_start: int | None = None
    bootstrap: Bootstrap | None = None  # PD: where this item's KV hand-off lives


@dataclass
class GenerateJob:
    """A parsed /generate body."""

    items: list[GenerateItem]
    is_single: bool  # answer one object rather than an array
    stream: bool
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    log_metrics: bool = True


def _per_item(value: Any, n_prompts: int, name: str, default: Any) -> list:
    if value is None:
        return [default] * n_prompts
    if isinstance(value, list):
        if len(value) != n_prompts:
            raise ValueError(f"The length of {name} ({len(value)}) should be equal to the batch size ({n_prompts}).")
        return value
    return [value] * n_prompts


def parse_generate(body: dict, *, tokenizer: Tokenizer, vocab_size: int, context_len: int,
                   internal: bool = False, prefill_only: bool = False) -> GenerateJob:
    """A /generate body -> items; raises SchemaError (contract) or ValueError (bad values)."""
    if not internal:
        check_generate_schema(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise ValueError("input_embeds is not supported by the reference engine.")
    if text is None and input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # sglang prefers text when both are given
        is_single = isinstance(text, str)
        prompts = [tokenizer.encode(t) for t in ([text] if is_single else text)]
    else:
        if len(input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        is_single = not isinstance(input_ids[0], list)
        prompts = [list(input_ids)] if is_single else [list(r) for r in input_ids]
    n_prompts = len(prompts)
    if n_prompts == 0:
        raise ValueError("The batch is empty: give at least one prompt.")
    sp = body.get("sampling_params")
    sps = _per_item(sp, n_prompts, "sampling_params", {})
    n_values = {(s or {}).get("n") or 1 for s in sps}
    if len(n_values) > 1:
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    n = n_values.pop()
    if isinstance(n, int) and n_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        raise ValueError(f"{n_prompts} prompts x n={n} is more than the "
                         f"{MAX_SEQUENCES_PER_REQUEST} sequences one request may ask for.")
    if n > 1 and any(isinstance(body.get(k), list) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num")):
        raise ValueError("Cannot use list return_logprob with parallel_sample_num > 1")
    return_logprob = _per_item(body.get("return_logprob"), n_prompts, "return_logprob", False)
    start_lens = _per_item(body.get("logprob_start_len"), n_prompts, "logprob_start_len", -1)
    top_nums = _per_item(body.get("top_logprobs_num"), n_prompts, "top_logprobs_num", 0)
    rid = body.get("rid")
    if n > 1:
        # sglang gives every sample a fresh rid; the caller's rid only names an internal warm-up.
        rids = [uuid.uuid4().hex for _ in range(n_prompts * n)]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(n_prompts)]
    elif is_single:
        if not isinstance(rid, str):
            raise ValueError("The rid should be a string for a single request.")
        rids = [rid]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n_prompts)]
    else:
        if len(rid) != n_prompts:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    if len(set(rids)) != len(rids):
        dups = sorted({r for r in rids if rids.count(r) > 1})
        raise ValueError(f"Duplicate request IDs detected within the request: {dups}")
    bootstraps = [None] * (n_prompts * n) if internal else bootstrap_items(body, n_prompts, n)

    items: list[GenerateItem] = []
    for i, prompt in enumerate(prompts):
        for tid in prompt:
            if not 0 <= tid < vocab_size:
                raise ValueError(f"Token id {tid} in input_ids is out of the vocabulary range [0, {vocab_size}).")
        if not prompt:
            raise ValueError("The prompt is empty after tokenization.")
        spec = resolve_sampling_params(sps[i], vocab_size)
        if len(prompt) >= context_len:
            raise ValueError(f"The input ({len(prompt)} tokens) is longer than the model's context "
                             f"length ({context_len} tokens).")
        if spec.max_new_tokens is not None and spec.max_new_tokens + len(prompt) > context_len:
            total = spec.max_new_tokens + len(prompt)
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context_len} "
                f"tokens. You requested a total of {total} tokens: {len(prompt)} tokens from the input "
                f"messages and {spec.max_new_tokens} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit.")
        start = start_lens[i]
        if start is not None and start > len(prompt):
            raise ValueError(f"logprob_start_len ({start}) is larger than the input length ({len(prompt)}).")
        # -1 (sglang's default) starts the window at the prompt's end: no prompt logprobs.
        input_start = start if return_logprob[i] and start is not None and 0 <= start < len(prompt) else None
        if prefill_only:
            # PD prefill server: prefill and acknowledge; the decode server generates.
            spec.max_new_tokens = min(1, spec.max_new_tokens if spec.max_new_tokens is not None else 1)
        if top_nums[i] and top_nums[i] < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_nums[i]}.")
        max_len = len(prompt) + (spec.max_new_tokens if spec.max_new_tokens is not None
                                 else context_len - len(prompt))
        for j in range(n):
            items.append(GenerateItem(
                rid=rids[i * n + j], prompt_ids=prompt, spec=spec,
                return_logprob=bool(return_logprob[i]), top_logprobs_num=int(top_nums[i] or 0),
                max_len=max_len, input_logprob_start=input_start, bootstrap=bootstraps[i * n + j]))
    return GenerateJob(
        items=items, is_single=is_single and n == 1, stream=bool(body.get("stream")),
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
        log_metrics=body.get("log_metrics", True) is not False,
    )


def _trim_at_stop(text: str, stop: str | None) -> str:
    if stop is None:
        return text
    cut = text.find(stop)
    return text if cut < 0 else text[:cut]


def build_output(req: Req, n_out: int, finished: bool, version: str, *, job: GenerateJob,
                 tokenizer: Tokenizer | None, start: int = 0) -> dict:
    """sglang's /generate output for `req` after n_out tokens; `start` > 0 gives a delta chunk."""
    out_ids = req.ids[len(req.prompt_ids):len(req.prompt_ids) + n_out]
    spans = weight_version_spans(req.version_events, version, n_out)
    meta: dict[str, Any] = {"id": req.rid, "finish_reason": req.finish if finished else None}
    waiting_abort = finished and req.finish is not None and req.finish.get("message") == "Abort in waiting queue"
    if not waiting_abort:
        meta.update({"prompt_tokens": len(req.prompt_ids), "completion_tokens": n_out,
                     "cached_tokens": req.cached_tokens, "reasoning_tokens": 0,
                     "num_retractions": req.num_retractions})
    else:
        meta["completion_tokens"] = n_out
    meta["weight_version"] = spans[-1]["version"]
    meta["weight_versions"] = spans
    if req.return_logprob:
        def text_of(tok: int) -> str | None:
            return tokenizer.decode([tok], skip_special_tokens=False) if job.return_text_in_logprobs and tokenizer else None

        lps = req.output_logprobs[start:n_out]
        meta["input_token_logprobs"] = [[lp, tok, text_of(tok)] for lp, tok in req.input_logprobs]
        meta["output_token_logprobs"] = [[lp, tok, text_of(tok)] for lp, tok in zip(lps, out_ids[start:], strict=False)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [
                None if row is None else [[lp, tok, text_of(tok)] for lp, tok in row]
                for row in req.input_top_logprobs]
            meta["output_top_logprobs"] = [
                [[lp, tok, text_of(tok)] for lp, tok in row] for row in req.output_top_logprobs[start:n_out]]
    if finished:
        now = time.time()
        meta["e2e_latency"] = time.perf_counter() - req.created
        meta["response_sent_to_client_ts"] = now
    out: dict[str, Any] = {}
    if tokenizer is not None:
        text = tokenizer.decode(out_ids, skip_special_tokens=req.spec.skip_special_tokens)
        if not req.spec.no_stop_trim:
            text = _trim_at_stop(text, req.matched_stop_str)
        if start:
            prev = tokenizer.decode(out_ids[:start], skip_special_tokens=req.spec.skip_special_tokens)
            text = text[len(prev):]
        out["text"] = text
    out["output_ids"] = out_ids[start:]
    out["meta_info"] = meta
    if job.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.prompt_ids)
    return out
