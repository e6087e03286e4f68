"""The four modes are types from the flag to the component: a flag, a `--config` file and a
`--sglang-config` group all give the enum member, and a member is still its word on the
wire, in JSON and in messages (what sglang's HTTP API and the report read)."""

from __future__ import annotations

import json

import pytest

from slime_like.config.parse import parse_args
from slime_like.config.sglang_config import parse_sglang_config
from slime_like.config.slices import job_settings
from slime_like.errors import ConfigError
from slime_like.protocol import io_struct as p
from slime_like.protocol.modes import AsyncMode, PauseMode, Transport, WorkerType

BASE = ["--engine", "reference", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]


def test_flags_parse_into_the_enums():
    args = parse_args([*BASE, "--pause-generation-mode", "in_place", "--async-mode", "one-step",
                       "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d"])
    assert args.pause_mode is PauseMode.IN_PLACE
    assert args.async_mode is AsyncMode.ONE_STEP
    assert args.update_weight_transport is Transport.DISK
    asynchrony = job_settings(args).asynchrony
    assert asynchrony.mode is AsyncMode.ONE_STEP and asynchrony.pause_mode is PauseMode.IN_PLACE


def test_defaults_and_slimes_nccl_resolve_to_members():
    args = parse_args(BASE)
    assert args.pause_mode is PauseMode.RETRACT and args.async_mode is AsyncMode.SYNC
    assert args.update_weight_transport is Transport.DISTRIBUTED  # "nccl", not colocated
    colocated = parse_args(["--engine", "reference", "--actor-num-gpus-per-node", "2",
                            "--colocate"])
    assert colocated.update_weight_transport is Transport.TENSOR


def test_a_config_file_gives_members_too(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("pause_mode: abort\nasync_mode: fully-async\npartial_rollout: true\n")
    args = parse_args([*BASE, "--config", str(cfg)])
    assert (args.pause_mode, args.async_mode) == (PauseMode.ABORT, AsyncMode.FULLY_ASYNC)
    assert isinstance(args.pause_mode, PauseMode) and isinstance(args.async_mode, AsyncMode)


def test_an_entry_points_default_is_a_member_too():
    """train_async's one-step default goes through the flag's type like a typed word."""
    args = parse_args(BASE, defaults={"async_mode": AsyncMode.ONE_STEP})
    assert args.async_mode is AsyncMode.ONE_STEP
    assert parse_args(BASE, defaults={"async_mode": "fully-async"}).async_mode \
        is AsyncMode.FULLY_ASYNC


@pytest.mark.parametrize("flags, message", [
    (["--pause-mode", "freeze"], "--pause-generation-mode: invalid choice: 'freeze' (choose "
                                 "from 'abort', 'retract', 'in_place')"),
    (["--async-mode", "two-step"], "--async-mode: invalid choice: 'two-step' (choose from "
                                   "'sync', 'one-step', 'fully-async')"),
    (["--update-weight-transport", "rdma"], "--update-weight-transport: invalid choice: 'rdma' "
                                            "(choose from 'nccl', 'distributed', 'tensor', "
                                            "'disk')"),
])
def test_an_unknown_word_is_refused_naming_the_choices(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *flags])
    assert str(err.value) == message


def test_server_groups_hold_worker_type_members():
    config = parse_sglang_config({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "prefill", "num_gpus": 1}, {"worker_type": "decode", "num_gpus": 1}]}]})
    types = [g.worker_type for g in config.sglang[0].server_groups]
    assert types == [WorkerType.PREFILL, WorkerType.DECODE]
    assert all(isinstance(t, WorkerType) and t.is_pd for t in types)
    with pytest.raises(ConfigError, match="must be one of regular, prefill, decode, placeholder, "
                                          "encoder; got 'mixed'"):
        parse_sglang_config({"sglang": [{"name": "m", "server_groups": [
            {"worker_type": "mixed", "num_gpus": 1}]}]})


def test_a_member_is_its_word_on_the_wire():
    body = p.PauseGenerationRequest(mode=PauseMode.IN_PLACE)
    assert body.model_dump(mode="json") == {"mode": "in_place"}
    assert json.loads(body.model_dump_json()) == {"mode": "in_place"}
    # a body from the wire gives the member; sglang's default is abort
    assert p.PauseGenerationRequest.model_validate({"mode": "retract"}).mode is PauseMode.RETRACT
    assert p.PauseGenerationRequest().mode is PauseMode.ABORT
    assert json.dumps({"async_mode": AsyncMode.FULLY_ASYNC}) == '{"async_mode": "fully-async"}'
    assert f"{Transport.TENSOR}" == "tensor" and PauseMode.ABORT == "abort"
