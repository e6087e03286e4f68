"""What CUDA IPC sharing costs per sync: one flat buffer vs every parameter shared itself.

The `tensor` transport packs separate parameters into one shared buffer. This measures the
alternative (share each parameter; the engine copies from each) next to sharing one flat
buffer, on dense7b's shapes, between this process and a receiver process on the same GPU.
The receiver keeps what it opened, as the reference engine does, so only the first sync
maps the memory. Prints per-sync medians (ms) of the sender's serialize, the receiver's
deserialize, its copy launches and the wait for the copies, and the round trip.

    python benchmarks/ipc_sharing.py        # one GPU
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slime_like.protocol.tensor_payload import deserialize, serialize  # noqa: E402

SYNCS = 6


def dense7b_shapes() -> list[tuple[int, ...]]:
    """Qwen2-7B-like shapes (the weight-sync benchmark's dense7b, biases folded in)."""
    hidden, inter, layers, vocab, kv = 3584, 18944, 28, 152064, 512
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                (inter, hidden), (inter, hidden), (hidden, inter),
                (hidden,), (hidden,), (hidden,), (kv,), (kv,)]
    return out + [(hidden,), (vocab, hidden)]


def receiver(conn) -> None:
    torch.cuda.set_device(0)
    dst = None
    opened = None  # kept open across syncs, as the reference engine keeps IPC storages
    while (msg := conn.recv()) is not None:
        t0 = time.perf_counter()
        obj = deserialize(msg)
        t1 = time.perf_counter()
        if isinstance(obj, list):
            dst = dst or [torch.empty_like(t) for t in obj]
            for d, s in zip(dst, obj, strict=True):
                d.copy_(s, non_blocking=True)
        else:
            dst = torch.empty_like(obj) if dst is None else dst
            dst.copy_(obj)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        opened = obj
        conn.send((t1 - t0, t2 - t1, time.perf_counter() - t2))
    del opened


def measure(payload_of, ctx) -> tuple[float, list[float]]:
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there,))
    proc.start()
    rows = []
    try:
        for _ in range(SYNCS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            payload = payload_of()
            t1 = time.perf_counter()
            here.send(payload)
            des, launch, wait = here.recv()
            rows.append((t1 - t0, des, launch, wait, time.perf_counter() - t0))
    finally:
        here.send(None)
        proc.join()
        torch.cuda.ipc_collect()
    steady = rows[1:]
    return rows[0][4] * 1e3, [statistics.median(r[j] for r in steady) * 1e3 for j in range(5)]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    params = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in dense7b_shapes()]
    total = sum(p.numel() * p.element_size() for p in params)
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    print(f"{len(params)} tensors, {total / 1e9:.2f} GB, {SYNCS} syncs (first one maps the memory)")
    results = {}
    for name, payload_of in (("one flat buffer", lambda: serialize(flat)),
                             ("every parameter", lambda: serialize(params))):
        first, (ser, des, launch, wait, total_ms) = measure(payload_of, ctx)
        results[name] = total_ms
        print(f"{name:16s} first {first:7.1f} ms | steady: serialize {ser:6.2f}  deserialize "
              f"{des:6.2f}  copy launch {launch:5.2f}  copy wait {wait:5.2f}  total {total_ms:6.2f} ms")
    print(f"every parameter / one flat buffer: {results['every parameter'] / results['one flat buffer']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
