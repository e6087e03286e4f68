"""Progress: live bars on a terminal, plain escape-free lines anywhere else."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import sys

from rich.console import Console

from slime_like.observe import progress as progress_mod
from slime_like.observe.progress import RunProgress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run(p: RunProgress, monkeypatch) -> None:
    p.engine_ready("default/g0/e0", "metrics http://h:1/metrics")
    p.engine_ready("default/g0/e1")
    for step in range(3):
        with p.syncing():
            pass
        p.step(step, reward=0.25 * (step + 1))
    monkeypatch.setattr(progress_mod, "LONG_SYNC_S", 0.0)  # every sync counts as long now
    with p.syncing():
        pass
    p.close()


def test_not_a_tty_prints_plain_lines_without_escape_codes(monkeypatch):
    out = io.StringIO()
    p = RunProgress(3, num_engines=2, file=out)
    assert not p.live
    _run(p, monkeypatch)
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[:2] == ["[slime_like] engine default/g0/e0 ready (1/2): metrics http://h:1/metrics",
                         "[slime_like] engine default/g0/e1 ready (2/2)"]
    assert lines[2] == "[slime_like] step 1/3, reward 0.250"
    assert lines[3].startswith("[slime_like] step 2/3, reward 0.500, ETA ")
    assert lines[4] == "[slime_like] step 3/3, reward 0.750"
    assert lines[5].startswith("[slime_like] weight sync took ")
    assert len(lines) == 6


def test_a_terminal_gets_live_bars_with_log_lines_above_them(monkeypatch):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system="standard")
    leader, follower = pty.openpty()
    terminal = os.fdopen(follower, "w")
    monkeypatch.setattr(sys, "__stderr__", terminal)  # stderr is the terminal, as in a shell
    handler = logging.StreamHandler(terminal)  # as logging.basicConfig makes it
    logging.getLogger().addHandler(handler)
    try:
        p = RunProgress(3, num_engines=2, console=console)
        assert p.live and handler.stream is not terminal
        logging.getLogger("slime_like.test").warning("a log line during the run")
        _run(p, monkeypatch)
        assert handler.stream is terminal  # given back when the display stops
    finally:
        logging.getLogger().removeHandler(handler)
        terminal.close()
        os.close(leader)
    raw = out.getvalue()
    assert "\x1b[" in raw  # cursor movement and colour: a live display
    text = ANSI.sub("", raw)
    assert "engine default/g0/e0 ready (1/2)" in text
    assert "steps" in text and "3/3" in text and "reward 0.750" in text
    assert "[slime_like]" not in text
    assert "a log line during the run" in text  # printed through the display, not across it


def test_a_pseudo_terminal_is_detected_as_a_terminal():
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            p = RunProgress(2, file=tty)
            assert p.live
            p.close()
    finally:
        os.close(follower)
        os.close(leader)
