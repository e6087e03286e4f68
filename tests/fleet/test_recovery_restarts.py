"""An engine that dies again while it is being recovered is recovered again.

Real Ray, the real sglang-router and two reference engines. Engine 0 is SIGKILLed; its
recovery relaunches it, and the relaunched server is SIGKILLed too, at the moment its
resync starts (found by the chaos long form: a kill armed for "the next sync" landed on a
recovery's resync). That second death must not be lost: the recovery starts over, and the
engine ends routed at the fleet's version.
"""

from __future__ import annotations

import time

import torch
from fleet_checks import routed_urls

from slime_like.api import FleetWeights
from slime_like.chaos import kill_engine
from slime_like.models import load_pretrained


def test_an_engine_killed_again_during_its_resync_is_recovered_again(fleet, tiny_model_dir):
    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = FleetWeights(fleet, transport="distributed")
    weights.push(model)
    weights.push(model)
    victim = fleet.engines[0]
    resync = fleet.weight_source
    killed_during_resync: list[str] = []

    def kill_at_first_resync(update):
        if not update.full and not killed_during_resync:
            killed_during_resync.append(update.targets[0].url)
            kill_engine(fleet, 0)  # the relaunched server, as its resync begins
        return resync(update)

    fleet.set_weight_source(kill_at_first_resync)
    first_url = victim.url
    kill_engine(fleet, 0)
    time.sleep(1.0)  # the exit watcher starts the recovery
    assert fleet.wait_recovered(timeout=240)
    # the second death happened to the relaunched server, and was recovered too
    assert killed_during_resync and killed_during_resync[0] != first_url
    assert victim.restarts == 2
    assert victim.url not in (first_url, killed_during_resync[0])
    assert fleet.states()[victim.engine_id] == "REGISTERED"
    assert victim.handle.weight_version() == str(fleet.version) == "2"
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    mine = [r for r in fleet.recoveries if r["engine"] == victim.engine_id]
    assert len(mine) == 1 and "error" not in mine[0] and mine[0]["url"] == victim.url
    weights.close()
