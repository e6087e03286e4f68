"""Checkpoints written by `transformers.save_pretrained` load in our model with equal logits.

The reference engine serves these checkpoints and the trainer trains them through
transformers; the job's log-probability check needs both to agree exactly in fp32.
"""

from __future__ import annotations

import pytest
import torch

from slime_like.errors import ConfigError
from slime_like.models import ByteTokenizer, load_pretrained
from slime_like.models.config import ModelConfig
from slime_like.models.hf_checkpoint import check_checkpoint, load_transformers_model
from slime_like.models.hf_tokenizer import HFTokenizer, load_tokenizer
from tests.models.hf_helpers import write_hf_checkpoint

pytest.importorskip("transformers")

IDS = torch.tensor([[5, 17, 33, 80, 2, 9, 100, 41], [7, 7, 7, 64, 90, 3, 1, 120]])


@pytest.mark.parametrize(("arch", "tie", "shard"), [
    ("llama", False, False), ("llama", True, True), ("qwen2", False, True),
    ("qwen3", True, False)])
def test_saved_checkpoint_gives_transformers_logits_in_fp32(tmp_path, arch, tie, shard):
    ckpt = write_hf_checkpoint(tmp_path / arch, arch, tie=tie, shard=shard)
    ours = load_pretrained(ckpt, dtype=torch.float32)
    theirs = load_transformers_model(ckpt)
    with torch.no_grad():
        expected = theirs(input_ids=IDS, use_cache=False).logits
        got = ours(IDS)
    assert expected.abs().max() > 0.5  # not a degenerate model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the names the trainer's transformers model syncs are the engine's parameter names
    ours_names = {n for n, _ in ours.named_parameters()}
    assert {n for n, _ in theirs.named_parameters()} == ours_names


def test_a_checkpoint_that_stores_a_tied_lm_head_still_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = write_hf_checkpoint(tmp_path / "tied", "llama", tie=True)
    state = load_file(str(ckpt / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    model = load_pretrained(ckpt)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unsupported_rope_scaling_is_refused_not_served_wrong():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ConfigError, match="rope_scaling: RoPE type 'llama3'"):
        ModelConfig.from_dict(raw)


def test_checkpoint_tokenizer_is_autotokenizer_unless_byte_level(tmp_path, tiny_model_dir):
    ckpt = write_hf_checkpoint(tmp_path / "m", "llama")
    tok = load_tokenizer(ckpt, add_special_tokens=False)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("What is 3+4? Answer: ")
    assert ids != ByteTokenizer().encode("What is 3+4? Answer: ")  # merges: fewer, other ids
    assert tok.decode(ids) == "What is 3+4? Answer: "
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|user|>hi\n<|assistant|>"
    assert isinstance(load_tokenizer(tiny_model_dir), ByteTokenizer)


def test_hf_checkpoint_that_is_neither_a_model_dir_nor_on_the_hub_fails_naming_the_flag(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: .* directory without a config"):
        check_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: 'no/such/path' is neither"):
        check_checkpoint("no/such/path")
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint: 'nobody/no-such-model' is not a "
                                          "local directory and cannot be resolved"):
        check_checkpoint("nobody/no-such-model")
    assert check_checkpoint(str(write_hf_checkpoint(tmp_path / "ok", "llama"))) == "local"
