"""The reference engine's own record of what it served at which weight version.

One JSON line per request a client got an answer to (health checks and the engine's own
probes are not served): its id, the wall-clock time it finished, the weight version the
engine held then, how it finished and how many tokens it made. Append-only; the scheduler
buffers a step's lines and writes them with one `write` and one `flush` after the step,
so a SIGKILL loses at most the step in progress and the hot path pays a list append.

The job's fleet names the file (`<engine label>.served.jsonl` next to the engine's log)
through SERVED_LOG_ENV: it is not an sglang flag, and the engine accepts exactly sglang's
argv. Readers: `read_served` here, the chaos run's check (`chaos/served.py`) and the
partition tests, which compare each line with the fleet's version at its time.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path

SERVED_LOG_ENV = "SLIME_LIKE_REFERENCE_SERVED_LOG"
# json's own C string quoting: a line costs a few string formats, not a json.dumps of a dict
_quote = encode_basestring_ascii


@dataclass(frozen=True)
class Served:
    """One line of a served log."""

    rid: str
    time: float  # time.time() at the finish
    version: str  # the engine's weight version at the finish
    finish: str  # stop | length | abort
    tokens: int


class ServedLog:
    """Appends what the engine served to a JSONL file; only the scheduler thread writes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the engine's life
        self._pending: list[tuple[str, float, str, str, int]] = []

    @classmethod
    def from_env(cls) -> ServedLog | None:
        """The log SERVED_LOG_ENV names, or None when it is unset."""
        path = os.environ.get(SERVED_LOG_ENV, "").strip()
        return cls(path) if path else None

    def record(self, rid: str, version: str, finish: str, tokens: int) -> None:
        """Note one finished request (written at the next `flush`)."""
        self._pending.append((rid, time.time(), version, finish, tokens))

    def flush(self) -> None:
        """Write and flush the noted lines (nothing to do when none)."""
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        self._file.write("".join(
            f'{{"rid": {_quote(rid)}, "time": {t:.4f}, "version": {_quote(v)}, '
            f'"finish": {_quote(f)}, "tokens": {n}}}\n' for rid, t, v, f, n in lines))
        self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def read_served(path: str | Path) -> list[Served]:
    """Every complete line of a served log (a line cut by a kill is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append(Served(d["rid"], float(d["time"]), str(d["version"]), d["finish"],
                          int(d["tokens"])))
    return out
