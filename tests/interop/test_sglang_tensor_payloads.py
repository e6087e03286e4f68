"""Tensor-transport payloads both ways against sglang's own MultiprocessingSerializer."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import requests
import torch

from slime_like.errors import UnsafePayloadError
from slime_like.models.loading import init_dummy_weights, load_pretrained
from slime_like.models.transformer import hf_named_parameters
from slime_like.protocol import tensor_payload as serialization
from slime_like.protocol.buckets import FlattenedTensorMetadata, flatten, unflatten
from tests.weights.weight_sync_helpers import start_engine

pytestmark = pytest.mark.sglang


def mixed_named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        ("model.embed_tokens.weight", torch.arange(11, dtype=torch.int64)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 7, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g).to(torch.float16)),
    ]


def test_our_allowlist_is_exactly_sglangs(import_sglang):
    sglang_allowed = import_sglang("sglang.srt.utils.common").SafeUnpickler.ALLOWED_GLOBALS
    resolvable = {(m, n) for m, n in sglang_allowed
                  if not (m == "torch" and n.startswith("bcomplex") and not hasattr(torch, n))}
    ours = serialization.ALLOWED_GLOBALS | set(serialization.MAPPED_GLOBALS)
    refused = set(serialization.NOT_WEIGHT_PAYLOAD)
    assert resolvable - ours - refused == set(), "sglang allows globals we would refuse"
    # The one extra is torch's storage loader, which both sides replace by a weights-only load.
    assert ours - set(sglang_allowed) == {("torch.storage", "_load_from_bytes")}


def _cached_payload(buf, meta) -> str:
    """The transport's serializer: the second call reuses the metadata's pickle."""
    payloads = serialization.FlattenedPayloads()
    key = tuple((m.name, m.start_idx) for m in meta)
    payloads.serialize(buf, key, lambda: meta)
    return payloads.serialize(buf, key, lambda: meta)


@pytest.mark.parametrize("make", [
    lambda buf, meta: serialization.serialize({"flattened_tensor": buf, "metadata": meta}),
    _cached_payload], ids=["serialize", "cached_metadata"])
def test_sglang_accepts_our_flattened_bucket_payload_in_another_process(import_sglang, make):
    import_sglang("sglang.srt.utils.common")
    named = mixed_named_tensors()
    buf, meta = flatten(named)
    payload = make(buf, meta)
    code = """
        import json, sys
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        obj = MultiprocessingSerializer.deserialize(sys.stdin.read())
        bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                       metadata=obj["metadata"])
        print(json.dumps({
            "classes": sorted({type(m).__module__ + "." + type(m).__name__
                               for m in obj["metadata"]}),
            "tensors": [[n, str(t.dtype), list(t.shape), t.float().flatten().tolist()]
                        for n, t in bucket.reconstruct_tensors()]}))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=payload,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["classes"] == ["sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"]
    for (name, t), (name2, dtype, shape, values) in zip(named, out["tensors"], strict=True):
        assert (name2, dtype, shape) == (name, str(t.dtype), list(t.shape))
        assert torch.equal(torch.tensor(values), t.float().flatten())


def test_we_accept_sglangs_flattened_bucket_payload_from_another_process(import_sglang):
    import_sglang("sglang.srt.utils.common")
    code = """
        import json, sys, torch, torch.multiprocessing
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
        # CPU tensors between unrelated processes: by shm file name (fds need a shared authkey).
        torch.multiprocessing.set_sharing_strategy("file_system")
        named = json.loads(sys.stdin.readline())
        tensors = [(n, torch.tensor(v, dtype=getattr(torch, d))) for n, d, v in named]
        b = FlattenedTensorBucket(named_tensors=tensors)
        print(MultiprocessingSerializer.serialize(
            {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()},
            output_str=True), flush=True)
        sys.stdin.read()  # keep the tensors alive until the receiver is done
    """
    named = mixed_named_tensors()
    spec = [[n, str(t.dtype).removeprefix("torch."), t.tolist()] for n, t in named]
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        payload = proc.stdout.readline().strip()
        assert payload, proc.stderr.read()[-3000:]
        obj = serialization.deserialize(payload)
        assert all(isinstance(m, FlattenedTensorMetadata) for m in obj["metadata"])
        got = unflatten(obj["flattened_tensor"], obj["metadata"])
        for (name, t), (name2, t2) in zip(named, got, strict=True):
            assert name == name2 and t2.dtype == t.dtype and torch.equal(t2, t)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_sglang_blocks_what_we_block(import_sglang):
    common = import_sglang("sglang.srt.utils.common")
    data = base64.b64encode(pickle.dumps(_RunsCode())).decode()
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        common.MultiprocessingSerializer.deserialize(data)
    with pytest.raises(UnsafePayloadError, match="Blocked unsafe global"):
        serialization.deserialize(data)


def test_reference_engine_loads_a_flattened_bucket_made_by_sglangs_serializer(
        import_sglang, tiny_model_dir, tmp_path):
    common = import_sglang("sglang.srt.utils.common")
    tensor_bucket = import_sglang("sglang.srt.weight_sync.tensor_bucket")
    model = load_pretrained(tiny_model_dir)
    init_dummy_weights(model, seed=11)
    # the way slime/verl send a colocated update: sglang's bucket, sglang's serializer
    named = [(n, p.detach()) for n, p in hf_named_parameters(model)]
    bucket = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
    engine = start_engine(tiny_model_dir, tmp_path)
    url, proc = engine.url, engine.process
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors to another program
    try:
        payload = common.MultiprocessingSerializer.serialize(
            {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
            output_str=True)
        assert requests.post(url + "/begin_weight_update", json={}, timeout=30).ok
        resp = requests.post(url + "/update_weights_from_tensor", timeout=60, json={
            "serialized_named_tensors": [payload], "load_format": "flattened_bucket",
            "weight_version": "from-sglang"})
        assert requests.post(url + "/end_weight_update", json={}, timeout=30).ok
        assert resp.status_code == 200, resp.text
        for name, tensor in named[:3] + named[-2:]:
            got = requests.post(url + "/get_weights_by_name", timeout=30,
                                json={"name": name, "truncate_size": 1000}).json()
            assert torch.equal(torch.tensor(got), tensor.float()), name
        info = requests.get(url + "/model_info", timeout=30).json()
        assert info["weight_version"] == "from-sglang"
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
        proc.terminate(grace=10)


def test_sglang_http_schema_ignores_keep_ipc_mapping(import_sglang):
    """Our extra fields of /update_weights_from_tensor (the reference engine keeps the
    buffer mapped past the session; it waits for the sender's ready event) are dropped by
    sglang's own request schema."""
    from pydantic import TypeAdapter

    from slime_like.protocol import io_struct as p

    req_cls = import_sglang("sglang.srt.managers.io_struct").UpdateWeightsFromTensorReqInput
    body = p.UpdateWeightsFromTensorRequest(
        serialized_named_tensors=[base64.b64encode(b"x").decode()], load_format="flattened_bucket",
        keep_ipc_mapping=True, ready_event="AAAA").model_dump(exclude_none=False)
    assert body["keep_ipc_mapping"] is True and body["ready_event"] == "AAAA"
    req = TypeAdapter(req_cls).validate_json(json.dumps(body))
    assert req.load_format == "flattened_bucket" and not hasattr(req, "keep_ipc_mapping")
    assert not hasattr(req, "ready_event")
