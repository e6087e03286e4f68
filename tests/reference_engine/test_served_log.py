"""The engine's served log: one line per request a client got, at the version it held then.

A partition test and the chaos checks read stale serves from these logs
(`slime_like/chaos/served.py`); the job names each engine's file (`engine_config`).
"""

from __future__ import annotations

import json

from slime_like.chaos.served import stale_serves
from slime_like.config.fleet_slices import engine_settings
from slime_like.config.parse import parse_args
from slime_like.engine.from_placement import engine_config
from slime_like.reference_engine.served_log import SERVED_LOG_ENV, read_served
from tests.reference_engine.conftest import start_engine, stop_engine


def test_each_served_request_is_logged_at_the_version_it_finished_at(tiny_model_dir,
                                                                    engine_log_dir):
    path = engine_log_dir / "served" / "e0.served.jsonl"
    e = start_engine(tiny_model_dir, engine_log_dir, "--weight-version", "3",
                     env={SERVED_LOG_ENV: str(path)})
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4,
                                                            "ignore_eos": True}}
        assert e.generate({**body, "rid": "a"}).status_code == 200
        assert e.get("/health_generate").status_code == 200  # a probe: nothing served
        r = e.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                 "weight_version": "4"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert e.generate({**body, "rid": "b"}).status_code == 200
        served = read_served(path)  # written after each step, before the answer
    finally:
        stop_engine(e)
    assert [(s.rid, s.version, s.finish, s.tokens) for s in served] == [
        ("a", "3", "length", 4), ("b", "4", "length", 4)], served
    assert served[0].time < served[1].time


def test_the_job_names_each_reference_engine_s_served_log_beside_its_log():
    args = parse_args(["--engine", "reference", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "2"])
    for engine in args.nominal_plan.engines:
        env = engine_config(engine, engine_settings(args), model_path="m", log_dir="/r/logs").env
        name = engine.engine_id.replace("/", "-")
        assert env[SERVED_LOG_ENV] == f"/r/logs/{name}.served.jsonl"


def test_a_serve_older_than_the_fleet_s_version_at_its_time_is_stale(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "engine_timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"time_s": 0.0, "engine": "fleet", "state": "VERSION", "version": "1", "wall_time": 100.0},
        {"time_s": 9.0, "engine": "default/g0/e0", "state": "SUSPECT"},
        {"time_s": 10.0, "engine": "fleet", "state": "VERSION", "version": "2",
         "wall_time": 110.0}]))
    lines = [("r1", 105.0, "1", "length", 4),  # at the fleet's version
             ("r2", 109.0, "2", "length", 4),  # synced just before the fleet moved: fine
             ("r3", 111.0, "1", "length", 4),  # one version behind after it moved: stale
             ("r4", 112.0, "1", "abort", 0)]   # aborted before any token: served nothing
    (tmp_path / "logs" / "default-g0-e0.served.jsonl").write_text("".join(
        json.dumps({"rid": r, "time": t, "version": v, "finish": f, "tokens": n}) + "\n"
        for r, t, v, f, n in lines) + '{"rid": "cut by a ki')
    assert stale_serves(tmp_path) == [{"engine": "default-g0-e0", "rid": "r3", "time": 111.0,
                                       "served": "1", "fleet": 2, "finish": "length"}]
    assert stale_serves(tmp_path, since=111.5) == []
