"""The run's report folder: metrics.jsonl, engine timeline, plots and report.md."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunReport:
    """Appends metrics and engine events as they happen; renders plots and markdown at the end."""

    out_dir: Path
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.timeline_path = self.out_dir / "engine_timeline.jsonl"

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time_s": round(time.time() - self.started, 3), **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def log_event(self, engine: str, state: str, **details: Any) -> None:
        row = {"time_s": round(time.time() - self.started, 3), "engine": engine, "state": state,
               **details}
        with self.timeline_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _read(self, path: Path) -> list[dict]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def render(self, title: str = "slime_like run", notes: list[str] | None = None) -> Path:
        """Plots (PNG) and report.md from what was logged; returns the report path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = self._read(self.metrics_path)
        events = self._read(self.timeline_path)
        figures = []
        series = [("reward_mean", "reward", "reward.png"),
                  ("sync_s", "weight sync (s)", "weight_sync.png")]
        for key, label, name in series:
            xs = [r["step"] for r in steps if key in r]
            ys = [r[key] for r in steps if key in r]
            if not xs:
                continue
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot(xs, ys, marker="o", ms=3)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(self.out_dir / name, dpi=110)
            plt.close(fig)
            figures.append((label, name))
        if events:
            figures.append(("engine timeline", self._plot_timeline(events, plt)))

        lines = [f"# {title}", ""]
        if steps:
            first, last = steps[0], steps[-1]
            lines += [f"- steps: {len(steps)}, wall time {last['time_s']:.1f} s"]
            for key in ("reward_mean", "sync_s", "logprob_max_abs_diff"):
                if key in first and key in last:
                    lines.append(f"- {key}: first {first[key]:.4g}, last {last[key]:.4g}")
        for note in notes or []:
            lines.append(f"- {note}")
        lines += [""] + [f"![{label}]({name})" for label, name in figures]
        if events:
            lines += ["", "## Engine timeline", "", "| t (s) | engine | state | details |",
                      "|---|---|---|---|"]
            for e in events:
                details = {k: v for k, v in e.items() if k not in ("time_s", "engine", "state")}
                lines.append(f"| {e['time_s']:.1f} | {e['engine']} | {e['state']} | "
                             f"{json.dumps(details) if details else ''} |")
        path = self.out_dir / "report.md"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _plot_timeline(self, events: list[dict], plt) -> str:
        engines = sorted({e["engine"] for e in events})
        colors = {"REGISTERED": "tab:green", "UPDATING": "tab:blue", "DEAD": "tab:red",
                  "RELAUNCHING": "tab:orange", "STALE": "tab:olive", "LAUNCHING": "tab:gray",
                  "LOADED": "tab:cyan"}
        end = max(e["time_s"] for e in events) + 1.0
        fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(engines)))
        for row, engine in enumerate(engines):
            mine = [e for e in events if e["engine"] == engine]
            for cur, nxt in zip(mine, mine[1:] + [None], strict=True):
                stop = nxt["time_s"] if nxt else end
                ax.barh(row, stop - cur["time_s"], left=cur["time_s"],
                        color=colors.get(cur["state"], "tab:purple"), edgecolor="none")
        ax.set_yticks(range(len(engines)), engines)
        ax.set_xlabel("time (s)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, colors.keys(), fontsize=6, ncol=4, loc="upper center",
                  bbox_to_anchor=(0.5, -0.35), frameon=False)
        fig.tight_layout()
        fig.savefig(self.out_dir / "engine_timeline.png", dpi=110)
        plt.close(fig)
        return "engine_timeline.png"
