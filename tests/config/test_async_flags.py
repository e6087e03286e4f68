"""The asynchronous schedules' flags: what each resolves to, and every combination refused
with one line naming the flag."""

from __future__ import annotations

import pytest

from slime_like.cli import main as cli_main
from slime_like.config.parse import parse_args
from slime_like.config.slices import job_settings
from slime_like.errors import ConfigError

BASE = ["--engine", "reference", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]


def test_modes_and_their_staleness_bounds():
    assert job_settings(parse_args(BASE)).asynchrony.mode == "sync"
    one = job_settings(parse_args([*BASE, "--async-mode", "one-step"])).asynchrony
    assert (one.mode, one.max_staleness, one.enabled) == ("one-step", 1, True)
    full = job_settings(parse_args([*BASE, "--fully-async"])).asynchrony
    assert (full.mode, full.max_staleness, full.pause_mode) == ("fully-async", 1, "retract")
    zero = job_settings(parse_args([*BASE, "--fully-async", "--max-weight-staleness", "0"]))
    assert zero.asynchrony.max_staleness == 0


def test_pause_mode_keeps_its_older_spelling():
    assert parse_args([*BASE, "--pause-mode", "abort"]).pause_mode == "abort"
    assert parse_args([*BASE, "--pause-generation-mode", "in_place"]).pause_mode == "in_place"


def test_train_async_defaults_to_one_step(capsys):
    assert cli_main(["train-async", *BASE, "--dry-run"]) == 0
    # an explicit schedule wins over the entry point's default
    assert cli_main(["train-async", *BASE, "--dry-run", "--max-weight-staleness", "2"]) == 2
    assert "--max-weight-staleness" in capsys.readouterr().err


@pytest.mark.parametrize("flags, flag, why", [
    (["--max-weight-staleness", "1"], "--max-weight-staleness", "fully-async only"),
    (["--partial-rollout"], "--partial-rollout", "fully-async only"),
    (["--fully-async", "--mask-offpolicy-in-partial-rollout"],
     "--mask-offpolicy-in-partial-rollout", "needs --partial-rollout"),
    (["--fully-async", "--partial-rollout"], "--partial-rollout",
     "needs --pause-generation-mode abort"),
    (["--async-mode", "one-step", "--colocate"], "--async-mode", "--colocate"),
    (["--fully-async", "--update-weights-interval", "2"], "--update-weights-interval",
     "must be 1"),
    (["--fully-async", "--rollout-function-path", "m.f"], "--rollout-function-path",
     "one-step for custom rollouts"),
    (["--fully-async", "--pause-generation-mode", "in_place"], "--pause-generation-mode",
     "--sglang-disable-radix-cache"),
    (["--fully-async", "--pause-generation-mode", "in_place", "--sglang-disable-radix-cache",
      "--hf-checkpoint", "some/model"], "--pause-generation-mode", "use retract"),
    (["--logprob-check-fraction", "0"], "--logprob-check-fraction", "must be in (0, 1]"),
])
def test_what_the_schedules_cannot_run_is_refused(flags, flag, why):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *flags])
    assert err.value.path == flag and why in str(err.value), str(err.value)


def test_a_sharded_trainer_runs_the_sync_schedule_only():
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, "--fully-async", "--train-backend", "fsdp"])
    assert err.value.path == "--train-backend" and "earlier versions" in str(err.value)
