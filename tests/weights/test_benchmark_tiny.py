"""The weight-sync benchmark's CPU form runs end to end (the GPU form is the same code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_reports_every_mode_with_matching_checksums(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "weight_sync.py"), "--tiny", "--layout",
         "tiny_moe", "--engines", "1,2tp2", "--repeats", "1", "--json-out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_mode = {r["mode"]: r for r in records}
    # the façade drives one server, so it is measured in the test below
    assert set(by_mode) == {"raw", "per_tensor", "ours", "sglang_per_tensor", "d2d", "tensor"}
    assert by_mode["raw"]["ratio_to_raw"] == 1.0
    for mode in ("per_tensor", "ours"):
        r = by_mode[mode]
        assert r["ratio_to_raw"] == pytest.approx(r["seconds"] / by_mode["raw"]["seconds"], rel=1e-3)
        assert set(r["gbps_per_engine"]) == {"A(tp1)", "B(tp2)"}
    for mode in ("ours", "sglang_per_tensor", "tensor"):
        assert by_mode[mode]["checksums_match"] is True
        assert by_mode[mode]["where_time_went"]["transfer"] > 0
        assert {"pause", "begin", "end", "continue"} <= set(by_mode[mode]["where_time_went"]["round_trips"])
    assert by_mode["ours"]["tensors"] == by_mode["raw"]["tensors"] > 100


def test_tiny_benchmark_measures_the_facade_next_to_weight_sync(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "weight_sync.py"), "--tiny", "--layout",
         "tiny_dense", "--engines", "1", "--modes", "raw,ours,facade", "--repeats", "2",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_mode = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(by_mode) == {"raw", "ours", "facade"}
    for mode in ("ours", "facade"):
        assert by_mode[mode]["checksums_match"] is True
        assert by_mode[mode]["bucket_mb"] == by_mode["ours"]["bucket_mb"]
        assert by_mode[mode]["first_sync_s"] > 0
