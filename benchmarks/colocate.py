"""Colocated RL step on one GPU, phase by phase, beside the host link's limit.

The job's colocated step, with its real parts in plain processes (no Ray, no router): a
`PolicyTrainer` in this process and a reference engine process on the same GPU
(`--load-format dummy --enable-weights-cpu-backup`), synced over the `tensor` transport
(CUDA IPC). Per step, in the job's order:

  trainer_offload  weights + AdamW moments to the pinned host buffers (grads freed);
                   enqueued, so the copy overlaps the generation
  generation       16 samples x 12 new tokens from the engine over HTTP
  trainer_onload   back to the GPU; enqueued, so it overlaps the engine's release (the
                   other direction of the link); the check waits for it
  engine_release   /release_memory_occupation (weights backed up to pinned host, KV freed)
  check            the trainer's log-probabilities of the samples (the job's check)
  train            one GRPO step
  engine_resume    /resume_memory_occupation (the backup copied back)
  sync             WeightSync into the engine (`tensor` transport)

The same steps run without the four offload phases first (the `--no-offload-train
--no-offload-rollout` step). In the same run it measures a pinned device-to-host and
host-to-device copy (one large buffer each way), a device-to-device copy of one buffer
and one of the sync's tensors tensor by tensor, and prints beside every moving phase the
time the link needs for the same bytes (and beside the sync, both d2d times). One JSON line per
layout goes to --json-out.

    python benchmarks/colocate.py --layout tiny0.75b,dense7b          # one GPU
    python benchmarks/colocate.py --layout tiny --steps 2              # CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import requests  # noqa: E402
import torch  # noqa: E402

from slime_like.models.tiny import tiny_config  # noqa: E402

SAMPLES, PROMPT_LEN, NEW_TOKENS = 16, 8, 12  # the job's colocated step (16 x 12 tokens)


def layout(name: str):
    """(model config, trainer dtype) of a benchmark layout."""
    from weight_sync import layout_config

    if name == "tiny0.75b":  # the job's --tiny-model-layers 16 --tiny-model-hidden 2048
        return tiny_config(layers=16, hidden=2048), torch.float32
    if name == "tiny3b":  # the job's --tiny-model-layers 28 --tiny-model-hidden 3072
        return tiny_config(layers=28, hidden=3072), torch.float32
    if name == "tiny":  # CPU smoke run
        return tiny_config(layers=2, hidden=64), torch.float32
    if name == "dense7b":  # Qwen2.5-7B shapes; trainer state in bf16 so that weights, grads,
        # two moments and the engine fit one GPU and the host
        return layout_config("dense7b"), torch.bfloat16
    raise SystemExit(f"--layout: unknown layout {name!r} (tiny0.75b, tiny3b, dense7b, tiny)")


def log(msg: str) -> None:
    print(f"[colocate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn, cuda: bool):
    _sync(cuda)
    t0 = time.perf_counter()
    out = fn()
    _sync(cuda)
    return time.perf_counter() - t0, out


# ---- the link's limits, measured in this run ------------------------------------------------

def link_rates(cuda: bool, nbytes: int, reps: int = 5) -> dict[str, float]:
    """Bytes copied per second by a pinned D2H, a pinned H2D and a d2d copy of one `nbytes`
    buffer (each byte counted once, not as read + written); medians."""
    if not cuda:
        return {"d2h": 0.0, "h2d": 0.0, "d2d": 0.0}
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    other = torch.empty_like(dev)
    rates: dict[str, list[float]] = {"d2h": [], "h2d": [], "d2d": []}
    for i in range(reps + 1):
        for key, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host), "d2d": (other, dev)}.items():
            seconds, _ = timed(lambda d=dst, s=src: d.copy_(s, non_blocking=True), cuda)
            if i:
                rates[key].append(nbytes / seconds)
    del dev, host, other
    torch.cuda.empty_cache()
    return {k: statistics.median(v) for k, v in rates.items()}


def d2d_tensors(cuda: bool, source) -> float:
    """Seconds of a device-to-device copy of the sync's tensors, tensor by tensor (what
    `benchmarks/weight_sync.py` calls d2d); median."""
    if not cuda:
        return 0.0
    from weight_sync import d2d_copy

    from slime_like.weights.packing import as_source

    return statistics.median(d2d_copy([t for _, t in as_source(source).tensors()], reps=5,
                                      warmup=1))


# ---- the engine -----------------------------------------------------------------------------

class Engine:
    """A reference engine process on this process's GPU (killed with its tree)."""

    def __init__(self, model_dir: Path, cuda: bool, log_dir: Path, dtype: str,
                 log_level: str = "info"):
        from weight_sync import _healthy, free_port

        from slime_like.cluster.process import ServerProcess, server_env

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path",
                str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--load-format",
                "dummy", "--dtype", dtype, "--context-length", "256", "--max-running-requests",
                str(SAMPLES), "--max-total-tokens", str(SAMPLES * 256), "--skip-server-warmup",
                "--enable-weights-cpu-backup", "--device", "cuda" if cuda else "cpu",
                "--log-level", log_level]
        env = server_env(extra={"PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
        self.log_path = log_dir / f"engine-{port}.log"
        self.proc = ServerProcess(argv, log_path=self.log_path, env=env,
                                  name="engine")
        self.proc.start()
        self.proc.wait_healthy(lambda: _healthy(self.url), timeout=900)

    def post(self, path: str, body: dict) -> dict:
        r = requests.post(self.url + path, json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    def generate(self, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        """SAMPLES concurrent requests of NEW_TOKENS each; (prompt, output) token ids."""
        def one(_: int) -> tuple[list[int], list[int]]:
            prompt = [rng.randrange(3, 200) for _ in range(PROMPT_LEN)]
            out = self.post("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}})
            ids = out.get("output_ids") or [rng.randrange(3, 200) for _ in range(NEW_TOKENS)]
            return prompt, list(ids)
        with ThreadPoolExecutor(SAMPLES) as pool:
            return list(pool.map(one, range(SAMPLES)))

    def stop(self) -> None:
        self.proc.terminate(grace=20)


# ---- the steps ------------------------------------------------------------------------------

def run_layout(args, name: str, work: Path) -> dict:
    from weight_sync import write_model_dir

    from slime_like.trainer.policy import PolicyTrainer
    from slime_like.weights import WeightSync

    cuda = torch.cuda.is_available() and not args.cpu
    config, trainer_dtype = layout(name)
    model_dir = write_model_dir(config, work / name)
    engine_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[config.dtype]
    engine = Engine(model_dir, cuda, work, engine_dtype, args.engine_log_level)
    trainer = sync = None
    try:
        trainer = PolicyTrainer(model_dir, device="cuda" if cuda else "cpu", load_format="dummy",
                                dtype=trainer_dtype, engine_dtype=engine_dtype)
        weight_bytes = sum(p.numel() for p in trainer.model.parameters()) * config.dtype.itemsize
        log(f"{name}: {sum(p.numel() for p in trainer.model.parameters()) / 1e9:.2f}B params, "
            f"engine weights {weight_bytes / 1e9:.2f} GB ({engine_dtype})")
        sync = WeightSync([(engine.url, 1)], transport="tensor", device="cuda" if cuda else "cpu",
                          update_weight_buffer_size=args.bucket_mb << 20,
                          master_address="127.0.0.1", http_timeout_s=900)
        version = 1
        sync.update(trainer.sync_source(), str(version))
        rng = random.Random(0)
        rates = link_rates(cuda, args.copy_mb << 20)
        d2d_tensors_s = d2d_tensors(cuda, trainer.sync_source())
        log(f"link: pinned D2H {rates['d2h'] / 1e9:.1f} GB/s, H2D {rates['h2d'] / 1e9:.1f} GB/s, "
            f"d2d {rates['d2d'] / 1e9:.0f} GB/s (one buffer of {args.copy_mb} MiB)")

        def step(colocated: bool, keep_weights: bool = False) -> dict[str, float]:
            """One step in the job's order. Offload and onload are enqueued and overlap the
            generation and the engine's release; their seconds are the copies' own (events).
            Only local GPU work is timed with a device synchronize."""
            nonlocal version
            t: dict[str, float] = {}
            _sync(cuda)
            t_step = time.perf_counter()
            if colocated:
                trainer.move_to("cpu", wait=False, keep_weights=keep_weights)
            t["generation_s"], samples = timed(lambda: engine.generate(rng), False)
            if colocated:
                trainer.offloader.onload(wait=False)
                t["engine_release_s"], _ = timed(
                    lambda: engine.post("/release_memory_occupation", {}), False)
            t["check_s"], _ = timed(lambda: trainer.completion_logprobs(samples), cuda)
            if colocated:
                off, on = trainer.offloader.last_offload, trainer.offloader.onload_stats()
                t["trainer_offload_s"], t["trainer_offload_bytes"] = off.seconds, off.bytes
                t["trainer_onload_s"], t["trainer_onload_bytes"] = on.seconds, on.bytes
            advantages = [rng.choice((-1.0, 1.0)) for _ in samples]
            t["train_s"], _ = timed(lambda: trainer.train_step(samples, advantages), cuda)
            if cuda:  # what the trainer holds when the engine resumes
                t["trainer_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
                t["trainer_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
                log(f"after train: trainer allocated {t['trainer_allocated_gb']:.1f} GB, "
                    f"reserved {t['trainer_reserved_gb']:.1f} GB")
            if colocated:
                t["engine_resume_s"], _ = timed(
                    lambda: engine.post("/resume_memory_occupation", {}), False)
                t["engine_backup_bytes"] = weight_bytes
            version += 1
            # As in the job: a colocated engine is held out of the router from its resume to
            # the sync, so the sync does not pause it; a routed one is paused.
            quiet = {engine.url} if colocated else set()
            def update():
                return sync.update(trainer.sync_source(), str(version), quiet=quiet)
            if keep_weights and args.profile_sync:  # the trainer's side, function by function
                profile = cProfile.Profile()
                t["sync_s"], report = timed(lambda: profile.runcall(update), cuda)
                profiles.append(profile)
            else:
                t["sync_s"], report = timed(update, cuda)
            t["sync_bytes"] = (report.transfer or {}).get("bytes", weight_bytes)
            t["step_s"] = time.perf_counter() - t_step
            last_report.clear()
            last_report.update(report.as_dict())
            return t

        last_report: dict = {}
        profiles: list[cProfile.Profile] = []
        result: dict = {"layout": name, "params_b": round(sum(
            p.numel() for p in trainer.model.parameters()) / 1e9, 3),
            "trainer_dtype": str(trainer_dtype).removeprefix("torch."),
            "engine_dtype": engine_dtype, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "link_gbps": {k: round(v / 1e9, 2) for k, v in rates.items()}}
        modes = {"no_offload": (False, False), "colocated": (True, False),
                 "keep_weights": (True, True)}
        for mode in ["no_offload", "colocated"] + (["keep_weights"] if args.keep_weights else []):
            colocated, keep = modes[mode]
            runs = [step(colocated, keep) for _ in range(args.warmup + args.steps)][args.warmup:]
            result[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            if cuda and colocated:
                result["gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            result[f"{mode}_sync_seconds"] = {k: round(v, 4) for k, v in
                                              (last_report.get("seconds") or {}).items()}
            result[f"{mode}_sync_transfer"] = last_report.get("transfer")
        if cuda:
            result["pinned_host_gb"] = round(trainer.offloader.host_bytes() / 1e9, 2)
        if profiles:
            stats = pstats.Stats(profiles[-1], stream=sys.stderr)
            for p in profiles[-3:-1]:
                stats.add(p)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
        if args.engine_log_level == "debug":  # the engine's own breakdown of each update
            lines = [x for x in engine.log_path.read_text().splitlines()
                     if "flattened update" in x or "update_weights_from_tensor:" in x]
            result["engine_update_log"] = lines[-4 * (args.steps + args.warmup):]
        return summarize(result, rates, d2d_tensors_s)
    finally:
        if sync is not None:
            sync.close()
        engine.stop()


def summarize(result: dict, rates: dict[str, float], d2d_tensors_s: float) -> dict:
    """Beside each moving phase: the pinned copy of the same bytes; beside the sync, a d2d
    copy of one buffer and of its tensors (`d2d_tensors_s`); the targets' ratios."""
    c = result["colocated"]
    link = {  # (bytes, rate) of what each phase moves over the host link
        "trainer_offload": (c["trainer_offload_bytes"], rates["d2h"]),
        "trainer_onload": (c["trainer_onload_bytes"], rates["h2d"]),
        "engine_release": (c["engine_backup_bytes"], rates["d2h"]),
        "engine_resume": (c["engine_backup_bytes"], rates["h2d"]),
    }
    phases = {}
    for phase, (nbytes, rate) in link.items():
        seconds = c[f"{phase}_s"]
        copy_s = nbytes / rate if rate else 0.0
        phases[phase] = {"s": round(seconds, 4), "gb": round(nbytes / 1e9, 3),
                         "gbps": round(nbytes / seconds / 1e9, 2),
                         "pinned_copy_s": round(copy_s, 4),
                         "ratio": round(seconds / copy_s, 2) if copy_s else None}
    moved_s = sum(p["s"] for p in phases.values())
    copy_s = sum(p["pinned_copy_s"] for p in phases.values())
    d2d_s = c["sync_bytes"] / rates["d2d"] if rates["d2d"] else 0.0
    result["phases"] = phases
    result["offload_onload_release_resume"] = {
        "s": round(moved_s, 4), "pinned_copy_s": round(copy_s, 4),
        "ratio": round(moved_s / copy_s, 2) if copy_s else None, "target": 2.0}
    result["step_ratio"] = {"colocated_s": round(c["step_s"], 4),
                            "no_offload_s": round(result["no_offload"]["step_s"], 4),
                            "ratio": round(c["step_s"] / result["no_offload"]["step_s"], 2),
                            "target": 2.0}
    result["sync"] = {"s": round(c["sync_s"], 4), "gb": round(c["sync_bytes"] / 1e9, 3),
                      "d2d_s": round(d2d_s, 4),
                      "ratio_to_d2d": round(c["sync_s"] / d2d_s, 2) if d2d_s else None,
                      "d2d_tensors_s": round(d2d_tensors_s, 4),
                      "ratio_to_d2d_tensors": round(c["sync_s"] / d2d_tensors_s, 2)
                      if d2d_tensors_s else None,
                      "target": 3.0}
    kept = result.get("keep_weights")
    if kept:
        result["keep_weights_sync"] = {
            "s": round(kept["sync_s"], 4), "gb": round(kept["sync_bytes"] / 1e9, 3),
            "ratio_to_d2d": round(kept["sync_s"] / d2d_s, 2) if d2d_s else None,
            "step_s": round(kept["step_s"], 4),
            "step_ratio": round(kept["step_s"] / result["no_offload"]["step_s"], 2)}
    return result


def print_table(r: dict) -> None:
    print(f"\n== {r['layout']} ({r['params_b']}B params, trainer {r['trainer_dtype']}, engine "
          f"{r['engine_dtype']}, {r['device']}); link: pinned D2H {r['link_gbps']['d2h']} GB/s, "
          f"H2D {r['link_gbps']['h2d']} GB/s, d2d {r['link_gbps']['d2d']} GB/s")
    print(f"{'phase':<18}{'seconds':>10}{'GB':>9}{'GB/s':>9}{'pinned copy s':>15}{'ratio':>8}")
    for phase, p in r["phases"].items():
        print(f"{phase:<18}{p['s']:>10.4f}{p['gb']:>9.3f}{p['gbps']:>9.2f}"
              f"{p['pinned_copy_s']:>15.4f}{p['ratio'] or 0:>8.2f}")
    m = r["offload_onload_release_resume"]
    print(f"{'the four, total':<18}{m['s']:>10.4f}{'':>18}{m['pinned_copy_s']:>15.4f}"
          f"{m['ratio'] or 0:>8.2f}  (target <= {m['target']})")
    s = r["sync"]
    print(f"{'sync':<18}{s['s']:>10.4f}{s['gb']:>9.3f}{'':>9}{'d2d ' + str(s['d2d_s']):>15}"
          f"{s['ratio_to_d2d'] or 0:>8.2f}  (target <= {s['target']} x d2d: one buffer)")
    print(f"{'':<46}{'per tensor ' + str(s['d2d_tensors_s']):>15}"
          f"{s['ratio_to_d2d_tensors'] or 0:>8.2f}  (d2d tensor by tensor)")
    print(f"{'phase':<18}{'no offload s':>14}{'colocated s':>14}")
    for k in r["colocated"]:
        if k.endswith("_s"):
            print(f"{k:<18}{r['no_offload'].get(k, 0.0):>14.4f}{r['colocated'][k]:>14.4f}")
    st = r["step_ratio"]
    print(f"colocated step / no-offload step = {st['ratio']} (target <= {st['target']})")
    print(f"sync, where the time went (last colocated step): {r.get('colocated_sync_seconds')}; "
          f"transfer {r.get('colocated_sync_transfer')}")
    k = r.get("keep_weights_sync")
    if k:
        print(f"weights kept on the GPU: sync {k['s']} s ({k['gb']} GB) = {k['ratio_to_d2d']} x d2d; "
              f"step {k['step_s']} s = {k['step_ratio']} x no-offload; where the sync's time went: "
              f"{r.get('keep_weights_sync_seconds')}; transfer {r.get('keep_weights_sync_transfer')}")
    for line in r.get("engine_update_log", []):
        print("engine:", line.split("] ")[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="tiny0.75b,dense7b")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (medians)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--copy-mb", type=int, default=2048, help="the link probe's buffer")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (a smoke run)")
    ap.add_argument("--keep-weights", action="store_true",
                    help="also run the colocated step with the trainer's weights kept on the GPU "
                         "(the job's --no-offload-train-weights)")
    ap.add_argument("--profile-sync", action="store_true",
                    help="cProfile the last three syncs with the weights kept (trainer side)")
    ap.add_argument("--engine-log-level", default="info",
                    help="debug: the engine logs each update's unpickle, plan and copy times")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="colocate-") as tmp:
        for name in args.layout.split(","):
            result = run_layout(args, name, Path(tmp))
            print_table(result)
            if args.json_out:
                with args.json_out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
