"""`WeightSyncConfig`: the one sync config, typed, checked once, and sent as itself."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from slime_like.config.parse import parse_args
from slime_like.errors import ConfigError
from slime_like.protocol.modes import PauseMode, Transport
from slime_like.weights.sync_config import WeightSyncConfig


def test_words_become_members_and_defaults_are_the_flags():
    cfg = WeightSyncConfig(transport="tensor", pause_mode="in_place")
    assert cfg.transport is Transport.TENSOR and cfg.pause_mode is PauseMode.IN_PLACE
    default = WeightSyncConfig()
    args = parse_args(["--engine", "reference", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "1"])
    assert (default.transport, default.pause_mode) == (args.update_weight_transport,
                                                       args.pause_mode)


@pytest.mark.parametrize("kw, message", [
    ({"pause_mode": "freeze"}, "pause_mode: expected one of ['abort', 'retract', 'in_place'], "
                               "got 'freeze'"),
    ({"transport": "nccl"}, "transport: expected one of ['distributed', 'tensor', 'disk'], "
                            "got 'nccl'"),
    ({"transport": Transport.DISK}, "disk_dir: the disk transport needs a directory"),
    ({"http_timeout_s": 0}, "http_timeout_s: expected a positive number of seconds"),
    ({"update_weight_mode": "sparse"}, "update_weight_mode: expected one of ['full', 'delta']"),
    ({"update_weight_delta_full_every": 0}, "update_weight_delta_full_every: expected a number "
                                            "of syncs >= 1"),
    ({"update_weight_mode": "delta", "transport": "tensor"}, "update_weight_mode: delta "
                                                             "updates run over the disk and"),
])
def test_a_bad_setting_is_refused_naming_its_field(kw, message):
    with pytest.raises(ConfigError) as err:
        WeightSyncConfig(**kw)
    assert str(err.value).startswith(message)


def test_it_is_frozen_and_crosses_processes_as_itself():
    cfg = WeightSyncConfig(pause_mode=PauseMode.ABORT, update_weight_buffer_size=1 << 16,
                           resume_on_failure=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pause_mode = PauseMode.RETRACT  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(cfg))  # what Ray does to the trainer's argument
    assert back == cfg and back.pause_mode is PauseMode.ABORT
    resync = dataclasses.replace(cfg, model_dir="/m")  # checked again, still typed
    assert resync.transport is Transport.DISTRIBUTED and resync.model_dir == "/m"


def test_the_jobs_sync_comes_from_its_flags():
    args = parse_args(["--engine", "reference", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "1", "--pause-generation-mode", "in_place",
                       "--update-weight-buffer-size", "4096", "--rollout-request-timeout", "30"])
    cfg = WeightSyncConfig.from_flags(args, model_dir="/m")
    assert (cfg.transport, cfg.pause_mode) == (Transport.DISTRIBUTED, PauseMode.IN_PLACE)
    assert cfg.update_weight_buffer_size == 4096 and cfg.model_dir == "/m"
    assert cfg.http_timeout_s == cfg.group_timeout_s == 30.0  # no longer than a request
    assert not cfg.resume_on_failure  # the fleet unroutes a failed sync's engines first


def test_delta_mode_comes_from_slimes_flag_or_ours():
    base = ["--engine", "reference", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    assert WeightSyncConfig.from_flags(parse_args(base)).update_weight_mode == "full"
    for argv in (["--update-weight-mode", "delta"], ["--update-weight-delta"]):
        cfg = WeightSyncConfig.from_flags(parse_args([*base, *argv,
                                                      "--update-weight-delta-full-every", "5"]))
        assert (cfg.update_weight_mode, cfg.update_weight_delta_full_every) == ("delta", 5)
