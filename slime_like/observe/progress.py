"""What the console shows while a job runs: engines coming up, step k/N with ETA, long syncs.

On a terminal it is a live rich display; anywhere else (a Ray job's log, a file, CI) it is
plain lines with no escape codes, one per event, so logs stay greppable.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from slime_like.observe.fleet_view import LIST_ENGINES_UP_TO

LONG_SYNC_S = 10.0  # a sync longer than this gets its own line in plain mode


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _route_logging_through(stream: IO[str]) -> list[tuple[logging.StreamHandler, IO[str]]]:
    """Point the loggers' console handlers at `stream`; (handler, old stream) pairs.

    While the live display runs, rich swaps sys.stderr for a proxy that prints above the
    bars; handlers made earlier (logging.basicConfig) still hold the real stream and would
    tear the display apart.
    """
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]  # ray has its own
    handlers = {id(h): h for lg in loggers for h in lg.handlers}.values()
    moved = []
    for handler in handlers:
        old = getattr(handler, "stream", None)
        # Only the terminal's own streams: a log redirected to a file stays in the file.
        if (isinstance(handler, logging.StreamHandler) and old is not stream
                and old in (sys.__stderr__, sys.__stdout__) and old.isatty()):
            moved.append((handler, handler.setStream(stream)))
    return moved


class RunProgress:
    """Launch, step and sync progress; live bars on a TTY, plain lines otherwise."""

    def __init__(self, total_steps: int, num_engines: int | None = None, *,
                 file: IO[str] | None = None, console: Console | None = None):
        self.console = console or Console(file=file or sys.stdout)
        self.live = self.console.is_terminal
        self.total_steps = total_steps
        self.num_engines = num_engines
        self._ready = 0
        self._run_started: float | None = None
        self._bars: Progress | None = None
        self._launch: TaskID | None = None
        self._steps: TaskID | None = None
        self._rerouted: list[tuple[logging.StreamHandler, IO[str]]] = []
        if self.live:
            self._bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                                  TextColumn("{task.fields[info]}"), console=self.console)
            self._bars.start()
            self._launch = self._bars.add_task("engines ready", total=num_engines, info="")
            self._rerouted = _route_logging_through(sys.stderr)

    def say(self, text: str) -> None:
        """One line for the operator, above the bars on a terminal."""
        if self._bars is not None:
            self._bars.console.print(text, markup=False, highlight=False)
        else:
            print(f"[slime_like] {text}", file=self.console.file, flush=True)

    def engine_ready(self, name: str, detail: str = "") -> None:
        """One engine is up (called engine by engine as they report LOADED)."""
        self._ready += 1
        of = f"/{self.num_engines}" if self.num_engines else ""
        if (self.num_engines or 0) <= LIST_ENGINES_UP_TO:
            self.say(f"engine {name} ready ({self._ready}{of})" + (f": {detail}" if detail else ""))
        elif self._ready % max(1, self.num_engines // 4) == 0 or self._ready == self.num_engines:
            # a large fleet: a line per quarter, not 64 (every address is in the report)
            self.say(f"engines ready: {self._ready}{of}")
        if self._bars is not None and self._launch is not None:
            self._bars.update(self._launch, completed=self._ready)

    def step(self, step: int, reward: float | None = None) -> None:
        """Step `step` (0-based) finished; shows k/N, ETA and the last reward."""
        now = time.monotonic()
        if self._run_started is None:
            self._run_started = now
            self._first_step = step
        done = step + 1
        info = f"reward {reward:.3f}" if reward is not None else ""
        if self._bars is not None:
            if self._steps is None:
                if self._launch is not None:
                    self._bars.remove_task(self._launch)
                    self._launch = None
                self._steps = self._bars.add_task("steps", total=self.total_steps,
                                                  completed=step, info="")
            self._bars.update(self._steps, completed=done, info=info)
            return
        timed = done - self._first_step - 1  # steps measured since the first one ended
        eta = ""
        if timed > 0 and done < self.total_steps:
            per = (now - self._run_started) / timed
            eta = f", ETA {_duration(per * (self.total_steps - done))}"
        self.say(f"step {done}/{self.total_steps}" + (f", {info}" if info else "") + eta)

    @contextlib.contextmanager
    def syncing(self, what: str = "weight sync") -> Iterator[None]:
        """Wraps a weight sync: a spinner while it runs; in plain mode a line if it was long."""
        start = time.monotonic()
        task = None
        if self._bars is not None:
            task = self._bars.add_task(what, total=None, info="")
        try:
            yield
        finally:
            took = time.monotonic() - start
            if self._bars is not None and task is not None:
                self._bars.remove_task(task)
            if took >= LONG_SYNC_S:
                self.say(f"{what} took {_duration(took)}")

    def close(self) -> None:
        """Stop the live display (the last frame stays on screen)."""
        if self._bars is not None:
            self._bars.stop()
            self._bars = None
            for handler, stream in self._rerouted:
                handler.setStream(stream)
            self._rerouted = []
