"""The per-step metrics of the asynchronous schedules, and how each backend shows them.

The job puts these keys into each step's metrics (any may be missing; the `sync`
schedule has none of the sample counts):

- `async_mode`: `sync`, `one-step` or `fully-async`;
- `samples_per_s`: samples trained this step / the step's wall time;
- `engine_idle_ratio`, `trainer_idle_ratio`: over the step (`utilization.RunUtilization`);
- `staleness`: histogram {age in versions: samples}, age = the version being trained minus
  the sample's oldest span version;
- `samples_partial`, `samples_resubmitted`, `samples_dropped_stale`, `samples_filtered`:
  this step's counts (not running totals).

metrics.jsonl keeps the histogram as a JSON object (its keys become strings); scalar
backends get `staleness_mean`, `staleness_max` and `staleness_samples` in its place.
"""

from __future__ import annotations

from collections import Counter as _Counter
from collections.abc import Iterable, Mapping
from typing import Any

STALENESS = "staleness"
COUNTS = ("samples_partial", "samples_resubmitted", "samples_dropped_stale", "samples_filtered")
RATIOS = ("engine_idle_ratio", "trainer_idle_ratio")
ASYNC_KEYS = (STALENESS, "samples_per_s", "async_mode", *RATIOS, *COUNTS)


def staleness_histogram(trained_version: int, oldest_versions: Iterable[int]) -> dict[int, int]:
    """{age: samples} for samples whose oldest span is at `oldest_versions`, trained at
    `trained_version` (ages sorted; never negative)."""
    ages = _Counter(max(0, int(trained_version) - int(v)) for v in oldest_versions)
    return dict(sorted(ages.items()))


def as_histogram(value: Any) -> dict[int, int]:
    """A staleness histogram as logged or read back from JSON (string keys); {} if not one."""
    if not isinstance(value, Mapping):
        return {}
    out: dict[int, int] = {}
    for age, count in value.items():
        try:
            out[int(age)] = out.get(int(age), 0) + int(count)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items()))


def merge_histograms(hists: Iterable[Any]) -> dict[int, int]:
    """The sum of several steps' histograms."""
    total: _Counter = _Counter()
    for h in hists:
        total.update(as_histogram(h))
    return dict(sorted(total.items()))


def histogram_stats(hist: Mapping[int, int]) -> dict[str, float]:
    """`staleness_mean`, `staleness_max`, `staleness_samples` of a histogram ({} if empty)."""
    n = sum(hist.values())
    if n <= 0:
        return {}
    return {"staleness_mean": round(sum(a * c for a, c in hist.items()) / n, 4),
            "staleness_max": float(max(a for a, c in hist.items() if c > 0)),
            "staleness_samples": float(n)}


def for_scalar_backends(metrics: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics with the staleness histogram replaced by its scalars."""
    if STALENESS not in metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if k != STALENESS}
    out.update(histogram_stats(as_histogram(metrics[STALENESS])))
    return out


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _time_weighted(steps: list[dict], key: str) -> float | None:
    """Mean of a per-step rate, each step weighted by its wall time (from `time_s`)."""
    total = weight = 0.0
    prev = None
    for row in steps:
        t = row.get("time_s")
        value = row.get(key)
        if prev is not None and isinstance(value, int | float) and t is not None and t > prev:
            total += value * (t - prev)
            weight += t - prev
        prev = t if t is not None else prev
    if weight > 0:
        return total / weight
    values = [r[key] for r in steps if isinstance(r.get(key), int | float)]
    return sum(values) / len(values) if values else None


def has_async_metrics(steps: list[dict]) -> bool:
    """Whether any step carries these metrics (a `sync` run of the same job may too, so
    the two compare)."""
    return any(k in r for r in steps for k in ASYNC_KEYS)


def summary_lines(steps: list[dict], run_ratios: Mapping[str, float | None] | None = None
                  ) -> list[str]:
    """The report's bullets for a run with these metrics ([] for one without them).

    `run_ratios` are the idle ratios over the whole run from utilization.jsonl; without
    them each is the per-step ratios weighted by step time.
    """
    if not has_async_metrics(steps) and not any(v is not None for v in (run_ratios or {}).values()):
        return []
    modes = sorted({str(r["async_mode"]) for r in steps if r.get("async_mode")})
    lines = [f"- schedule: {', '.join(modes) or 'not recorded'}"]
    rate = _time_weighted(steps, "samples_per_s")
    if rate is not None:
        lines.append(f"- samples/s: {rate:.4g} (steps weighted by their wall time)")
    ratios = dict(run_ratios or {})
    for key in RATIOS:
        if ratios.get(key) is None:
            ratios[key] = _time_weighted(steps, key)
    if any(v is not None for v in ratios.values()):
        lines.append(f"- idle over the run: engines {_fmt_ratio(ratios['engine_idle_ratio'])} "
                     f"(no request running), trainer {_fmt_ratio(ratios['trainer_idle_ratio'])}")
    hist = merge_histograms(r.get(STALENESS) for r in steps)
    stats = histogram_stats(hist)
    if stats:
        lines.append(f"- staleness (versions behind the trained one): max "
                     f"{stats['staleness_max']:.0f}, mean {stats['staleness_mean']:.3g} over "
                     f"{stats['staleness_samples']:.0f} samples; by age "
                     + ", ".join(f"{a}: {c}" for a, c in hist.items()))
    totals = {k: sum(int(r.get(k) or 0) for r in steps) for k in COUNTS}
    if any(k in r for r in steps for k in COUNTS):
        lines.append(f"- samples partial {totals['samples_partial']}, resubmitted "
                     f"{totals['samples_resubmitted']}, dropped as stale "
                     f"{totals['samples_dropped_stale']}, filtered "
                     f"{totals['samples_filtered']}")
    return lines
