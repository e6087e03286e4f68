"""Which engines get their prefix cache flushed after a sync: the pause-mode rule by version."""

from __future__ import annotations

import pytest

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.weights import SyncReport, WeightSync


def engine(version: tuple[int, ...] | None) -> EngineSession:
    e = EngineSession(EngineAddress("http://127.0.0.1:9"))  # never contacted: the rule needs no I/O
    e.version = version
    e.server_info = {"version": ".".join(map(str, version)) if version else None}
    return e


@pytest.mark.parametrize("mode, version, expected", [
    ("abort", (0, 5, 9), None),                  # drained: always flushed
    ("abort", (0, 5, 23), None),
    ("in_place", (0, 5, 23), "skipped: in_place keeps the KV cache by design"),
    ("retract", (0, 5, 23), None),               # 0.5.23 frees retracted requests' KV
    ("retract", (0, 5, 21), "skipped: engine keeps retracted KV"),
    ("retract", None, "skipped: engine keeps retracted KV"),  # unknown: do not risk it
])
def test_flush_follows_the_pause_mode_rule(mode, version, expected):
    sync = WeightSync([engine(version)], pause_mode=mode)
    report = SyncReport("1", "distributed", mode, [])
    assert sync.control.flush_plan(sync.engines[0], report) == expected
    if expected == "skipped: engine keeps retracted KV":
        assert len(report.warnings) == 1 and "stale prefixes" in report.warnings[0]
        sync.control.flush_plan(sync.engines[0], report)
        assert len(report.warnings) == 1  # one warning, not one per check


def test_flush_is_folded_into_the_last_update_only_where_a_refusal_cannot_crash_the_engine():
    assert engine((0, 5, 23)).folds_flush
    assert not engine((0, 5, 21)).folds_flush  # asserts, i.e. crashes, on refusal
    assert not engine(None).folds_flush
