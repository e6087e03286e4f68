"""The trainer keeps fp32 weights and syncs them in the dtype the engines serve."""

from __future__ import annotations

import pytest
import torch

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.protocol.checksums import tensor_checksum
from slime_like.trainer.policy import PolicyTrainer
from slime_like.trainer.serve_dtype import serve_dtype
from slime_like.weights.sync import WeightSync, WeightSyncConfig
from tests.models.hf_helpers import write_hf_checkpoint
from tests.reference_engine.conftest import start_engine, stop_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A Llama checkpoint saved in bfloat16, as most HF checkpoints are."""
    import transformers

    out = tmp_path_factory.mktemp("bf16") / "llama"
    write_hf_checkpoint(out, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    return out


def test_engines_serve_the_checkpoint_dtype_unless_sglang_dtype_says_otherwise(
        bf16_checkpoint, tiny_model_dir):
    assert serve_dtype(bf16_checkpoint) == torch.bfloat16
    assert serve_dtype(bf16_checkpoint, "auto") == torch.bfloat16
    assert serve_dtype(bf16_checkpoint, "float32") == torch.float32
    assert serve_dtype(bf16_checkpoint, "half") == torch.float16
    assert serve_dtype(tiny_model_dir) == torch.float32


def test_fp32_training_syncs_into_a_bf16_engine_as_bf16(bf16_checkpoint, tmp_path):
    policy = PolicyTrainer(bf16_checkpoint, lr=1e-2, use_transformers=True)
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    policy.train_step([([5, 6, 7], [8, 9])], [1.0])
    engine = start_engine(bf16_checkpoint, tmp_path)
    sync = WeightSync([EngineSession(EngineAddress(engine.url, 1))],
                      WeightSyncConfig(transport="distributed", http_timeout_s=60,
                                       group_timeout_s=60))
    try:
        report = sync.update(policy.sync_source(), "2").as_dict()
        body = engine.post("/weights_checker", {"action": "checksum"}).json()
    finally:
        sync.close()
        stop_engine(engine)
    # bf16 went over the wire; a CPU engine holds bf16 checkpoints in fp32 (as sglang does)
    assert body["ranks"][0]["checksums"] != {n: tensor_checksum(p.detach())
                                             for n, p in policy.model.named_parameters()}
    expected = {n: tensor_checksum(p.detach().to(torch.bfloat16).float())
                for n, p in policy.model.named_parameters()}
    assert body["ranks"][0]["checksums"] == expected
    n_params = sum(p.numel() for p in policy.model.parameters())
    assert report["transfer"]["bytes"] == 2 * n_params  # sent as bf16, not fp32
