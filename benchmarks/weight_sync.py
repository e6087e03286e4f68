"""Weight-sync benchmark: the full transaction against the link's limit, side by side.

Modes, all measured in one run over the same ranks and GPUs:
  raw         one broadcast of every byte in one buffer (the link's practical limit)
  per_tensor  one broadcast per tensor (the seed's design, torchrl / OpenRLHF), wire only
  ours        WeightSync into reference engines (`--load-format dummy`): HTTP, pause, begin,
              bucketed broadcast, load into the engines' parameters, end, flush, version
              check, continue
  facade      the seed's API (`SGLangWeightSyncScheme(...).create_sender().update_weights()`)
              into the same engine, same bucket size, timed around the whole call
  sglang_per_tensor
              WeightSync with sglang's per-tensor format into the same engine: one broadcast
              per tensor, each received into a fresh tensor and then loaded (the seed's
              design end to end)
  tensor      WeightSync's colocated `tensor` transport (CUDA IPC) into an engine on the
              trainer's own GPU, next to `d2d`: a device-to-device copy of the same bytes

GPU layout: the trainer (this process) is rank 0 on GPU 0. `--engines 1` puts engine A on
GPU 1; `--engines 1,2tp2` adds engine B with TP=2 on GPUs 2-3 (world size 4). raw and
per_tensor run between the trainer and plain receiver processes holding exactly the
engines' ranks on the engines' GPUs, before the engines start (so memory is free).
`--tiny` runs the same code on CPU over gloo with tiny layouts (CI).

Prints one JSON line per (layout, mode) on stdout: seconds (median), GB/s per receiving
engine, ratio_to_raw (ratio_to_d2d for tensor), and for `ours`/`tensor` where the time
went (with every control round trip) and the first sync's seconds; engine checksums are
compared with the trainer's after the first and the last sync (`--verify each`: after
every sync).

    python benchmarks/weight_sync.py --layout dense7b,moe30b --engines 1
    python benchmarks/weight_sync.py --layout dense7b,moe30b --engines 1,2tp2   # 4 GPUs
    python benchmarks/weight_sync.py --tiny
    python benchmarks/weight_sync.py --delta   # CPU: delta vs full, 1B bf16, disk and gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# NVLink multicast off and cuMem off (sglang's engines force it) for every process; NCCL's
# P2P and SHM transports stay on: disabling them costs 80x on NVLink.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import weight_sync_delta  # noqa: E402

from slime_like.cluster.ports import free_port  # noqa: E402
from slime_like.models.config import ModelConfig  # noqa: E402
from slime_like.models.transformer import CausalLM, hf_named_parameters  # noqa: E402
from slime_like.protocol.buckets import TensorMeta, dtype_from_name, dtype_name  # noqa: E402
from slime_like.protocol.checksums import overall_checksum, tensor_checksum  # noqa: E402
from slime_like.protocol.weight_group import (  # noqa: E402
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)

TARGETS = {("dense7b", "ours", "1"): 1.15, ("moe30b", "ours", "1"): 1.25,
           ("dense7b", "ours", "1,2tp2"): 1.2, ("moe30b", "ours", "1,2tp2"): 1.2}
TENSOR_TARGETS = {"dense7b": 2.0, "moe30b": 2.0}


def layout_config(name: str) -> ModelConfig:
    """HF configs of the benchmark layouts (the reference engine serves them with dummy weights)."""
    if name == "dense7b":  # Qwen2.5-7B shapes (Llama with q/k/v/o biases: +28 o_proj biases)
        return ModelConfig(
            architecture="LlamaForCausalLM", model_type="llama", vocab_size=152064,
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, head_dim=128, attention_bias=True,
            torch_dtype="bfloat16", max_position_embeddings=2048, rope_theta=1e6)
    if name == "moe30b":  # Qwen3-30B-A3B shapes: 48 layers x 128 experts as separate tensors
        return ModelConfig(
            architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=151936,
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, qk_norm=True,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            torch_dtype="bfloat16", max_position_embeddings=2048, rope_theta=1e6)
    if name == "tiny_dense":
        return ModelConfig(vocab_size=259, hidden_size=64, intermediate_size=176,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, attention_bias=True, torch_dtype="bfloat16")
    if name == "tiny_moe":
        return ModelConfig(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
                           vocab_size=259, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, qk_norm=True, num_experts=16, num_experts_per_tok=2,
                           moe_intermediate_size=32, torch_dtype="bfloat16")
    raise SystemExit(f"--layout: unknown layout {name!r} (dense7b, moe30b, tiny_dense, tiny_moe)")


def layout_metas(config: ModelConfig) -> list[TensorMeta]:
    with torch.device("meta"):
        model = CausalLM(config)
    return [TensorMeta(n, config.dtype, tuple(p.shape)) for n, p in hf_named_parameters(model)]


def write_model_dir(config: ModelConfig, root: Path) -> Path:
    d = root / f"{config.architecture}-{config.num_hidden_layers}l-{config.hidden_size}h"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    return d


@dataclass
class EngineSpec:
    name: str
    tp_size: int
    base_gpu: int  # first GPU (GPU runs); ranks take base_gpu .. base_gpu + tp - 1


def parse_engines(text: str, cuda: bool, check_gpus: bool = True) -> list[EngineSpec]:
    """One engine per comma item: `1` (1 GPU, TP=1) or `2tp2` (2 GPUs, TP=2), e.g. `1,2tp2`."""
    specs, gpu = [], 1
    for item in (x.strip() for x in text.split(",")):
        gpus, _, tp = item.partition("tp")
        try:
            gpus_n, tp_n = int(gpus), int(tp or gpus)
        except ValueError:
            raise SystemExit(f"--engines: cannot parse {item!r} in {text!r} (e.g. 1 or 1,2tp2)") from None
        if gpus_n != tp_n or tp_n < 1:
            raise SystemExit(f"--engines: {item!r}: an engine's GPU count must equal its TP size")
        specs.append(EngineSpec(chr(ord("A") + len(specs)), tp_n, gpu if cuda else 0))
        gpu += tp_n
    if check_gpus and cuda and gpu > torch.cuda.device_count():
        raise SystemExit(f"--engines {text}: needs {gpu} GPUs (trainer on GPU 0), "
                         f"{torch.cuda.device_count()} visible")
    return specs


# ---- trainer-side tensors and checksums ----------------------------------------------------

def make_params(metas: list[TensorMeta], device: torch.device, seed: int,
                flat: bool = False) -> list[torch.Tensor]:
    """One allocation per tensor, like a plain model's parameters; with `flat`, views of one
    buffer per dtype in parameter order, like a Megatron-style trainer's parameter buffers."""
    gen = torch.Generator(device=device).manual_seed(seed)
    buffers: dict[torch.dtype, torch.Tensor] = {}
    offsets: dict[torch.dtype, int] = {}
    if flat:
        for m in metas:
            offsets[m.dtype] = offsets.get(m.dtype, 0) + m.nbytes
        buffers = {dt: torch.empty(n, dtype=torch.uint8, device=device) for dt, n in offsets.items()}
        offsets = dict.fromkeys(buffers, 0)
    out = []
    for m in metas:
        if flat:
            start = offsets[m.dtype]
            offsets[m.dtype] = start + m.nbytes
            t = buffers[m.dtype][start:start + m.nbytes].view(m.dtype).view(m.shape)
        else:
            t = torch.empty(m.shape, dtype=m.dtype, device=device)
        t.normal_(generator=gen)
        out.append(t)
    return out


def perturb(params: list[torch.Tensor]) -> None:
    """New values for every byte between timed syncs (not timed)."""
    torch._foreach_add_(params, 0.5)
    if params[0].is_cuda:
        torch.cuda.synchronize()


def trainer_checksum(metas: list[TensorMeta], params: list[torch.Tensor]) -> str:
    """The engines' per-rank checksum (sha256 over name + per-tensor hash), computed here."""
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        sums = dict(zip([m.name for m in metas], pool.map(tensor_checksum, params), strict=True))
    return overall_checksum(sums)


def engine_checksums(url: str) -> list[str]:
    import requests

    body = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=1800).json()
    if not body.get("success"):
        raise RuntimeError(f"{url}/weights_checker failed: {body}")
    return [r["per_gpu_checksum"] for r in body["ranks"]]


def verify(urls: list[str], metas, params) -> bool:
    expected = trainer_checksum(metas, params)
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        got = list(pool.map(engine_checksums, urls))
    ok = all(all(c == expected for c in ranks) for ranks in got)
    if not ok:
        log(f"CHECKSUM MISMATCH: trainer {expected[:16]}, engines "
            f"{[[c[:16] for c in r] for r in got]}")
    return ok


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- raw and per-tensor: plain receivers on the engines' ranks ----------------------------

def _receiver(rank: int, world: int, port: int, device: str, backend: str, spec: list,
              plan: list[tuple[str, int]], conn) -> None:
    """One receiving rank: joins the group, then takes part in every timed broadcast."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        pg = init_custom_process_group(backend=backend, init_method=tcp_init_method("127.0.0.1", port),
                                       world_size=world, rank=rank, group_name="bench_raw",
                                       timeout=900)
        token = torch.zeros(1, device=dev)
        total = sum(n for _, _, n in spec)
        for mode, reps in plan:
            if mode == "raw":
                bufs = [torch.empty(total, dtype=torch.uint8, device=dev)]
            else:
                bufs = [torch.empty(shape, dtype=dtype_from_name(d), device=dev) for d, shape, _ in spec]
            for _ in range(reps):
                dist.all_reduce(token, group=pg)  # start line
                works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
                for w in works:
                    w.wait()
                dist.all_reduce(token, group=pg)  # finish line: every rank has every byte
            flat = bufs[0].reshape(-1).view(torch.uint8)
            conn.send((mode, flat[:64].cpu().tolist(), bufs[-1].reshape(-1).view(torch.uint8)[-64:].cpu().tolist()))
            del bufs
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        destroy_process_group(pg)
        conn.send(("done", None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        conn.send(("error", repr(e), None))
        raise


def run_baselines(args, metas, params, engines: list[EngineSpec], device, backend) -> dict:
    """raw and per_tensor over a group laid out exactly like the engines' weight group."""
    modes = [m for m in ("raw", "per_tensor") if m in args.modes]
    if not modes:
        return {}
    reps = args.warmup + args.repeats
    plan = [(m, reps) for m in modes]
    spec = [(dtype_name(m.dtype), list(m.shape), m.nbytes) for m in metas]
    world = 1 + sum(e.tp_size for e in engines)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs, conns, rank = [], [], 1
    for e in engines:
        for tp in range(e.tp_size):
            dev = f"cuda:{e.base_gpu + tp}" if device.type == "cuda" else "cpu"
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_receiver, args=(rank, world, port, dev, backend, spec, plan, child),
                            daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
            rank += 1
    results = {}
    try:
        pg = init_custom_process_group(backend=backend, init_method=tcp_init_method("127.0.0.1", port),
                                       world_size=world, rank=0, group_name="bench_raw", timeout=900)
        token = torch.zeros(1, device=device)
        total = sum(m.nbytes for m in metas)
        for mode in modes:
            if mode == "raw":
                raw = torch.empty(total, dtype=torch.uint8, device=device)
                offset = 0
                for t in params:  # packed once, not timed: raw is the wire alone
                    n = t.numel() * t.element_size()
                    raw[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
                    offset += n
                bufs = [raw]
            else:
                bufs = params
            times = []
            for _ in range(reps):
                dist.all_reduce(token, group=pg)
                _sync(device)
                t0 = time.perf_counter()
                works = [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]
                for w in works:
                    w.wait()
                dist.all_reduce(token, group=pg)
                _sync(device)
                times.append(time.perf_counter() - t0)
            first = bufs[0].reshape(-1).view(torch.uint8)[:64].cpu().tolist()
            last = bufs[-1].reshape(-1).view(torch.uint8)[-64:].cpu().tolist()
            for c in conns:
                got_mode, head, tail = c.recv()
                if got_mode == "error":
                    raise RuntimeError(f"receiver failed: {head}")
                if (head, tail) != (first, last):
                    raise RuntimeError(f"{mode}: a receiver got different bytes")
            results[mode] = times[args.warmup:]
            del bufs
            if mode == "raw":
                del raw
            if device.type == "cuda":
                torch.cuda.empty_cache()
        destroy_process_group(pg)
        for c in conns:
            c.recv()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- engines ------------------------------------------------------------------------------

class Engines:
    """Reference engines as plain processes (no Ray), killed with their whole tree."""

    def __init__(self, model_dir: Path, specs: list[EngineSpec], cuda: bool, log_dir: Path,
                 extra_argv: tuple[str, ...] = ()):
        from slime_like.cluster.process import ServerProcess, server_env

        self.procs, self.urls = [], []
        env = server_env(extra={"PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
        for spec in specs:
            port = free_port()
            argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path",
                    str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                    "--tp-size", str(spec.tp_size), "--load-format", "dummy",
                    "--context-length", "256", "--max-running-requests", "2",
                    "--max-total-tokens", "1024", "--skip-server-warmup"]
            argv += (["--device", "cuda", "--base-gpu-id", str(spec.base_gpu), "--dtype", "bfloat16"]
                     if cuda else ["--device", "cpu", "--dtype", "bfloat16"])
            argv += list(extra_argv)
            proc = ServerProcess(argv, log_path=log_dir / f"engine-{spec.name}-{port}.log",
                                 env=env, name=f"engine {spec.name}")
            proc.start()
            self.procs.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(self.procs, self.urls, strict=True):
            proc.wait_healthy(lambda url=url: _healthy(url), timeout=900)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate(grace=20)


def _healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(url + "/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def run_sync(args, metas, params, urls_tp, transport: str, device, bucket_bytes: int,
             engine_urls: list[str], load_format: str = "flattened_bucket",
             ) -> tuple[list[float], list[dict], bool | None, float]:
    """Timed WeightSync updates: seconds, reports, checksums matched?, first sync's seconds."""
    from slime_like.weights import NamedTensors, WeightSync

    source = NamedTensors([(m.name, t) for m, t in zip(metas, params, strict=True)])
    sync = WeightSync(urls_tp, transport=transport, device=str(device),
                      update_weight_buffer_size=bucket_bytes, pause_mode=args.pause_mode,
                      load_format=load_format, master_address="127.0.0.1", http_timeout_s=900,
                      group_timeout_s=900)
    try:
        sync.attach(source)
        return _timed_updates(args, metas, params, engine_urls, lambda: sync.update(source))
    finally:
        sync.close()


def run_facade(args, metas, params, url: str, tp_size: int, device, bucket_bytes: int,
               ) -> tuple[list[float], list[dict], bool | None, float]:
    """The seed's API (`SGLangWeightSyncScheme`) against the same engine, timed from outside."""
    from slime_like.weights import SGLangWeightSyncScheme, get_model_metadata

    model = _ParamsModule(metas, params)
    scheme = SGLangWeightSyncScheme(url, master_address="127.0.0.1", num_gpus=tp_size,
                                    device=device, pause_mode=args.pause_mode,
                                    update_weight_buffer_size=bucket_bytes)
    sender = scheme.create_sender()
    try:
        sender.register_model(model)
        sender.init_all_workers_group(get_model_metadata(model))

        def update() -> dict:
            t0 = time.perf_counter()
            report = sender.update_weights()
            report.total_s = time.perf_counter() - t0  # the whole façade call, not WeightSync's
            return report
        return _timed_updates(args, metas, params, [url], update)
    finally:
        sender.shutdown()


class _ParamsModule(torch.nn.Module):
    """The benchmark's tensors as a module whose parameters carry the HF names."""

    def __init__(self, metas, params):
        super().__init__()
        self.names = [m.name for m in metas]
        for m, t in zip(metas, params, strict=True):
            owner = self
            *path, leaf = m.name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))


def _timed_updates(args, metas, params, engine_urls, update) -> tuple[list[float], list[dict],
                                                                     bool | None, float]:
    times: list[float] = []
    reports: list[dict] = []
    ok: bool | None = None  # None: not checked (--verify none)
    first = None
    for i in range(args.warmup + args.repeats):
        perturb(params)
        report = update()
        if first is None:
            first = report.total_s
        if i >= args.warmup:
            times.append(report.total_s)
            reports.append(report.as_dict())
        last = i == args.warmup + args.repeats - 1
        if args.verify == "each" or (args.verify == "ends" and (i == 0 or last)):
            ok = verify(engine_urls, metas, params) and ok is not False
    return times, reports, ok, first


def d2d_copy(params: list[torch.Tensor], reps: int, warmup: int) -> list[float]:
    """A device-to-device copy of the same bytes into a second set of tensors."""
    dst = [torch.empty_like(t) for t in params]
    times = []
    for i in range(warmup + reps):
        _sync(params[0].device)
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, params)
        _sync(params[0].device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del dst
    if params[0].is_cuda:
        torch.cuda.empty_cache()
    return times


# ---- reporting ----------------------------------------------------------------------------

def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def where_time_went(report: dict) -> dict:
    s, t = report["seconds"], report.get("transfer", {})
    return {"pause": s.get("pause"), "begin": s.get("begin"), "transfer": s.get("transfer"),
            "pack": t.get("pack_s"), "wire": t.get("wire_s"), "http_engine": t.get("http_s"),
            "host_wait": t.get("wait_s"), "host_prep": t.get("prep_s"),
            "first_call": t.get("first_call_s"), "end": s.get("end"), "flush": s.get("flush"),
            "verify_version": s.get("verify"), "continue": s.get("continue"),
            "attach": s.get("attach"), "check_metadata": s.get("check_metadata"),
            "buckets": t.get("buckets"), "round_trips": report.get("round_trips")}


def median_report(times: list[float], reports: list[dict]) -> dict:
    order = sorted(range(len(times)), key=lambda i: times[i])
    return reports[order[len(order) // 2]]


def bench_layout(args, layout: str, specs: list[EngineSpec], device, backend, work: Path, out) -> None:
    config = layout_config(layout)
    metas = layout_metas(config)
    total = sum(m.nbytes for m in metas)
    model_dir = write_model_dir(config, work)
    log(f"[{layout}] {len(metas)} tensors, {total / 1e9:.2f} GB, engines {args.engines}, "
        f"device {device}")
    params = make_params(metas, device, seed=0, flat=args.trainer_params == "flat")
    base = {"layout": layout, "engines": args.engines, "tensors": len(metas), "bytes": total,
            "device": str(device), "trainer_params": args.trainer_params}
    names = [f"{e.name}(tp{e.tp_size})" for e in specs]

    def gbps(seconds: float) -> dict:
        return {n: round(total / seconds / 1e9, 2) for n in names}

    baselines = run_baselines(args, metas, params, specs, device, backend)
    raw_s = statistics.median(baselines["raw"]) if "raw" in baselines else None
    for mode, times in baselines.items():
        sec = statistics.median(times)
        emit({**base, "mode": mode, "seconds": round(sec, 6), "seconds_all": [round(x, 6) for x in times],
              "gbps_per_engine": gbps(sec),
              "ratio_to_raw": round(sec / raw_s, 3) if raw_s else None}, out)

    engine_modes = [m for m in ("ours", "facade", "sglang_per_tensor") if m in args.modes]
    if engine_modes:
        engines = Engines(model_dir, specs, device.type == "cuda", _log_dir(args, work),
                          tuple(args.engine_arg))
        try:
            urls_tp = [(u, s.tp_size) for u, s in zip(engines.urls, specs, strict=True)]
            for mb in args.bucket_mb:
                for mode in engine_modes:
                    if mode == "facade" and len(specs) != 1:
                        log(f"[{layout}] facade: the seed's API drives one server; skipped for "
                            f"--engines {args.engines}")
                        continue
                    if mode == "facade":
                        result = run_facade(args, metas, params, engines.urls[0], specs[0].tp_size,
                                            device, mb << 20)
                    else:
                        fmt = "per_tensor" if mode == "sglang_per_tensor" else "flattened_bucket"
                        result = run_sync(args, metas, params, urls_tp, "distributed", device,
                                          mb << 20, engines.urls, load_format=fmt)
                    times, reports, ok, first = result
                    sec = statistics.median(times)
                    ratio = round(sec / raw_s, 3) if raw_s else None
                    target = TARGETS.get((layout, "ours", args.engines)) if mode != "sglang_per_tensor" else None
                    record = {**base, "mode": mode, "bucket_mb": mb, "pause_mode": args.pause_mode,
                              "seconds": round(sec, 6), "seconds_all": [round(x, 6) for x in times],
                              "first_sync_s": round(first, 6),
                              "gbps_per_engine": gbps(sec), "ratio_to_raw": ratio,
                              "checksums_match": ok, "target_ratio": target,
                              "met": (ratio <= target) if (ratio and target) else None,
                              "where_time_went": where_time_went(median_report(times, reports))}
                    emit(record, out)
                    if record["met"] is False or ok is False:
                        log(f"[{layout}] {mode} (bucket {mb} MiB) at {ratio}x raw, target {target}x; "
                            f"where the time went: {json.dumps(record['where_time_went'])}")
        finally:
            engines.stop()

    if "tensor" in args.modes:
        d2d = d2d_copy(params, args.repeats, args.warmup)
        d2d_s = statistics.median(d2d)
        emit({**base, "mode": "d2d", "seconds": round(d2d_s, 6),
              "seconds_all": [round(x, 6) for x in d2d], "gbps": round(total / d2d_s / 1e9, 2)}, out)
        colocated = [EngineSpec("C", 1, (device.index or 0) if device.type == "cuda" else 0)]
        engines = Engines(model_dir, colocated, device.type == "cuda", _log_dir(args, work),
                          tuple(args.engine_arg))
        try:
            for mb in args.bucket_mb:
                times, reports, ok, first = run_sync(args, metas, params, [(engines.urls[0], 1)],
                                                     "tensor", device, mb << 20, engines.urls)
                sec = statistics.median(times)
                ratio = round(sec / d2d_s, 3)
                target = TENSOR_TARGETS.get(layout)
                record = {**base, "engines": "colocated", "mode": "tensor", "bucket_mb": mb,
                          "seconds": round(sec, 6), "seconds_all": [round(x, 6) for x in times],
                          "first_sync_s": round(first, 6),
                          "gbps": round(total / sec / 1e9, 2), "ratio_to_d2d": ratio,
                          "checksums_match": ok, "target_ratio": target,
                          "met": (ratio <= target) if target else None,
                          "where_time_went": where_time_went(median_report(times, reports))}
                emit(record, out)
                if record["met"] is False or ok is False:
                    log(f"[{layout}] tensor transport (bucket {mb} MiB) at {ratio}x d2d, target "
                        f"{target}x; where the time went: {json.dumps(record['where_time_went'])}")
        finally:
            engines.stop()
    del params
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _log_dir(args, work: Path) -> Path:
    """Where the engines write their logs: `--engine-log-dir`, else the run's own directory."""
    if not args.engine_log_dir:
        return work
    path = Path(args.engine_log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default=None,
                    help="comma list of dense7b, moe30b (GPU) or tiny_dense, tiny_moe (--tiny)")
    ap.add_argument("--engines", default="1", help="1 (engine A, GPU 1) or 1,2tp2 (A + B with TP=2)")
    ap.add_argument("--modes", default="raw,per_tensor,ours,facade,sglang_per_tensor,tensor")
    ap.add_argument("--tiny", action="store_true", help="CPU + gloo, tiny layouts (CI)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", default=None,
                    help="update-weight-buffer-size in MiB; a comma list runs each engine mode and tensor "
                         "once per size")
    ap.add_argument("--pause-mode", default="retract", choices=["abort", "retract", "in_place"])
    ap.add_argument("--verify", default="ends", choices=["ends", "each", "none"],
                    help="compare engine checksums with the trainer's after the first and last "
                         "sync (ends), after every sync (each), or never")
    ap.add_argument("--trainer-params", default="separate", choices=["separate", "flat"],
                    help="the trainer's tensors: one allocation each (a plain model), or views "
                         "of one buffer per dtype (Megatron-style); buckets that lie back to "
                         "back in the trainer's memory go out without packing")
    ap.add_argument("--json-out", default=None, help="also append the JSON lines to this file")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="one more argument for every engine (repeat the flag), e.g. "
                         "--engine-arg=--log-level --engine-arg=debug to log each load's times")
    ap.add_argument("--engine-log-dir", default=None,
                    help="keep the engines' logs here (default: the run's temporary directory)")
    weight_sync_delta.add_flags(ap)
    args = ap.parse_args(argv)
    if args.delta:  # CPU: delta vs full after real optimizer steps (its own module)
        return weight_sync_delta.run(args)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(args.modes) - {"raw", "per_tensor", "ours", "facade", "sglang_per_tensor", "tensor"}
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}")
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device visible; use --tiny for the CPU version")
    layouts = (args.layout or ("tiny_dense,tiny_moe" if args.tiny else "dense7b,moe30b")).split(",")
    args.repeats = args.repeats or (2 if args.tiny else 3)
    args.bucket_mb = [int(x) for x in (args.bucket_mb or ("1" if args.tiny else "1024")).split(",")]
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    # The colocated `tensor` mode alone needs one GPU; every other mode needs the engines' GPUs.
    specs = parse_engines(args.engines, cuda, check_gpus=set(args.modes) != {"tensor"})
    if cuda and "tensor" in args.modes and args.engines != "1":
        log("note: the tensor transport is measured on GPU 0 (trainer and engine colocated)")
    out = open(args.json_out, "a") if args.json_out else None  # noqa: SIM115
    try:
        with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as work:
            for layout in layouts:
                bench_layout(args, layout.strip(), specs, device, backend, Path(work), out)
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
