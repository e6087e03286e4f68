"""A sync that fails after engines paused: no unverified engine stays in the router.

Real Ray, the real sglang-router, two reference engines and a real weight transfer that
breaks after its first bucket landed (the engines then hold partly new weights under the
old version string). The router's own `/workers` must not list them until they are
resynced; then both are routed again at the fleet's version.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import ray
import torch
from fleet_checks import routed_urls, wait_all_registered

from slime_like.api import EngineState, FleetWeights
from slime_like.errors import WeightSyncError
from slime_like.models import load_pretrained
from slime_like.weights.packing import ModelWeights


class BreaksAfterFirstBucket:
    """The model's weights, perturbed, whose stream fails after a few tensors (a trainer
    that dies mid-sync)."""

    def __init__(self, model: torch.nn.Module, good: int):
        self.inner, self.good = ModelWeights(model), good

    def metadata(self):
        return self.inner.metadata()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, t) in enumerate(self.inner.tensors()):
            if i == self.good:
                raise RuntimeError("trainer lost its weights mid-sync")
            yield name, t + 1.0



def test_failed_sync_unroutes_every_unverified_engine_then_resyncs_them(fleet, tiny_model_dir):
    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    # small buckets: the first bucket reaches the engines before the stream breaks
    weights = FleetWeights(fleet, transport="distributed", update_weight_buffer_size=4096)
    weights.push(model)
    urls = {e.url for e in fleet.engines}
    assert routed_urls(fleet) == urls and int(fleet.version) == 1

    pushed = checksums(fleet)
    stale_checks: list[tuple[str, set[str]]] = []
    fleet.subscribe(lambda event: event.kind is EngineState.STALE and
                    stale_checks.append((fleet.find(event.subject).url, routed_urls(fleet))))
    with pytest.raises(WeightSyncError, match="mid-sync"):
        fleet.sync(lambda u: weights.sync.update(BreaksAfterFirstBucket(model, good=5),
                                                 u.version.wire, engines=u.targets).as_dict(),
                   retries=0)
    # the moment each engine went STALE it was already out of the router (the real
    # router's /workers), and the fleet's version did not move
    assert sorted(url for url, _ in stale_checks) == sorted(urls)
    assert all(url not in routed for url, routed in stale_checks)
    assert int(fleet.version) == 1
    # resynced from the last push (the model is unchanged since), then routed again
    assert fleet.wait_recovered(timeout=120)
    deadline = time.monotonic() + 60
    while routed_urls(fleet) != urls and time.monotonic() < deadline:
        time.sleep(0.2)
    assert routed_urls(fleet) == urls
    assert set(fleet.states().values()) == {"REGISTERED"}
    for e in fleet.engines:
        assert e.handle.weight_version() == "1"
    # and they serve the pushed weights again, not the half-written ones
    assert checksums(fleet) == pushed
    weights.close()


def checksums(fleet) -> dict[str, str]:
    return {e.engine_id: e.handle.weights_checker()["ranks"][0]["per_gpu_checksum"]
            for e in fleet.engines}


def test_a_retry_leaves_out_an_engine_that_stopped_answering(fleet, tiny_model_dir):
    """A SIGSTOPped engine fails the first attempt (its pause times out); the retry goes
    to the engines that answer, and the stopped one is brought to the version afterwards."""
    import os
    import signal

    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    # No health monitor here to kill the stopped engine: the transfer already sent to it
    # ends when the group times out (gloo), so keep that short.
    weights = FleetWeights(fleet, transport="distributed", http_timeout_s=3.0, group_timeout_s=5.0)
    weights.push(model)
    frozen, other = fleet.engines[0], fleet.engines[1]
    pid = ray.get(frozen.actors[0].server_pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        report = fleet.sync(lambda u: weights.sync.update(model, u.version.wire,
                                                          engines=u.targets).as_dict(),
                            retries=2)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert report["engines"] == [other.url]
    assert int(fleet.version) == 2 and other.handle.weight_version() == "2"
    # the stopped engine rejoins at the new version (resynced, or relaunched if the health
    # monitor gave it up meanwhile)
    wait_all_registered(fleet)
    assert {e.handle.weight_version() for e in fleet.engines} == {"2"}
    weights.close()


def test_a_retry_leaves_out_an_engine_whose_scheduler_is_busy(fleet, tiny_model_dir):
    """An engine that answers /ping but whose scheduler is held (here: inside another
    group's rendezvous, as a real engine stuck in a collective would be) never answers its
    join of the first sync's group; the retry goes to the others, and the held one catches
    up once it is free."""
    import gc
    import threading

    from slime_like.engine.address import EngineAddress
    from slime_like.engine.session import EngineSession
    from slime_like.protocol import io_struct as p
    from slime_like.protocol.weight_group import host_store

    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = FleetWeights(fleet, transport="distributed", group_timeout_s=3.0)
    held_engine, other = fleet.engines[0], fleet.engines[1]
    held = {"store": host_store(2, 600.0, host="127.0.0.1")}
    join = p.InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1", master_port=held["store"].port, rank_offset=1,
        world_size=2, group_name="held", backend="gloo")
    client = EngineSession(EngineAddress(held_engine.url, api_key=held_engine.handle.api_key,
                          admin_api_key=held_engine.handle.admin_api_key))
    stuck = threading.Thread(target=_quietly, args=(client.init_weights_update_group, join, 700),
                             daemon=True)
    stuck.start()
    time.sleep(1.0)
    try:
        assert held_engine.handle.ping(timeout=2.0)  # it still answers /ping
        report = weights.push(model)  # the fleet's sync, retried for the living
        assert report["engines"] == [other.url]
        assert int(fleet.version) == 1 and other.handle.weight_version() == "1"
        assert fleet.states()[held_engine.engine_id] in ("LOADED", "STALE", "UPDATING")
    finally:
        held.clear()  # its scheduler is free again
        gc.collect()
        stuck.join(timeout=30)
    wait_all_registered(fleet)
    assert {e.handle.weight_version() for e in fleet.engines} == {"1"}
    weights.close()


def _quietly(fn, *args) -> None:
    with contextlib.suppress(Exception):  # the held call fails once its store closes
        fn(*args)


def test_a_router_relaunched_while_an_engine_hangs_lets_go_of_it_without_holding_the_fleet(
        fleet, tiny_model_dir):
    """The router dies while one engine is SIGSTOPped. The fleet relaunches it and re-adds
    both engines at once: the answering one is routed again; the hung one is given up after
    REROUTE_TIMEOUT_S, not the 60 s registration timeout (the fleet's lock is held during
    the re-add, which kept the health monitor from finding it), and goes STALE. Once it
    answers again it resyncs and rejoins, never registered at its old version."""
    import os
    import signal
    import threading

    from slime_like.chaos import kill_router
    from slime_like.fleet.supervision import REROUTE_TIMEOUT_S

    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = FleetWeights(fleet, transport="distributed", http_timeout_s=5.0, group_timeout_s=5.0)
    weights.push(model)
    hung, other = fleet.engines[0], fleet.engines[1]
    given_up, reasons = threading.Event(), []

    def on_event(event) -> None:
        if event.subject == hung.engine_id and event.kind is EngineState.STALE:
            reasons.append(str(event.details.get("reason")))
            given_up.set()

    fleet.subscribe(on_event)
    pid = ray.get(hung.actors[0].server_pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        kill_router(fleet)
        # well before the 60 s registration timeout would have let go of the fleet's lock
        assert given_up.wait(REROUTE_TIMEOUT_S + 20), "the hung engine held the re-add"
        assert reasons[0].startswith("router restart"), reasons
        assert routed_urls(fleet) == {other.url}
        weights.push(model)  # the fleet moves on without it (its pause times out)
        assert other.handle.weight_version() == fleet.version.wire == "2"
    finally:
        os.kill(pid, signal.SIGCONT)
    # It was never registered while hung (a registration the router is left probing
    # cannot be cancelled and would land now, at version 1): it is routed only once resynced.
    served_while_listed = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if hung.url in routed_urls(fleet):
            served_while_listed.append(hung.handle.weight_version())
        time.sleep(0.1)
    assert set(served_while_listed) <= {"2"}, served_while_listed
    wait_all_registered(fleet)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    weights.close()


def test_a_router_relaunched_during_a_sync_that_then_fails_routes_no_engine_at_its_weights(
        fleet, tiny_model_dir):
    """Found by the fully-async chaos short form: the router dies while a sync holds the
    engines paused, and the sync fails after they took its weights. A paused engine answers
    no health check, and sglang-router cannot cancel a registration it is still probing (a
    DELETE does nothing; it lands once the engine answers): re-added then, the engines
    entered the new router at the failed sync's weights when the sync continued them. Now
    they are not re-added until their sync settles: never listed at those weights, then
    resynced and routed at the fleet's version."""
    from slime_like.chaos import kill_router

    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = FleetWeights(fleet, transport="distributed")
    weights.push(model)
    version = fleet.version.wire
    restarts = len(fleet.routers.restarts)
    listed_versions: list[set[str]] = []

    def sample_router(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            listed = {e.url for e in fleet.engines} & routed_urls(fleet)
            listed_versions.append({e.handle.weight_version() for e in fleet.engines
                                    if e.url in listed})
            time.sleep(0.2)

    def sync_that_fails(update):
        for h in update.targets:
            h.pause_generation("retract")
        kill_router(fleet)
        deadline = time.monotonic() + 60
        while len(fleet.routers.restarts) == restarts:  # relaunched, engines re-added
            assert time.monotonic() < deadline, "the router was not relaunched"
            time.sleep(0.1)
        perturbed = {name: t + 1.0 for name, t in ModelWeights(model).tensors()}
        weights.sync.update(perturbed, update.version.wire, engines=update.targets)  # continues
        sample_router(3.0)  # a registration left probing would land now
        raise WeightSyncError("end_weight_update", "the trainer failed after the transfer")

    with pytest.raises(WeightSyncError, match="failed after the transfer"):
        fleet.sync(sync_that_fails, retries=0)
    sample_router(3.0)
    assert fleet.version.wire == version
    assert all(v <= {version} for v in listed_versions), listed_versions
    wait_all_registered(fleet)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    assert {e.handle.weight_version() for e in fleet.engines} == {version}
    weights.close()
