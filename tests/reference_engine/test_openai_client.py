"""The official `openai` client against a reference engine, and through the real routers.

Every test runs three times: straight at the engine, through sglang-router 0.3.2 and
through smg 1.13.0 in front of it. Answers are checked against the engine's native /generate for the same prompt tokens
(greedy or seeded), so "the chat template rendered the messages" and "the logprobs are the
engine's" are facts, not shapes. Where the router changes a request (it drops chat keys
its schema lacks, refuses token-id prompts, answers /v1/models itself) the test says so.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from slime_like.models.chat_template import TINY_CHAT_TEMPLATE, render_chat
from slime_like.models.loading import load_pretrained
from slime_like.models.tokenizer import VOCAB_SIZE as VOCAB
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.router.router import Router

openai = pytest.importorskip("openai")

TOK = ByteTokenizer()
MESSAGES = [{"role": "system", "content": "You add."}, {"role": "user", "content": "3+4="}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def smg(engine, tmp_path_factory):
    """A real smg (round robin) with the shared engine added."""
    r = Router(host="127.0.0.1", router_flags={"policy": "round_robin"}, kind="smg",
               log_dir=tmp_path_factory.mktemp("smg")).start()
    r.client.add_worker(engine.url)
    yield r
    r.stop()


class ServedName:
    """The client with every request's `model` set to the served name: smg routes OpenAI
    requests by `model` (a name no worker serves is a 404, see the test below), where
    sglang and sglang-router 0.3.2 take any name."""

    def __init__(self, client, name: str = "tiny"):
        self._client, self._name = client, name
        self.chat = SimpleNamespace(completions=SimpleNamespace(
            create=partial(self._create, client.chat.completions.create)))
        self.completions = SimpleNamespace(create=partial(self._create,
                                                          client.completions.create))

    def _create(self, create, **kw):
        return create(**{**kw, "model": self._name})

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture(scope="module", params=["engine", "router", "smg"])
def api(request, engine, router):
    """(openai client, which) for the shared engine, or a router with that engine added."""
    if request.param == "router":
        router.client.add_worker(engine.url)
        url = router.url
    elif request.param == "smg":
        url = request.getfixturevalue("smg").url
    else:
        url = engine.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return (ServedName(client) if request.param == "smg" else client), request.param


def _chat_prompt(messages=MESSAGES) -> list[int]:
    return TOK.encode(render_chat(TINY_CHAT_TEMPLATE, messages))


def _native(engine, prompt_ids, max_new_tokens, **sampling) -> dict:
    r = engine.generate({"input_ids": prompt_ids, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_renders_the_checkpoint_template_and_answers_as_generate_does(api, engine):
    client, which = api
    native = _native(engine, _chat_prompt(), 6)
    r = client.chat.completions.create(model="any-name-at-all", messages=MESSAGES,
                                       max_completion_tokens=6, logprobs=True, top_logprobs=3,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert r.model == ("tiny" if which == "smg" else "any-name-at-all")
    assert choice.message.role == "assistant" and choice.message.content == native["text"]
    assert choice.finish_reason == "length"
    rows = choice.logprobs.content
    assert [e.logprob for e in rows] == pytest.approx(
        [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]], abs=1e-6)
    assert [e.bytes for e in rows] == [[t - 3] for t in native["output_ids"]]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in rows)
    assert r.usage.prompt_tokens == len(_chat_prompt()) and r.usage.completion_tokens == 6
    meta = r.to_dict()["metadata"]
    assert meta["weight_version"] == native["meta_info"]["weight_version"]
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 6}]
    # the deprecated max_tokens means the same (the router turns it into max_completion_tokens)
    again = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == native["text"]


def test_chat_streams_the_same_text_and_every_tokens_logprob(api, engine):
    client, _ = api
    native = _native(engine, _chat_prompt(), 8)
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, temperature=0.0, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == native["text"]
    streamed = [e.logprob for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]],
                                     abs=1e-6)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_n_samples_seed_and_stop(api, engine):
    client, _ = api
    kw = dict(model="m", messages=MESSAGES, max_tokens=5, temperature=1.0, n=3,
              extra_body={"ignore_eos": True})
    unseeded = client.chat.completions.create(**kw)
    assert [c.index for c in unseeded.choices] == [0, 1, 2]
    assert len({c.message.content for c in unseeded.choices}) > 1  # n independent samples
    assert unseeded.usage.completion_tokens == 15
    assert unseeded.usage.prompt_tokens == len(_chat_prompt())  # the prompt counts once
    first = client.chat.completions.create(**kw, seed=11)
    second = client.chat.completions.create(**kw, seed=11)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]  # the seed makes it reproducible
    greedy = _native(engine, _chat_prompt(), 8)["text"]
    stop = next(ch for ch in greedy[2:] if ch.isascii() and ch.isprintable())
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == greedy[:greedy.index(stop)]


def test_completions_take_any_model_echo_and_stream_their_logprobs(api, engine):
    client, _ = api
    native = _native(engine, TOK.encode("hello"), 6)
    r = client.completions.create(model="not-the-served-name", prompt="hello", max_tokens=6,
                                  temperature=0.0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == "hello" + native["text"]
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(c.logprobs.tokens) == 5 + 6 and len(c.logprobs.top_logprobs) == 5 + 6
    assert c.logprobs.token_logprobs[5:] == pytest.approx(
        [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]], abs=1e-6)
    chunks = list(client.completions.create(model="x", prompt="hello", max_tokens=6, logprobs=1,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == native["text"]
    streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(c.logprobs.token_logprobs[5:], abs=1e-6)


def _local_greedy(model_dir, prompt: list[int], n: int, adjust) -> list[int]:
    """Greedy decoding on the checkpoint loaded here, with `adjust(logits, output)` applied."""
    model = load_pretrained(model_dir)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = adjust(model(torch.tensor([ids]))[0, -1].float(), out)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_sampling_fields_change_the_tokens_or_are_refused_by_name(api, engine, tiny_model_dir):
    client, _ = api

    def tokens(**kw) -> list[int]:
        kw.setdefault("temperature", 0.0)
        r = client.completions.create(model="m", prompt="aaaa", max_tokens=24,
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  **kw.pop("extra", {})}, **kw)
        return r.choices[0].model_extra["token_ids"]

    base = tokens()
    assert base == _local_greedy(tiny_model_dir, TOK.encode("aaaa"), 24, lambda lg, out: lg)
    assert len(set(base)) < len(base), "the greedy baseline repeats tokens (the penalties' case)"

    def seen(out):
        return torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB) if out \
            else torch.zeros(VOCAB)

    # sglang's formulas over the generated tokens, computed here on the checkpoint itself
    rules = [({"frequency_penalty": 2.0}, lambda lg, out: lg - 2.0 * seen(out)),
             ({"presence_penalty": 2.0}, lambda lg, out: lg - 2.0 * (seen(out) > 0).float()),
             ({"extra": {"repetition_penalty": 2.0}}, lambda lg, out: torch.where(
                 seen(out) > 0, torch.where(lg < 0, lg * 2.0, lg / 2.0), lg))]
    for kw, rule in rules:
        penalized = tokens(**kw)
        assert penalized != base, kw
        assert penalized == _local_greedy(tiny_model_dir, TOK.encode("aaaa"), 24, rule), kw
    forced = TOK.encode("z")[0]
    assert tokens(logit_bias={str(forced): 100.0}) == [forced] * 24
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy again
    assert tokens(temperature=1.0, seed=3, extra={"min_p": 1.0}) == base
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="m", prompt="a", max_tokens=2, extra_body={"regex": "a+"})
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2,
                                       extra_body={"regex": "a+"})


def test_chat_token_ids_and_refusals_on_the_engine(engine):
    """Keys sglang-router 0.3.2 drops from chat bodies, straight at the engine."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0.0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0].model_extra
    assert choice["prompt_token_ids"] == _chat_prompt()
    native = _native(engine, _chat_prompt(), 4)
    assert choice["response_token_ids"] == native["output_ids"]
    # pre-computed prompt ids bypass the template, as in sglang
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0.0,
                                       extra_body={"input_ids": _chat_prompt(), "ignore_eos": True})
    assert r.choices[0].message.content == native["text"]
    with pytest.raises(openai.BadRequestError, match="only supports text input.*image_url"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'adapter'"):
        client.chat.completions.create(model="tiny:adapter", messages=MESSAGES, max_tokens=2)


def test_models_list_and_retrieve(api, engine):
    client, which = api
    names = [m.id for m in client.models.list().data]
    if which == "engine":
        assert names == ["tiny"]
        card = client.models.retrieve("tiny")
        assert card.id == "tiny" and card.model_extra["max_model_len"] == 1024
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("nope")
        assert e.value.body["code"] == "model_not_found"
    elif which == "router":  # 0.3.2 lists its own registry, does not forward /v1/models/{model}
        assert names
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("tiny")
    else:  # smg lists and retrieves the served names, and routes by them
        assert names == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
        for call in (lambda: client.models.retrieve("nope"),
                     lambda: client._client.chat.completions.create(
                         model="nope", messages=MESSAGES, max_tokens=2)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert e.value.body["code"] == "model_not_found"


def test_custom_params_are_accepted_and_change_nothing(engine, router):
    """slime's --rollout-top-p sends custom_params; sglang ignores them without a processor."""
    import requests

    plain = _native(engine, TOK.encode("custom"), 5)
    with_params = _native(engine, TOK.encode("custom"), 5,
                          custom_params={"return_top_p_token_ids": True})
    assert with_params["output_ids"] == plain["output_ids"]
    router.client.add_worker(engine.url)
    r = requests.post(router.url + "/generate", timeout=30, json={
        "input_ids": TOK.encode("custom"), "sampling_params": {
            "max_new_tokens": 5, **GREEDY, "custom_params": {"return_top_p_token_ids": True}}})
    assert r.status_code == 200 and r.json()["output_ids"] == plain["output_ids"], r.text


def test_the_agentic_example_plays_its_episode_through_chat_completions(engine, router):
    """examples/agentic/openai_episode.py through the router: a call, the tool's answer as a
    `tool` message, the answer; the sample is the exact token sequence the server ran."""
    import asyncio
    from types import SimpleNamespace

    from examples.agentic import openai_episode
    from slime_like.rollout.generate import Sample

    router.client.add_worker(engine.url)
    call = TOK.encode("#")[0]
    sample = Sample(0, TOK.encode("3+4="), [], [], "", "", prompt="3+4=", label="7")
    # the bias makes the model call the tool at once and again when it answers
    params = {"temperature": 1.0, "logit_bias": {str(call): 100.0}}
    out = asyncio.run(openai_episode.generate(SimpleNamespace(hf_checkpoint=None), sample, params,
                                              router_url=router.url))
    messages = [{"role": "user", "content": "3+4="}]
    prompt = TOK.encode(render_chat(TINY_CHAT_TEMPLATE, messages))
    env = TOK.encode("\ntool: 7\n\nassistant: ")
    assert out.meta["turn_texts"] == ["#", "#"] and out.meta["env_texts"] == ["7\n"]
    assert out.output_ids == [call, *env, call]
    assert out.loss_mask == [1] + [0] * len(env) + [1]
    assert out.output_logprobs[1:-1] == [0.0] * len(env)
    # turn 2's logprob is the engine's on exactly this context: what the server rendered
    # from the messages is the prompt, the model's turn and the tool's tokens, in order
    native = engine.generate({"input_ids": prompt + out.output_ids[:-1], "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 1, "temperature": 1.0,
                                                  "logit_bias": {str(call): 100.0}}}).json()
    assert native["output_ids"] == [call]
    assert out.output_logprobs[-1] == pytest.approx(native["meta_info"]["output_token_logprobs"][0][0],
                                                    abs=1e-6)
    assert {s["version"] for s in out.meta["weight_versions"]} == {out.weight_version}


def _aborted_total(engine) -> float:
    for line in engine.get("/metrics").text.splitlines():
        if line.startswith("sglang:num_aborted_requests_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("via", ["engine", "smg"])
def test_a_client_that_goes_away_has_its_request_aborted(engine, request, via):
    """As sglang: a non-streamed chat whose client closed the connection stops generating;
    through smg too (it drops its upstream request, and the engine sees that client go)."""
    import json
    import socket
    import time

    url = engine.url if via == "engine" else request.getfixturevalue("smg").url
    n = 64 if via == "engine" else 10  # smg refuses n > 10 (400 integer_above_max_value)
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 900, "n": n,
                       "ignore_eos": True}).encode()
    host, port = url.rsplit("//", 1)[1].split(":")
    before = _aborted_total(engine)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        # the client goes once the engine generates (64 x 900 tokens take seconds on a CPU)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and \
                engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _aborted_total(engine) < before + n:
        time.sleep(0.2)
    assert _aborted_total(engine) == before + n  # every sequence, running or waiting
    assert engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0
