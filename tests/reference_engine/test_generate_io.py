"""Parsing and output building of /generate, without a server."""

from __future__ import annotations

import pytest

from slime_like.models.tokenizer import ByteTokenizer
from slime_like.reference_engine.generate_io import build_output, parse_generate
from slime_like.reference_engine.request import Req
from slime_like.reference_engine.sampling import SchemaError

TOK = ByteTokenizer()


def parse(body: dict, **kw):
    return parse_generate(body, tokenizer=TOK, vocab_size=259, context_len=1024, **kw)


def test_prefill_server_of_a_pd_pair_only_acknowledges_with_one_token():
    job = parse({"text": "hello", "sampling_params": {"max_new_tokens": 50}}, prefill_only=True)
    assert job.items[0].spec.max_new_tokens == 1
    assert parse({"text": "hello", "sampling_params": {"max_new_tokens": 50}}).items[0].spec.max_new_tokens == 50


def test_batch_list_rids_must_match_the_batch_and_be_unique():
    with pytest.raises(ValueError, match="mismatch with the batch_size"):
        parse({"input_ids": [[5], [6]], "rid": ["a"]})
    with pytest.raises(ValueError, match="Duplicate request IDs detected within the request"):
        parse({"input_ids": [[5], [6]], "rid": ["a", "a"]})
    with pytest.raises(ValueError, match="out of the vocabulary range"):
        parse({"input_ids": [5, 999]})
    with pytest.raises(SchemaError, match="expected struct GenerateRequest"):
        parse([1, 2])
    with pytest.raises(SchemaError, match="expected a boolean"):
        parse({"text": "x", "stream": "yes"})


def test_incremental_stream_chunks_are_deltas_and_cumulative_ones_are_not():
    job = parse({"text": "ab", "stream": True, "return_logprob": True})
    item = job.items[0]
    req = Req(rid="r", prompt_ids=item.prompt_ids, spec=item.spec, max_len=item.max_len,
              return_logprob=True)
    req.ids += [TOK.encode("x")[0], TOK.encode("y")[0], TOK.encode("z")[0]]
    req.output_logprobs = [-1.0, -2.0, -3.0]
    full = build_output(req, 3, False, "v", job=job, tokenizer=TOK)
    delta = build_output(req, 3, False, "v", job=job, tokenizer=TOK, start=2)
    assert full["text"] == "xyz" and full["output_ids"] == TOK.encode("xyz")
    assert delta["text"] == "z" and delta["output_ids"] == TOK.encode("z")
    assert delta["meta_info"]["output_token_logprobs"] == [[-3.0, TOK.encode("z")[0], None]]
    assert full["meta_info"]["finish_reason"] is None
