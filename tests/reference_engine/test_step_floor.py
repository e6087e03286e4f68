"""--reference-min-step-ms: the reference engine's forward steps last at least the floor (a
GPU's decode-step time, waited off the CPU), the job hands it to every engine, and only the
reference engine takes it."""

from __future__ import annotations

import pytest

from slime_like.config.fleet_slices import engine_settings
from slime_like.config.parse import parse_args
from slime_like.engine.from_placement import engine_config
from slime_like.errors import ConfigError
from slime_like.reference_engine.step_floor import MIN_STEP_ENV
from tests.reference_engine.conftest import start_engine, stop_engine

BASE = ["--engine", "reference", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]


def test_each_forward_step_lasts_at_least_the_floor(tiny_model_dir, engine_log_dir):
    e = start_engine(tiny_model_dir, engine_log_dir, "--skip-server-warmup",
                     env={MIN_STEP_ENV: "50"})
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8,
                                                            "ignore_eos": True}}
        meta = e.generate(body).json()["meta_info"]
        # a prefill step and seven decode steps of at least 50 ms each (the request's clock
        # starts inside the first)
        assert meta["completion_tokens"] == 8 and meta["e2e_latency"] >= 7 * 0.05, meta
    finally:
        stop_engine(e)


def test_the_job_hands_the_floor_to_every_engine():
    args = parse_args([*BASE, "--reference-min-step-ms", "30"])
    settings = engine_settings(args)
    for engine in args.nominal_plan.engines:
        assert engine_config(engine, settings, model_path="m").env == {MIN_STEP_ENV: "30.0"}
    plain = parse_args(BASE)
    assert all(engine_config(e, engine_settings(plain), model_path="m").env == {}
               for e in plain.nominal_plan.engines)


@pytest.mark.parametrize("flags, why", [
    (["--engine", "sglang", "--hf-checkpoint", "some/model"], "only the reference engine"),
    (["--engine", "reference"], "invalid"),
])
def test_the_floor_is_refused_where_it_cannot_apply(flags, why):
    value = "-1" if why == "invalid" else "20"
    with pytest.raises((ConfigError, SystemExit)) as err:
        parse_args([*flags, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
                    "--reference-min-step-ms", value])
    if why != "invalid":
        assert err.value.path == "--reference-min-step-ms" and why in str(err.value)
