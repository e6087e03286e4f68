"""The printed tables of benchmarks/logprob_noise.py (its measurements stay there)."""

from __future__ import annotations

from typing import Any

import numpy as np

PROB_BUCKETS = (("p>0.5", 0.5, 1.01), ("0.1-0.5", 0.1, 0.5), ("0.01-0.1", 0.01, 0.1),
                ("<0.01", 0.0, 0.01))
POS_BUCKETS = (("0", 0, 1), ("1-7", 1, 8), ("8-31", 8, 32), ("32-63", 32, 64))
TOLERANCE = 1e-4  # the job's --logprob-check-tolerance default


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


def _f(x: float | None) -> str:
    return "      -" if x is None else f"{x:8.2e}"


def print_pairs(rows: list[dict]) -> None:
    print(f"\n{'model':>7} {'eng':>4} {'engine path':<24} {'vs':<22} {'n':>6} {'median':>8} "
          f"{'p99':>8} {'p99.9':>8} {'max':>8} {'>1e-4':>5}")
    for r in rows:
        print(f"{r['model']:>7} {_short(r['engine_dtype']):>4} {r['a']:<24} {r['b']:<22} {r['n']:>6} "
              f"{_f(r.get('median'))} {_f(r.get('p99'))} {_f(r.get('p999'))} {_f(r.get('max'))} "
              f"{r['above_tolerance']:>5}")


def print_buckets(rows: list[dict]) -> None:
    head = " ".join(f"{b[0]:>17}" for b in PROB_BUCKETS) + " | " + " ".join(
        f"{b[0]:>17}" for b in POS_BUCKETS)
    print("\n|diff| p99/max by token probability (trainer fp32) | by output position")
    print(f"{'model':>7} {'eng':>4} {'pair':<48} {head}")
    for r in rows:
        cells = []
        for group in ("by_prob", "by_pos"):
            for q in r[group].values():
                cells.append(f"{'-':>17}" if not q["n"] else f"{q['p99']:8.1e}/{q['max']:8.1e}")
        pair = f"{r['a'].removeprefix('engine/')} ~ {r['b'].removeprefix('trainer/')}"
        print(f"{r['model']:>7} {_short(r['engine_dtype']):>4} {pair:<48} {cells[0]} {' '.join(cells[1:4])}"
              f" | {' '.join(cells[4:])}")


def print_counts(run: Any, prob: np.ndarray) -> None:
    counts = [int(((prob >= lo) & (prob < hi)).sum()) for _n, lo, hi in PROB_BUCKETS]
    pos = [int(((run.pos >= lo) & (run.pos < hi)).sum()) for _n, lo, hi in POS_BUCKETS]
    cache = {k: f"{sum(c > 0 for c in v)}/{len(v)}" for k, v in run.cached.items()}
    print(f"{run.model} / engine {run.engine_dtype}: {len(run.pairs)} samples, {prob.size} tokens; "
          f"by prob {dict(zip([b[0] for b in PROB_BUCKETS], counts, strict=True))}; by pos "
          f"{dict(zip([b[0] for b in POS_BUCKETS], pos, strict=True))}; requests with a cache hit "
          f"{cache}; seconds {run.seconds}")


def print_worst(rows: list[dict]) -> None:
    print("\n5 worst tokens (engine path vs trainer of the same dtype, batched)")
    for r in rows:
        print(f"  {r['model']} engine {r['engine_dtype']} {r['a']} vs {r['b']}:")
        for w in r["worst"]:
            print(f"    |d|={w['absdiff']:.2e} sample {w['sample']:>4} out_pos {w['out_pos']:>2} "
                  f"abs_pos {w['abs_pos']:>2} token {w['token']:>3} engine {w['a_lp']:+.7f} "
                  f"trainer {w['b_lp']:+.7f} p={w['p']:.3g} max|z|={w['zmax']:.1f} "
                  f"H={w['entropy']:.2f} |w_tok|={w['lm_head_row_norm']:.2f}")


def print_neighbours(rows: list[dict]) -> None:
    print(f"\nneighbour versions (fp32 trainer, one AdamW step) vs fp32 noise; check tolerance "
          f"{TOLERANCE:g}")
    print(f"{'model':>7} {'lr':>8} {'median':>8} {'p99':>8} {'mean':>8} {'L2':>8} {'max':>8} "
          f"| {'stale max':>9} {'stale p99':>9} {'stale L2':>9} {'flagged':>7}")
    for r in rows:
        stale = (f"{r['stale_engine_max']:9.2e} {r['stale_engine_p99']:9.2e} "
                 f"{r['stale_engine_l2']:9.2e} {str(r['stale_engine_max'] > TOLERANCE):>7}"
                 if "stale_engine_max" in r else f"{'(noise row)':>39}")
        lr = f"{r['lr']:8.0e}" if r["lr"] else f"{'noise':>8}"
        print(f"{r['model']:>7} {lr} {r['median']:8.2e} {r['p99']:8.2e} {r['mean']:8.2e} "
              f"{r['l2']:8.2e} {r['max']:8.2e} | {stale}")
