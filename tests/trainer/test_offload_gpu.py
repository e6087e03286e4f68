"""--offload-train on a GPU: model and optimizer state leave the device and come back intact.

Needs CUDA (skipped on CPU machines such as CI; run on a GPU host with
`python -m pytest tests/trainer/test_offload_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from slime_like.models.tiny import make_tiny_model
from slime_like.trainer.policy import PolicyTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SAMPLES = [([1, 2, 3, 4], [5, 6, 7]), ([8, 9], [10, 11, 12, 13])]
ADVANTAGES = [1.0, -1.0]


def _on(trainer: PolicyTrainer, device: str) -> bool:
    tensors = [p for p in trainer.model.parameters()]
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    tensors += [v for s in trainer.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0]
    return all(t.device.type == device for t in tensors)


def test_offload_gives_back_weights_grads_and_adam_state_and_training_resumes_unchanged(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    offloaded = PolicyTrainer(model_dir, device="cuda", seed=0)
    twin = PolicyTrainer(model_dir, device="cuda", seed=0)
    for t in (offloaded, twin):
        t.train_step(SAMPLES, ADVANTAGES)  # grads and AdamW's two moments now exist
    per_copy = sum(p.numel() * p.element_size() for p in offloaded.model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    offloaded.move_to("cpu")
    freed = before - torch.cuda.memory_allocated()
    assert _on(offloaded, "cpu")
    # weights + grads + exp_avg + exp_avg_sq
    assert freed >= 4 * per_copy, f"freed {freed} bytes, expected at least {4 * per_copy}"

    offloaded.move_to("cuda")
    assert _on(offloaded, "cuda")
    for mine, theirs in zip(offloaded.completion_logprobs(SAMPLES),
                            twin.completion_logprobs(SAMPLES), strict=True):
        assert mine == pytest.approx(theirs, abs=1e-6)
    a = offloaded.train_step(SAMPLES, ADVANTAGES)
    b = twin.train_step(SAMPLES, ADVANTAGES)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for (name, p), q in zip(offloaded.model.named_parameters(), twin.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=f"{name} differs after offload")


def test_overlapped_offload_and_onload_keep_the_state_for_every_use(tmp_path):
    """Enqueued copies (the job's schedule): the next use of the model waits for them."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    moved = PolicyTrainer(model_dir, device="cuda", seed=0)
    twin = PolicyTrainer(model_dir, device="cuda", seed=0)
    for step in range(3):
        for t in (moved, twin):
            t.train_step(SAMPLES, ADVANTAGES)
        moved.move_to("cpu", wait=False)
        moved.move_to("cuda", wait=False)  # waits for the offload, then enqueues the onload
        for mine, theirs in zip(moved.completion_logprobs(SAMPLES),
                                twin.completion_logprobs(SAMPLES), strict=True):
            assert mine == theirs, f"step {step}"
        stats = moved.offloader.onload_stats()
        assert stats.bytes > 0 and stats.seconds > 0
        assert moved.offloader.last_offload.seconds > 0


def test_kept_weights_stay_in_one_gpu_storage_while_adam_state_moves(tmp_path):
    """--no-offload-train-weights: weights stay on the GPU in one storage that outlives the
    offloads (what a colocated sync sends in place); grads and both moments are given back;
    every use and every train step match a twin that never moved (overlapped copies)."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    kept = PolicyTrainer(model_dir, device="cuda", seed=0)
    twin = PolicyTrainer(model_dir, device="cuda", seed=0)
    params = list(kept.model.parameters())
    per_copy = sum(p.numel() * p.element_size() for p in params)
    storages = set()
    for step in range(3):
        for t in (kept, twin):
            t.train_step(SAMPLES, ADVANTAGES)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        kept.move_to("cpu", keep_weights=True)
        kept.offloader._wait_drained()
        freed = before - torch.cuda.memory_allocated()
        # grads + exp_avg + exp_avg_sq (less the weights' alignment padding)
        assert freed >= 3 * per_copy - 16 * len(params), f"step {step}: freed {freed}"
        assert all(p.is_cuda for p in params)
        storages |= {p.untyped_storage().data_ptr() for p in params}
        kept.move_to("cuda", wait=False)
        for mine, theirs in zip(kept.completion_logprobs(SAMPLES),
                                twin.completion_logprobs(SAMPLES), strict=True):
            assert mine == theirs, f"step {step}"
    assert len(storages) == 1, f"the weights moved between {len(storages)} storages"
    assert kept.train_step(SAMPLES, ADVANTAGES)["loss"] == twin.train_step(SAMPLES, ADVANTAGES)["loss"]


def test_the_first_offload_pins_one_host_buffer_for_the_whole_run(tmp_path):
    """The job's first offload comes before any train step (weights only): the pinned host
    buffer it allocates has room for AdamW's moments, so later offloads reuse it."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    moved = PolicyTrainer(model_dir, device="cuda", seed=0)
    twin = PolicyTrainer(model_dir, device="cuda", seed=0)
    moved.move_to("cpu", wait=False)
    moved.move_to("cuda", wait=False)
    host = {d: (b.data_ptr(), b.is_pinned()) for d, b in moved.offloader._host.items()}
    assert all(pinned for _, pinned in host.values())
    for step in range(2):
        for t in (moved, twin):
            t.train_step(SAMPLES, ADVANTAGES)
        moved.move_to("cpu", wait=False)
        moved.move_to("cuda", wait=False)
        assert {d: (b.data_ptr(), b.is_pinned()) for d, b in moved.offloader._host.items()} == host
        for mine, theirs in zip(moved.completion_logprobs(SAMPLES),
                                twin.completion_logprobs(SAMPLES), strict=True):
            assert mine == theirs, f"step {step}"
