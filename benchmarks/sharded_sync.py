"""Sharded weight sync: FSDP2 trainer ranks against full replicas, side by side in one run.

For each world size (default 1, 2, 4) the same weights are loaded on every trainer rank in
both forms and synced into one reference engine over the `distributed` transport, the two
alternating in every round (the order flipping), so both see the same machine load:
  ddp   every rank holds the whole model; rank 0 syncs it (the full-replica reference)
  fsdp  FSDP2 `fully_shard` per decoder layer; every rank takes part, rank 0 gathers the
        shards bucket by bucket into two buffers while the previous bucket is broadcast
        (`slime_like.weights.sharded.ShardedWeights`)

Printed per (world size, backend): sync seconds (median of --repeats after a warm-up), the
ratio to the ddp sync at that world size, peak extra memory per rank during the first sync
(measured: the process's peak RSS reset before the sync, minus its RSS before it; large
allocations are mapped and unmapped one by one, MALLOC_MMAP_THRESHOLD_) against
the bound of two buckets, and the overlap fraction (the share of rank 0's gather time the
broadcast hid: 1 - time the transport waited for a gathered bucket / time spent gathering).
Every sync is checked: the engine's checksum must equal the full model's.

    python benchmarks/sharded_sync.py                       # CPU, gloo (what CI machines run)
    python benchmarks/sharded_sync.py --device cuda --world-sizes 2,4 --layers 28 --hidden 3584
        # GPU form: trainer ranks on GPUs 0..N-1 (NCCL), the engine on GPU N; needs N+1 GPUs

Peak memory on GPU is `torch.cuda.max_memory_allocated` (reset before the first sync).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from slime_like.cluster.ports import free_port  # noqa: E402
from slime_like.protocol.checksums import overall_checksum, tensor_checksum  # noqa: E402

TARGETS = {"ratio": 1.3, "extra_vs_bound": 1.1, "overlap": 0.7}


def checksum(named) -> str:
    """The engine's /weights_checker checksum, computed on full tensors."""
    return overall_checksum({name: tensor_checksum(t) for name, t in named})


# ---- memory --------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak extra bytes over a span: RSS high-water mark (CPU) or CUDA's allocator peak."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.extra = _status_kb("VmHWM") * 1024 - self.base


# ---- one trainer rank ------------------------------------------------------------------------

def rank_main(rank: int, world: int, port: int, engine_url: str, model_dir: str, opts: dict,
              out) -> None:
    """One rank holding both forms of the same weights: a full replica (ddp) and FSDP2
    shards. Rank 0 syncs them alternately into the same engine over the same weight group
    (the order flips every round), so both see the same machine load."""
    from slime_like.models.loading import init_dummy_weights, load_pretrained
    from slime_like.models.transformer import hf_named_parameters
    from slime_like.trainer.sharding import shard_model
    from slime_like.weights.sharded import ShardedWeights
    from slime_like.weights.sync import WeightSync

    cuda = opts["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    models = {}
    for backend in ("ddp", "fsdp"):
        model = load_pretrained(model_dir, device=device, dtype=torch.float32)
        init_dummy_weights(model, seed=opts["seed"])  # new weights: a sync sending none fails
        models[backend] = model
    expected = checksum(hf_named_parameters(models["ddp"])) if rank == 0 else ""
    bucket = opts["bucket_bytes"]
    model_bytes = sum(p.numel() * p.element_size() for _, p in hf_named_parameters(models["ddp"]))
    shard_model(models["fsdp"], dist.group.WORLD)
    group = dist.new_group(backend="nccl" if cuda else "gloo")
    sources = {"ddp": models["ddp"],
               "fsdp": ShardedWeights(models["fsdp"], bucket_bytes=bucket, group=group)}
    held = {b: sum(getattr(p, "_local_tensor", p).numel() * p.element_size()
                   for _, p in hf_named_parameters(m)) for b, m in models.items()}
    result = {"rank": rank, "model_bytes": model_bytes, "held_bytes": held,
              "peak_extra_bytes": {"ddp": 0}}  # a replica that does not sync holds no more
    rounds = 1 + opts["repeats"]
    if rank == 0:
        sync = WeightSync([engine_url], transport="distributed", update_weight_buffer_size=bucket,
                          http_timeout_s=600, group_timeout_s=600, check_engine_metadata=False)
        seconds: dict[str, list[float]] = {"ddp": [], "fsdp": []}
        overlaps, waits, gathers = [], [], []
        checks = []
        try:
            for i in range(rounds):
                for backend in (("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")):
                    source = sources[backend]
                    with PeakMemory(cuda) as mem:
                        t0 = time.perf_counter()
                        try:
                            sync.update(source, f"{backend}-{world}-{i}")
                        finally:
                            if backend == "fsdp":
                                source.finish()
                        seconds[backend].append(time.perf_counter() - t0)
                    if i == 0:
                        result["peak_extra_bytes"][backend] = mem.extra
                    elif backend == "fsdp":
                        overlaps.append(source.stats.overlap)
                        waits.append(source.stats.wait_s)
                        gathers.append(source.stats.gather_s)
                    checks.append(engine_checksum(engine_url) == expected)
        finally:
            sync.close()
        result.update(checksum_ok=all(checks),
                      seconds={b: statistics.median(v[1:]) for b, v in seconds.items()},
                      overlap=statistics.median(overlaps), gather_s=statistics.median(gathers),
                      wait_s=statistics.median(waits), buckets=sources["fsdp"].stats.buckets)
    else:
        for i in range(rounds):
            with PeakMemory(cuda) as mem:
                sources["fsdp"].serve()
            if i == 0:
                result["peak_extra_bytes"]["fsdp"] = mem.extra
    dist.barrier()
    out.put(json.dumps(result))
    dist.destroy_process_group()


def engine_checksum(url: str) -> str:
    import requests

    body = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=120).json()
    return body["ranks"][0]["per_gpu_checksum"]


def run(world: int, engine_url: str, model_dir: Path, opts: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, engine_url, str(model_dir),
                                                 opts, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [json.loads(out.get(timeout=1800)) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: r["rank"])


# ---- the engine ----------------------------------------------------------------------------

def start_engine(model_dir: Path, log_dir: Path, cuda_gpu: int | None):
    import requests

    from slime_like.cluster.process import ServerProcess, server_env

    port = free_port()
    argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--context-length", "256",
            "--max-running-requests", "2", "--max-total-tokens", "1024",
            "--skip-server-warmup", "--dtype", "float32"]
    argv += ["--device", "cuda", "--base-gpu-id", str(cuda_gpu)] if cuda_gpu is not None \
        else ["--device", "cpu"]
    env = server_env(extra={"PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
    proc = ServerProcess(argv, log_path=log_dir / f"engine-{port}.log", env=env, name="engine")
    proc.start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return requests.get(url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    proc.wait_healthy(healthy, timeout=900)
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    a = ap.parse_args()
    from slime_like.models.tiny import make_tiny_model

    # Ranks map every large allocation and unmap it when freed (glibc), so their peak RSS
    # counts exactly the buffers a sync allocates, not heap reused from earlier frees.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    worlds = [int(w) for w in a.world_sizes.split(",")]
    opts = {"device": a.device, "repeats": a.repeats, "bucket_bytes": int(a.bucket_mb * 2**20)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="sharded-sync-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", layers=a.layers, hidden=a.hidden,
                                    heads=max(4, a.hidden // 64))
        gpu = max(worlds) if a.device == "cuda" else None
        proc, url = start_engine(model_dir, Path(tmp), gpu)
        try:
            for world in worlds:
                opts["seed"] = world
                ranks = run(world, url, model_dir, opts)
                r0 = ranks[0]
                bound = 2 * opts["bucket_bytes"]
                for backend in ("ddp", "fsdp"):
                    extra = max(r["peak_extra_bytes"][backend] for r in ranks)
                    row = {"world": world, "backend": backend,
                           "seconds": round(r0["seconds"][backend], 4),
                           "ratio_to_full_replica": round(r0["seconds"][backend]
                                                          / r0["seconds"]["ddp"], 3),
                           "model_mb": round(r0["model_bytes"] / 2**20, 1),
                           "held_mb_per_rank": [round(r["held_bytes"][backend] / 2**20, 1)
                                                for r in ranks],
                           "shard_plus_2_buckets_mb": round((r0["model_bytes"] / world + bound)
                                                            / 2**20, 1),
                           "peak_extra_mb_per_rank": [round(r["peak_extra_bytes"][backend] / 2**20, 1)
                                                      for r in ranks],
                           "extra_vs_2_buckets": round(extra / bound, 3),
                           "checksum_ok": r0["checksum_ok"]}
                    if backend == "fsdp":
                        row.update(overlap=round(r0["overlap"], 3), gather_s=round(r0["gather_s"], 4),
                                   gather_wait_s=round(r0["wait_s"], 4), buckets=r0["buckets"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            proc.terminate(grace=20)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print("| ws | backend | sync s | x full replica | held MB/rank | peak extra MB/rank "
          "| extra / 2 buckets | overlap | checksum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['backend']} | {r['seconds']:.3f} | {r['ratio_to_full_replica']:.2f} "
              f"| {r['held_mb_per_rank']} | {r['peak_extra_mb_per_rank']} | {r['extra_vs_2_buckets']:.2f} "
              f"| {r.get('overlap', '')} | {'ok' if r['checksum_ok'] else 'MISMATCH'} |")
    fsdp = [r for r in rows if r["backend"] == "fsdp"]
    ok = all(r["checksum_ok"] for r in rows)
    print(f"\ntargets: sync <= {TARGETS['ratio']}x full replica at ws >= 2; peak extra <= 2 buckets "
          f"+ 10%; overlap >= {TARGETS['overlap']}")
    for r in fsdp:
        print(f"  ws {r['world']}: ratio {r['ratio_to_full_replica']} "
              f"{'MET' if r['world'] < 2 or r['ratio_to_full_replica'] <= TARGETS['ratio'] else 'MISSED'}, "
              f"extra {r['extra_vs_2_buckets']} "
              f"{'MET' if r['extra_vs_2_buckets'] <= TARGETS['extra_vs_bound'] else 'MISSED'}, "
              f"overlap {r['overlap']} {'MET' if r['overlap'] >= TARGETS['overlap'] else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
