"""Trainer offload/onload keeps every byte of the state and the training it drives.

Runs on CPU (the "device" is the CPU there): the same code path as on a GPU moves the
weights and AdamW's moments into the reused host buffers and back into one flat buffer
per dtype; checked by checksum, by the log-probability check against a twin that never
moved, and by the next train step.
"""

from __future__ import annotations

import torch

from slime_like.models.tiny import make_tiny_model
from slime_like.protocol.checksums import tensor_checksum
from slime_like.trainer import offload as offload_module
from slime_like.trainer.policy import PolicyTrainer
from slime_like.weights.packing import direct_view

SAMPLES = [([1, 2, 3, 4], [5, 6, 7]), ([8, 9], [10, 11, 12, 13])]
ADVANTAGES = [1.0, -1.0]


def _checksums(t: PolicyTrainer) -> dict[str, str]:
    sums = {f"param/{n}": tensor_checksum(p) for n, p in t.model.named_parameters()}
    names = {id(p): n for n, p in t.model.named_parameters()}
    for p, state in t.optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v):
                sums[f"state/{names[id(p)]}/{k}"] = tensor_checksum(v)
    return sums


def test_offload_and_onload_keep_weights_and_adam_state_and_training_goes_on_as_if_never_moved(
        tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    moved = PolicyTrainer(model_dir, seed=0)
    twin = PolicyTrainer(model_dir, seed=0)
    for t in (moved, twin):
        t.train_step(SAMPLES, ADVANTAGES)  # grads and AdamW's two moments now exist
    before = _checksums(moved)
    ptrs = {n: p.data_ptr() for n, p in moved.model.named_parameters()}
    params = list(moved.model.parameters())

    out = moved.move_to("cpu")
    # weights + exp_avg + exp_avg_sq, all of it; gradients freed, not copied
    per_copy = sum(p.numel() * p.element_size() for p in params)
    assert out.bytes >= 3 * per_copy
    assert all(p.grad is None for p in params)
    assert all(p.data_ptr() != ptrs[n] for n, p in moved.model.named_parameters())
    assert _checksums(moved) == before

    back = moved.offloader.onload()
    # One dtype: two copies back, the weights first (a forward waits for them only), then
    # the optimizer state (the optimizer step waits for it).
    assert back.bytes == out.bytes and back.copies == 2
    assert _checksums(moved) == before
    # Onloaded as views of one flat buffer: the next offload is one copy, into the same
    # (reused) host buffer.
    bases = {p.untyped_storage().data_ptr() for p in params}
    assert len(bases) == 1
    # ... back to back in the sync's order: a weight sync sends them without a pack copy.
    assert direct_view([p.data for p in params], params[0].device) is not None
    host = moved.offloader.host_bytes()
    again = moved.move_to("cpu")
    assert again.copies == 1 and moved.offloader.host_bytes() == host
    assert _checksums(moved) == before
    moved.offloader.onload()

    for mine, theirs in zip(moved.completion_logprobs(SAMPLES), twin.completion_logprobs(SAMPLES),
                            strict=True):
        assert mine == theirs
    a = moved.train_step(SAMPLES, ADVANTAGES)
    b = twin.train_step(SAMPLES, ADVANTAGES)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert _checksums(moved) == _checksums(twin)


def test_kept_weights_stay_in_one_storage_that_outlives_every_offload_and_only_adam_moves(
        tmp_path, monkeypatch):
    """--no-offload-train-weights: the weights stay on the device, as views of one flat
    buffer in the sync's order that survives offloads (so a colocated sync sends them in
    place); only AdamW's moments go to the host, and training matches a twin that never
    moved. The buffer is renewed every WEIGHTS_RENEW_EVERY offloads, bytes unchanged."""
    monkeypatch.setattr(offload_module, "WEIGHTS_RENEW_EVERY", 3)
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    kept = PolicyTrainer(model_dir, seed=0)
    twin = PolicyTrainer(model_dir, seed=0)
    params = list(kept.model.parameters())
    per_copy = sum(p.numel() * p.element_size() for p in params)
    storages, stays = [], []
    for step in range(4):
        for t in (kept, twin):
            t.train_step(SAMPLES, ADVANTAGES)
        # the sync source's word to the tensor transport (may engines keep the mapping?)
        stays.append(kept.sync_source().storage_stays())
        before = _checksums(kept)
        out = kept.move_to("cpu", keep_weights=True)
        # AdamW's two moments moved (alignment may pad a few bytes), the weights did not
        assert 2 * per_copy <= out.bytes < 3 * per_copy, step
        assert all(p.grad is None for p in params)
        weights = {p.untyped_storage().data_ptr() for p in params}
        assert len(weights) == 1, f"step {step}: weights in {len(weights)} storages"
        assert direct_view([p.data for p in params], params[0].device) is not None
        assert _checksums(kept) == before
        storages.append(weights.pop())
        back = kept.offloader.onload()
        assert back.bytes == out.bytes and back.copies == 1  # only the state comes back
        assert _checksums(kept) == before
        for mine, theirs in zip(kept.completion_logprobs(SAMPLES),
                                twin.completion_logprobs(SAMPLES), strict=True):
            assert mine == theirs, f"step {step}"
    # the same storage offload after offload, a fresh one at the renewal (the 3rd offload)
    assert storages[0] == storages[1] != storages[2] == storages[3]
    # ... and the sync before the renewing offload says the weights will not stay
    assert stays == [False, True, False, True]  # before any offload: not vouched for
    assert _checksums(kept) == _checksums(twin)
    twin.move_to("cpu")  # offloaded with the rest: the next offload frees the weights
    twin.move_to(twin.device)
    assert twin.sync_source().storage_stays() is False


def test_weights_kept_then_moved_again_come_back_intact(tmp_path):
    """Switching between the two modes keeps every byte (the kept buffer is let go)."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    moved = PolicyTrainer(model_dir, seed=0)
    twin = PolicyTrainer(model_dir, seed=0)
    for keep in (True, False, True):
        for t in (moved, twin):
            t.train_step(SAMPLES, ADVANTAGES)
        before = _checksums(moved)
        moved.move_to("cpu", keep_weights=keep)
        moved.offloader.onload()
        assert _checksums(moved) == before, f"keep_weights={keep}"
    a = moved.train_step(SAMPLES, ADVANTAGES)
    b = twin.train_step(SAMPLES, ADVANTAGES)
    assert a["loss"] == b["loss"] and _checksums(moved) == _checksums(twin)


def test_the_first_offload_sizes_the_host_buffer_for_the_moments_adamw_is_about_to_add(
        tmp_path):
    """The job offloads before the first train step (only weights exist then); the host
    buffer is allocated once, with room for AdamW's two moments, not replaced at step 1
    (pinning takes seconds per ten GB, and a replaced buffer stays pinned in torch's cache)."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    moved = PolicyTrainer(model_dir, seed=0)
    twin = PolicyTrainer(model_dir, seed=0)
    per_copy = sum(p.numel() * p.element_size() for p in moved.model.parameters())
    first = moved.move_to("cpu")
    assert first.bytes < 1.1 * per_copy  # the weights alone moved
    host = dict(moved.offloader._host)
    assert moved.offloader.host_bytes() >= 3 * per_copy
    moved.offloader.onload()
    for t in (moved, twin):
        t.train_step(SAMPLES, ADVANTAGES)
    before = _checksums(moved)
    second = moved.move_to("cpu")
    assert second.bytes >= 3 * per_copy  # weights and both moments
    assert {d: b.data_ptr() for d, b in moved.offloader._host.items()} == \
        {d: b.data_ptr() for d, b in host.items()}, "the host buffer was replaced"
    assert _checksums(moved) == before
    moved.offloader.onload()
    assert _checksums(moved) == _checksums(twin)
