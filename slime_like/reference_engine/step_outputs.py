"""What one forward pass means for each request: its new token, the logprobs it asked
for, and whether it is done.

Apart from the scheduler (which owns the thread, the queues and the KV pool) because these
are pure functions of a request and its row of logits: the same rules sglang applies per
request after a batch's forward (prompt logprobs from `logprob_start_len`, top-k logprobs,
stop tokens, stop strings, `ignore_eos`, `min_new_tokens`, the length limits).
"""

from __future__ import annotations

import torch

from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.reference_engine.request import Req


def prompt_logprobs(r: Req, row_logits: torch.Tensor, kv_start: int) -> None:
    """Logprobs of prompt tokens from the window start (the first prompt token has none),
    with the top-k at each position where asked; `kv_start`: the row's first position."""
    lp = torch.log_softmax(row_logits.float(), dim=-1)
    prompt = r.prompt_ids
    out: list[tuple[float | None, int]] = []
    tops: list[list[tuple[float, int]] | None] = []
    k = min(r.top_logprobs_num, lp.shape[-1])
    for pos in range(r.input_logprob_start, len(prompt)):
        if pos == 0:
            out.append((None, prompt[0]))
            tops.append(None)
        else:
            out.append((lp[pos - 1 - kv_start, prompt[pos]].item(), prompt[pos]))
            if k:
                vals, idx = lp[pos - 1 - kv_start].topk(k)
                tops.append(list(zip(vals.tolist(), idx.tolist(), strict=True)))
    r.input_logprobs = out
    r.input_top_logprobs = tops if k else []


def append_token(r: Req, tok: int, logprob: float | None,
                 logprobs_row: torch.Tensor | None) -> None:
    """The sampled token onto the request, with its logprob (and top-k) where asked."""
    r.ids.append(tok)
    if logprob is None:
        return
    r.output_logprobs.append(logprob)
    if r.top_logprobs_num and logprobs_row is not None:
        vals, idx = logprobs_row.topk(min(r.top_logprobs_num, logprobs_row.shape[-1]))
        r.output_top_logprobs.append(list(zip(vals.tolist(), idx.tolist(), strict=True)))


def stop_reason(r: Req, tok: int, eos_id: int | None, context_len: int,
                tokenizer: Tokenizer) -> dict | None:
    """sglang's finish reason for the request after `tok`, or None while it goes on."""
    n_out = r.num_output
    spec = r.spec
    if n_out >= spec.min_new_tokens:
        if tok == eos_id and not spec.ignore_eos:
            return {"type": "stop", "matched": tok}
        if tok in spec.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if spec.stop_strs:
            longest = max(len(s.encode()) for s in spec.stop_strs)
            tail = tokenizer.decode(r.ids[len(r.prompt_ids):][-(longest + 3):])
            for s in spec.stop_strs:
                if s in tail:
                    r.matched_stop_str = s
                    return {"type": "stop", "matched": s}
    if len(r.ids) >= r.max_len or len(r.ids) >= context_len:
        return {"type": "length", "length": n_out}
    return None
