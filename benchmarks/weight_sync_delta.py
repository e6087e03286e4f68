"""`weight_sync.py --delta`: delta vs full weight syncs after real AdamW steps.

A bf16 Llama of about 1B parameters (`--delta-layers 17`: 1.005B) trains with AdamW on a
random batch (one real forward, backward and optimizer step per sync); after each step the
same weights go to one reference engine twice, side by side: first as a delta
(`update_weight_mode="delta"`), then in full with the same version string (the engine then
still holds exactly the delta's next base). Reported per (transport, lr): bytes sent and
sync seconds (median over steps) for both, their ratios, the fraction of bf16 values the
step changed, and what the other codec (sparse int32 index + bf16 value per changed
element) would have sent for the same step. The engine's checksums are compared with the
trainer's after each (transport, lr). Over `disk`, each sync's files are also fsynced after
it (timed apart): "time × with fsync" is the ratio when the files must reach the disk, as
on a network filesystem, which sends them at close, rather than stay in the page cache.

Transports: `disk` (checkpoint vs delta directory on this host's filesystem) and `gloo`
(a weight group to an engine in its own network namespace, across a veth pair shaped to
`--delta-link-gbit` with `tc tbf`; addresses in 198.18.0.0/15; the namespace and link are
removed on exit, failure included; needs root). `--delta-link-gbit 0` runs gloo over
loopback, unshaped.

    python benchmarks/weight_sync.py --delta                      # 1B, disk and gloo
    python benchmarks/weight_sync.py --delta --delta-layers 2 --delta-steps 2   # smoke
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from slime_like.cluster.ports import free_port
from slime_like.models.config import ModelConfig
from slime_like.models.loading import init_dummy_weights, save_state_dict_atomic
from slime_like.models.transformer import CausalLM, hf_named_parameters
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from slime_like.weights import WeightSync
from slime_like.weights.delta import host_bytes
from slime_like.weights.packing import bucket_tensors

REPO = Path(__file__).resolve().parent.parent
BYTES_TARGET, TIME_TARGET = 0.25, 0.5


def one_b_config(layers: int) -> ModelConfig:
    """Llama shapes of TinyLlama-1.1B's width (2048 hidden, 5632 MLP), `layers` deep."""
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=32000,
                       hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                       torch_dtype="bfloat16", max_position_embeddings=512)


@contextlib.contextmanager
def shaped_link(gbit: float) -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair shaped to `gbit` both ways.

    Yields (namespace, this side's address, the namespace's address). Everything made here
    is removed on exit (deleting the namespace deletes its end of the pair, and the pair)."""
    tag = f"{os.getpid() % 100000}"
    ns, near, far = f"sldelta{tag}", f"sld{tag}a", f"sld{tag}b"
    octet = 1 + os.getpid() % 250
    ours, theirs = f"198.18.{octet}.1", f"198.18.{octet}.2"

    def run(*argv: str) -> None:
        subprocess.run(list(argv), check=True, capture_output=True, timeout=30)

    try:
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", near, "type", "veth", "peer", "name", far, "netns", ns)
        run("ip", "addr", "add", f"{ours}/30", "dev", near)
        run("ip", "link", "set", near, "up")
        inside = ("ip", "netns", "exec", ns)
        run(*inside, "ip", "addr", "add", f"{theirs}/30", "dev", far)
        run(*inside, "ip", "link", "set", far, "up")
        run(*inside, "ip", "link", "set", "lo", "up")
        if gbit > 0:  # burst: a few ms at the rate, so tbf is not the bottleneck by itself
            shape = ("root", "tbf", "rate", f"{gbit}gbit", "burst", "32mb", "latency", "50ms")
            run("tc", "qdisc", "add", "dev", near, *shape)
            run(*inside, "tc", "qdisc", "add", "dev", far, *shape)
        yield ns, ours, theirs
    finally:
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Engine:
    """One reference engine, optionally inside a network namespace. It loads a real
    checkpoint: an engine started with `--load-format dummy` would re-initialize at random
    on every `update_weights_from_disk` without a format (sglang's rule, ours too)."""

    def __init__(self, model_dir: Path, log_dir: Path, host: str = "127.0.0.1",
                 netns: str | None = None, ifname: str | None = None):
        from slime_like.cluster.process import ServerProcess, server_env

        port = free_port()
        # the repo first, then whatever the caller's PYTHONPATH holds (packages installed
        # with --target live only there)
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        extra = {"PYTHONPATH": pythonpath, "NO_PROXY": "*", "no_proxy": "*"}
        if ifname:
            extra["GLOO_SOCKET_IFNAME"] = ifname
        argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path",
                str(model_dir), "--host", host, "--port", str(port),
                "--device", "cpu", "--dtype", "bfloat16", "--context-length", "256",
                "--max-running-requests", "2", "--max-total-tokens", "1024",
                "--skip-server-warmup"]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.url = f"http://{host}:{port}"
        self.proc = ServerProcess(argv, log_path=log_dir / f"delta-engine-{port}.log",
                                  env=server_env(extra=extra), name="delta bench engine")
        self.proc.start()
        self.proc.wait_healthy(self._healthy, timeout=900)

    def _healthy(self) -> bool:
        import requests

        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def checksum(self) -> str:
        import requests

        body = requests.post(self.url + "/weights_checker", json={}, timeout=900).json()
        return body["ranks"][0]["per_gpu_checksum"]

    def stop(self) -> None:
        self.proc.terminate(grace=20)


def trainer_checksum(model: CausalLM) -> str:
    return overall_checksum({n: tensor_checksum(p) for n, p in hf_named_parameters(model)})


def train_step(model: CausalLM, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    """One real AdamW step on a random next-token batch; grads freed after it (memory)."""
    ids = torch.randint(0, model.config.vocab_size, (1, 17), generator=gen)
    t0 = time.perf_counter()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def codec_sizes(sync: WeightSync, model: CausalLM) -> dict:
    """Before a delta sync: how many bf16 values changed since the base, and what the
    sparse codec (int32 index + the 2-byte value per changed element) would send."""
    base = sync.transport.base
    changed = total = 0
    src = _hf(model)
    for k, bucket in enumerate(sync._plan(sync._registered)):
        new = host_bytes(bucket_tensors(src, bucket))
        old = base.buckets[k]
        changed += int(np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)))
        total += new.size // 2
    return {"changed_fraction": round(changed / total, 6), "sparse_bytes": changed * 6,
            "elements": total}


def flushed(sync: WeightSync) -> float:
    """fsync every file of the sync's newest directory: the seconds a filesystem that must
    hold the bytes durably (or a network filesystem, which sends them at close) adds. The
    engine has read them already; this is timed after the sync, not inside it."""
    t0 = time.perf_counter()
    newest = sync.transport.written[-1]
    for f in sorted(x for x in newest.rglob("*") if x.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _hf(model: CausalLM):
    return ((n, p.detach()) for n, p in hf_named_parameters(model))


def bench_transport(args, transport: str, model: CausalLM, model_dir: Path, work: Path,
                    out) -> list[dict]:
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        settings = dict(update_weight_buffer_size=args.delta_bucket_mb << 20,
                        http_timeout_s=900, group_timeout_s=900)
        if transport == "gloo":
            if args.delta_link_gbit > 0:
                ns, ours, theirs = stack.enter_context(shaped_link(args.delta_link_gbit))
                ifname = f"sld{os.getpid() % 100000}"
                os.environ["GLOO_SOCKET_IFNAME"] = f"{ifname}a"  # this process's end
                stack.callback(os.environ.pop, "GLOO_SOCKET_IFNAME", None)
                engine = Engine(model_dir, work, host=theirs, netns=ns, ifname=f"{ifname}b")
                settings["master_address"] = ours
            else:
                engine = Engine(model_dir, work)
            kind = "distributed"
        else:
            engine = Engine(model_dir, work)
            kind = "disk"
        stack.callback(engine.stop)
        for lr in args.delta_lrs:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
            gen = torch.Generator().manual_seed(int(lr * 1e9))
            common = dict(transport=kind, disk_dir=str(work / f"ckpt-{transport}"), **settings)
            delta = WeightSync([engine.url], update_weight_mode="delta",
                               update_weight_delta_full_every=10**6, **common)
            full = WeightSync([engine.url], **common)
            stack.callback(delta.close)
            stack.callback(full.close)
            tag = f"lr{lr:g}"
            first = delta.update(model, f"{tag}-0")
            log(f"{transport} {tag}: base sync (full through the delta transport) "
                f"{first.total_s:.1f}s")
            steps = []
            for step in range(1, args.delta_steps + 1):
                step_s = train_step(model, opt, gen)
                sizes = codec_sizes(delta, model) if step == 1 else {}
                version = f"{tag}-{step}"
                rd = delta.update(model, version)
                delta_flush_s = flushed(delta) if kind == "disk" else 0.0
                rf = full.update(model, version)
                full_flush_s = flushed(full) if kind == "disk" else 0.0
                d = rd.transfer["delta"]
                assert d["mode"] == "delta", d
                steps.append({"step": step, "train_s": round(step_s, 3),
                              "delta_s": rd.total_s, "full_s": rf.total_s,
                              "delta_encode_s": round(rd.transfer["pack_s"], 3),
                              "delta_engine_s": round(rd.transfer["http_s"], 3),
                              "full_pack_s": round(rf.transfer["pack_s"], 3),
                              "full_engine_s": round(rf.transfer["http_s"], 3),
                              "delta_flush_s": round(delta_flush_s, 3),
                              "full_flush_s": round(full_flush_s, 3),
                              "delta_bytes": rd.transfer["bytes"],
                              "full_bytes": rf.transfer["bytes"], **sizes})
                log(f"{transport} {tag} step {step}: delta {rd.total_s:.2f}s (trainer "
                    f"encode {rd.transfer['pack_s']:.2f}s, engine calls "
                    f"{rd.transfer['http_s']:.2f}s) "
                    f"{rd.transfer['bytes'] / 1e6:.1f} MB, full {rf.total_s:.2f}s "
                    f"{rf.transfer['bytes'] / 1e6:.1f} MB {sizes}")
            same = engine.checksum() == trainer_checksum(model)
            row = summarize(transport, lr, steps, same, args)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            delta.close()
            full.close()
            del opt
    return rows


def summarize(transport: str, lr: float, steps: list[dict], same: bool, args) -> dict:
    med = {k: statistics.median(s[k] for s in steps)
           for k in ("delta_s", "full_s", "delta_bytes", "full_bytes")}
    first = steps[0]
    row = {"bench": "delta", "transport": transport, "lr": lr, "steps": len(steps),
           "link_gbit": args.delta_link_gbit if transport == "gloo" else None,
           "delta_bytes": int(med["delta_bytes"]), "full_bytes": int(med["full_bytes"]),
           "bytes_ratio": round(med["delta_bytes"] / med["full_bytes"], 4),
           "delta_s": round(med["delta_s"], 3), "full_s": round(med["full_s"], 3),
           "time_ratio": round(med["delta_s"] / med["full_s"], 3),
           "delta_flush_s": round(statistics.median(s["delta_flush_s"] for s in steps), 3),
           "full_flush_s": round(statistics.median(s["full_flush_s"] for s in steps), 3),
           "changed_fraction": first.get("changed_fraction"),
           "sparse_bytes_ratio": round(first["sparse_bytes"] / first["full_bytes"], 4)
           if "sparse_bytes" in first else None,
           "zstd_bytes_ratio_step1": round(first["delta_bytes"] / first["full_bytes"], 4),
           "checksum_equal": same, "per_step": steps}
    if transport == "disk":  # the same pair with each sync's files made durable
        row["time_ratio_flushed"] = round(
            statistics.median(s["delta_s"] + s["delta_flush_s"] for s in steps)
            / statistics.median(s["full_s"] + s["full_flush_s"] for s in steps), 3)
    row["bytes_target_met"] = row["bytes_ratio"] <= BYTES_TARGET
    row["time_target_met"] = row["time_ratio"] <= TIME_TARGET
    return row


def log(msg: str) -> None:
    print(f"[delta] {msg}", file=sys.stderr, flush=True)


def table(rows: list[dict]) -> str:
    lines = ["| transport | lr | params changed | delta MB | full MB | bytes × | sparse × "
             "| delta s | full s | time × | time × with fsync | checksums |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = r["transport"] + (f" ({r['link_gbit']:g} Gb/s)" if r["link_gbit"] else "")
        lines.append(f"| {where} | {r['lr']:g} | {100 * (r['changed_fraction'] or 0):.2f}% "
                     f"| {r['delta_bytes'] / 1e6:.1f} | {r['full_bytes'] / 1e6:.1f} "
                     f"| {r['bytes_ratio']:.3f} | {r['sparse_bytes_ratio']} "
                     f"| {r['delta_s']:.2f} | {r['full_s']:.2f} | {r['time_ratio']:.2f} "
                     f"| {r.get('time_ratio_flushed', '')} "
                     f"| {'equal' if r['checksum_equal'] else 'DIFFER'} |")
    return "\n".join(lines)


def run(args) -> int:
    import tempfile

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = one_b_config(args.delta_layers)
    work = Path(tempfile.mkdtemp(prefix="delta-bench-"))
    model_dir = work / "model"
    model = CausalLM(config).to(torch.bfloat16)
    init_dummy_weights(model, seed=0)
    save_state_dict_atomic({n: p.detach() for n, p in hf_named_parameters(model)}, model_dir,
                           extra_files={"config.json": json.dumps(config.to_hf_dict(), indent=1)})
    n = sum(p.numel() for p in model.parameters())
    log(f"model: {n / 1e9:.3f}B parameters, {n * 2 / 2**30:.2f} GiB in bf16")
    out = open(args.json_out, "a") if args.json_out else open(os.devnull, "w")  # noqa: SIM115
    rows = []
    try:
        for transport in args.delta_transports:
            rows += bench_transport(args, transport, model, model_dir, work, out)
    finally:
        out.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "per_step"}))
    print(table(rows))
    return 0 if all(r["checksum_equal"] for r in rows) else 1


def add_flags(ap) -> None:
    ap.add_argument("--delta", action="store_true",
                    help="delta vs full syncs after real AdamW steps (benchmarks/weight_sync_delta.py)")
    ap.add_argument("--delta-layers", type=int, default=17, help="1.005B parameters at 17")
    ap.add_argument("--delta-steps", type=int, default=3)
    ap.add_argument("--delta-lrs", type=lambda s: [float(x) for x in s.split(",")],
                    default=[1e-6, 1e-5])
    ap.add_argument("--delta-transports", type=lambda s: s.split(","), default=["disk", "gloo"])
    ap.add_argument("--delta-link-gbit", type=float, default=10.0,
                    help="gloo across a veth pair shaped to this rate (0: loopback, unshaped)")
    ap.add_argument("--delta-bucket-mb", type=int, default=512)
