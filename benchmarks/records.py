"""What every benchmark does with its results: latency summaries, one JSON line printed per
record and appended to the `--json-out` file (rows accumulate across runs and machines)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable


def latency_ms(seconds: list[float], digits: int = 4) -> dict:
    """Median and p90 of call times, in milliseconds."""
    xs = sorted(seconds)
    return {"median_ms": round(statistics.median(xs) * 1e3, digits),
            "p90_ms": round(xs[int(len(xs) * 0.9)] * 1e3, digits)}


def append_rows(path: str | None, rows: Iterable[dict]) -> None:
    """Append each row as a JSON line to `path` (nothing without one)."""
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def emit(record: dict, path: str | None) -> str:
    """Print `record` as one JSON line and append it to `path`; the line."""
    line = json.dumps(record)
    print(line, flush=True)
    append_rows(path, [record])
    return line
