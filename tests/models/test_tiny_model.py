"""The tiny model is a real HF Llama checkpoint: transformers loads it and agrees with us."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slime_like.models import ByteTokenizer, load_pretrained
from slime_like.models.loading import checkpoint_files


def test_cli_writes_an_hf_llama_checkpoint(tmp_path):
    out = tmp_path / "m"
    subprocess.run([sys.executable, "-m", "slime_like.cli", "make-tiny-model", str(out),
                    "--layers", "3", "--hidden", "32", "--heads", "4", "--seed", "7"], check=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == 32
    assert [p.name for p in checkpoint_files(out)] == ["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file()


def test_logits_match_transformers_llama(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ours = load_pretrained(tiny_model_dir)
    ids = torch.randint(3, 259, (3, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_parameter_names_are_the_checkpoint_names(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    ours = load_pretrained(tiny_model_dir)
    assert names == set(ours.hf_state_dict())


def test_autotokenizer_agrees_with_byte_tokenizer(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ours = ByteTokenizer()
    for text in ["Hello, world!", "naïve café ✓", "  leading spaces\n\ttabs", "1+1=2"]:
        assert hf.encode(text) == ours.encode(text)
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text)) == text
    assert hf.eos_token_id == ours.eos_token_id and hf.bos_token_id == ours.bos_token_id


def test_kv_cached_decoding_matches_full_forward(tiny_model_dir):
    """Incremental decoding with a cache gives the logits of one full forward pass."""
    model = load_pretrained(tiny_model_dir)
    ids = torch.randint(3, 259, (1, 12), generator=torch.Generator().manual_seed(1))

    class ListCache:
        def __init__(self):
            self.kv = {}

        def update(self, layer, k, v):
            if layer in self.kv:
                k = torch.cat([self.kv[layer][0], k], dim=2)
                v = torch.cat([self.kv[layer][1], v], dim=2)
            self.kv[layer] = (k, v)
            return k, v

    with torch.no_grad():
        full = model(ids)
        cache = ListCache()
        first = model(ids[:, :8], kv_cache=cache)
        steps = [first[:, -1]]
        for pos in range(8, 12):
            mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
            out = model(ids[:, pos:pos + 1], position_ids=torch.tensor([[pos]]), attn_mask=mask,
                        kv_cache=cache)
            steps.append(out[:, -1])
    assert torch.allclose(full[:, 7:12], torch.stack(steps[:5], dim=1), atol=1e-5)
