"""`slime_like.api.launch_fleet`'s settings objects start the fleet the job's flags start.

What a user of the Python API relies on: the defaults are the job's, settings reach the
fleet as given, and a bad setting fails before any GPU is held, naming itself.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slime_like.config.fleet_config import FleetLayout, fleet_config
from slime_like.config.fleet_slices import (
    EngineSettings,
    HealthSettings,
    RouterSettings,
    fleet_settings,
    make_keys,
)
from slime_like.config.parse import parse_args
from slime_like.config.slices import placement_settings
from slime_like.errors import ConfigError
from slime_like.protocol.modes import WorkerType

YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"
KEYS = ("api", "admin", "router")


def _api(sglang_config=YAML, **kw):
    settings = {"engine": EngineSettings(program="reference"), "router": RouterSettings(),
                "health": HealthSettings(), "layout": FleetLayout(), **kw}
    return fleet_config(sglang_config, model_path="/m", log_dir="/logs", **settings)


def _job(*flags: str):
    args = parse_args(["--engine", "reference", "--hf-checkpoint", "/m", "--debug-rollout-only",
                       "--sglang-config", str(YAML), *flags])
    updatable = {m.name: "/m" for m in args.topology.models if m.update_weights}
    return placement_settings(args), fleet_settings(args, log_dir="/logs", keys=KEYS,
                                                    model_paths=updatable)


def _same_keys(fleet):
    """The API's fleet with the job's fixed keys (both make fresh ones otherwise)."""
    return replace(fleet, engine=replace(fleet.engine, api_key="api", admin_api_key="admin"),
                   router=replace(fleet.router, api_key="router"))


def test_the_defaults_are_the_jobs_without_flags():
    placement, fleet = _api()
    job_placement, job_fleet = _job()
    assert placement.topology == job_placement.topology
    assert placement.layout == job_placement.layout
    assert _same_keys(fleet) == job_fleet
    assert not fleet.health.enabled  # probing is --use-fault-tolerance, off by default
    assert fleet.engine.api_key and fleet.engine.admin_api_key != fleet.engine.api_key
    assert fleet.router.api_key == fleet.engine.api_key


def test_settings_reach_the_fleet_as_the_equivalent_flags_do():
    health = HealthSettings(enabled=True, interval_s=1.0, timeout_s=2.0, first_wait_s=0.0,
                            failure_threshold=2)
    _, fleet = _api(health=health, router=RouterSettings(flags={"policy": "round_robin"}),
                    engine=EngineSettings(program="reference",
                                          sglang_flags={"mem_fraction_static": 0.5}))
    _, job_fleet = _job("--use-fault-tolerance", "--rollout-health-check-interval", "1",
                        "--rollout-health-check-timeout", "2",
                        "--rollout-health-check-first-wait", "0",
                        "--rollout-health-check-failures", "2", "--router-policy", "round_robin",
                        "--sglang-mem-fraction-static", "0.5")
    assert _same_keys(fleet) == job_fleet


def test_without_a_yaml_the_layout_says_how_many_engines():
    placement, _ = _api(None, layout=FleetLayout(num_gpus=4, gpus_per_engine=2))
    [model] = placement.topology.models
    assert [(g.worker_type, g.num_engines) for g in model.groups] == [(WorkerType.REGULAR, 2)]
    assert placement.layout.num_bundles == 4 and placement.layout.num_trainer_slots == 0


def test_given_keys_are_kept():
    _, fleet = _api(engine=EngineSettings(program="reference", api_key="k", admin_api_key="a"))
    assert (fleet.engine.api_key, fleet.engine.admin_api_key, fleet.router.api_key) == \
        ("k", "a", "k")


def test_the_rl_plane_gives_engines_the_admin_key_only_and_the_router_its_own():
    rl = RouterSettings(kind="smg", flags={"enable_rl": True})
    _, fleet = _api(router=rl)
    assert fleet.engine.api_key is None and fleet.engine.admin_api_key
    assert fleet.router.api_key and fleet.router.api_key != fleet.engine.admin_api_key
    args = parse_args(["--engine", "reference", "--hf-checkpoint", "/m", "--debug-rollout-only",
                       "--sglang-config", str(YAML), "--router", "smg", "--router-enable-rl"])
    api, admin, router = make_keys(args)
    assert api is None and admin and router and router != admin
    with pytest.raises(ConfigError, match="--sglang-api-key"):
        _api(router=rl, engine=EngineSettings(program="reference", api_key="k"))


@pytest.mark.parametrize("kw, where", [
    ({"router": RouterSettings(flags={"policy": "power_of_two"})}, "--router-policy"),
    ({"router": RouterSettings(flags={"worker_urls": ["http://x:1"]})}, "--router-worker-urls"),
    ({"engine": EngineSettings(program="vllm")}, "engine.program"),
    ({"layout": FleetLayout(num_gpus=0)}, "layout.num_gpus"),
    ({"layout": FleetLayout(gpus_per_engine=3, num_gpus=3, gpus_per_node=2)},
     "--rollout-num-gpus-per-engine"),
])
def test_a_bad_setting_fails_before_placement_naming_itself(kw, where):
    with pytest.raises(ConfigError) as err:
        _api(None if "layout" in kw else YAML, **kw)
    assert err.value.path == where, err.value


def test_external_engines_need_probes():
    layout = FleetLayout(external_addrs=("127.0.0.1:1",))
    with pytest.raises(ConfigError, match="HealthSettings"):
        _api(None, layout=layout)
    placement, fleet = _api(None, layout=layout, health=HealthSettings(enabled=True))
    assert placement.layout.num_bundles == 0 and fleet.external_addrs == ("127.0.0.1:1",)
