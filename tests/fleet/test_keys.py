"""Keys are on by default: a run's control endpoints refuse callers without its keys.

A fleet launched as a job launches it (fresh keys per run), then probed from outside with
plain HTTP: the engines' control and weight endpoints need the admin key, generation needs
the API key, and the router's worker list needs the router key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import requests

from slime_like.api import launch_fleet

YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    f = launch_fleet(YAML, model_path=tiny_model_dir, engine="reference",
                     log_dir=tmp_path_factory.mktemp("keys"))
    yield f
    f.shutdown()
    ray.shutdown()


def bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.mark.parametrize("endpoint", ["/pause_generation", "/continue_generation",
                                      "/flush_cache", "/update_weights_from_disk",
                                      "/init_weights_update_group", "/release_memory_occupation"])
def test_control_endpoints_refuse_requests_without_the_admin_key(fleet, endpoint):
    handle = fleet.engines[0].handle
    assert handle.api_key and handle.admin_api_key and handle.api_key != handle.admin_api_key
    for key in (None, "wrong", handle.api_key):
        r = requests.post(handle.url + endpoint, json={}, headers=bearer(key), timeout=10)
        assert r.status_code == 401, (endpoint, key is None, r.status_code, r.text[:200])


def test_generation_needs_the_api_key_and_control_the_admin_key(fleet):
    handle = fleet.engines[0].handle
    body = {"input_ids": [1, 72, 105], "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(handle.url + "/generate", json=body, timeout=30).status_code == 401
    ok = requests.post(handle.url + "/generate", json=body, headers=bearer(handle.api_key),
                       timeout=30)
    assert ok.status_code == 200, ok.text[:200]
    r = requests.post(handle.url + "/flush_cache", json={}, headers=bearer(handle.admin_api_key),
                      timeout=10)
    assert r.status_code == 200, r.text[:200]


def test_the_router_needs_its_key_too(fleet):
    router = fleet.routers["policy"]
    assert router.api_key
    assert requests.get(router.url + "/workers", timeout=10).status_code == 401
    assert requests.get(router.url + "/workers", headers=bearer(router.api_key),
                        timeout=10).status_code == 200
