"""Scale commands through the run folder: `slime-like fleet scale RUN_DIR --engines N`
reaches the job's `ScaleWatcher`, which resizes the fleet and answers (a fake fleet here;
tests/fleet/test_elastic.py drives the real one)."""

from __future__ import annotations

import json
import threading

import pytest

from slime_like.cli import main
from slime_like.errors import FleetError
from slime_like.job.scaling import ScaleError, ScaleWatcher, request_scale, scale_dir


class FakeFleet:
    def __init__(self):
        self.engines = 2
        self.calls: list[tuple] = []

    def resize(self, engines, *, model=None, deadline_s=30.0, timeout_s=600.0):
        self.calls.append((engines, model, deadline_s))
        if engines > 4:
            raise FleetError("not added: no room for policy/g0/e4")
        before, self.engines = self.engines, engines
        return {"model": model or "policy", "before": before, "engines": engines}


@pytest.fixture
def job(tmp_path):
    fleet = FakeFleet()
    watcher = ScaleWatcher(fleet, tmp_path, poll_s=0.02).start()
    yield fleet, watcher
    watcher.stop()


def test_a_command_resizes_the_fleet_and_the_answer_comes_back(job, tmp_path, capsys):
    fleet, watcher = job
    assert main(["fleet", "scale", str(tmp_path), "--engines", "4", "--drain-deadline",
                 "2.5"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] and (answer["before"], answer["engines"]) == (2, 4)
    assert fleet.calls == [(4, None, 2.5)]
    assert not list((scale_dir(tmp_path) / "requests").glob("*.json"))  # taken, once


def test_commands_are_taken_in_order_and_a_refused_one_says_why(job, tmp_path, capsys):
    fleet, _ = job
    queued = [request_scale(tmp_path, n, wait_s=0)["id"] for n in (3, 1)]
    assert len(set(queued)) == 2
    assert main(["fleet", "scale", str(tmp_path), "--engines", "9"]) == 1
    assert "no room for policy/g0/e4" in capsys.readouterr().err
    assert [c[0] for c in fleet.calls] == [3, 1, 9]


def test_no_job_no_command(tmp_path, capsys):
    with pytest.raises(ScaleError, match="no job is running"):
        request_scale(tmp_path, 2)
    assert main(["fleet", "scale", str(tmp_path), "--engines", "2"]) == 1
    assert "no job is running" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fleet", "scale", str(tmp_path)])  # --engines is required


def test_a_job_that_ended_takes_no_more_commands(tmp_path):
    watcher = ScaleWatcher(FakeFleet(), tmp_path).start()
    watcher.stop()
    with pytest.raises(ScaleError, match="no job is running"):
        request_scale(tmp_path, 2)


def test_the_watcher_stops_between_commands(tmp_path):
    release = threading.Event()

    class Slow(FakeFleet):
        def resize(self, engines, **kw):
            release.wait(5)
            return super().resize(engines, **kw)

    watcher = ScaleWatcher(Slow(), tmp_path, poll_s=0.02).start()
    request_scale(tmp_path, 3, wait_s=0)
    release.set()
    watcher.stop()  # the command under way finished first
    assert [a["ok"] for a in watcher.done] in ([True], [])
