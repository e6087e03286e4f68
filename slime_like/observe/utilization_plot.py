"""utilization.png: one row per engine (busy / idle / paused / down over time), one row
for the trainer's busy phases, and each weight sync as a shaded band across all rows."""

from __future__ import annotations

from pathlib import Path

from slime_like.observe.utilization import BUSY, DOWN, IDLE, PAUSED

ENGINE_COLORS = {BUSY: "tab:green", IDLE: "lightgray", PAUSED: "tab:orange", DOWN: "tab:red"}
TRAINER_ROW = "trainer"
PHASE_COLORS = ("tab:blue", "tab:purple", "tab:cyan", "tab:brown", "tab:olive", "tab:pink")


def _bars(rows: list[dict]) -> list[tuple[float, float]]:
    return [(r["start_s"], r["end_s"] - r["start_s"]) for r in rows if r["end_s"] > r["start_s"]]


def plot_utilization(out_dir: Path, rows: dict[str, list[dict]], plt) -> str:
    """Draw utilization.png from `read_utilization`'s rows; returns the file name."""
    engines = sorted({r["subject"] for r in rows.get("engine", [])})
    trainer_rows = rows.get("trainer", [])
    labels = engines + ([TRAINER_ROW] if trainer_rows else [])
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(labels)))
    handles, names = [], []
    for y, engine in enumerate(engines):
        mine = [r for r in rows["engine"] if r["subject"] == engine]
        for state, color in ENGINE_COLORS.items():
            ax.broken_barh(_bars([r for r in mine if r["state"] == state]), (y - 0.4, 0.8),
                           facecolors=color)
    for state, color in ENGINE_COLORS.items():
        handles.append(plt.Rectangle((0, 0), 1, 1, color=color))
        names.append(f"engine {state}")
    phases = sorted({str(r["state"]) for r in trainer_rows})
    for n, phase in enumerate(phases):
        color = PHASE_COLORS[n % len(PHASE_COLORS)]
        ax.broken_barh(_bars([r for r in trainer_rows if str(r["state"]) == phase]),
                       (len(engines) - 0.4, 0.8), facecolors=color)
        handles.append(plt.Rectangle((0, 0), 1, 1, color=color))
        names.append(f"trainer {phase}")
    syncs = rows.get("sync", [])
    for s in syncs:
        ax.axvspan(s["start_s"], max(s["end_s"], s["start_s"] + 1e-3), color="black",
                   alpha=0.18, lw=0)
        ax.axvline(s["end_s"], color="black", lw=0.6, alpha=0.6)
    if syncs:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="black", alpha=0.18))
        names.append("weight sync (line: new version live)")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time since the run started (s)")
    ax.legend(handles, names, fontsize=6, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.25 - 0.3 / max(1, len(labels))), frameon=False)
    fig.tight_layout()
    name = "utilization.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name
