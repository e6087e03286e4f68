"""Chat messages -> prompt ids: sglang's message rules over the checkpoint's chat template."""

from __future__ import annotations

import json

import pytest

from slime_like.models.chat_template import TINY_CHAT_TEMPLATE, render_chat
from slime_like.models.tokenizer import ByteTokenizer, write_tokenizer_files
from slime_like.protocol.openai_struct import ChatCompletionRequest
from slime_like.reference_engine.chat_prompt import ChatPrompter, ChatPromptError

TOK = ByteTokenizer()


def _req(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **kw})


def test_a_checkpoint_without_a_chat_template_is_refused_naming_it(tmp_path):
    write_tokenizer_files(tmp_path)  # tokenizer files, no template
    prompter = ChatPrompter(TOK, str(tmp_path))
    with pytest.raises(ChatPromptError, match=f"checkpoint {tmp_path} has no chat template"):
        prompter.prompt_ids(_req([{"role": "user", "content": "hi"}]))
    # pre-computed ids need no template
    assert prompter.prompt_ids(_req([{"role": "user", "content": "hi"}], input_ids=[5, 6])) == [5, 6]


def test_messages_follow_sglangs_rules(tmp_path):
    write_tokenizer_files(tmp_path, chat_template=TINY_CHAT_TEMPLATE)
    prompter = ChatPrompter(TOK, str(tmp_path))

    def text(messages, **kw) -> str:
        return TOK.decode(prompter.prompt_ids(_req(messages, **kw)))

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert text([{"role": "User", "content": parts}, {"role": "tool", "content": None}]) == \
        "user: a b\ntool: \nassistant: "
    # a trailing assistant message is continued, or (sglang's default) becomes a user turn
    ends_on_assistant = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    assert text(ends_on_assistant, continue_final_message=True) == "user: q\nassistant: x"
    assert text(ends_on_assistant) == render_chat(TINY_CHAT_TEMPLATE, [
        {"role": "user", "content": "q"}, {"role": "user", "content": "x"}])
    with pytest.raises(ChatPromptError, match="only supports text input.*'image_url'"):
        text([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatPromptError, match="function.arguments must be valid JSON"):
        text([{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
            {"role": "user", "content": "q"}])
    with pytest.raises(ChatPromptError, match="Request-supplied chat_template is not allowed"):
        text([{"role": "user", "content": "q"}], chat_template_kwargs={"chat_template": "x"})


def test_the_template_can_refuse_a_conversation(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ChatPromptError, match="user first"):
        ChatPrompter(TOK, str(tmp_path)).prompt_ids(_req([{"role": "system", "content": "s"}]))
