"""The engine's side of a flattened bucket, without the network: how long loading takes.

For every bucket of a layout (planned as the trainer plans them), a uint8 buffer holding
the bucket's bytes is loaded into a reference-engine `WeightReceiver`'s parameters by:

  seed       the receiver before load plans: parse names/dtypes/shapes, compute the layout,
             a view per tensor, a name and shape check per tensor, one `_foreach_copy_`
  plan       the load plan cached per bucket signature (`load_plan.py`): a few byte copies
             into the parameter arenas (`plan_first` is the first sync, building the plans)
  per_tensor sglang's per-tensor path: a fresh tensor per tensor, then a load by name

Host time is what the engine's scheduler thread spends per bucket; GPU time is the copies
themselves (CUDA events). Both paths must leave identical parameters (checked).

    python benchmarks/receiver_load.py --layout dense7b,moe30b          # one GPU
    python benchmarks/receiver_load.py --layout tiny_moe --device cpu   # anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.records import emit  # noqa: E402
from benchmarks.weight_sync import layout_config  # noqa: E402
from slime_like.models.loading import build_model, init_dummy_weights  # noqa: E402
from slime_like.protocol.buckets import (  # noqa: E402
    TensorMeta,
    dtype_from_name,
    dtype_name,
    layout,
    plan_buckets,
    unflatten,
)
from slime_like.reference_engine.load_plan import request_key  # noqa: E402
from slime_like.reference_engine.weight_receiver import WeightReceiver  # noqa: E402


def seed_load(receiver: WeightReceiver, names, dtypes, shapes, buffer: torch.Tensor) -> None:
    """The receiver's flattened path before load plans (kept here as the baseline)."""
    metas = [TensorMeta(n, dtype_from_name(d), tuple(int(x) for x in s))
             for n, d, s in zip(names, dtypes, shapes, strict=True)]
    named = unflatten(buffer, layout(metas))
    problems = receiver.check_loadable((n, t.shape) for n, t in named)
    if problems:
        raise ValueError(problems[:3])
    receiver._copy_in(named)


def plan_load(receiver: WeightReceiver, names, dtypes, shapes, buffer: torch.Tensor) -> None:
    plan = receiver._plan(request_key(names, dtypes, shapes))
    if plan.problems:
        raise ValueError(plan.problems[:3])
    plan.apply(buffer)


def per_tensor_load(receiver: WeightReceiver, names, dtypes, shapes, buffer: torch.Tensor) -> None:
    """sglang's per-tensor receive: a fresh tensor per name (filled here from the buffer)."""
    metas = [TensorMeta(n, dtype_from_name(d), tuple(int(x) for x in s))
             for n, d, s in zip(names, dtypes, shapes, strict=True)]
    named = []
    for m, (_, view) in zip(metas, unflatten(buffer, layout(metas)), strict=True):
        t = torch.empty(m.shape, dtype=m.dtype, device=buffer.device)
        t.copy_(view)
        named.append((m.name, t))
    receiver.load_named(named)


def run(load, receiver, requests, buffers, device) -> tuple[float, float]:
    """(host seconds, device seconds) to load every bucket once."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for (names, dtypes, shapes), buf in zip(requests, buffers, strict=True):
        load(receiver, names, dtypes, shapes, buf)
    host = time.perf_counter() - t0
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        return host, start.elapsed_time(end) / 1e3
    return host, host


def fingerprint(receiver: WeightReceiver) -> float:
    return float(sum(p.float().sum().item() for p in receiver.params.values()))


def bench(layout_name: str, device: torch.device, bucket_mb: int, repeats: int) -> dict:
    config = layout_config(layout_name)
    model = build_model(config, device=device)
    init_dummy_weights(model, seed=0)
    receiver = WeightReceiver(model, tp_rank=0, tp_size=1, device=device, model_path="",
                              load_format="dummy")
    metas = [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in receiver.params.items()]
    buckets = [b for b in plan_buckets(metas, bucket_mb << 20) if len(b.metas) > 1]
    requests = [([m.name for m in b.metas], [dtype_name(m.dtype) for m in b.metas],
                 [list(m.shape) for m in b.metas]) for b in buckets]
    gen = torch.Generator(device=device).manual_seed(0)
    # Two rotating buffers' worth of random bytes (kept small: the copies, not the fill, count).
    pool = [torch.randint(0, 127, (max(b.nbytes for b in buckets),), dtype=torch.uint8,
                          device=device, generator=gen) for _ in range(2)]
    buffers = [pool[k % 2][:b.nbytes] for k, b in enumerate(buckets)]
    out = {"layout": layout_name, "device": str(device), "bucket_mb": bucket_mb,
           "buckets": len(buckets), "tensors": sum(len(b.metas) for b in buckets),
           "bytes": sum(b.nbytes for b in buckets)}
    first_host, first_dev = run(plan_load, receiver, requests, buffers, device)
    out["plan_first"] = {"host_s": round(first_host, 6), "device_s": round(first_dev, 6)}
    after_plan = fingerprint(receiver)
    for name, load in (("seed", seed_load), ("plan", plan_load), ("per_tensor", per_tensor_load)):
        hosts, devs = [], []
        for _ in range(repeats):
            h, d = run(load, receiver, requests, buffers, device)
            hosts.append(h)
            devs.append(d)
        h, d = statistics.median(hosts), statistics.median(devs)
        out[name] = {"host_s": round(h, 6), "device_s": round(d, 6),
                     "host_ms_per_bucket": round(h / len(buckets) * 1e3, 4),
                     "gbps": round(out["bytes"] / d / 1e9, 1)}
        if fingerprint(receiver) != after_plan:
            raise SystemExit(f"{layout_name}: {name} left different parameters than the plan")
    out["runs_per_bucket"] = round(statistics.mean(
        len(receiver._plan(request_key(*r)).runs) for r in requests), 2)
    del receiver, model, pool, buffers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="dense7b,moe30b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bucket-mb", default="1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    for layout_name in args.layout.split(","):
        for mb in (int(x) for x in args.bucket_mb.split(",")):
            record = bench(layout_name.strip(), device, mb, args.repeats)
            emit({"bench": "receiver_load", **record}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
