"""The checkpoint's tokenizer, for the job (prompts, chat template) and the reference engine.

A checkpoint whose tokenizer files are the project's byte-level vocabulary gets the
pure-Python `ByteTokenizer` (same ids, no `transformers` import, fast engine start-up);
any other tokenizer is loaded with `transformers.AutoTokenizer`, imported only then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from slime_like.errors import ConfigError
from slime_like.models.chat_template import read_chat_template
from slime_like.models.tokenizer import ByteTokenizer, byte_vocab


class Tokenizer(Protocol):
    """What the job and the engine need from a tokenizer."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class HFTokenizer:
    """A `transformers` tokenizer behind the `Tokenizer` protocol.

    `add_special_tokens` is what `encode` passes: True for text sent to an engine (sglang
    does the same), False for prompts the job tokenizes itself (slime does the same; a chat
    template already carries the special tokens).
    """

    def __init__(self, hf_tokenizer: Any, add_special_tokens: bool = True):
        self.hf = hf_tokenizer
        self.add_special_tokens = add_special_tokens
        self.eos_token_id = hf_tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=self.add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def is_byte_tokenizer(model_dir: str | Path) -> bool:
    """True if the directory's tokenizer is exactly the project's byte-level one (a chat
    template beside it is rendered with jinja2, `models/chat_template.py`)."""
    model_dir = Path(model_dir)
    model = _read_json(model_dir / "tokenizer.json").get("model") or {}
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == byte_vocab())


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether the directory holds tokenizer files at all."""
    model_dir = Path(model_dir)
    return any((model_dir / f).is_file() for f in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(model_dir: str | Path, *, add_special_tokens: bool = True,
                   where: str = "--hf-checkpoint") -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint directory (or hub id); the byte tokenizer if it has none."""
    local = Path(model_dir).is_dir()
    if local and (not has_tokenizer(model_dir) or is_byte_tokenizer(model_dir)):
        return ByteTokenizer(chat_template=read_chat_template(model_dir))
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(where, f"the tokenizer of {model_dir} needs transformers "
                                 "(pip install 'slime_like[hf]')") from e
    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ConfigError(where, f"cannot load the tokenizer of {model_dir}: "
                                 f"{type(e).__name__}: {e}") from e
    return HFTokenizer(hf, add_special_tokens=add_special_tokens)
