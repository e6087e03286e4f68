"""The reference engine serves a checkpoint saved by transformers, with its own tokenizer."""

from __future__ import annotations

import pytest
import torch

from slime_like.models.hf_checkpoint import load_transformers_model
from slime_like.models.hf_tokenizer import load_tokenizer
from tests.models.hf_helpers import write_hf_checkpoint
from tests.reference_engine.conftest import start_engine, stop_engine

pytest.importorskip("transformers")


def test_engine_tokenizes_text_with_the_checkpoint_tokenizer_and_matches_transformers(
        tmp_path):
    ckpt = write_hf_checkpoint(tmp_path / "qwen3", "qwen3", tie=True, shard=True)
    engine = start_engine(ckpt, tmp_path)
    try:
        r = engine.generate({"text": "What is 3+4? Answer: ", "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 6, "temperature": 1.0,
                                                 "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        # /v1/chat/completions renders the checkpoint's template (jinja2, no transformers in
        # the engine) exactly as transformers does, and encodes it without added specials
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 3+4?"}]
        chat = engine.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                    "return_prompt_token_ids": True})
        assert chat.status_code == 200, chat.text
    finally:
        stop_engine(engine)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(ckpt))
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.json()["choices"][0]["prompt_token_ids"] == hf.encode(rendered,
                                                                      add_special_tokens=False)
    tok = load_tokenizer(ckpt)
    prompt = tok.encode("What is 3+4? Answer: ")
    assert out["meta_info"]["prompt_tokens"] == len(prompt)
    assert out["text"] == tok.decode(out["output_ids"])
    # every sampled token's engine logprob equals transformers' in fp32
    model = load_transformers_model(ckpt)
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    got = [lp for lp, _tok, _text in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(expected, abs=1e-5)
