"""The minimal OpenAI-compatible /v1/completions route."""

from __future__ import annotations

import json

import requests


def test_completions_answer_text_completion_objects_with_logprobs(engine):
    r = requests.post(engine.url + "/v1/completions", json={
        "model": "tiny", "prompt": ["one", "two"], "max_tokens": 5, "n": 2, "temperature": 0.7,
        "ignore_eos": True, "logprobs": 2, "return_token_ids": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 5 for c in body["choices"])
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and len(lp["top_logprobs"][0]) <= 2
    assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
        == {"prompt_tokens": 6, "completion_tokens": 20, "total_tokens": 26}
    assert body["metadata"]["weight_version"] == "default"


def test_completions_stream_deltas_then_done(engine):
    native = engine.generate({"text": "stream", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True}}).json()
    with requests.post(engine.url + "/v1/completions", json={
            "prompt": "stream", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True},
            stream=True, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == native["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_need_json_content_type_and_serve_any_model_name(engine):
    r = requests.post(engine.url + "/v1/completions", data=b'{"prompt": "x"}',
                      headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["message"]
    # sglang serves any name (only a base:adapter suffix asks for a LoRA adapter), so a client
    # keeps working after update_weights_from_disk renamed the served model to its path
    r = requests.post(engine.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=10)
    assert r.status_code == 200 and r.json()["model"] == "other"
    r = requests.post(engine.url + "/v1/completions", json={"max_tokens": 3}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"
