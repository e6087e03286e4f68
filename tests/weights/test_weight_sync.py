"""A trainer (this process) syncs two reference engines (TP=1 and TP=2) over every transport."""

from __future__ import annotations

import base64
import copy
import itertools
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from weight_sync_helpers import (
    greedy_continuation,
    model_checksum,
    start_engine,
    trainer_model,
)

from slime_like.errors import ConfigError, WeightMetadataError, WeightSyncError
from slime_like.weights import ModelWeights, WeightSync, get_model_metadata

PROMPT = [1, 72, 101, 108, 108, 111]
LONG = 1000  # tokens: long enough (seconds) to be in flight while a sync runs
_seeds = itertools.count(100)


@pytest.mark.parametrize("transport, load_format", [
    ("distributed", "flattened_bucket"),
    ("distributed", "per_tensor"),
    ("tensor", "flattened_bucket"),
    ("disk", "flattened_bucket"),
])
def test_every_rank_matches_the_trainer_after_a_sync(engines, tiny_model_dir, tmp_path,
                                                     transport, load_format):
    sync = WeightSync([(e.url, e.tp_size) for e in engines], transport=transport,
                      load_format=load_format, update_weight_buffer_size=64 << 10,
                      disk_dir=str(tmp_path / "ckpt"), http_timeout_s=60, group_timeout_s=60)
    try:
        for _ in range(2):  # the second sync reuses the group, buffers and plan
            model = trainer_model(tiny_model_dir, seed=next(_seeds))
            report = sync.update(model)
            expected = model_checksum(model)
            for e in engines:
                assert e.rank_checksums() == [expected] * e.tp_size, e.url
                assert e.weight_version() == report.weight_version
                assert e.greedy(PROMPT, 8) == greedy_continuation(model, PROMPT, 8)
            assert report.transfer["buckets"] > (1 if transport != "disk" else 0)
            assert set(report.flush.values()) == {"flushed"}
    finally:
        sync.close()


def _start_long_requests(pool, engine, n: int, max_new_tokens: int = LONG):
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                     "max_new_tokens": max_new_tokens}}
    return [pool.submit(lambda: engine.post("/generate", body, timeout=120).json())
            for _ in range(n)]


def _wait_running(engine, n: int, futures, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    loads: dict = {}
    while time.monotonic() < deadline:
        loads = engine.get("/v1/loads").json()["loads"][0]
        if loads["num_running_reqs"] >= n:
            time.sleep(0.05)  # a few tokens under the old weights
            return
        time.sleep(0.02)
    done = [f.exception() or f.result() for f in futures if f.done()]
    raise AssertionError(f"{engine.url}: {n} requests never ran; loads {loads}; finished "
                         f"requests {done}; engine log:\n{engine.process.log_tail(4000)}")


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
def test_pause_modes_with_requests_in_flight(engines, tiny_model_dir, pause_mode):
    old_versions = {e.url: e.weight_version() for e in engines}
    sync = WeightSync([(e.url, e.tp_size) for e in engines], pause_mode=pause_mode,
                      update_weight_buffer_size=64 << 10, http_timeout_s=60)
    model = trainer_model(tiny_model_dir, seed=next(_seeds))
    try:
        # Probe, metadata check and weight group first: on a loaded machine they take
        # seconds, long enough for the requests to finish before the pause.
        sync.attach(model)
        with ThreadPoolExecutor(8) as pool:
            pending = {e.url: _start_long_requests(pool, e, 2) for e in engines}
            for e in engines:
                _wait_running(e, 2, pending[e.url])
            report = sync.update(model)
            results = {url: [f.result(timeout=120) for f in fs] for url, fs in pending.items()}
    finally:
        sync.close()
    new = report.weight_version
    for e in engines:
        for out in results[e.url]:
            meta = out["meta_info"]
            if pause_mode == "abort":
                assert meta["finish_reason"]["type"] == "abort"
                assert meta["completion_tokens"] < LONG
            else:
                # kept alive across the update: tokens before it under the old version, after
                # it under the new one
                assert meta["finish_reason"]["type"] == "length"
                spans = meta["weight_versions"]
                assert spans[0]["version"] == old_versions[e.url] and spans[0]["end"] > 0
                assert spans[-1]["version"] == new and spans[-1]["end"] == LONG
        assert e.rank_checksums() == [model_checksum(model)] * e.tp_size
    if pause_mode == "abort":
        assert report.in_flight_at_pause == {e.url: 2 for e in engines}
        assert set(report.flush.values()) == {"flushed"}
    elif pause_mode == "retract":
        assert set(report.flush.values()) == {"flushed"}  # 0.5.23 frees retracted KV
    else:
        assert all(v.startswith("skipped: in_place") for v in report.flush.values())


def test_bad_metadata_is_refused_before_any_engine_is_paused(engines, tiny_model_dir):
    before = {e.url: e.rank_checksums() for e in engines}
    sync = WeightSync([(e.url, e.tp_size) for e in engines], http_timeout_s=30)
    model = trainer_model(tiny_model_dir, seed=next(_seeds))
    wrong_shape = dict(model.hf_state_dict())
    wrong_shape["model.norm.weight"] = torch.ones(65)
    unknown = {**model.hf_state_dict(), "model.layers.7.mlp.up_proj.weight": torch.ones(2, 2)}
    try:
        with pytest.raises(WeightMetadataError, match=r"'model\.norm\.weight': shape \[65\], "
                                                      r"expected \[64\]") as e1:
            sync.update(wrong_shape)
        with pytest.raises(WeightMetadataError, match=r"unexpected 'model\.layers\.7"):
            WeightSync([(e.url, e.tp_size) for e in engines]).update(unknown)
        # metadata registered at attach binds later updates
        sync.attach(metadata=get_model_metadata(model))
        with pytest.raises(WeightMetadataError, match="dtype bfloat16, expected float32"):
            sync.update(model.to(torch.bfloat16))
    finally:
        sync.close()
    assert e1.value.step == "check_metadata" and e1.value.engine == engines[0].url
    for e in engines:
        assert e.rank_checksums() == before[e.url]  # not a byte moved
        assert e.get("/ready").status_code == 200  # never paused


def test_malicious_tensor_payload_is_refused_by_the_engine(engines, tmp_path):
    engine = engines[0]
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = base64.b64encode(pickle.dumps([("model.norm.weight", RunsCode())])).decode()
    before = engine.rank_checksums()
    assert engine.post("/begin_weight_update").status_code == 200
    try:
        resp = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    finally:
        engine.post("/end_weight_update")
    assert resp.status_code == 400
    assert "Blocked unsafe global (posix.system)" in resp.text
    assert not marker.exists()
    assert engine.rank_checksums() == before
    assert engine.greedy(PROMPT, 2)  # still serving


class KillAfter:
    """A weight source that SIGKILLs an engine once `n` tensors went out: a real crash,
    placed at a known point of the broadcast."""

    def __init__(self, model, n: int, victim):
        self.inner, self.n, self.victim = ModelWeights(model), n, victim

    def metadata(self):
        return self.inner.metadata()

    def tensors(self):
        for i, item in enumerate(self.inner.tensors()):
            if i == self.n:
                self.victim.process.kill()
                self.victim.process.wait_exit(30)
            yield item


def test_engine_killed_mid_broadcast_fails_fast_and_the_other_engine_keeps_serving(
        engines, tiny_model_dir, weights_log_dir):
    survivor = engines[0]
    victim = start_engine(tiny_model_dir, weights_log_dir, 1)
    sync = WeightSync([(survivor.url, 1), (victim.url, 1)], update_weight_buffer_size=16 << 10,
                      http_timeout_s=20, group_timeout_s=20)
    try:
        sync.update(trainer_model(tiny_model_dir, seed=next(_seeds)))
        model = trainer_model(tiny_model_dir, seed=next(_seeds))
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            sync.update(KillAfter(model, 5, victim))
        elapsed = time.monotonic() - start
        assert elapsed < 20, f"the failed sync took {elapsed:.1f}s, past its 20s timeout"
        # pause and begin overlap packing the first bucket, so the kill may hit one of them
        assert err.value.step.startswith(("transfer", "update_weights_from_distributed", "broadcast",
                                          "begin_weight_update", "pause_generation"))
        assert victim.url in str(err.value)
        # the survivor was resumed and serves; the dead engine was dropped for recovery
        assert survivor.get("/ready").status_code == 200
        assert survivor.greedy(PROMPT, 4)
        assert sync.take_dropped() == [victim.url]
        # the next sync rebuilds the group for the living engine alone
        report = sync.update(model)
        assert report.engines == [survivor.url]
        assert survivor.rank_checksums() == [model_checksum(model)]
    finally:
        sync.close()
        victim.process.terminate(grace=5)


def test_engine_refusing_a_bucket_before_joining_does_not_hang_the_trainer(engines, tiny_model_dir):
    refuser, other = engines
    sync = WeightSync([(e.url, e.tp_size) for e in engines], update_weight_buffer_size=64 << 10,
                      http_timeout_s=60, group_timeout_s=60)
    try:
        sync.update(trainer_model(tiny_model_dir, seed=next(_seeds)))
        # behind the sync's back the group disappears on one engine: its next update answers
        # 400 ("Group ... not in ...") without joining the broadcast
        group = sync.transport.group_name
        assert refuser.post("/destroy_weights_update_group", {"group_name": group}).ok
        model = trainer_model(tiny_model_dir, seed=next(_seeds))
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="Please call `init_weights_update_group`") as err:
            sync.update(model)
        assert time.monotonic() - start < 15, "the trainer sat in the broadcast"
        assert err.value.engine == refuser.url
        assert err.value.step.startswith("update_weights_from_distributed (bucket 1/")
        for e in engines:
            assert e.get("/ready").status_code == 200  # both resumed
        assert sync.take_dropped() == []  # it answered: not dead, not dropped
        sync.update(model)  # a fresh group; everything lands
        for e in engines:
            assert e.rank_checksums() == [model_checksum(model)] * e.tp_size
    finally:
        sync.close()


class Collector:
    """What torchrl's collectors expose to a weight sender: a policy version to bump."""

    def __init__(self):
        self.version = 0

    def increment_version(self):
        self.version += 1


def test_seed_api_switches_by_changing_the_import(engines, tiny_model_dir):
    from slime_like.weights import SGLangWeightSyncScheme
    from slime_like.weights import get_model_metadata as metadata_of

    server = engines[1]  # the TP=2 engine: num_gpus=2 ranks in the group
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    scheme = SGLangWeightSyncScheme(server.url, num_gpus=2, device=0, pause_mode="retract")
    sender = scheme.create_sender()
    collector = Collector()
    try:
        sender.register_model(policy)
        sender.register_collector(collector)
        sender.init_all_workers_group(metadata_of(policy))
        sender.update_weights()
        assert server.rank_checksums() == [model_checksum(policy)] * 2
        assert collector.version == 1
        newer = trainer_model(tiny_model_dir, seed=next(_seeds))
        sender.update_weights(newer.hf_state_dict())  # strategy="state_dict"-style weights
        assert server.rank_checksums() == [model_checksum(newer)] * 2
        assert server.greedy(PROMPT, 6) == greedy_continuation(newer, PROMPT, 6)
        assert collector.version == 2
        assert sender.flush_cache() is True
    finally:
        sender.shutdown()


def test_seed_api_refuses_a_flush_its_pause_mode_cannot_honour():
    from slime_like.weights import SGLangWeightSyncScheme

    with pytest.raises(ConfigError, match="flush_cache_on_update: True needs pause_mode='abort'"):
        SGLangWeightSyncScheme("http://127.0.0.1:1", flush_cache_on_update=True,
                               pause_mode="retract")
    SGLangWeightSyncScheme("http://127.0.0.1:1", flush_cache_on_update=True, pause_mode="abort")


def test_lora_model_is_merged_and_sent_under_base_names(engines, tiny_model_dir):
    peft = pytest.importorskip("peft")
    base = trainer_model(tiny_model_dir, seed=next(_seeds))
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at zero; make the adapter matter
    merged = copy.deepcopy(lora).merge_and_unload()
    sync = WeightSync([(e.url, e.tp_size) for e in engines], update_weight_buffer_size=64 << 10)
    try:
        sync.update(lora)
    finally:
        sync.close()
    for e in engines:
        assert e.rank_checksums() == [model_checksum(merged)] * e.tp_size
        assert e.greedy(PROMPT, 6) == greedy_continuation(merged, PROMPT, 6)
    # the trainer's model is untouched: base weights as they were, adapter still separate
    assert all(torch.equal(p, before[n.replace("base_model.model.", "").replace(".base_layer", "")])
               for n, p in lora.named_parameters() if "lora_" not in n)


def _serve_unpaused_with_no_session_open(engines, model, version: str) -> None:
    """Every engine holds the model's weights at `version`, is not paused and has no
    weight-update session left open."""
    for e in engines:
        assert e.rank_checksums() == [model_checksum(model)] * e.tp_size
        assert e.weight_version() == version
        assert e.get("/ready").status_code == 200
        assert e.post("/begin_weight_update").json()["success"]  # no session left open
        assert e.post("/end_weight_update").json()["success"]


def test_a_tensor_sync_leaves_every_engine_serving_unpaused_with_no_session_open(
        engines, tiny_model_dir):
    # end and continue go out of the engines' lanes (no separate verify: the last update's
    # answer carries the version); the engines serve the new weights, unpaused
    sync = WeightSync([(e.url, e.tp_size) for e in engines], transport="tensor",
                      update_weight_buffer_size=64 << 10, http_timeout_s=60)
    try:
        model = trainer_model(tiny_model_dir, seed=next(_seeds))
        report = sync.update(model)
    finally:
        sync.close()
    assert {"end", "continue"} <= set(report.round_trips)
    assert report.seconds["verify"] == 0.0 and set(report.flush.values()) == {"flushed"}
    _serve_unpaused_with_no_session_open(engines, model, report.weight_version)


def test_a_refused_last_update_names_the_engine_and_leaves_no_engine_paused(
        engines, tiny_model_dir):
    a, b = engines
    sync = WeightSync([(e.url, e.tp_size) for e in engines], transport="tensor",
                      update_weight_buffer_size=64 << 10, http_timeout_s=60)
    handle = sync.engines[1]
    real = handle.update_steps  # what a sync's update runs (on the engine-call loop)

    def close_session_first(verb, req, *args, **kwargs):
        # A real refusal: B's session is closed (by a real /end_weight_update) just before
        # its last update, so B answers 400 "must run between begin and end".
        if req.weight_version is not None:
            assert b.post("/end_weight_update").json()["success"]
        return real(verb, req, *args, **kwargs)

    handle.update_steps = close_session_first
    model = trainer_model(tiny_model_dir, seed=next(_seeds))
    try:
        with pytest.raises(WeightSyncError, match="between begin_weight_update") as failed:
            sync.update(model)
        assert failed.value.engine == b.url
        for e in engines:
            assert e.get("/ready").status_code == 200, e.url  # continued after the failure
            assert e.post("/begin_weight_update").json()["success"], e.url  # session closed
            assert e.post("/end_weight_update").json()["success"], e.url
        handle.update_steps = real
        report = sync.update(model)  # and the next sync lands everywhere
        for e in engines:
            assert e.rank_checksums() == [model_checksum(model)] * e.tp_size
            assert e.weight_version() == report.weight_version
    finally:
        sync.close()


def test_an_engine_held_out_of_the_router_is_updated_without_a_pause(engines, tiny_model_dir):
    # The fleet holds a colocated engine out of the router from its memory resume to the
    # sync (`quiet`): that engine gets begin, the updates and end, no pause or continue;
    # the other engine is paused and continued as always. Both end at the new weights.
    a, b = engines
    sync = WeightSync([(e.url, e.tp_size) for e in engines], transport="tensor",
                      update_weight_buffer_size=64 << 10, http_timeout_s=60)
    control: list[tuple[str, str]] = []
    for handle in sync.engines:  # spies that record the call and make it for real
        for verb, steps in (("pause_generation", "pause_steps"),
                            ("continue_generation", "continue_steps")):
            real = getattr(handle, steps)  # what both the lane and the blocking verb run

            def spy(*args, real=real, url=handle.url, verb=verb, **kwargs):
                control.append((url, verb))
                return real(*args, **kwargs)

            setattr(handle, steps, spy)
    model = trainer_model(tiny_model_dir, seed=next(_seeds))
    try:
        report = sync.update(model, quiet={a.url})
    finally:
        sync.close()
    assert report.not_paused == [a.url]
    assert sorted(control) == [(b.url, "continue_generation"), (b.url, "pause_generation")]
    _serve_unpaused_with_no_session_open(engines, model, report.weight_version)
