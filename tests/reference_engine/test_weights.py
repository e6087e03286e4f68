"""The weight receiver of a TP=2 engine, driven by this test process acting as the trainer.

The test process joins the engine's weight group as rank 0 over gloo (the engine's two TP
ranks are ranks 1 and 2), broadcasts real tensors, and checks every rank's checksums and
the engine's generation against a local model holding the same weights.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import os
import pickle
import shutil
import uuid

import pytest
import torch
import torch.distributed as dist

from slime_like.models.loading import load_pretrained, save_state_dict_atomic
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.protocol.buckets import TensorMeta, dtype_name, flatten, plan_buckets
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from slime_like.protocol.weight_group import (
    destroy_process_group,
    host_store,
    init_custom_process_group,
)

TOK = ByteTokenizer()
PROMPT = TOK.encode("weights under test")


@pytest.fixture(scope="module")
def pool():
    with cf.ThreadPoolExecutor(4) as ex:
        yield ex


@pytest.fixture
def weights_engine(tp2_engine, tiny_model_dir):
    """The TP=2 engine; afterwards its original checkpoint and version are back."""
    yield tp2_engine
    tp2_engine.post("/continue_generation", {})
    released = tp2_engine.get("/server_info").json()["internal_states"][0]
    tp2_engine.post("/resume_memory_occupation", {"tags": None})  # no-op unless released
    r = tp2_engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                      "weight_version": "v0"})
    assert r.status_code == 200, (r.text, released)


def perturbed_state(model_dir, seed: int) -> dict[str, torch.Tensor]:
    model = load_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.hf_state_dict().items()}


def local_greedy(model_dir, state: dict[str, torch.Tensor], n: int) -> list[int]:
    model = load_pretrained(model_dir)
    model.load_state_dict(state, strict=False)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(PROMPT):]


def engine_greedy(engine, n: int) -> list[int]:
    r = engine.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                  "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def assert_checksums_equal(engine, state: dict[str, torch.Tensor], tp_size: int = 2) -> None:
    body = engine.post("/weights_checker", {"action": "checksum"}).json()
    assert body["success"], body
    expected = {n: tensor_checksum(t) for n, t in state.items()}
    assert len(body["ranks"]) == tp_size
    for rank, entry in enumerate(body["ranks"]):
        assert entry["checksums"] == expected
        assert entry["per_gpu_checksum"] == overall_checksum(expected)
        assert entry["parallelism_info"][0]["tp_rank"] == rank


class Trainer:
    """Rank 0 of a weight group with one engine (TP ranks at 1..tp)."""

    def __init__(self, engine, pool, tp_size: int = 2):
        self.engine, self.pool = engine, pool
        self.name = f"test-{uuid.uuid4().hex[:8]}"
        store = host_store(1 + tp_size, timeout=60)
        fut = pool.submit(engine.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1,
            "world_size": 1 + tp_size, "group_name": self.name, "backend": "gloo"})
        self.pg = init_custom_process_group(backend="gloo", world_size=1 + tp_size, rank=0,
                                            group_name=self.name, store=store, timeout=60)
        r = fut.result(timeout=60)
        assert r.status_code == 200 and r.json() == {
            "success": True, "message": "Succeeded to initialize custom process group."}

    def update(self, named: list[tuple[str, torch.Tensor]], flattened: bool, **extra) -> dict:
        body = {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": self.name, **extra}
        if flattened:
            body["load_format"] = "flattened_bucket"
        fut = self.pool.submit(self.engine.post, "/update_weights_from_distributed", body)
        if flattened:
            buf, _ = flatten(named)
            dist.broadcast(buf, src=0, group=self.pg)
        else:
            for _, t in named:
                dist.broadcast(t.contiguous(), src=0, group=self.pg)
        r = fut.result(timeout=60)
        return {"status": r.status_code, **r.json()}

    def close(self) -> None:
        r = self.engine.post("/destroy_weights_update_group", {"group_name": self.name})
        assert r.json()["success"], r.text
        destroy_process_group(self.pg)


def test_per_tensor_broadcast_updates_every_rank_and_generation(weights_engine, pool, tiny_model_dir):
    state = perturbed_state(tiny_model_dir, seed=1)
    trainer = Trainer(weights_engine, pool)
    try:
        assert weights_engine.post("/begin_weight_update", {}).json()["success"]
        out = trainer.update(list(state.items()), flattened=False, weight_version="v1")
        assert out == {"status": 200, "success": True,
                       "message": "Succeeded to update parameter online. Weight version updated to v1."}
        assert weights_engine.post("/end_weight_update", {}).json()["success"]
    finally:
        trainer.close()
    assert_checksums_equal(weights_engine, state)
    assert engine_greedy(weights_engine, 8) == local_greedy(tiny_model_dir, state, 8)
    info = weights_engine.get("/model_info").json()
    assert info["weight_version"] == "v1"


def test_flattened_buckets_in_two_requests_update_all_ranks(weights_engine, pool, tiny_model_dir):
    state = perturbed_state(tiny_model_dir, seed=2)
    # A mixed-dtype bucket exercises the alignment rule: bf16 after fp32 is aligned.
    metas = [TensorMeta.of(n, t) for n, t in state.items()]
    total = sum(m.nbytes for m in metas)
    buckets = plan_buckets(metas, max_bytes=total // 2 + 1)
    assert len(buckets) >= 2
    trainer = Trainer(weights_engine, pool)
    try:
        weights_engine.post("/begin_weight_update", {})
        for k, bucket in enumerate(buckets):
            named = [(m.name, state[m.name]) for m in bucket.metas]
            out = trainer.update(named, flattened=True, weight_version=f"b{k}", flush_cache=k == len(buckets) - 1)
            assert out["success"], out
        weights_engine.post("/end_weight_update", {})
    finally:
        trainer.close()
    assert_checksums_equal(weights_engine, state)
    assert engine_greedy(weights_engine, 8) == local_greedy(tiny_model_dir, state, 8)
    assert weights_engine.get("/model_info").json()["weight_version"] == f"b{len(buckets) - 1}"


def test_update_outside_a_session_is_refused_before_any_collective(weights_engine, pool):
    trainer = Trainer(weights_engine, pool)
    try:
        # No broadcast from us: a 400 that came after joining would hang this call.
        r = weights_engine.post("/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": trainer.name}, timeout=20)
        assert r.status_code == 400
        assert r.json() == {"success": False, "message": "update_weights_from_distributed must run "
                            "between begin_weight_update() and end_weight_update()"}
        r = weights_engine.post("/end_weight_update", {})
        assert r.status_code == 400
        assert r.json()["message"] == "no weight-update session is open; call begin_weight_update() first"
        assert weights_engine.post("/begin_weight_update", {}).status_code == 200
        r = weights_engine.post("/begin_weight_update", {})
        assert r.status_code == 400
        assert r.json()["message"] == ("a weight-update session is already open; call "
                                       "end_weight_update() first")
        r = weights_engine.post("/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": "no-such-group"}, timeout=20)
        assert r.status_code == 400 and r.json()["message"].startswith(
            "Failed to receive weights: Group no-such-group not in")
    finally:
        weights_engine.post("/end_weight_update", {})
        trainer.close()
    r = weights_engine.post("/destroy_weights_update_group", {"group_name": trainer.name})
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": "The group to be destroyed does not exist."}


def test_unknown_parameter_name_fails_the_load_and_names_the_tensor(weights_engine, pool):
    before = weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"]
    trainer = Trainer(weights_engine, pool)
    try:
        weights_engine.post("/begin_weight_update", {})
        out = trainer.update([("model.no_such.weight", torch.ones(4))], flattened=True)
    finally:
        weights_engine.post("/end_weight_update", {})
        trainer.close()
    assert out["status"] == 400 and "model.no_such.weight" in out["message"]
    assert weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"] == before


def test_update_flush_fails_with_sglang_message_when_requests_hold_kv(weights_engine, pool, tiny_model_dir):
    state = perturbed_state(tiny_model_dir, seed=3)
    fut = pool.submit(weights_engine.generate, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 500, "ignore_eos": True}})
    while weights_engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        pass
    weights_engine.post("/pause_generation", {"mode": "in_place"})
    trainer = Trainer(weights_engine, pool)
    try:
        weights_engine.post("/begin_weight_update", {})
        out = trainer.update(list(state.items()), flattened=True, weight_version="in-place-v")
        weights_engine.post("/end_weight_update", {})
    finally:
        trainer.close()
    assert out["status"] == 400
    assert out["message"].startswith("Weights were updated, but the cache was not flushed")
    assert_checksums_equal(weights_engine, state)  # the weights did change
    weights_engine.post("/continue_generation", {})
    meta = fut.result(timeout=60).json()["meta_info"]
    assert [s["version"] for s in meta["weight_versions"]] == ["v0", "in-place-v"]


def test_update_on_a_running_engine_waits_for_in_flight_requests(weights_engine, tiny_model_dir, pool):
    fut = pool.submit(weights_engine.generate, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 300, "ignore_eos": True}})
    while weights_engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        pass
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                          "weight_version": "after-drain"})
    assert r.status_code == 200
    # The writer lock drained the request first: it finished whole, under the old version.
    meta = fut.result(timeout=10).json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 300}]


def test_prefix_cache_goes_stale_after_an_update_until_flushed(weights_engine, tiny_model_dir, tmp_path):
    prompt = TOK.encode("a prompt whose KV is cached before the update")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    weights_engine.generate(body)  # caches the prompt's KV under the old weights
    state = perturbed_state(tiny_model_dir, seed=8)
    ckpt = save_state_dict_atomic(state, tmp_path / "new")
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(ckpt), "flush_cache": False})
    assert r.status_code == 200
    stale = weights_engine.generate(body).json()
    assert stale["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert weights_engine.post("/flush_cache").status_code == 200
    fresh = weights_engine.generate(body).json()
    assert fresh["meta_info"]["cached_tokens"] == 0
    model = load_pretrained(tiny_model_dir)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert fresh["output_ids"] == ids[len(prompt):]
    assert stale["output_ids"] != fresh["output_ids"]  # old KV, new weights: a different answer


def test_disk_update_switches_model_path_and_rolls_back_a_bad_checkpoint(weights_engine, tiny_model_dir, tmp_path):
    state = perturbed_state(tiny_model_dir, seed=4)
    good = save_state_dict_atomic(state, tmp_path / "good")
    shutil.copy(tiny_model_dir / "config.json", good / "config.json")
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(good), "weight_version": "disk-1"})
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "Succeeded to update model weights. Weight version "
                        "updated to disk-1.", "num_paused_requests": 0}
    info = weights_engine.get("/model_info").json()
    assert info["model_path"] == str(good) and info["served_model_name"] == str(good)
    assert_checksums_equal(weights_engine, state)
    assert engine_greedy(weights_engine, 6) == local_greedy(tiny_model_dir, state, 6)

    broken = dict(state)
    broken["model.norm.weight"] = torch.ones(3)  # wrong shape: the load must fail mid-way
    bad = save_state_dict_atomic(broken, tmp_path / "bad")
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(bad)})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "model.norm.weight" in r.json()["message"]
    assert weights_engine.get("/model_info").json()["model_path"] == str(good)
    assert_checksums_equal(weights_engine, state)  # rolled back, on every rank
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400


def test_tensor_payload_per_rank_direct_and_flattened(weights_engine, tiny_model_dir):
    from slime_like.protocol.tensor_payload import serialize

    state = perturbed_state(tiny_model_dir, seed=5)
    named = list(state.items())
    r = weights_engine.post("/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize(named), serialize(named)]})
    assert r.status_code == 400 and "between begin_weight_update()" in r.json()["message"]
    weights_engine.post("/begin_weight_update", {})
    try:
        r = weights_engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize(named)]})
        assert r.status_code == 400 and "one payload per TP rank" in r.json()["message"]
        r = weights_engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize(named), serialize(named)], "weight_version": "t1"})
        assert r.status_code == 200 and r.json() == {"success": True,
                                                     "message": "Success Weight version updated to t1."}
        assert_checksums_equal(weights_engine, state)
        state2 = perturbed_state(tiny_model_dir, seed=6)
        buf, meta = flatten(list(state2.items()))
        payload = serialize({"flattened_tensor": buf, "metadata": meta})
        r = weights_engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload, payload], "load_format": "flattened_bucket"})
        assert r.status_code == 200, r.text
    finally:
        weights_engine.post("/end_weight_update", {})
    assert_checksums_equal(weights_engine, state2)
    assert engine_greedy(weights_engine, 6) == local_greedy(tiny_model_dir, state2, 6)


def test_an_engine_on_cpu_refuses_a_ready_event_naming_it(weights_engine, tiny_model_dir):
    """A CUDA IPC ready event (`protocol/ready_event.py`) means nothing to an engine on the
    CPU: it does not advertise the key, and a request that carries one anyway is refused
    by name, its weights left as they were."""
    from slime_like.protocol.ready_event import READY_EVENT_KEY
    from slime_like.protocol.tensor_payload import serialize

    assert weights_engine.get("/server_info").json()[READY_EVENT_KEY] is False
    before = weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"]
    named = list(perturbed_state(tiny_model_dir, seed=9).items())
    weights_engine.post("/begin_weight_update", {})
    try:
        r = weights_engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize(named), serialize(named)],
            "ready_event": base64.b64encode(bytes(64)).decode()})
    finally:
        weights_engine.post("/end_weight_update", {})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "ready_event" in r.json()["message"] and "cpu" in r.json()["message"]
    assert weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"] == before


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_pickle_is_refused_with_400_and_nothing_changes(weights_engine):
    before = weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"]
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", _Evil())])).decode()
    weights_engine.post("/begin_weight_update", {})
    try:
        r = weights_engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [evil, evil]})
    finally:
        weights_engine.post("/end_weight_update", {})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "Blocked unsafe global" in r.json()["message"] and "system" in r.json()["message"]
    assert weights_engine.post("/weights_checker", {}).json()["per_engine_checksum"] == before
    assert weights_engine.get("/health").status_code == 200


def test_release_drops_weights_and_resume_serves_nothing_until_an_update(weights_engine, tiny_model_dir, pool):
    fut = pool.submit(weights_engine.generate, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 300, "ignore_eos": True}})
    while weights_engine.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 1:
        pass
    r = weights_engine.post("/release_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 400 and "idle" in r.json()["error"]["message"]
    fut.result(timeout=60)
    r = weights_engine.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 400 and "not released" in r.json()["error"]["message"]
    r = weights_engine.post("/release_memory_occupation", {"tags": None})
    assert r.status_code == 200 and r.json() is None
    r = weights_engine.post("/weights_checker", {})
    assert all(entry["checksums"]["model.norm.weight"] == tensor_checksum(torch.empty(0))
               for entry in r.json()["ranks"])  # storage really dropped on every rank
    assert weights_engine.generate({"input_ids": PROMPT}).status_code == 503
    assert weights_engine.post("/resume_memory_occupation", {}).status_code == 200
    r = weights_engine.generate({"input_ids": PROMPT})
    assert r.status_code == 503 and "released" in r.json()["message"]
    r = weights_engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert r.status_code == 200
    assert weights_engine.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_get_weights_by_name_and_update_weight_version(weights_engine, tiny_model_dir):
    model = load_pretrained(tiny_model_dir)
    r = weights_engine.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 3})
    assert r.status_code == 200
    assert torch.allclose(torch.tensor(r.json()), model.model.embed_tokens.weight[:3])
    r = weights_engine.post("/get_weights_by_name", {"name": "nope"})
    assert r.status_code == 400 and r.json() == {"error": {"message": "Get parameter by name failed"}}
    r = weights_engine.post("/update_weight_version", {"new_version": "named-v"})
    assert r.json()["success"] and weights_engine.get("/model_info").json()["weight_version"] == "named-v"
