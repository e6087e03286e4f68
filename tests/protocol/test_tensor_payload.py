"""Tensor-transport payloads: shared-memory handles across processes, and an allowlist."""

from __future__ import annotations

import base64
import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap

import pytest
import torch

from slime_like.errors import UnsafePayloadError
from slime_like.protocol.buckets import FlattenedTensorMetadata, flatten
from slime_like.protocol.tensor_payload import (
    LocalSerializedTensor,
    deserialize,
    serialize,
    serialize_bytes,
)


def mixed_named_tensors() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, fp16 and int64 with odd sizes, already in aligned (descending itemsize) order."""
    g = torch.Generator().manual_seed(1)
    return [
        ("layers.0.idx", torch.arange(7, dtype=torch.int64)),
        ("layers.0.w", torch.randn(3, 5, generator=g)),
        ("layers.0.b", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("layers.1.w", torch.randn(1, 9, generator=g).to(torch.float16)),
    ]


def global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle whose whole content is the global `module.name`."""
    def short_str(s: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()
    return b"\x80\x04" + short_str(module) + short_str(name) + pickle.STACK_GLOBAL + pickle.STOP


def run_python(code: str, stdin: str = "", timeout: float = 60) -> str:
    """Run code in a fresh interpreter (not a multiprocessing child: no shared authkey)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=stdin,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_flattened_bucket_payload_round_trips_with_our_metadata_class():
    named = mixed_named_tensors()
    buf, meta = flatten(named)
    back = deserialize(serialize({"flattened_tensor": buf, "metadata": meta}))
    assert all(isinstance(m, FlattenedTensorMetadata) for m in back["metadata"])
    assert back["metadata"] == meta
    assert torch.equal(back["flattened_tensor"], buf)


def test_metadata_travels_under_sglangs_class_path():
    _, meta = flatten(mixed_named_tensors())
    text = str(list(pickletools.genops(serialize_bytes(meta))))
    assert "sglang.srt.weight_sync.tensor_bucket" in text and "FlattenedTensorMetadata" in text
    assert "slime_like" not in text


def test_an_unrelated_process_rebuilds_cpu_tensors_from_shared_memory():
    named = mixed_named_tensors()
    payload = serialize(named)  # `named` stays alive here until the receiver is done
    out = run_python("""
        import json, sys, torch
        from slime_like.protocol.tensor_payload import deserialize
        got = deserialize(sys.stdin.read())
        print(json.dumps([[n, str(t.dtype), t.float().tolist()] for n, t in got]))
    """, stdin=payload)
    got = json.loads(out)
    assert [g[0] for g in got] == [n for n, _ in named]
    for (_, t), (_, dtype, values) in zip(named, got, strict=True):
        assert dtype == str(t.dtype)
        assert torch.equal(torch.tensor(values), t.float())


def test_local_serialized_tensor_gives_each_rank_its_own_payload():
    per_rank = [torch.full((2,), float(r)) for r in range(2)]
    lst = LocalSerializedTensor(values=[serialize_bytes(t) for t in per_rank])
    back = deserialize(serialize([("w", lst)]))
    name, got = back[0]
    assert name == "w" and isinstance(got, LocalSerializedTensor)
    assert [got.get(r).tolist() for r in range(2)] == [[0.0, 0.0], [1.0, 1.0]]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


def test_malicious_pickle_is_refused_naming_the_global_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = base64.b64encode(pickle.dumps([("w", _RunsCode())])).decode()
    with pytest.raises(UnsafePayloadError, match=r"Blocked unsafe global \(posix\.system\)") as e:
        deserialize(data)
    assert e.value.global_name == "posix.system"
    assert not (tmp_path / "pwned-by-pickle").exists()


def test_sglang_request_objects_are_refused_as_not_weights():
    # A global sglang allows for its own scheduler messages, written by hand (no sglang import).
    raw = global_pickle("sglang.srt.managers.io_struct", "GenerateReqInput")
    with pytest.raises(UnsafePayloadError, match="GenerateReqInput.*not part of a weight payload"):
        deserialize(raw)


@pytest.mark.parametrize("data, match", [("not base64!!", "not valid base64"),
                                         (b"\x00\x01garbage", "neither a pickle nor base64"),
                                         (base64.b64encode(b"\x80\x04truncated"), "malformed")])
def test_malformed_payloads_are_refused_with_a_clear_error(data, match):
    with pytest.raises(UnsafePayloadError, match=match):
        deserialize(data)


def test_fd_shared_cpu_payload_from_an_unrelated_process_is_refused_with_advice():
    # torch's default CPU sharing passes an fd through a socket authenticated by the
    # sender's multiprocessing authkey, which another program does not hold.
    code = """
        import base64, io, sys, torch, torch.multiprocessing
        from multiprocessing.reduction import ForkingPickler
        t = torch.arange(4.0)
        buf = io.BytesIO(); ForkingPickler(buf).dump(t)
        print(base64.b64encode(buf.getvalue()).decode(), flush=True)
        sys.stdin.read()  # stay alive (serving the fd) until the test is done
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        payload = proc.stdout.readline().strip()
        with pytest.raises(UnsafePayloadError, match="file_system"):
            deserialize(payload)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
