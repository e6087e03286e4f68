"""Auth exactly as sglang 0.5.23: open health paths, NORMAL vs ADMIN_OPTIONAL endpoints."""

from __future__ import annotations

import pytest
import requests

from slime_like.reference_engine.http_server import AuthLevel, decide_auth
from tests.reference_engine.conftest import start_engine, stop_engine


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir, engine_log_dir):
    e = start_engine(tiny_model_dir, engine_log_dir, "--api-key", "user-key",
                     "--admin-api-key", "admin-key", "--skip-server-warmup")
    yield e
    stop_engine(e)


def _h(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_health_ready_and_metrics_paths_are_open(keyed_engine):
    assert requests.get(keyed_engine.url + "/health", timeout=30).status_code == 200
    assert requests.get(keyed_engine.url + "/ready", timeout=10).status_code == 200


def test_normal_endpoints_need_the_api_key_not_the_admin_key(keyed_engine):
    url = keyed_engine.url
    r = requests.get(url + "/model_info", timeout=10)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert requests.get(url + "/model_info", headers=_h("admin-key"), timeout=10).status_code == 401
    assert requests.get(url + "/model_info", headers=_h("user-key"), timeout=10).status_code == 200
    r = requests.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                      headers=_h("user-key"), timeout=30)
    assert r.status_code == 200


def test_admin_endpoints_need_the_admin_key_when_one_is_set(keyed_engine):
    url = keyed_engine.url
    for key in (None, "user-key"):
        r = requests.post(url + "/flush_cache", headers=_h(key), timeout=10)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert requests.post(url + "/flush_cache", headers=_h("admin-key"), timeout=10).status_code == 200
    r = requests.post(url + "/pause_generation", json={"mode": "in_place"}, headers=_h("admin-key"), timeout=10)
    assert r.status_code == 200
    r = requests.post(url + "/continue_generation", json={}, headers=_h("admin-key"), timeout=10)
    assert r.status_code == 200


@pytest.mark.parametrize("api_key,admin_key,level,header,expected", [
    (None, None, AuthLevel.NORMAL, None, None),
    (None, None, AuthLevel.ADMIN_OPTIONAL, None, None),
    ("k", None, AuthLevel.ADMIN_OPTIONAL, "k", None),
    ("k", None, AuthLevel.ADMIN_OPTIONAL, None, 401),
    (None, "a", AuthLevel.NORMAL, None, None),  # admin key only: normal endpoints stay open
    (None, "a", AuthLevel.ADMIN_OPTIONAL, "a", None),
    ("k", "a", AuthLevel.ADMIN_OPTIONAL, "k", 401),
    (None, None, AuthLevel.ADMIN_FORCE, None, 403),
    ("k", "a", AuthLevel.ADMIN_FORCE, "a", None),
])
def test_auth_decision_table_matches_sglang(api_key, admin_key, level, header, expected):
    auth = f"Bearer {header}" if header else None
    assert decide_auth("POST", "/x", auth, api_key, admin_key, level) == expected
    assert decide_auth("GET", "/health_generate", None, "k", "a", AuthLevel.NORMAL) is None
