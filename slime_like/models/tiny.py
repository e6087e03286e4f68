"""`make-tiny-model`: a small HF-layout Llama checkpoint generated on the fly."""

from __future__ import annotations

import json
from pathlib import Path

from slime_like.models.chat_template import TINY_CHAT_TEMPLATE
from slime_like.models.config import ModelConfig
from slime_like.models.loading import build_model, init_dummy_weights, save_state_dict_atomic
from slime_like.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer_files


def tiny_config(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int | None = None,
                intermediate: int | None = None, max_positions: int = 1024,
                tie_word_embeddings: bool = False) -> ModelConfig:
    """A LlamaForCausalLM config over the byte-level vocabulary."""
    if hidden % heads:
        raise ValueError(f"--hidden ({hidden}) must be divisible by --heads ({heads})")
    kv_heads = kv_heads or max(1, heads // 2)
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be divisible by the kv heads ({kv_heads})")
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=VOCAB_SIZE,
        hidden_size=hidden, intermediate_size=intermediate or (hidden * 11 // 4),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, torch_dtype="float32",
    )


def make_tiny_model(out_dir: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int | None = None, seed: int = 0,
                    tie_word_embeddings: bool = False, intermediate: int | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files
    (with a small chat template, so OpenAI chat routes run on the tiny model too)."""
    config = tiny_config(layers, hidden, heads, kv_heads, intermediate=intermediate,
                         tie_word_embeddings=tie_word_embeddings)
    model = build_model(config)
    init_dummy_weights(model, seed)
    extra = {
        "config.json": json.dumps(config.to_hf_dict(), indent=2),
        "generation_config.json": json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2),
    }
    out = save_state_dict_atomic(model.hf_state_dict(), out_dir, extra_files=extra)
    write_tokenizer_files(out, model_max_length=config.max_position_embeddings,
                          chat_template=TINY_CHAT_TEMPLATE)
    return out
