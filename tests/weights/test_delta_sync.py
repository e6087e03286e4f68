"""Delta weight updates (`update_weight_mode="delta"`) into real reference engines.

The trainer (this process) takes real AdamW steps on the tiny model and syncs engine A
(TP=1) and engine B (TP=2) over disk and over a gloo weight group; after every sync each
TP rank's `/weights_checker` checksum must equal the trainer's weights, byte for byte.
"""

from __future__ import annotations

import json

import pytest
import torch
from weight_sync_helpers import model_checksum, trainer_model

from slime_like.protocol import weight_delta as wd
from slime_like.weights import WeightSync

BUCKET = 64 << 10  # several buckets for the tiny model


def _sync(engines, transport, tmp_path, **kw) -> WeightSync:
    kw.setdefault("update_weight_buffer_size", BUCKET)
    return WeightSync([(e.url, e.tp_size) for e in engines], transport=transport,
                      update_weight_mode="delta",
                      disk_dir=str(tmp_path / "ckpt"), http_timeout_s=60, group_timeout_s=60,
                      **kw)


class Trainer:
    """The tiny model and a real AdamW: each step changes a part of the bit patterns."""

    def __init__(self, model_dir, lr: float = 1e-4, seed: int = 7):
        self.model = trainer_model(model_dir, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the tiny model: 10 ms on one thread, 15x that on two
        try:
            ids = torch.randint(0, 256, (2, 12), generator=self.gen)
            logits = self.model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        finally:
            torch.set_num_threads(threads)


def _all_match(engines, model) -> None:
    expected = model_checksum(model)
    for e in engines:
        assert e.rank_checksums() == [expected] * e.tp_size, e.url


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_delta_syncs_land_byte_for_byte_and_send_less(engines, tiny_model_dir, tmp_path,
                                                      transport):
    trainer = Trainer(tiny_model_dir)
    sync = _sync(engines, transport, tmp_path)
    try:
        first = sync.update(trainer.model)
        assert first.transfer["delta"]["mode"] == "full"  # no base yet
        _all_match(engines, trainer.model)
        for _ in range(2):
            trainer.step()
            report = sync.update(trainer.model)
            delta = report.transfer["delta"]
            assert delta["mode"] == "delta", delta
            assert delta["sent_bytes"] < delta["raw_bytes"]
            assert report.transfer["bytes"] == delta["sent_bytes"]
            _all_match(engines, trainer.model)
            assert {e.weight_version() for e in engines} == {report.weight_version}
        if transport == "disk":  # the delta directory sits beside the full checkpoint
            names = {p.name for p in (tmp_path / "ckpt").iterdir()}
            assert {f"weights-{first.weight_version}",
                    f"weights-{report.weight_version}.delta"} <= names
    finally:
        sync.close()


def test_a_wrong_base_is_refused_unchanged_and_the_sync_falls_back_to_full(
        engines, tiny_model_dir, tmp_path):
    trainer = Trainer(tiny_model_dir, seed=8)
    sync = _sync(engines[:1], "disk", tmp_path)
    try:
        sync.update(trainer.model)
        trainer.step()
        sync.update(trainer.model)  # a delta: the engines hold the base now
        # Engine A's weights change behind the trainer's back (same version served).
        a = engines[0]
        served = a.weight_version()
        assert a.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)}).json()[
            "success"]
        assert a.weight_version() == served
        before = a.rank_checksums()

        # The last delta's first bucket again (one sub-directory and request per bucket):
        # its base is the version before, refused as such.
        last = max((tmp_path / "ckpt").glob("*.delta"), key=lambda p: p.stat().st_mtime)
        last = last / "00000"
        answer = a.post("/update_weights_from_disk", {"model_path": str(last),
                                                      "load_format": wd.XOR_ZSTD}).json()
        assert not answer["success"] and f"but this engine serves {served!r}" in answer["message"]
        # Named onto the served version: the digest of A's bytes is not the base's; refused,
        # nothing changed.
        manifest = json.loads((last / wd.MANIFEST).read_text())
        manifest["base_version"] = served
        for bucket in manifest["buckets"]:
            bucket["header"]["base_version"] = served
        (last / wd.MANIFEST).write_text(json.dumps(manifest))
        answer = a.post("/update_weights_from_disk", {"model_path": str(last),
                                                      "load_format": wd.XOR_ZSTD}).json()
        assert not answer["success"] and wd.REFUSED in answer["message"]
        assert "not the delta's base" in answer["message"]
        assert a.rank_checksums() == before

        # The trainer's next delta is refused by A the same way; the sync runs in full.
        trainer.step()
        report = sync.update(trainer.model)
        assert report.transfer["delta"]["mode"] == "full"
        _all_match([a], trainer.model)
        trainer.step()
        assert sync.update(trainer.model).transfer["delta"]["mode"] == "delta"
        _all_match([a], trainer.model)
    finally:
        sync.close()


def test_a_new_engine_gets_full_weights(engines, tiny_model_dir, tmp_path):
    trainer = Trainer(tiny_model_dir, seed=9)
    a, b = engines
    sync = _sync([a], "distributed", tmp_path)
    try:
        sync.update(trainer.model)
        trainer.step()
        assert sync.update(trainer.model).transfer["delta"]["mode"] == "delta"
        trainer.step()
        report = sync.update(trainer.model, engines=[(a.url, 1), (b.url, 2)])
        assert report.transfer["delta"]["mode"] == "full"
        assert b.url in report.transfer["delta"]["reason"]
        _all_match(engines, trainer.model)
        trainer.step()
        assert sync.update(trainer.model).transfer["delta"]["mode"] == "delta"
        _all_match(engines, trainer.model)
    finally:
        sync.close()


def test_a_sglang_engine_without_delta_support_gets_full_weights(engines, tiny_model_dir,
                                                                  tmp_path):
    trainer = Trainer(tiny_model_dir, seed=10)
    sync = _sync(engines[:1], "disk", tmp_path)
    try:
        sync.update(trainer.model)
        for session in sync.engines:  # as sglang answers /server_info: no delta formats
            session.server_info.pop(wd.SERVER_INFO_KEY)
        trainer.step()
        report = sync.update(trainer.model)
        assert report.transfer["delta"]["mode"] == "full"
        assert wd.SERVER_INFO_KEY in report.transfer["delta"]["reason"]
        _all_match(engines[:1], trainer.model)
    finally:
        sync.close()
    # A delta bucket without its header is refused before any rank waits for bytes.
    answer = engines[0].post("/update_weights_from_distributed", {
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
        "load_format": wd.XOR_ZSTD}).json()
    assert not answer["success"] and "needs the bucket's weight_delta header" in answer["message"]


def test_fifty_delta_syncs_end_exactly_at_the_trainers_weights(engines, tiny_model_dir,
                                                               tmp_path):
    trainer = Trainer(tiny_model_dir, lr=3e-5, seed=11)
    # engine A, one bucket: 50 syncs' worth of control calls kept few (the other tests
    # cover several buckets and TP=2)
    sync = _sync(engines[:1], "distributed", tmp_path, update_weight_delta_full_every=20,
                 update_weight_buffer_size=1 << 20)
    modes = []
    try:
        for _ in range(50):
            trainer.step()
            modes.append(sync.update(trainer.model).transfer["delta"]["mode"])
        _all_match(engines[:1], trainer.model)
    finally:
        sync.close()
    assert [i for i, m in enumerate(modes) if m == "full"] == [0, 20, 40]
