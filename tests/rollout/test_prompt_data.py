"""--prompt-data: JSONL prompts with labels, chat template, shuffle, and a resumable position."""

from __future__ import annotations

import json

import pytest

from slime_like.errors import ConfigError
from slime_like.models import ByteTokenizer
from slime_like.rollout.prompts import PromptDataset, ToyPrompts

TOK = ByteTokenizer()


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _texts(batch) -> list[str]:
    return [p.text for p in batch]


def test_prompts_come_with_labels_metadata_and_token_ids(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2", "metadata": {"k": 1}},
                                         {"question": "2+2=", "answer": "4"}])
    data = PromptDataset(path, TOK, input_key="question", label_key="answer")
    a, b = data.next_batch(2)
    assert (a.text, a.label, a.metadata, a.input_ids) == ("1+1=", "2", {"k": 1}, TOK.encode("1+1="))
    assert (b.text, b.label, b.metadata) == ("2+2=", "4", {})


@pytest.mark.parametrize(("rows", "kwargs", "message"), [
    ([{"prompt": "a"}, {"text": "b"}], {}, r"^--input-key: .*d\.jsonl:2: no key 'prompt' "
                                           r"\(keys: \['text'\]\)$"),
    ([{"prompt": "a", "label": 1}, {"prompt": "b"}], {"label_key": "label"},
     r"^--label-key: .*d\.jsonl:2: no key 'label'"),
    ([{"prompt": "a"}, "{not json"], {}, r"^--prompt-data: .*d\.jsonl:2: not a JSON object"),
    ([], {}, r"^--prompt-data: .* holds no prompts$"),
    ([{"prompt": [{"role": "user", "content": "hi"}]}], {},
     r"^--apply-chat-template: .*d\.jsonl:1: the prompt is a list of messages"),
    ([{"prompt": "a"}], {"apply_chat_template": True},
     r"^--apply-chat-template: the checkpoint's tokenizer has no chat template$"),
])
def test_bad_prompt_files_fail_with_the_flag_and_line(tmp_path, rows, kwargs, message):
    path = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=message):
        PromptDataset(path, TOK, **kwargs)


def test_a_missing_file_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--prompt-data: no such file: .*nope\.jsonl$"):
        PromptDataset(tmp_path / "nope.jsonl", TOK)


def test_chat_template_comes_from_the_checkpoint_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from slime_like.models.hf_tokenizer import load_tokenizer
    from tests.models.hf_helpers import write_bpe_tokenizer

    write_bpe_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, add_special_tokens=False)
    path = _write(tmp_path / "d.jsonl", [{"prompt": "What is 1+2?"},
                                         {"prompt": [{"role": "system", "content": "s"},
                                                     {"role": "user", "content": "u"}]}])
    a, b = PromptDataset(path, tok, apply_chat_template=True).next_batch(2)
    assert a.text == "<|user|>What is 1+2?\n<|assistant|>"
    assert b.text == "<|system|>s\n<|user|>u\n<|assistant|>"
    assert a.input_ids == tok.encode(a.text)


def test_shuffle_visits_every_prompt_once_per_epoch_in_a_new_order(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    data = PromptDataset(path, TOK, shuffle=True, seed=3)
    first, second = _texts(data.next_batch(10)), _texts(data.next_batch(10))
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(10))
    assert first != second and first != [f"p{i}" for i in range(10)]
    plain = PromptDataset(path, TOK)
    assert _texts(plain.next_batch(12)) == [f"p{i}" for i in range(10)] + ["p0", "p1"]


def test_a_restored_position_continues_with_the_prompts_that_came_next(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(7)])
    data = PromptDataset(path, TOK, shuffle=True, seed=1)
    data.next_batch(5)
    data.next_batch(5)  # into the second epoch
    state = json.loads(json.dumps(data.state_dict()))  # as stored in job_state.json
    expected = _texts(data.next_batch(9))
    resumed = PromptDataset(path, TOK, shuffle=True, seed=99)
    resumed.load_state_dict(state)
    assert _texts(resumed.next_batch(9)) == expected


def test_toy_prompts_resume_where_they_stopped(tmp_path):
    toy = ToyPrompts(TOK, seed=5)
    toy.next_batch(3)
    state = json.loads(json.dumps(toy.state_dict()))
    expected = [(p.text, p.label) for p in toy.next_batch(6)]
    again = ToyPrompts(TOK, seed=0)
    again.load_state_dict(state)
    assert [(p.text, p.label) for p in again.next_batch(6)] == expected
    with pytest.raises(ConfigError, match="^--load: .*'toy' source, not --prompt-data"):
        PromptDataset(_write(tmp_path / "d.jsonl", [{"prompt": "x"}]), TOK).load_state_dict(state)
