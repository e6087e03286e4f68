"""The public API as a user with their own trainer sees it: the example runs on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import ray

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "train_loop.py"


@pytest.fixture(scope="module")
def fresh_ray():
    """One local Ray cluster for the module: the first run of the example starts it (the
    example joins a running one), the module's end stops it."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def _example():
    spec = importlib.util.spec_from_file_location("train_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_own_trainer_example_pushes_weights_and_serves_only_the_pushed_version(tmp_path,
                                                                              fresh_ray):
    out = _example().main(["--steps", "2", "--out", str(tmp_path)])
    # push 1 before the loop, one push per step: each step's samples came from exactly the
    # version pushed before it
    assert out["served"] == [["1"], ["2"]]
    assert out["version"] == 3
    # The job's log-probability check with the loop's own model (LogprobChecker): every
    # sample at its version, and from the second push on both engines confirmed by name
    # at the version they claim against the one before it.
    first, second = out["checks"]
    assert first["logprob_sample_mean_diff_max"] < 1e-4 > second["logprob_sample_mean_diff_max"]
    assert first["logprob_probe_engines"] == 2 and first["logprob_probe_confirmed"] == 0
    assert second["logprob_probe_confirmed"] == 2, second
    engines = {e for e, _ in out["events"] if e.startswith("policy/")}
    assert engines == {"policy/g0/e0", "policy/g0/e1"}
    for engine in engines:
        states = [s for e, s in out["events"] if e == engine]
        # routed only through a verified update; stopped at the end
        assert states[:4] == ["LAUNCHING", "LOADED", "UPDATING", "REGISTERED"], states
        assert states[-1] == "STOPPED"


def test_own_trainer_streams_batches_while_pushes_update_in_flight(tmp_path, fresh_ray):
    out = _example().main(["--steps", "4", "--out", str(tmp_path), "--fully-async"])
    # every batch within the bound, one push per step after the first
    assert out["version"] == 5
    assert all(max(ages) <= 1 for ages in out["staleness"]), out["staleness"]
    assert any(1 in ages for ages in out["staleness"]), "the stream never ran ahead"
    counts = out["counts"]
    assert out["balanced"] and counts["taken"] == 4 * 2 and counts["failed"] == 0, counts
    assert set(out["states"].values()) == {"REGISTERED"}
def test_own_trainer_example_pushes_an_fsdp_model_from_every_rank(tmp_path, fresh_ray,
                                                                  monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # its spawned ranks import it by name
    example = importlib.import_module("train_loop")
    out = example.main(["--steps", "1", "--fsdp", "2", "--out", str(tmp_path)])
    # the sharded model's pushes verified like any: each step served the version before it
    assert out["served"] == [["1"]] and out["version"] == 2
    assert out["peer_exit_codes"] == [0]  # rank 1 trained and served both pushes' gathers


def test_launch_fleet_takes_settings_objects_without_a_yaml(tmp_path, tiny_model_dir, fresh_ray):
    """Settings reach the running fleet: one engine from the layout alone, the keys given,
    the router's flags; a push with the typed transport serves version 1 through it."""
    import requests
    import torch

    from slime_like.api import (
        EngineSettings,
        FleetLayout,
        FleetWeights,
        HealthSettings,
        PauseMode,
        RouterSettings,
        Transport,
        launch_fleet,
    )
    from slime_like.models import load_pretrained
    from slime_like.models.transformer import hf_named_parameters
    from slime_like.protocol.checksums import overall_checksum, tensor_checksum

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    fleet = launch_fleet(model_path=tiny_model_dir, log_dir=tmp_path,
                         engine=EngineSettings(program="reference", api_key="user-key",
                                               admin_api_key="admin-key"),
                         router=RouterSettings(flags={"policy": "round_robin"}),
                         health=HealthSettings(enabled=True, interval_s=5.0),
                         layout=FleetLayout(num_gpus=1))
    try:
        assert list(fleet.states()) == ["default/g0/e0"]
        assert fleet.settings.router.flags["policy"] == "round_robin"
        handle = fleet.engines[0].handle
        assert (handle.api_key, handle.admin_api_key) == ("user-key", "admin-key")
        body = {"input_ids": [1, 72, 105], "sampling_params": {"max_new_tokens": 2}}
        assert requests.post(handle.url + "/generate", json=body, timeout=30).status_code == 401
        workers = fleet.router_url() + "/workers"
        assert requests.get(workers, timeout=10).status_code == 401  # the router's key: the API key
        assert requests.get(workers, headers={"Authorization": "Bearer user-key"},
                            timeout=10).status_code == 200
        weights = FleetWeights(fleet, transport=Transport.DISTRIBUTED,
                               pause_mode=PauseMode.RETRACT, update_weight_buffer_size=1 << 20,
                               update_weight_mode="delta")
        model = load_pretrained(tiny_model_dir, dtype=torch.float32)
        assert weights.push(model)["transfer"]["delta"]["mode"] == "full"  # no base yet
        [sample] = fleet.generate([[1, 72, 105]], n=1,
                                  sampling_params={"temperature": 1.0, "max_new_tokens": 2})
        assert sample.versions() == ["1"]
        with torch.no_grad():  # a step's worth of change: the next push sends a delta
            model.lm_head.weight[:3].add_(1e-3)
        assert weights.push(model)["transfer"]["delta"]["mode"] == "delta"
        checker = requests.post(handle.url + "/weights_checker", json={}, timeout=30,
                                headers={"Authorization": "Bearer admin-key"}).json()
        sums = {n: tensor_checksum(p) for n, p in hf_named_parameters(model)}
        assert checker["ranks"][0]["per_gpu_checksum"] == overall_checksum(sums)
    finally:
        fleet.shutdown()
