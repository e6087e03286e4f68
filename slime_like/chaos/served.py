"""Stale serves read from the engines' own served logs, against the fleet's versions.

Each reference engine of a job appends what it served, at which weight version, to
`logs/<engine>.served.jsonl` in the run folder (`reference_engine/served_log.py`). The
fleet's timeline records when each version became the fleet's (`VERSION` rows with their
`wall_time`). A request an engine finished at time t is stale when its version is older
than the fleet's at t: every engine a sync took along holds the new weights before the
fleet moves, so a routed engine never does this; one that was out of reach (partitioned,
hung) and came back unsynced would. Aborted requests that made no token served nothing.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

from slime_like.fleet.events import Happening
from slime_like.reference_engine.served_log import read_served

SERVED_SUFFIX = ".served.jsonl"


def fleet_versions(run_dir: Path) -> list[tuple[float, int]]:
    """(wall time, version) of each VERSION row of the run's timeline, in time order (none
    without a timeline)."""
    path = Path(run_dir) / "engine_timeline.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return sorted((float(r["wall_time"]), int(r["version"])) for r in rows
                  if r.get("engine") == "fleet" and r.get("state") == Happening.VERSION.value
                  and "wall_time" in r)


def served_logs(run_dir: Path) -> dict[str, Path]:
    """Engine log name (e.g. default-g0-e1) -> its served log."""
    return {p.name[:-len(SERVED_SUFFIX)]: p
            for p in sorted((Path(run_dir) / "logs").glob("*" + SERVED_SUFFIX))}


def stale_serves(run_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """Every request an engine finished after `since` (wall time) at a version older than
    the fleet's at that moment; [] when none was."""
    versions = fleet_versions(run_dir)
    times = [t for t, _ in versions]
    out = []
    for engine, path in served_logs(run_dir).items():
        for s in read_served(path):
            if s.time < since or (s.finish == "abort" and s.tokens == 0):
                continue
            i = bisect.bisect_right(times, s.time) - 1
            if i >= 0 and int(s.version) < versions[i][1]:
                out.append({"engine": engine, "rid": s.rid, "time": s.time,
                            "served": s.version, "fleet": versions[i][1], "finish": s.finish})
    return out
