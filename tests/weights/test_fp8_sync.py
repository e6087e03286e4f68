"""FP8 syncs into a real TP=2 engine running `--quantization fp8`, on a model whose every
quantized matrix spans several 128x128 blocks in both dimensions (hidden 256, MLP 512,
head dim 128, so each rank's share of every split dimension is whole blocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from weight_sync_helpers import Engine, greedy_continuation, start_engine, trainer_model

from slime_like.errors import ConfigError
from slime_like.models.loading import load_pretrained
from slime_like.models.tiny import make_tiny_model
from slime_like.protocol import fp8
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from slime_like.reference_engine.fp8 import Fp8Linear, quantize_model
from slime_like.weights import WeightSync
from slime_like.weights.fp8 import Fp8Weights, ServedWeights

PROMPT = [1, 72, 101, 108, 108, 111]


def multi_block_model(out: Path, intermediate: int = 512) -> Path:
    return make_tiny_model(out, layers=2, hidden=256, heads=2, kv_heads=2,
                           intermediate=intermediate, seed=3)


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory) -> Path:
    return multi_block_model(tmp_path_factory.mktemp("fp8-model") / "model")


@pytest.fixture(scope="module")
def fp8_tp2_engine(fp8_model_dir, weights_log_dir) -> Iterator[Engine]:
    engine = start_engine(fp8_model_dir, weights_log_dir, 2, "--quantization", "fp8")
    try:
        yield engine
    finally:
        engine.process.terminate(grace=10)


def _checksum(named) -> str:
    """The engine's per-rank checksum (sha256 over name + per-tensor hash) of these tensors."""
    return overall_checksum({n: tensor_checksum(t) for n, t in named})


def test_both_ranks_load_the_quantized_sync_and_generate_as_the_served_copy(
        fp8_tp2_engine, fp8_model_dir, tmp_path):
    """Over a broadcast (twice: the second reuses the group and the engine's load plans),
    then from a checkpoint on disk, whose safetensors file holds the FP8 values as they are."""
    engine = fp8_tp2_engine
    for transport, seeds in (("distributed", (11, 12)), ("disk", (13,))):
        sync = WeightSync([(engine.url, engine.tp_size)], transport=transport,
                          update_weight_buffer_size=256 << 10, disk_dir=str(tmp_path / "ckpt"),
                          http_timeout_s=60, group_timeout_s=60)
        try:
            for seed in seeds:
                model = trainer_model(fp8_model_dir, seed=seed)
                source = Fp8Weights(model, torch.float32)
                metas = {m.name: m for m in source.metadata()}
                gate = "model.layers.1.mlp.gate_proj.weight"
                assert metas[gate].dtype == torch.float8_e4m3fn
                assert metas[gate].shape == (512, 256)
                assert metas[fp8.scale_name(gate)].shape == (4, 2)
                assert metas["lm_head.weight"].dtype == torch.float32  # not quantized
                report = sync.update(source)
                assert report.transfer["buckets"] > (1 if transport == "distributed" else 0)
                sent = list(Fp8Weights(model, torch.float32).tensors())
                assert engine.rank_checksums() == [_checksum(sent)] * 2, transport
                served = ServedWeights(model, torch.float32).refresh()
                assert engine.greedy(PROMPT, 8) == greedy_continuation(served, PROMPT, 8)
                # from what the sync sent (as the trainer does): the same weights
                from_sent = ServedWeights(model, torch.float32).refresh(source)
                assert all(torch.equal(a, b) for a, b in zip(
                    served.state_dict().values(), from_sent.state_dict().values(), strict=True))
        finally:
            sync.close()


def test_each_rank_holds_whole_blocks_of_a_split_weight(fp8_model_dir):
    """TP=2 splits gate/up by rows and down/o by columns; each rank's values with the scale
    blocks over them dequantize to exactly its slice of the whole weight."""
    model = quantize_model(load_pretrained(fp8_model_dir), tp_size=2)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 * 7
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        values, scale = module.weight.data, module.weight_scale_inv.data
        whole = fp8.dequantize(values, scale, torch.float32)
        parts = fp8.partitions(f"{name}.weight", tuple(values.shape), 2)
        assert len({p.rows for p in parts}) * len({p.cols for p in parts}) == 2  # one dim split
        for part in parts:
            v, s = fp8.shard(values, scale, part)
            (r0, r1), (c0, c1) = part.rows, part.cols
            assert torch.equal(fp8.dequantize(v, s, torch.float32), whole[r0:r1, c0:c1]), name


def test_a_tp_size_that_splits_a_block_is_refused_naming_it(tmp_path):
    path = multi_block_model(tmp_path / "m", intermediate=384)
    quantize_model(load_pretrained(path), tp_size=1)  # 384 rows: whole blocks on one rank
    with pytest.raises(ConfigError, match=r"--tp-size.*gate_proj.weight: 192 output rows"):
        quantize_model(load_pretrained(path), tp_size=2)


def test_a_kept_quantized_copy_goes_in_place_and_is_rewritten_every_sync(
        fp8_tp2_engine, fp8_model_dir):
    """`Fp8Weights(keep=True)` over the colocated `tensor` transport (CPU form: the model in
    shared memory): the first sync packs; from the second on every tensor goes in place in
    one request, the engine reusing its mappings; each sync sends the trainer's weights of
    that sync (the copy is re-quantized, never stale), and after `release` (an offload) the
    copy is made anew and shared afresh; while the source says its tensors will not stay, no
    copy is held at all."""
    engine = fp8_tp2_engine
    model = trainer_model(fp8_model_dir, seed=21)
    for param in model.parameters():  # named shared memory, as the transport shares it
        param.untyped_storage()._share_filename_cpu_()
    source = Fp8Weights(model, torch.float32, keep=True)
    sync = WeightSync([(engine.url, engine.tp_size)], transport="tensor",
                      update_weight_buffer_size=4 << 20, http_timeout_s=60)  # several tensors a bucket: packed

    def step_and_sync(seed: int) -> dict:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        report = sync.update(source).as_dict()
        expected = _checksum(Fp8Weights(model, torch.float32).tensors())
        assert engine.rank_checksums() == [expected] * 2, f"step {seed}: stale or partial"
        return report["transfer"]

    def reused() -> int:
        body = engine.post("/weights_checker", {"action": "checksum"}).json()
        return sum(rank["ipc_mappings"]["reused"] for rank in body["ranks"])

    def in_place(transfer: dict) -> bool:
        return transfer["buckets"] == 1 and transfer["pack_s"] == 0.0

    try:
        assert step_and_sync(1)["pack_s"] > 0  # nothing yet says the copy stays
        assert in_place(step_and_sync(2))  # one request, nothing packed: a fresh share
        before = reused()
        for seed in (3, 4):
            assert in_place(step_and_sync(seed))
        assert reused() - before == 2 * 2, "a rank reopened what it holds mapped"
        kept = source.resident()
        assert all(t.untyped_storage().is_shared() for t in kept)
        source.release()  # an offload: the copy is freed, made anew at the next sync
        assert step_and_sync(5)["pack_s"] > 0
        assert in_place(step_and_sync(6))
        # What is sent will not stay (the trainer's offloader says so): no copy is held,
        # each sync quantizes afresh and packs, still the weights of that sync.
        source.storage_stays = lambda: False
        assert step_and_sync(7)["pack_s"] > 0 and source.resident() is None
        source.storage_stays = lambda: True
        assert step_and_sync(8)["pack_s"] > 0 and in_place(step_and_sync(9))
    finally:
        sync.close()
