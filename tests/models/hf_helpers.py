"""Tiny checkpoints written by `transformers.save_pretrained`, with a real BPE tokenizer.

The tokenizer is trained offline on a few sentences (merges, a chat template), so its ids
differ from the project's byte tokenizer and the AutoTokenizer path is really exercised.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["What is 3+4? Answer: 7", "What is 2+2? Answer: 4", "Say a: aaaa", "Say e: eeee",
          "the quick brown fox jumps over the lazy dog 0123456789 +-=?:"] * 20


def write_bpe_tokenizer(out: Path, vocab_size: int = 160) -> int:
    """A byte-level BPE tokenizer with merges and a chat template; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def write_hf_checkpoint(out: Path, arch: str = "llama", *, tie: bool = False,
                        shard: bool = False, seed: int = 0) -> Path:
    """A 2-layer fp32 model of `arch` (llama | qwen2 | qwen3) saved by transformers."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_bpe_tokenizer(out)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rms_norm_eps=1e-6)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # weights large enough that logits are not all alike
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out), max_shard_size="40KB" if shard else "5GB")
    return out
