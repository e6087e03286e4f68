"""A byte-level tokenizer: one token per UTF-8 byte plus three specials.

The same vocabulary is written as HF tokenizer files (`tokenizer.json`, GPT-2 byte-level
model with no merges), so `transformers.AutoTokenizer` and real SGLang tokenize exactly as
this pure-Python version does, and the reference engine starts without importing either.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}
SPECIAL_TOKEN_NAMES = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
BYTE_OFFSET = 3
VOCAB_SIZE = BYTE_OFFSET + 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by ByteLevel tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class ByteTokenizer:
    """encode/decode without any tokenizer library (fast engine start-up).

    `chat_template` is the checkpoint's (the tiny model ships one), rendered with jinja2 by
    `apply_chat_template`; None when the checkpoint has none.
    """

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text of `messages`, the assistant's turn opened (as transformers does)."""
        from slime_like.models.chat_template import render_chat

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat(self.chat_template, messages, add_generation_prompt=True,
                           special_tokens=SPECIAL_TOKEN_NAMES)

    def encode(self, text: str) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if i >= BYTE_OFFSET and i < VOCAB_SIZE:
                out.append(i - BYTE_OFFSET)
            elif not skip_special_tokens and i in SPECIAL_TOKENS:
                parts.append(out.decode("utf-8", errors="replace"))
                out = bytearray()
                parts.append(SPECIAL_TOKENS[i])
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


def byte_vocab() -> dict[str, int]:
    """tokenizer.json's vocabulary of this tokenizer: the specials, then GPT-2's byte chars."""
    vocab = {tok: i for i, tok in SPECIAL_TOKENS.items()}
    vocab.update({ch: BYTE_OFFSET + b for b, ch in _bytes_to_unicode().items()})
    return vocab


def write_tokenizer_files(model_dir: str | Path, model_max_length: int = 1024,
                          chat_template: str | None = None) -> None:
    """tokenizer.json, tokenizer_config.json (with `chat_template` when given) and
    special_tokens_map.json for AutoTokenizer."""
    model_dir = Path(model_dir)
    vocab = byte_vocab()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, tok in SPECIAL_TOKENS.items()
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template:
        config["chat_template"] = chat_template
    special = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
               "pad_token": SPECIAL_TOKENS[PAD_ID]}
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
