"""smg's RL control plane (`--router smg --router-enable-rl`) in a real fleet.

Two reference engines behind smg 1.13 started with `--enable-rl` (its own binary, real
Ray). The engines run with the admin key only and are registered with it, so smg reaches
their admin routes; a push then pauses and continues both through one smg request per
step (each engine's own `/health` says whether it is paused, not smg's answer), an engine
smg cannot reach is called directly and its failure named, and the admin routes still
refuse whoever lacks the admin key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import requests
import torch

from slime_like.api import FleetWeights, PauseMode, RouterSettings, Transport, launch_fleet
from slime_like.engine.fanout import each
from slime_like.engine.rl_plane import PlaneCall
from slime_like.engine.server import EngineConfig, EngineServer
from slime_like.engine.session import EngineSession
from slime_like.errors import EngineError
from slime_like.models import load_pretrained
from slime_like.weights.control import Control
from slime_like.weights.sync_config import WeightSyncConfig

YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    f = launch_fleet(YAML, model_path=tiny_model_dir, engine="reference",
                     router=RouterSettings(kind="smg", flags={"enable_rl": True,
                                                              "policy": "round_robin"}),
                     log_dir=tmp_path_factory.mktemp("rl-plane"))
    yield f
    f.shutdown()
    ray.shutdown()


def bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def health(urls: list[str]) -> dict[str, int]:
    """Each engine's own word: /ready answers 503 while it is paused."""
    return {u: requests.get(u + "/ready", timeout=10).status_code for u in urls}


def test_a_push_pauses_and_continues_every_engine_through_smg(fleet, tiny_model_dir):
    """The first push installs the version the engines are routed at (none is smg's worker
    yet: each is called directly); the second goes through smg for both."""
    handles = [e.handle for e in fleet.engines]
    urls = sorted(h.url for h in handles)
    router = fleet.routers["policy"]
    assert [(h.api_key, bool(h.admin_api_key)) for h in handles] == [(None, True)] * 2
    weights = FleetWeights(fleet, transport=Transport.DISTRIBUTED, pause_mode=PauseMode.RETRACT,
                           update_weight_buffer_size=1 << 20)
    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    during: dict[str, int] = {}
    try:
        assert weights.push(model)["via_rl_plane"] == {}
        assert [h.rl_plane for h in handles] == [router.rl_plane] * 2  # routed: smg's workers
        weights.sync.on_step = lambda step: during.update(health(urls)) if step == "end" else None
        report = weights.push(model)
    finally:
        weights.close()
    assert during == dict.fromkeys(urls, 503)  # every engine paused while the weights moved
    assert health(urls) == dict.fromkeys(urls, 200)  # and every one continued
    assert report["via_rl_plane"] == {"pause_generation": urls, "continue_generation": urls}
    [sample] = fleet.generate([[1, 72, 105]], n=1,
                              sampling_params={"temperature": 1.0, "max_new_tokens": 2})
    assert sample.versions() == ["2"]


def test_admin_routes_still_need_the_admin_key_and_the_router_its_own(fleet):
    handle = fleet.engines[0].handle
    router = fleet.routers["policy"]
    for endpoint in ("/pause_generation", "/update_weights_from_disk", "/flush_cache"):
        for key in (None, "wrong", router.api_key):
            r = requests.post(handle.url + endpoint, json={}, headers=bearer(key), timeout=10)
            assert r.status_code == 401, (endpoint, key, r.status_code, r.text[:200])
    body = {"input_ids": [1, 72, 105], "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(router.url + "/generate", json=body, timeout=30).status_code == 401
    ok = requests.post(router.url + "/generate", json=body, headers=bearer(router.api_key),
                       timeout=30)
    assert ok.status_code == 200, ok.text[:200]


def test_an_engine_smg_cannot_reach_is_called_directly_and_named(fleet, tiny_model_dir,
                                                                 tmp_path):
    """A third engine registered with smg, then stopped: smg pauses the two living ones,
    the stopped one's session calls it itself and fails naming it; the undo continues the
    living through smg and reports the stopped one."""
    handles = [e.handle for e in fleet.engines]
    router = fleet.routers["policy"]
    admin = handles[0].admin_api_key
    extra = EngineServer(EngineConfig(model_path=str(tiny_model_dir), program="reference",
                                      host="127.0.0.1", log_dir=str(tmp_path),
                                      startup_timeout=120.0, admin_api_key=admin))
    extra.init()
    stopped = EngineSession(extra.handle().address, rl_plane=router.rl_plane)
    try:
        router.client.add_worker(stopped.url, api_key=admin, timeout=60)
        extra.shutdown(grace=5)
        sessions = [*handles, stopped]
        call = PlaneCall(router.rl_plane, "pause_generation", {"mode": PauseMode.RETRACT},
                         sessions, on_sent=EngineSession.record_paused(PauseMode.RETRACT),
                         timeout=10).start()
        outcomes = each(sessions, lambda s: s.pause_generation(PauseMode.RETRACT, timeout=5,
                                                               via=call))
        assert sorted(call.future.result()) == sorted(h.url for h in handles)
        assert [err is None for _, err in outcomes] == [True, True, False]
        assert isinstance(outcomes[2][1], EngineError) and stopped.url in str(outcomes[2][1])
        assert health([h.url for h in handles]) == {h.url: 503 for h in handles}
        assert all(s.paused is PauseMode.RETRACT for s in sessions)  # each recorded it

        problems = Control(WeightSyncConfig(http_timeout_s=5), lambda *a: None).undo(sessions)
        assert [url for url, _ in problems] == [stopped.url]
        assert health([h.url for h in handles]) == {h.url: 200 for h in handles}
        assert all(h.paused is None for h in handles)
    finally:
        extra.shutdown(grace=5)
        router.client.remove_worker(url=stopped.url, timeout=15)
