"""/generate as sglang 0.5.23 answers it, checked against a local copy of the same model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading

import pytest
import requests
import torch

from slime_like.models.loading import load_pretrained
from slime_like.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def local_model(tiny_model_dir):
    return load_pretrained(tiny_model_dir)


def recomputed_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """What the trainer computes: log_softmax of a full forward, at the sampled tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids]))[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt_ids) - 1 + k, tok].item() for k, tok in enumerate(output_ids)]


def greedy_continuation(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_greedy_output_equals_local_model_and_meta_info_is_complete(engine, local_model):
    prompt = "The quick brown fox"
    r = engine.generate({"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                               "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == greedy_continuation(local_model, TOK.encode(prompt), 12)
    assert out["text"] == TOK.decode(out["output_ids"])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(TOK.encode(prompt))
    assert meta["completion_tokens"] == 12
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    assert "cached_tokens" in meta and "output_token_logprobs" not in meta


def test_sampled_logprobs_match_trainer_recompute_to_1e5(engine, local_model):
    prompts = [TOK.encode(f"sample {i} of a batch") for i in range(4)]
    r = engine.generate({"input_ids": prompts, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 4
    for prompt, out in zip(prompts, outs, strict=True):
        meta = out["meta_info"]
        assert meta["input_token_logprobs"] == []
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
        expected = recomputed_logprobs(local_model, prompt, out["output_ids"])
        assert max(abs(a - t[0]) for a, t in zip(expected, triples, strict=True)) < 1e-5


def test_prompt_logprobs_from_logprob_start_len_match_recompute(engine, local_model):
    prompt = TOK.encode("prompt logprobs please")
    engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})  # cache it
    out = engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                           "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}).json()
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    with torch.no_grad():
        lp = torch.log_softmax(local_model(torch.tensor([prompt]))[0].float(), -1)
    for pos in range(1, len(prompt)):
        assert abs(entries[pos][0] - lp[pos - 1, prompt[pos]].item()) < 1e-5
    tail = engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 5,
                            "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert [e[1] for e in tail["input_token_logprobs"]] == prompt[5:]


def test_temperature_scaled_logprob_is_that_of_the_scaled_distribution(engine, local_model):
    prompt = TOK.encode("temperature")
    out = engine.generate({"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.5, "sampling_seed": 7, "ignore_eos": True}}).json()
    with torch.no_grad():
        logits = local_model(torch.tensor([prompt + out["output_ids"]]))[0].float() / 0.5
    lp = torch.log_softmax(logits, -1)
    for k, (got, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp[len(prompt) - 1 + k, tok].item() - got) < 1e-5


def test_sampling_seed_makes_sampling_reproducible(engine):
    body = {"text": "seeded", "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                                  "sampling_seed": 1234, "ignore_eos": True}}
    a, b = engine.generate(body).json(), engine.generate(body).json()
    other = engine.generate({**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 99}}).json()
    assert a["output_ids"] == b["output_ids"]
    assert other["output_ids"] != a["output_ids"]


def test_top_k_one_is_greedy_and_top_p_keeps_only_likely_tokens(engine, local_model):
    prompt = TOK.encode("top-k and top-p")
    greedy = greedy_continuation(local_model, prompt, 6)
    out = engine.generate({"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "top_k": 1, "temperature": 1.0, "ignore_eos": True}}).json()
    assert out["output_ids"] == greedy
    out = engine.generate({"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "top_p": 1e-6, "temperature": 1.0, "ignore_eos": True}}).json()
    assert out["output_ids"] == greedy


def test_batch_with_string_rid_gets_suffixed_rids_in_input_order(engine):
    r = engine.generate({"input_ids": [TOK.encode("a"), TOK.encode("bb"), TOK.encode("ccc")],
                         "rid": "batch", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["batch_0", "batch_1", "batch_2"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 2, 3]


def test_n_samples_are_an_array_prompt_major_with_fresh_rids(engine):
    r = engine.generate({"input_ids": [TOK.encode("x"), TOK.encode("yy")], "rid": "mine",
                         "sampling_params": {"n": 3, "max_new_tokens": 4, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 1, 1, 2, 2, 2]
    rids = [o["meta_info"]["id"] for o in outs]
    assert len(set(rids)) == 6 and not any(rid.startswith("mine") for rid in rids)
    single = engine.generate({"text": "one", "sampling_params": {"n": 2, "max_new_tokens": 2}}).json()
    assert isinstance(single, list) and len(single) == 2


def test_stop_string_stop_token_and_eos_finish_reasons(engine, local_model):
    prompt = TOK.encode("stop reasons")
    greedy = greedy_continuation(local_model, prompt, 8)
    stop_tok = greedy[3]
    out = engine.generate({"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_tok], "ignore_eos": True}}).json()
    first = greedy.index(stop_tok)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["output_ids"] == greedy[:first + 1]
    text = TOK.decode(greedy)
    stop_str = next((text[i:i + 1] for i in range(1, len(text)) if text[i:i + 1].strip()), None)
    if stop_str:
        out = engine.generate({"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "stop": [stop_str], "ignore_eos": True}}).json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert stop_str not in out["text"]


def test_unknown_sampling_key_is_a_400_with_sglang_string_envelope(engine):
    r = engine.generate({"text": "hi", "sampling_params": {"max_new_tokens": 2, "foo": 1}})
    assert r.status_code == 400
    body = r.json()
    assert isinstance(body["error"], str)
    assert body["error"].startswith("unknown field `foo`, expected one of `max_new_tokens`")
    r = engine.generate({"text": "hi", "sampling_params": {"max_new_tokens": "x"}})
    assert r.status_code == 400 and r.json() == {"error": 'invalid type: string "x", expected i64'}


def test_bad_sampling_values_and_long_inputs_are_400_with_message_envelope(engine):
    r = engine.generate({"text": "hi", "sampling_params": {"top_p": 0}})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}
    info = engine.get("/server_info").json()
    too_long = [5] * info["context_length"]
    r = engine.generate({"input_ids": too_long})
    assert r.status_code == 400
    assert "is longer than the model's context length" in r.json()["error"]["message"]
    r = engine.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": info["context_length"]}})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = engine.generate({"sampling_params": {}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Either text, input_ids or input_embeds should be provided."


def test_missing_body_is_a_400_validation_envelope(engine):
    r = requests.post(engine.url + "/generate", timeout=10)
    assert r.status_code == 400
    body = r.json()
    assert body["object"] == "error" and body["type"] == "Bad Request" and body["code"] == 400
    r = requests.post(engine.url + "/pause_generation", timeout=10)
    assert r.status_code == 400 and "Field required" in r.json()["message"]


def test_duplicate_live_rid_is_refused(engine):
    first: dict = {}

    def long_request():
        first["r"] = engine.generate({"text": "dup", "rid": "dup-rid", "sampling_params": {
            "max_new_tokens": 1000, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    try:
        while engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
            assert t.is_alive()
        r = engine.generate({"text": "dup", "rid": "dup-rid", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "Duplicate request ID detected: dup-rid"}}
    finally:
        engine.post("/abort_request", {"rid": "dup-rid"})
        t.join(timeout=30)
    assert first["r"].json()["meta_info"]["finish_reason"]["message"] == "Aborted"


def test_router_injected_default_keys_are_tolerated(engine):
    body = {"text": "hi", "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
            "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": False,
            "stream": False, "log_metrics": True, "return_hidden_states": False, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False, "rid": "router-keys"}
    r = engine.generate(body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["id"] == "router-keys"
    assert len(meta["output_top_logprobs"]) == 3 and all(len(row) == 2 for row in meta["output_top_logprobs"])


def test_stream_sends_cumulative_chunks_then_done(engine):
    with requests.post(engine.url + "/generate", json={
            "text": "stream me", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}, stream=True, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert chunks[-1]["output_ids"][:5] == chunks[-2]["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 6


def test_batch_stream_chunks_carry_their_index(engine):
    with requests.post(engine.url + "/generate", json={
            "input_ids": [[10, 11], [12, 13]], "stream": True,
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}, stream=True, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted({c["index"] for c in chunks}) == [0, 1]
    assert sum(1 for c in chunks if c["meta_info"]["finish_reason"]) == 2


def test_prefix_cache_reuses_a_shared_prompt_and_reports_cached_tokens(engine):
    prefix = TOK.encode("a long shared system prompt, the same for every request: ")
    body = {"input_ids": prefix + TOK.encode("one"), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = engine.generate(body).json()
    again = engine.generate({**body, "input_ids": prefix + TOK.encode("two")}).json()
    assert again["meta_info"]["cached_tokens"] >= len(prefix)
    assert first["meta_info"]["cached_tokens"] < len(prefix)
    same = engine.generate(body).json()  # cached KV gives the same greedy tokens
    assert same["output_ids"] == first["output_ids"]


def test_concurrent_requests_are_batched_and_all_complete(engine):
    def one(i: int) -> dict:
        return engine.generate({"text": f"concurrent {i}", "sampling_params": {
            "max_new_tokens": 20, "ignore_eos": True}}).json()

    before = engine.get("/server_info").json()["internal_states"][0]["forward_steps"]
    with cf.ThreadPoolExecutor(12) as ex:
        outs = list(ex.map(one, range(12)))
    after = engine.get("/server_info").json()["internal_states"][0]["forward_steps"]
    assert all(o["meta_info"]["completion_tokens"] == 20 for o in outs)
    # 12 x 20 tokens took far fewer steps than 240: requests shared decode steps.
    assert after - before < 12 * 20 / 2
