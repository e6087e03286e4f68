"""The reference engine on CUDA: NCCL weight receive, pipelined buckets, CUDA IPC, checksums.

Needs GPUs (skipped on CPU machines, e.g. CI); the NCCL test needs two, one for the
trainer (this process) and one for the engine. Run on a GPU host with
`python -m pytest tests/reference_engine/test_gpu.py -s`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import time

import pytest
import torch

from slime_like.models.config import ModelConfig
from tests.reference_engine.conftest import start_engine, stop_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A ~1B Llama layout in bf16: big enough that buckets and streams matter, small to start.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=2048,
                     intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                     torch_dtype="bfloat16")
ENGINE_GPU = 1 if torch.cuda.device_count() > 1 else 0


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("llama1b")
    (model_dir / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    e = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "--device", "cuda", "--load-format",
                     "dummy", "--base-gpu-id", str(ENGINE_GPU), "--context-length", "2048",
                     env={"NCCL_NVLS_ENABLE": "0"}, timeout=300)
    yield e
    print(e.log_tail(20))
    stop_engine(e)


@pytest.fixture(scope="module")
def trainer_state():
    from slime_like.models.loading import build_model, init_dummy_weights

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    model = build_model(CONFIG, device=dev)
    init_dummy_weights(model, seed=123)
    return model


def test_generation_on_cuda_batches_requests(gpu_engine):
    r = gpu_engine.generate({"input_ids": [1, 2, 3, 4], "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    t0 = time.perf_counter()
    gpu_engine.generate({"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})
    print(f"1 x 64 tokens on cuda in {time.perf_counter() - t0:.2f} s")
    out_dir = os.environ.get("OUT")
    for attempt in range(2):
        if attempt and out_dir:
            gpu_engine.post("/start_profile", {"output_dir": out_dir, "profile_id": "gpu-batch", "num_steps": 8})
        with cf.ThreadPoolExecutor(32) as ex:
            t0 = time.perf_counter()
            outs = list(ex.map(lambda i: gpu_engine.generate({"input_ids": [i + 5, 6, 7], "sampling_params": {
                "max_new_tokens": 64, "ignore_eos": True}}).json(), range(32)))
            dt = time.perf_counter() - t0
        assert all(o["meta_info"]["completion_tokens"] == 64 for o in outs)
        print(f"32 x 64 tokens on cuda in {dt:.2f} s")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between trainer and engine needs 2 GPUs")
def test_nccl_flattened_buckets_serial_and_pipelined_then_checksums_and_greedy_match(gpu_engine, trainer_state):
    import torch.distributed as dist

    from slime_like.protocol.buckets import TensorMeta, dtype_name, flatten, plan_buckets
    from slime_like.protocol.weight_group import (
        destroy_process_group,
        host_store,
        init_custom_process_group,
    )
    from slime_like.reference_engine.weight_receiver import tensor_checksum

    state = dict(trainer_state.hf_state_dict())
    pool = cf.ThreadPoolExecutor(4)
    store = host_store(2, timeout=120)
    fut = pool.submit(gpu_engine.post, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
        "group_name": "gpu", "backend": "nccl"})
    # No device_id: NCCL connects lazily at the first broadcast on both sides, as with sglang.
    pg = init_custom_process_group(backend="nccl", world_size=2, rank=0, group_name="gpu", store=store,
                                   timeout=120)
    assert fut.result(timeout=120).json()["success"]
    try:
        gpu_engine.post("/pause_generation", {"mode": "retract"})
        assert gpu_engine.post("/begin_weight_update", {}).json()["success"]
        buckets = plan_buckets([TensorMeta.of(n, t) for n, t in state.items()], 512 << 20)
        total = sum(b.nbytes for b in buckets)
        for mode in ("serial", "pipelined", "pipelined"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            futs = []
            for k, b in enumerate(buckets):
                named = [(m.name, state[m.name]) for m in b.metas]
                f = pool.submit(gpu_engine.post, "/update_weights_from_distributed", {
                    "names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
                    "shapes": [list(t.shape) for _, t in named], "group_name": "gpu",
                    "load_format": "flattened_bucket", "flush_cache": k == len(buckets) - 1,
                    "weight_version": f"{mode}-{k}"})
                buf, _ = flatten(named)
                time.sleep(0.005)  # requests are applied in arrival order: let k arrive before k+1
                dist.broadcast(buf, src=0, group=pg)
                if mode == "serial":
                    assert f.result(timeout=120).json()["success"]
                futs.append(f)
            results = [f.result(timeout=120).json() for f in futs]
            assert all(r["success"] for r in results), results
            dt = time.perf_counter() - t0
            print(f"{mode}: {len(buckets)} buckets, {total / 1e9:.2f} GB in {dt:.3f} s ({total / dt / 1e9:.1f} GB/s)")
        assert gpu_engine.post("/end_weight_update", {}).json()["success"]
        body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
        assert body["ranks"][0]["checksums"] == {n: tensor_checksum(t) for n, t in state.items()}
        gpu_engine.post("/continue_generation", {})
        # bf16 logits of random weights are nearly flat, so greedy tokens are not compared
        # with the trainer's (rounding differs); the checksums above are the exact check.
        out = gpu_engine.generate({"input_ids": [1, 2, 3, 4], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
        assert out["meta_info"]["weight_version"] == f"pipelined-{len(buckets) - 1}"
    finally:
        for endpoint in ("/end_weight_update", "/continue_generation"):
            with contextlib.suppress(Exception):
                gpu_engine.post(endpoint, {}, timeout=30)
        # Both sides leave the NCCL group together (a one-sided destroy can wait for the peer).
        fut = pool.submit(gpu_engine.post, "/destroy_weights_update_group", {"group_name": "gpu"}, timeout=120)
        destroy_process_group(pg)
        print("destroy:", fut.result(timeout=130).json())


def test_cuda_ipc_tensor_payload_loads_flattened_buckets(gpu_engine, trainer_state):
    from slime_like.models.loading import init_dummy_weights
    from slime_like.protocol.buckets import TensorMeta, flatten, plan_buckets
    from slime_like.protocol.tensor_payload import serialize
    from slime_like.reference_engine.weight_receiver import tensor_checksum

    init_dummy_weights(trainer_state, seed=7)
    state = {n: t.to(f"cuda:{ENGINE_GPU}") for n, t in trainer_state.hf_state_dict().items()}
    gpu_engine.post("/begin_weight_update", {})
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in plan_buckets([TensorMeta.of(n, t) for n, t in state.items()], 512 << 20):
            buf, meta = flatten([(m.name, state[m.name]) for m in b.metas])
            torch.cuda.synchronize()
            r = gpu_engine.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize({"flattened_tensor": buf, "metadata": meta})],
                "load_format": "flattened_bucket", "flush_cache": False})
            assert r.status_code == 200, r.text
        print(f"CUDA IPC transport: {time.perf_counter() - t0:.3f} s")
    finally:
        gpu_engine.post("/end_weight_update", {})
    body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
    assert body["ranks"][0]["checksums"] == {n: tensor_checksum(t) for n, t in state.items()}


@pytest.mark.parametrize("params", ["separate", "flat", "flat, new every sync"])
def test_tensor_transport_lands_every_byte_packed_or_straight_from_flat_buffers(
        gpu_engine, trainer_state, params):
    """WeightSync's `tensor` transport (CUDA IPC) from plain parameters (packed, memcpy per
    tensor, at the first sync; from the second on every parameter in place, one request,
    the engine copying from its kept mappings: `weights/shared_params.py`) and from one flat
    buffer (no pack; the planned buckets merge into one request), also when the flat buffer
    is a new one every sync (an offloading trainer): it still goes in place, and the engine
    lets go of the old one when its update session ends."""
    from slime_like.reference_engine.weight_receiver import tensor_checksum
    from slime_like.weights import NamedTensors, WeightSync

    base = {n: t.detach() for n, t in trainer_state.hf_state_dict().items()}

    def flat_views(state):
        flat = torch.cat([t.reshape(-1) for t in state.values()])
        views, offset = {}, 0
        for n, t in state.items():
            views[n] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        return views

    if params.startswith("flat"):
        assert {t.dtype for t in base.values()} == {torch.bfloat16}
        state = flat_views(base)
    else:
        state = {n: t.clone() for n, t in base.items()}
    source = NamedTensors(list(state.items()))
    sync = WeightSync([(gpu_engine.url, 1)], transport="tensor", device="cuda:0",
                      update_weight_buffer_size=64 << 20, master_address="127.0.0.1")
    try:
        sync.attach(source)
        for step in range(3):
            if params == "flat, new every sync":
                old = next(iter(state.values())).untyped_storage()
                state = flat_views(state)
                source = NamedTensors(list(state.items()))
            tensors = list(state.values())
            torch._foreach_add_(tensors, 0.25)
            report = sync.update(source).as_dict()
            planned = -(-sum(t.numel() * 2 for t in tensors) // (64 << 20))
            if params.startswith("flat"):
                assert report["transfer"]["buckets"] == 1
                assert report["transfer"]["pack_s"] == 0.0
            elif step == 0:
                assert report["transfer"]["buckets"] >= planned
            else:  # the same parameters again: in place, shared once, kept by the engine
                assert report["transfer"]["buckets"] == 1
                assert report["transfer"]["pack_s"] == 0.0
            body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
            assert body["ranks"][0]["checksums"] == {n: tensor_checksum(t) for n, t in state.items()}
            if params == "flat, new every sync":
                # the engine closed its mapping at end_weight_update: dropping our last
                # reference frees the old buffer (an importer still holding it would keep
                # it in torch's IPC limbo, and memory_allocated would not fall)
                before = torch.cuda.memory_allocated()
                nbytes = old.nbytes()
                del old
                torch.cuda.ipc_collect()
                assert torch.cuda.memory_allocated() <= before - nbytes
    finally:
        sync.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_quantize_on_cuda_fused_and_two_pass_make_the_float32_bytes(dtype):
    """The trainer quantizes on its GPU (`protocol/fp8.py`): in one Triton kernel where
    Triton is installed (`fp8_kernel`), else in two torch passes; its checks
    (`ServedWeights`) quantize there too. Both GPU forms must make the bytes the float32
    form makes on the same device, for blocks of every magnitude, an all-zero block, and a
    weight whose rows are a view into a wider tensor. (Across devices e4m3 rounding may
    differ, so the job never compares a CPU quantization with a GPU one.)"""
    from slime_like.protocol import fp8, fp8_kernel

    if dtype is torch.bfloat16:
        assert fp8_kernel.available(), "a CUDA build of torch ships Triton: the fused kernel must run"
    wide = (torch.randn(1024, 2304) * torch.logspace(-4, 0, 2304)).to(dtype).cuda()
    wide[:128, :128] = 0
    wide[128:256, 256:384] *= 1e3
    for w in (wide[:, :2048].contiguous(), wide[:, 128:2176]):
        values, scale = fp8._quantize_float32(w, fp8.BLOCK)
        for fused in ((True, False) if fp8_kernel.available() else (False,)):
            values2, scale2 = fp8.quantize(w, fused=fused)
            assert torch.equal(scale, scale2), f"fused={fused}"
            assert torch.equal(values.view(torch.uint8), values2.view(torch.uint8)), f"fused={fused}"
            kept = (torch.empty_like(values2), torch.empty_like(scale2))
            out = fp8.quantize(w, fused=fused, out=kept)
            assert out[0] is kept[0] and torch.equal(kept[0].view(torch.uint8),
                                                     values.view(torch.uint8))
    cpu_values, _ = fp8.quantize(wide[:, :2048].cpu())
    differ = int((cpu_values.view(torch.uint8) != fp8.quantize(wide[:, :2048])[0].cpu()
                  .view(torch.uint8)).sum())
    print(f"e4m3 bytes that differ between the CPU's and the GPU's quantization: {differ} "
          f"of {2048 * 1024}")


def test_tensor_transport_keeps_a_buffer_that_stays_mapped_and_frees_one_that_moves_or_offloads(
        gpu_engine, trainer_state):
    """CUDA IPC mapping reuse across syncs (`reference_engine/ipc_mappings.py`): a flat
    buffer sent in place twice is kept mapped by the engine (dropping it then leaves it in
    torch's IPC limbo: memory_allocated does not fall); once the buffer moved (the next sync
    sends another), or the source said it would not stay (an offload is coming), the engine
    lets go at end_weight_update and the trainer's memory really comes back."""
    from slime_like.reference_engine.weight_receiver import tensor_checksum
    from slime_like.weights import NamedTensors, WeightSync

    class Source(NamedTensors):
        stays = True

        def storage_stays(self):
            return self.stays

    def flat_source(state):
        flat = torch.cat([t.reshape(-1) for t in state.values()])
        views, offset = [], 0
        for n, t in state.items():
            views.append((n, flat[offset:offset + t.numel()].view(t.shape)))
            offset += t.numel()
        return Source(views), flat.untyped_storage().nbytes()

    def sync_and_check(source, step):
        torch._foreach_add_([t for _, t in source.tensors()], 0.25)
        report = sync.update(source, f"keep-{step}").as_dict()
        assert report["transfer"]["buckets"] == 1 and report["transfer"]["pack_s"] == 0.0
        body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
        assert body["ranks"][0]["checksums"] == {n: tensor_checksum(t) for n, t in source.tensors()}

    def freed_after_drop(source) -> bool:
        """Drop the source's buffer; True if its memory came back at once."""
        nbytes = source.resident()[0].untyped_storage().nbytes()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        source._items = [(n, t.clone()) for n, t in source.tensors()]  # moved elsewhere
        torch.cuda.ipc_collect()
        clones = sum(t.untyped_storage().nbytes() for _, t in source.tensors())
        return torch.cuda.memory_allocated() <= before + clones - nbytes // 2

    base = {n: t.detach() for n, t in trainer_state.hf_state_dict().items()}
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    sync = WeightSync([(gpu_engine.url, 1)], transport="tensor", device="cuda:0",
                      update_weight_buffer_size=64 << 20, master_address="127.0.0.1")
    try:
        source, _ = flat_source(base)
        sync.attach(source)
        for step in range(3):
            sync_and_check(source, step)  # from the second sync on: kept mapped
        kept = source
        source, _ = flat_source({n: t for n, t in kept.tensors()})
        assert not freed_after_drop(kept), "the engine should still map the kept buffer"
        torch.cuda.synchronize()
        before, nbytes = torch.cuda.memory_allocated(), source.resident()[0].untyped_storage().nbytes()
        sync_and_check(source, 3)  # the buffer moved: the old one is let go of at the end
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= before - nbytes // 2, "the moved buffer leaked"
        del kept
        sync_and_check(source, 4)  # the new one is kept from here
        source.stays = False  # an offload is coming
        sync_and_check(source, 5)
        assert freed_after_drop(source), "the offloaded buffer's memory did not come back"
    finally:
        sync.close()


def _in_place_syncs(sync_and_check, label: str) -> None:
    """Syncs 1..5 after a packed first one: each one request, nothing packed; the first
    shares (the engine opens), the next four reuse what the engine holds mapped."""
    times = []
    for step in range(1, 6):
        report, stats = sync_and_check(step)
        assert report["transfer"]["buckets"] == 1 and report["transfer"]["pack_s"] == 0.0
        times.append(report["total_s"])
        if step == 1:
            first = stats
    assert stats["reused"] - first["reused"] == 4 and stats["opened"] == first["opened"]
    print(f"{label}: share + open {times[0] * 1e3:.1f} ms, then "
          f"{[round(t * 1e3, 1) for t in times[1:]]} ms")


def test_separate_parameters_in_place_are_shared_once_and_freed_after_the_engine_lets_go(
        gpu_engine, trainer_state):
    """Separate CUDA parameters (`weights/shared_params.py`): the first sync packs; the
    second shares every parameter once and the engine keeps them mapped; the later syncs
    send the same share, which the engine reuses (nothing opened), and every sync lands
    byte for byte. When the source says its storages will not stay (an offload), the
    engine lets go at that sync's end and the trainer's memory comes back when dropped."""
    from slime_like.reference_engine.weight_receiver import tensor_checksum
    from slime_like.weights import NamedTensors, WeightSync

    class Source(NamedTensors):
        stays = True

        def storage_stays(self):
            return self.stays

    state = {n: t.detach().clone() for n, t in trainer_state.hf_state_dict().items()}
    source = Source(list(state.items()))
    sync = WeightSync([(gpu_engine.url, 1)], transport="tensor", device="cuda:0",
                      update_weight_buffer_size=256 << 20, master_address="127.0.0.1")

    def sync_and_check(step):
        torch._foreach_add_(list(state.values()), 0.25)
        report = sync.update(source, f"shared-{step}").as_dict()
        body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
        assert body["ranks"][0]["checksums"] == {n: tensor_checksum(t) for n, t in state.items()}
        return report, body["ranks"][0]["ipc_mappings"]

    try:
        report, _ = sync_and_check(0)
        assert report["transfer"]["buckets"] > 1 and report["transfer"]["pack_s"] > 0
        _in_place_syncs(sync_and_check, "separate parameters in place")
        source.stays = False  # an offload is coming: packed, and let go of at its end
        report, _ = sync_and_check(6)
        assert report["transfer"]["buckets"] > 1
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        nbytes = sum(t.untyped_storage().nbytes() for t in state.values())
        state.clear()
        source = None
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= before - nbytes // 2, "the parameters leaked"
    finally:
        sync.close()


@pytest.mark.parametrize("ready_event", [True, False], ids=["event", "host wait"])
@pytest.mark.parametrize("params", ["separate", "flat"])
def test_writes_still_queued_on_the_trainers_gpu_land_before_the_engine_copies(
        gpu_engine, trainer_state, params, ready_event):
    """Each sync's writes are queued behind 50 ms of GPU sleep, so they are still pending
    when the sync starts: an engine that copied as soon as the in-place request came would
    load the last sync's weights. With the ready event (`protocol/ready_event.py`) the
    trainer does not wait on its host; the engine's stream waits for the event; without
    it the trainer synchronizes first. Either way every sync lands byte for byte."""
    from slime_like.protocol.ready_event import READY_EVENT_KEY
    from slime_like.reference_engine.weight_receiver import tensor_checksum
    from slime_like.weights import NamedTensors, WeightSync

    assert gpu_engine.get("/server_info").json()[READY_EVENT_KEY] is True
    base = {n: t.detach() for n, t in trainer_state.hf_state_dict().items()}
    if params == "flat":
        flat = torch.cat([t.reshape(-1) for t in base.values()])
        state, offset = {}, 0
        for n, t in base.items():
            state[n] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
    else:
        state = {n: t.clone() for n, t in base.items()}
    source = NamedTensors(list(state.items()))
    sync = WeightSync([(gpu_engine.url, 1)], transport="tensor", device="cuda:0",
                      update_weight_buffer_size=256 << 20, master_address="127.0.0.1")
    waited = gpu_engine.post("/weights_checker", {}).json()["ranks"][0]["ready_events_waited"]
    try:
        sync.attach(source)
        sync.transport.ready_event = ready_event
        for step in range(4):
            torch.cuda._sleep(100_000_000)  # about 50 ms at the H100's clock
            torch._foreach_add_(list(state.values()), 0.25)
            sync.update(source, f"late-{params}-{step}")
            body = gpu_engine.post("/weights_checker", {}, timeout=600).json()
            assert body["ranks"][0]["checksums"] == {
                n: tensor_checksum(t) for n, t in state.items()}, f"sync {step}: stale"
        in_place = 4 if params == "flat" else 3  # separate parameters pack the first sync
        assert body["ranks"][0]["ready_events_waited"] - waited == (
            in_place if ready_event else 0)
    finally:
        sync.close()


@pytest.fixture(scope="module")
def fp8_gpu_engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("llama1b-fp8")
    (model_dir / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    e = start_engine(model_dir, tmp_path_factory.mktemp("logs-fp8"), "--device", "cuda",
                     "--load-format", "dummy", "--base-gpu-id", "0", "--context-length", "2048",
                     "--quantization", "fp8", env={"NCCL_NVLS_ENABLE": "0"}, timeout=300)
    yield e
    print(e.log_tail(20))
    stop_engine(e)


def test_a_kept_fp8_copy_goes_in_place_and_every_sync_lands_the_trainers_new_weights(
        fp8_gpu_engine, trainer_state):
    """FP8 rollout from a bf16 trainer, colocated (`Fp8Weights(keep=True)`): the first sync
    packs; from the second every e4m3 value, scale and unquantized tensor goes in one
    in-place request that the engine reuses (nothing opened again); each sync carries the
    trainer's weights of that sync, quantized on its GPU, byte for byte."""
    from slime_like.reference_engine.weight_receiver import tensor_checksum
    from slime_like.weights import WeightSync
    from slime_like.weights.fp8 import Fp8Weights

    source = Fp8Weights(trainer_state, torch.bfloat16, keep=True)
    sync = WeightSync([(fp8_gpu_engine.url, 1)], transport="tensor", device="cuda:0",
                      update_weight_buffer_size=256 << 20, master_address="127.0.0.1")

    def sync_and_check(step):
        with torch.no_grad():
            torch._foreach_mul_(list(trainer_state.parameters()), 1.0 + 2.0 ** -6)
        report = sync.update(source, f"fp8-kept-{step}").as_dict()
        body = fp8_gpu_engine.post("/weights_checker", {}, timeout=600).json()
        want = {n: tensor_checksum(t) for n, t in Fp8Weights(trainer_state, torch.bfloat16)
                .tensors()}
        assert body["ranks"][0]["checksums"] == want, f"sync {step}: stale or partial"
        return report, body["ranks"][0]["ipc_mappings"]

    try:
        report, _ = sync_and_check(0)
        assert report["transfer"]["pack_s"] > 0
        _in_place_syncs(sync_and_check, "FP8 kept copy in place")
        assert source.graph_replays == 5, "syncs 1-5 rewrite the kept copy by a graph replay"
    finally:
        sync.close()


def test_the_kept_fp8_copy_rewritten_by_a_graph_replay_holds_each_steps_quantized_weights(
        trainer_state):
    """`Fp8Weights(keep=True)` on CUDA rewrites its kept copy by replaying one captured graph
    (`weights/fp8_graph.py`). Each read must hold the bytes a fresh quantize of that step's
    weights makes, through in-place steps (one graph, replayed) and after a parameter moved
    (captured again: a replay of the old graph would read the freed storage)."""
    from slime_like.weights.fp8 import Fp8Weights

    kept = Fp8Weights(trainer_state, torch.bfloat16, keep=True)
    eager = Fp8Weights(trainer_state, torch.bfloat16, keep=True, graph=False)
    params = list(trainer_state.parameters())

    def read_and_check(step):
        with torch.no_grad():
            torch._foreach_mul_(params, 1.0 + 2.0 ** -5)
        for source in (kept, eager):
            source.begin_sync()
        want = [(n, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
                for n, t in Fp8Weights(trainer_state, torch.bfloat16).tensors()]
        for source in (kept, eager):
            got = list(source.tensors())
            assert [n for n, _ in got] == [n for n, _ in want]
            for (name, t), (_, w) in zip(got, want, strict=True):
                t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                assert torch.equal(t, w), f"step {step}, graph={source.graph}: {name} stale"

    for step in range(4):
        read_and_check(step)
    assert kept.graph_replays == 3 and eager.graph_replays == 0
    first_graph = kept._rewrite
    moved = params[len(params) // 2]
    moved.data = moved.data.clone()  # a parameter at a new address: the graph must follow
    read_and_check(4)
    assert kept._rewrite is not first_graph and kept.graph_replays == 1
    read_and_check(5)
    assert kept.graph_replays == 2
