"""Where the engine-vs-trainer log-probability noise comes from, and how far one optimizer
step moves the log-probabilities (the detection floor for a stale engine).

Every RL step compares, per sampled token, the engine's log-probability (batched decode
over a KV cache) with the trainer's recomputation (one full forward over prompt+output)
at the same weight version, and fails the step above 1e-4. This measures that
difference with the real parts: a reference-engine server process over HTTP (`/generate`
with `return_logprob`), its prompt-logprob path (`logprob_start_len`, as
`rollout/scoring.py` asks), and `PolicyTrainer.completion_logprobs` /
`PolicyTrainer.train_step`.

Per model (the quickstart's tiny byte-level Llama, 2 layers x hidden 64, as initialised,
and a "trained" copy: `--train-steps` real GRPO steps at lr 2e-3 so its logits grow) and
per engine `--dtype` (float32, bfloat16), one engine process serves N sampled requests
(temperature 1, 16-64 new tokens, up to 64 decoded in one batch). The same prompt+output
pairs are then scored by

- engine/decode     the logprobs the engine reported while sampling (output token 0 comes
                    from the request's prefill forward, the rest from batched decode steps);
- engine/decode-b1  a subset regenerated one request at a time (decode batch of 1, same
                    seeds; only samples whose tokens came out identical are compared);
- engine/prefill-warm  prompt logprobs right after generation: the prompt's KV (all but its
                    last token) comes from the prefix cache, the output is prefilled;
- engine/prefill-flushed  the same after /flush_cache (requests sharing a prompt still
                    reuse each other's prompt KV; `cached_tokens` says how much);
- trainer/{fp32,bf16}/{batched,single}  `completion_logprobs` over the whole batch
                    right-padded, or one sample per forward; bf16 = the model cast to
                    bfloat16, as a bf16 trainer (or a copy of the served weights) would.

For each (engine path, trainer variant) pair: median / p99 / p99.9 / max of |engine -
trainer| over all sampled tokens, the 5 worst tokens, and quantiles by the token's
probability (trainer fp32) and by its output position. Bounds: quantiles are over the
tokens of one run (N x ~40 tokens; p99.9 rests on ~N*40/1000 tokens, the max on one); the
tails depend on which tokens were sampled, so two runs differ in the max by up to ~2x.

Neighbour versions: from the fp32 trainer, one real AdamW `train_step` (GRPO loss, random
advantages, on the first `--step-batch` samples, a fresh trainer per lr) at each `--lrs`;
over all N samples' tokens, the per-token |logprob(v) - logprob(v-1)| (median, p99, mean,
L2 over the same tokens) next to the fp32 engine-vs-trainer noise, plus what the job's
check would see with an engine one version behind (max |engine(v-1) - trainer(v)|). AdamW's first step moves every weight by ~lr (its
update is ~sign(gradient)), so these figures scale ~linearly with lr until they reach
fp32 rounding.

    python benchmarks/logprob_noise.py [--n 512] [--models init,trained] [--json-out PATH]

Engines run one at a time, pinned to one core with one torch thread; the trainer runs in
this process with one torch thread.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import numpy as np
import requests
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_like.models.loading import save_state_dict_atomic  # noqa: E402
from slime_like.models.tiny import make_tiny_model  # noqa: E402
from slime_like.models.tokenizer import ByteTokenizer  # noqa: E402
from slime_like.trainer.grpo import group_advantages, pack  # noqa: E402
from slime_like.trainer.policy import PolicyTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_noise_tables import (  # noqa: E402
    POS_BUCKETS,
    PROB_BUCKETS,
    TOLERANCE,
    print_buckets,
    print_counts,
    print_neighbours,
    print_pairs,
    print_worst,
)
from pinned_engine import PinnedEngine, start_pinned_engine  # noqa: E402

Pair = tuple[list[int], list[int]]
T = TypeVar("T")
ENGINE_DTYPES = ("float32", "bfloat16")
WORDS = ("a", "b", "x", "yes", "no", "cat", "dog", "hello", "one two", "ok", "42", "zz")
ZMAX_BUCKETS = (("|z|<4", 0.0, 4.0), ("4-8", 4.0, 8.0), ("8-16", 8.0, 16.0), (">=16", 16.0, 1e30))

for _var in ("no_proxy", "NO_PROXY"):  # engines listen on loopback; no proxy may see them
    os.environ[_var] = ",".join(x for x in ("127.0.0.1", "localhost", os.environ.get(_var, "")) if x)


# ---- models --------------------------------------------------------------------------------

def _toy_batch(rng: random.Random, tok: ByteTokenizer, groups: int, n: int) -> tuple[list[Pair], list[float]]:
    """GRPO groups of a toy task: 'Say w: ' answered by w repeated (reward 1) or by random
    printable bytes (reward 0); advantages are the job's group-normalised ones."""
    pairs: list[Pair] = []
    rewards: list[float] = []
    for _ in range(groups):
        word = rng.choice(WORDS)
        prompt = tok.encode(f"Say {word}: ")
        for j in range(n):
            length = rng.randint(16, 48)
            if j % 2 == 0:
                text = ((word + " ") * 64)[:length]
                rewards.append(1.0)
            else:
                text = "".join(chr(rng.randint(32, 126)) for _ in range(length))
                rewards.append(0.0)
            pairs.append((prompt, tok.encode(text)))
    return pairs, group_advantages(rewards, n)


def make_models(tmp: Path, which: Sequence[str], train_steps: int) -> dict[str, Path]:
    """The tiny model as initialised ('init') and after `train_steps` real GRPO steps at lr
    2e-3 on the toy task ('trained'): a peaked policy whose sampled tokens span p ~ 1e-3..1,
    as in a real run, where the untrained model's are all p ~ 1/259."""
    init = make_tiny_model(tmp / "init", seed=0)
    out = {"init": init}
    if "trained" in which:
        trainer = PolicyTrainer(init, lr=2e-3, seed=0)
        rng = random.Random(0)
        tok = ByteTokenizer()
        for _ in range(train_steps):
            pairs, adv = _toy_batch(rng, tok, groups=4, n=8)
            trainer.train_step(pairs, adv)
        extra = {f.name: f.read_text() for f in init.iterdir() if f.suffix != ".safetensors"}
        out["trained"] = save_state_dict_atomic(trainer.model.hf_state_dict(), tmp / "trained",
                                                extra_files=extra)
    return {k: v for k, v in out.items() if k in which}


# ---- the engine ----------------------------------------------------------------------------

def start_engine(model_dir: Path, dtype: str, cpu: int, log: Path) -> PinnedEngine:
    """The engine at `--dtype dtype` on one core, one torch thread, seeded sampling."""
    return start_pinned_engine(model_dir, cpu, log, "--dtype", dtype,
                               "--max-running-requests", "64", "--random-seed", "0")


async def _post_all(url: str, bodies: list[dict], concurrency: int) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def one(body: dict) -> dict:
            async with limit, session.post(f"{url}/generate", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/generate: HTTP {resp.status}: {(await resp.text())[:300]}")
                return await resp.json(content_type=None)
        return list(await asyncio.gather(*[one(b) for b in bodies]))


def generate(url: str, prompts: list[list[int]], lengths: list[int], seeds: list[int],
             concurrency: int) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """The rollout's /generate (return_logprob): outputs, their logprobs, cached_tokens."""
    bodies = [{"input_ids": p, "return_logprob": True,
               "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True,
                                   "sampling_seed": s}}
              for p, n, s in zip(prompts, lengths, seeds, strict=True)]
    outs = asyncio.run(_post_all(url, bodies, concurrency))
    ids = [o["output_ids"] for o in outs]
    lps = [[float(lp) for lp, _tok, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return ids, lps, [int(o["meta_info"].get("cached_tokens", 0)) for o in outs]


def score(url: str, pairs: list[Pair], concurrency: int) -> tuple[list[list[float]], list[int]]:
    """Prompt logprobs of each output (scoring.py's request): logprobs, cached_tokens."""
    bodies = [{"input_ids": p + o, "return_logprob": True, "logprob_start_len": len(p),
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}} for p, o in pairs]
    outs = asyncio.run(_post_all(url, bodies, concurrency))
    lps = []
    for (_p, o), out in zip(pairs, outs, strict=True):
        window = out["meta_info"]["input_token_logprobs"]
        lps.append([float(lp) for lp, _tok, *_ in window][-len(o):])
    return lps, [int(o["meta_info"].get("cached_tokens", 0)) for o in outs]


# ---- one run: an engine dtype's samples scored every way ---------------------------------

@dataclass
class Run:
    """Samples of one (model, engine dtype) and every source's logprobs, flattened per token."""

    model: str
    engine_dtype: str
    pairs: list[Pair]
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, int))   # sample index
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, int))      # output position
    token: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    zmax: np.ndarray = field(default_factory=lambda: np.zeros(0))      # max |logit| there
    entropy: np.ndarray = field(default_factory=lambda: np.zeros(0))
    wnorm: np.ndarray = field(default_factory=lambda: np.zeros(0))    # its lm_head row norm
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    cached: dict[str, list[int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def index(self) -> None:
        self.sample = np.array([i for i, (_p, o) in enumerate(self.pairs) for _ in o])
        self.pos = np.array([t for _p, o in self.pairs for t in range(len(o))])
        self.token = np.array([x for _p, o in self.pairs for x in o])

    def add(self, name: str, per_sample: Sequence[Sequence[float] | None]) -> None:
        """Flatten one source; a sample it lacks (None) is NaN."""
        flat = []
        for (_p, o), lp in zip(self.pairs, per_sample, strict=True):
            if lp is None:
                flat.extend([float("nan")] * len(o))
            else:
                if len(lp) != len(o):
                    raise RuntimeError(f"{name}: {len(lp)} logprobs for {len(o)} tokens")
                flat.extend(lp)
        self.sources[name] = np.array(flat, dtype=np.float64)


def timed(run: Run, key: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    out = fn()
    run.seconds[key] = round(time.perf_counter() - t0, 2)
    return out


def engine_run(model: str, model_dir: Path, dtype: str, n: int, single: int, cpu: int,
               tmp: Path, seed: int) -> Run:
    """Generate N samples on a fresh engine, then score them through its prefill path."""
    rng = random.Random(seed)
    tok = ByteTokenizer()
    prompts = [tok.encode(f"Say {rng.choice(WORDS)}: ") for _ in range(n)]
    lengths = [rng.randint(16, 64) for _ in range(n)]
    seeds = [rng.randrange(1 << 31) for _ in range(n)]
    engine = start_engine(model_dir, dtype, cpu, tmp / f"engine-{model}-{dtype}.log")
    try:
        t0 = time.perf_counter()
        outs, dec, dec_cached = generate(engine.url, prompts, lengths, seeds, 64)
        gen_s = time.perf_counter() - t0
        run = Run(model, dtype, [(p, o) for p, o in zip(prompts, outs, strict=True)])
        run.index()
        run.seconds["generate"] = round(gen_s, 2)
        run.add("engine/decode", dec)
        run.cached["engine/decode"] = dec_cached
        warm, warm_cached = timed(run, "prefill-warm", lambda: score(engine.url, run.pairs, 64))
        run.add("engine/prefill-warm", warm)
        run.cached["engine/prefill-warm"] = warm_cached
        ok = requests.post(engine.url + "/flush_cache", timeout=30)
        if ok.status_code != 200:
            raise RuntimeError(f"/flush_cache: {ok.status_code} {ok.text[:200]}")
        cold, cold_cached = timed(run, "prefill-flushed", lambda: score(engine.url, run.pairs, 64))
        run.add("engine/prefill-flushed", cold)
        run.cached["engine/prefill-flushed"] = cold_cached
        # Decode batch of 1: the first `single` samples again, one at a time, same seeds.
        k = min(single, n)
        outs1, dec1, _ = timed(run, "decode-b1", lambda: generate(
            engine.url, prompts[:k], lengths[:k], seeds[:k], 1))
        same = [o1 == o for o1, o in zip(outs1, outs[:k], strict=True)]
        run.add("engine/decode-b1", [lp if s else None for lp, s in zip(dec1, same, strict=True)]
                + [None] * (n - k))
        run.seconds["decode-b1-identical-samples"] = sum(same)
    finally:
        engine.stop()
    return run


@torch.no_grad()
def logit_stats(run: Run, model: torch.nn.Module) -> None:
    """Per token, from the trainer's fp32 logits of the distribution it was drawn from: the
    largest |logit| (fp32 rounding error grows with the logits' scale) and the entropy."""
    batch = pack(run.pairs, [0.0] * len(run.pairs))
    logits = model(batch.input_ids).float()
    zmax, ent = [], []
    for i, (p, o) in enumerate(run.pairs):
        rows = logits[i, len(p) - 1: len(p) - 1 + len(o)]
        lp = torch.log_softmax(rows, dim=-1)
        zmax.extend(rows.abs().amax(-1).tolist())
        ent.extend((-(lp.exp() * lp).sum(-1)).tolist())
    run.zmax, run.entropy = np.array(zmax), np.array(ent)
    # The sampled token's lm_head row norm: a logit's rounding error is ~ its row's norm
    # times the hidden state's error.
    run.wnorm = model.lm_head.weight.float().norm(dim=1).numpy()[run.token]


def trainer_sources(run: Run, trainer: PolicyTrainer) -> None:
    """The trainer's recomputation in fp32 and bf16, the whole batch padded and per sample."""
    bf16 = copy.deepcopy(trainer.model).to(torch.bfloat16)
    for name, model in (("fp32", None), ("bf16", bf16)):
        batched = timed(run, f"trainer-{name}-batched",
                        lambda m=model: trainer.completion_logprobs(run.pairs, m))
        run.add(f"trainer/{name}/batched", batched)
        single = timed(run, f"trainer-{name}-single",
                       lambda m=model: [trainer.completion_logprobs([p], m)[0] for p in run.pairs])
        run.add(f"trainer/{name}/single", single)


# ---- statistics ----------------------------------------------------------------------------

def quantiles(x: np.ndarray) -> dict[str, float | int]:
    """median / p99 / p99.9 / max of |x| (NaNs dropped)."""
    x = np.abs(x[~np.isnan(x)])
    if not x.size:
        return {"n": 0}
    return {"n": int(x.size), "median": float(np.median(x)), "p99": float(np.quantile(x, 0.99)),
            "p999": float(np.quantile(x, 0.999)), "max": float(x.max())}


def compare(run: Run, a: str, b: str, prob: np.ndarray) -> dict:
    """|a - b| per token: quantiles, worst tokens, and by probability / position / cache hit."""
    d = run.sources[a] - run.sources[b]
    ok = ~np.isnan(d)
    worst = np.argsort(-np.where(ok, np.abs(d), -1.0))[:5]
    plen = np.array([len(run.pairs[s][0]) for s in run.sample])
    row: dict = {"kind": "pair", "model": run.model, "engine_dtype": run.engine_dtype,
                 "a": a, "b": b, **quantiles(d)}
    row["worst"] = [{"sample": int(run.sample[i]), "out_pos": int(run.pos[i]),
                     "abs_pos": int(plen[i] + run.pos[i]), "token": int(run.token[i]),
                     "a_lp": float(run.sources[a][i]), "b_lp": float(run.sources[b][i]),
                     "p": float(prob[i]), "zmax": float(run.zmax[i]),
                     "entropy": float(run.entropy[i]), "lm_head_row_norm": float(run.wnorm[i]),
                     "absdiff": float(abs(d[i]))}
                    for i in worst if ok[i]]
    row["by_prob"] = {name: quantiles(d[(prob >= lo) & (prob < hi)]) for name, lo, hi in PROB_BUCKETS}
    row["by_pos"] = {name: quantiles(d[(run.pos >= lo) & (run.pos < hi)]) for name, lo, hi in POS_BUCKETS}
    row["by_zmax"] = {name: quantiles(d[(run.zmax >= lo) & (run.zmax < hi)])
                      for name, lo, hi in ZMAX_BUCKETS}
    cached = run.cached.get(a)
    if cached is not None:
        hit = np.array([cached[s] > 0 for s in run.sample])
        row["by_cache"] = {"hit": quantiles(d[hit]), "miss": quantiles(d[~hit])}
    row["above_tolerance"] = int((np.abs(d[ok]) > TOLERANCE).sum())
    return row


def pairs_of(run: Run) -> list[tuple[str, str]]:
    """Every engine path against every trainer variant, plus each side against itself."""
    engines = ["engine/decode", "engine/decode-b1", "engine/prefill-warm", "engine/prefill-flushed"]
    trainers = ["trainer/fp32/batched", "trainer/fp32/single", "trainer/bf16/batched",
                "trainer/bf16/single"]
    out = [(e, t) for e in engines for t in trainers]
    out += [("engine/decode", "engine/prefill-flushed"), ("engine/decode-b1", "engine/decode"),
            ("engine/prefill-warm", "engine/prefill-flushed"),
            ("trainer/fp32/single", "trainer/fp32/batched"),
            ("trainer/bf16/single", "trainer/bf16/batched")]
    return out


def neighbours(run: Run, model_dir: Path, lrs: Sequence[float], seed: int,
               step_batch: int) -> list[dict]:
    """One AdamW step at each lr from the same weights (trained on the first `step_batch`
    samples, a rollout batch): how far every token's logprob moves, next to the fp32 noise,
    and what the job's check sees with an engine one version behind."""
    rng = np.random.default_rng(seed)
    adv = rng.standard_normal(len(run.pairs)).tolist()
    k = min(step_batch, len(run.pairs))
    v0 = run.sources["trainer/fp32/batched"]
    eng = run.sources["engine/decode"]
    noise = eng - v0
    rows = [{"kind": "neighbour", "model": run.model, "lr": 0.0, "what": "fp32 noise: engine/decode - trainer/fp32/batched",
             "median": float(np.median(np.abs(noise))), "p99": float(np.quantile(np.abs(noise), 0.99)),
             "mean": float(np.abs(noise).mean()), "l2": float(np.linalg.norm(noise)),
             "max": float(np.abs(noise).max())}]
    for lr in lrs:
        trainer = PolicyTrainer(model_dir, lr=lr, seed=0)
        metrics = trainer.train_step(run.pairs[:k], adv[:k])
        run_v1 = Run(run.model, run.engine_dtype, run.pairs)
        run_v1.add("v1", trainer.completion_logprobs(run.pairs))
        delta = run_v1.sources["v1"] - v0
        stale = eng - run_v1.sources["v1"]
        rows.append({"kind": "neighbour", "model": run.model, "lr": lr,
                     "what": "trainer/fp32 v1 - v0 (one AdamW step)",
                     "median": float(np.median(np.abs(delta))),
                     "p99": float(np.quantile(np.abs(delta), 0.99)),
                     "mean": float(np.abs(delta).mean()), "l2": float(np.linalg.norm(delta)),
                     "max": float(np.abs(delta).max()),
                     "stale_engine_max": float(np.abs(stale).max()),
                     "stale_engine_p99": float(np.quantile(np.abs(stale), 0.99)),
                     "stale_engine_l2": float(np.linalg.norm(stale)),
                     "grad_norm": metrics["grad_norm"]})
    return rows


# ---- main ----------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512, help="sampled requests per engine run")
    ap.add_argument("--step-batch", type=int, default=256,
                    help="samples the neighbour-version train step trains on")
    ap.add_argument("--single", type=int, default=32,
                    help="samples regenerated one at a time (decode batch 1)")
    ap.add_argument("--models", default="init,trained", help="comma list of init,trained")
    ap.add_argument("--train-steps", type=int, default=50, help="GRPO steps making 'trained'")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-6, 1e-7, 1e-8])
    ap.add_argument("--cpu", type=int, default=None, help="core for the engine (default: the last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path,
                    default=REPO / "benchmarks" / "results" / "logprob-noise-cpu.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    which = [m for m in a.models.split(",") if m]
    t_start = time.perf_counter()
    pair_rows: list[dict] = []
    neighbour_rows: list[dict] = []
    info_rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="logprob-noise-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        models = make_models(tmp, which, a.train_steps)
        print(f"models ready in {time.perf_counter() - t0:.1f}s: {list(models)}")
        for model, model_dir in models.items():
            trainer = PolicyTrainer(model_dir, seed=0)
            for dtype in ENGINE_DTYPES:
                run = engine_run(model, model_dir, dtype, a.n, a.single, cpu, tmp, a.seed)
                trainer_sources(run, trainer)
                logit_stats(run, trainer.model)
                prob = np.exp(run.sources["trainer/fp32/batched"])
                print_counts(run, prob)
                rows = [compare(run, x, y, prob) for x, y in pairs_of(run)]
                pair_rows += rows
                info_rows.append({"kind": "run", "model": model, "engine_dtype": dtype,
                                  "samples": len(run.pairs), "tokens": int(prob.size),
                                  "seconds": run.seconds,
                                  "prob_counts": {b[0]: int(((prob >= b[1]) & (prob < b[2])).sum())
                                                  for b in PROB_BUCKETS},
                                  "cache_hits": {k: sum(c > 0 for c in v) for k, v in run.cached.items()},
                                  "mean_logprob": float(run.sources["trainer/fp32/batched"].mean())})
                if dtype == "float32":
                    t0 = time.perf_counter()
                    neighbour_rows += neighbours(run, model_dir, a.lrs, a.seed, a.step_batch)
                    info_rows[-1]["seconds"]["neighbours"] = round(time.perf_counter() - t0, 2)
    wall = time.perf_counter() - t_start
    print_pairs(pair_rows)
    print_buckets(pair_rows)
    print_worst([r for r in pair_rows if r["b"].endswith("batched") and r["a"].startswith("engine/")
                 and (r["engine_dtype"] == "float32") == ("/fp32/" in r["b"])
                 and r["a"] in ("engine/decode", "engine/prefill-flushed")])
    print_neighbours(neighbour_rows)
    print(f"\nwall {wall:.0f}s, torch {torch.__version__}, {os.cpu_count()} cpus")
    header = {"kind": "config", "n": a.n, "single": a.single, "step_batch": a.step_batch, "models": which,
              "train_steps": a.train_steps, "lrs": a.lrs, "torch": torch.__version__,
              "cpus": os.cpu_count(), "wall_s": round(wall, 1), "tolerance": TOLERANCE,
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    a.json_out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.json_out, "w") as f:
        for row in [header, *info_rows, *pair_rows, *neighbour_rows]:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
