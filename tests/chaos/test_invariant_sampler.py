"""The chaos oracle itself: it must flag an engine routed at another version, and only that.

A real router and a real reference engine; the fleet is a stand-in holding the version
the sampler compares against (the one fault here, an engine routed at a version the fleet
does not serve, cannot be caused through a real Fleet: preventing it is the Fleet's job).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests

from slime_like.chaos import InvariantSampler
from tests.reference_engine.conftest import start_engine, stop_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    e = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"))
    yield e
    stop_engine(e)


def _serve(engine, version: str) -> None:
    r = engine.post("/update_weight_version", {"new_version": version, "abort_all_requests": False})
    assert r.status_code == 200, r.text


def test_flags_a_routed_engine_at_another_version_but_not_a_sync_or_an_unrouted_one(
        engine, router):
    router.client.add_worker(engine.url)
    fleet = SimpleNamespace(
        version=1, update_in_progress=False, routers={"default": router},
        engines=[SimpleNamespace(url=engine.url, update_weights=True, handle=None,
                                 engine_id="default/g0/e0")])
    sampler = InvariantSampler(fleet)
    session = requests.Session()
    try:
        _serve(engine, "1")
        sampler._sample(session)
        assert sampler.samples == 1 and sampler.violations == []

        _serve(engine, "2")  # the fleet still serves 1, and no sync is running
        sampler._sample(session)
        assert [(v["what"], v["served"], v["fleet"]) for v in sampler.violations] == [
            ("routed at another version", "2", 1)]

        fleet.update_in_progress = True  # during a sync the next version may already be served
        sampler._sample(session)
        assert len(sampler.violations) == 1
        fleet.update_in_progress = False

        # A failed sync may unroute the engine between the listing and the judgment: the
        # sampler asks the router again before it calls a violation.
        assert InvariantSampler._still_routed(router, engine.url)
        router.client.remove_worker(url=engine.url)
        assert not InvariantSampler._still_routed(router, engine.url)
        sampler._sample(session)
        assert len(sampler.violations) == 1 and sampler.samples == 3
    finally:
        if router.client.find_worker(engine.url) is not None:
            router.client.remove_worker(url=engine.url)
