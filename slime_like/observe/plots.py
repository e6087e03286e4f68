"""The report's PNG plots; engine deaths and recoveries drawn where they happened.

Events carry wall-clock offsets and steps carry the offset at which they ended, so an
event's position on a per-step axis is interpolated between the two steps around it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slime_like.fleet.events import EngineState, is_engine, kind_of
from slime_like.observe.fleet_view import LIST_ENGINES_UP_TO
from slime_like.observe.incidents import Incident

S = EngineState
STATE_COLORS = {S.REGISTERED: "tab:green", S.UPDATING: "tab:blue", S.DEAD: "tab:red",
                S.RELAUNCHING: "tab:orange", S.STALE: "tab:olive", S.LAUNCHING: "tab:gray",
                S.LOADED: "tab:cyan", S.OFFLOADED: "tab:pink", S.REATTACHING: "tab:brown",
                S.DRAINING: "tab:purple"}
SERIES = (("reward_mean", "reward", "reward.png"), ("sync_s", "weight sync (s)", "weight_sync.png"))


def step_position(t: float, steps: list[dict]) -> float:
    """Where time `t` falls on the step axis (fractional: between two step ends)."""
    return float(np.interp(t, [r["time_s"] for r in steps], [r["step"] for r in steps]))


def _mark_incidents(ax, steps: list[dict], incidents: list[Incident]) -> None:
    for n, i in enumerate(incidents):
        ax.axvline(step_position(i.died_at, steps), color="tab:red", ls="--", lw=1,
                   label="engine death" if n == 0 else None)
        if i.recovered_at is not None:
            ax.axvline(step_position(i.recovered_at, steps), color="tab:green", ls=":", lw=1.2,
                       label="recovered" if n == 0 else None)
    if incidents:
        ax.legend(fontsize=7, loc="best")


def plot_run(out_dir: Path, steps: list[dict], events: list[dict],
             incidents: list[Incident], utilization: dict[str, list[dict]] | None = None
             ) -> list[tuple[str, str]]:
    """Write the plots into `out_dir`; (label, file name) of each written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    for key, label, name in SERIES:
        rows = [r for r in steps if key in r]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", ms=3)
        _mark_incidents(ax, steps, incidents)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        figures.append((label, name))
    if events:
        figures.append(("engine timeline", _plot_timeline(out_dir, events, plt)))
    if utilization and (utilization.get("engine") or utilization.get("trainer")):
        from slime_like.observe.utilization_plot import plot_utilization

        figures.append(("engine and trainer busy/idle, syncs marked",
                        plot_utilization(out_dir, utilization, plt)))
    return figures


# Up to LIST_ENGINES_UP_TO engines the timeline has a row per engine; a larger fleet gets a
# line per state (how many engines are in it over time): 64 rows would be unreadable.
ROWS_PER_ENGINE_UP_TO = LIST_ENGINES_UP_TO


def _plot_timeline(out_dir: Path, events: list[dict], plt) -> str:
    engines = sorted({e["engine"] for e in events if is_engine(str(e["engine"]))})
    if len(engines) > ROWS_PER_ENGINE_UP_TO:
        return _plot_state_counts(out_dir, [e for e in events if e["engine"] in engines],
                                  len(engines), plt)
    engines = sorted({e["engine"] for e in events})
    end = max(e["time_s"] for e in events) + 1.0
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(engines)))
    for row, engine in enumerate(engines):
        mine = [e for e in events if e["engine"] == engine]
        for cur, nxt in zip(mine, mine[1:] + [None], strict=True):
            stop = nxt["time_s"] if nxt else end
            ax.barh(row, stop - cur["time_s"], left=cur["time_s"], edgecolor="none",
                    color=STATE_COLORS.get(kind_of(cur["state"], engine), "tab:purple"))
    ax.set_yticks(range(len(engines)), engines)
    ax.set_xlabel("time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLORS.values()]
    ax.legend(handles, [s.value for s in STATE_COLORS], fontsize=6, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(out_dir / "engine_timeline.png", dpi=110)
    plt.close(fig)
    return "engine_timeline.png"


def _plot_state_counts(out_dir: Path, events: list[dict], fleet_size: int, plt) -> str:
    """Engines per state over time (a line per state that ever held one)."""
    state: dict[str, str] = {}
    times: list[float] = []
    counts: dict[str, list[int]] = {}
    for e in sorted(events, key=lambda e: e["time_s"]):
        kind = kind_of(e["state"], e["engine"])
        if not isinstance(kind, EngineState):
            continue  # a happening: no state left or entered
        state[e["engine"]] = kind.value
        times.append(e["time_s"])
        now = {s: 0 for s in counts}
        for value in state.values():
            now[value] = now.get(value, 0) + 1
        for s, n in now.items():
            counts.setdefault(s, [0] * (len(times) - 1)).append(n)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for s, series in counts.items():
        ax.step(times, series, where="post", label=s, lw=1.4,
                color=STATE_COLORS.get(EngineState(s), "tab:purple"))
    ax.set_ylim(0, fleet_size + 0.5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"engines (of {fleet_size})")
    ax.legend(fontsize=6, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "engine_timeline.png", dpi=110)
    plt.close(fig)
    return "engine_timeline.png"
