"""The calculator episode through `/v1/chat/completions` with the official `openai` client.

The harness a tool-use agent usually is: messages in, an assistant message out; when it
calls the calculator the tool's answer goes back as a `tool` message and the model answers.
The chat template renders each turn's prompt on the server, so the trainer's tokens are
rebuilt here the way the server built them (the checkpoint's tokenizer and chat template),
and checked against what the server reports: every model token's bytes (the `logprobs`
entries) and the prompt of the next turn, which must begin with the previous prompt plus
the model's tokens. An episode whose re-tokenization does not reproduce the engine's tokens
(a special token the text dropped, a template that rewrites history) is refused rather than
trained on wrongly; the token-level path (`calculator.generate`) never needs this check.

    --custom-generate-function-path examples.agentic.openai_episode.generate
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from examples.agentic.calculator import MAX_TURNS, TOOL_CALL, TURN_TOKENS, _tokenizer, evaluate
from slime_like.errors import PluginError
from slime_like.models.tokenizer import BYTE_OFFSET, ByteTokenizer
from slime_like.rollout.generate import Sample

FLAG = "--custom-generate-function-path"


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def _token_bytes(tokenizer, tid: int) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer) and tid >= BYTE_OFFSET:
        return [tid - BYTE_OFFSET]
    return list(tokenizer.decode([tid], skip_special_tokens=False).encode())


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], *,
                   router_url: str, api_key: str | None = None, **kwargs: Any) -> Sample:
    """One calculator episode as chat messages; the sample carries tokens, mask and logprobs."""
    import openai

    tokenizer = _tokenizer(getattr(args, "hf_checkpoint", None))
    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key or "none",
                                max_retries=0)
    messages = [{"role": "user", "content": sample.prompt}]
    prompt_ids = _chat_ids(tokenizer, messages)
    output, logprobs, mask, spans, turn_texts, env_texts = [], [], [], [], [], []
    version = None
    try:
        for turn in range(MAX_TURNS):
            r = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=TURN_TOKENS, stop=[TOOL_CALL],
                temperature=sampling_params.get("temperature", 1.0), logprobs=True,
                logit_bias=sampling_params.get("logit_bias"),
                extra_body={"no_stop_trim": True, "ignore_eos": True})
            choice = r.choices[0]
            text = choice.message.content or ""
            entries = choice.logprobs.content if choice.logprobs else []
            ids = tokenizer.encode(text)
            if [list(e.bytes) for e in entries] != [_token_bytes(tokenizer, t) for t in ids]:
                raise PluginError(FLAG, f"prompt {sample.prompt_index}, turn {turn}: re-tokenizing "
                                        f"the reply {text!r} does not give the engine's tokens")
            meta = r.to_dict().get("metadata") or {}
            if version not in (None, meta.get("weight_version")):
                raise PluginError(FLAG, "the episode's turns came from two weight versions")
            version = meta.get("weight_version")
            spans.append({"version": version, "start": len(output), "end": len(output) + len(ids)})
            output += ids
            logprobs += [e.logprob for e in entries]
            mask += [1] * len(ids)
            turn_texts.append(text)
            if TOOL_CALL not in text or turn == MAX_TURNS - 1:
                break
            # the call as OpenAI messages spell it (no tool-call parser runs on the server:
            # the harness recognises the call in the text)
            call_id = f"calculator-{turn}"
            messages.append({"role": "assistant", "content": text, "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": "calculator", "arguments": json.dumps({"expression": sample.prompt})}}]})
            tool = f"{evaluate(sample.prompt)}\n"
            messages.append({"role": "tool", "content": tool, "tool_call_id": call_id})
            env_texts.append(tool)
            next_prompt = _chat_ids(tokenizer, messages)
            seen = prompt_ids + output
            if next_prompt[:len(seen)] != seen:
                raise PluginError(FLAG, "the chat template does not keep earlier turns as they "
                                        "were: the next prompt does not start with this one")
            env = next_prompt[len(seen):]
            output += env
            logprobs += [0.0] * len(env)
            mask += [0] * len(env)
    finally:
        await client.close()
    return replace(sample, output_ids=output, output_logprobs=logprobs, loss_mask=mask,
                   weight_version=str(version), finish_reason=choice.finish_reason or "",
                   meta={"weight_versions": spans, "model_turns": len(turn_texts),
                         "env_texts": env_texts, "turn_texts": turn_texts})


async def _demo(base_url: str, n: int) -> None:
    import types

    from slime_like.models.tokenizer import ByteTokenizer as _Tok

    tok, args = _Tok(), types.SimpleNamespace(hf_checkpoint=None)
    kept = 0
    for i in range(n):
        a, b = i % 5, (i // 5) % 5
        sample = Sample(i, tok.encode(f"{a}+{b}="), [], [], "", "", prompt=f"{a}+{b}=",
                        label=str(a + b))
        try:
            out = await generate(args, sample, {"temperature": 1.0}, router_url=base_url)
        except PluginError as e:
            print(f"{sample.prompt} refused: {e}")
            continue
        kept += 1
        print(f"{sample.prompt} turns={out.meta['turn_texts']!r} tool={out.meta['env_texts']!r} "
              f"mask={out.loss_mask}")
    print(f"{kept}/{n} episodes rebuilt exactly")


if __name__ == "__main__":
    import asyncio
    import sys

    asyncio.run(_demo(sys.argv[1].rstrip("/"), int(sys.argv[2]) if len(sys.argv) > 2 else 10))
