"""Admission dispatch (`--rollout-dispatch admission`) on the real fleet: real Ray, the real
sglang-router (registration and health), two reference engines of 2 slots each
(`--max-running-requests 2`) and a queue of 1 beyond them (`--rollout-dispatch-queue 1`),
and the rollout client binding requests to free slots.

- more requests than slots: no engine ever holds more than its slots and queue (running +
  waiting, read from its own `/v1/loads` while they run), both engines serve, and a weight
  update (pause, retract, resume) in the middle loses nothing;
- an engine drained while requests run (out of the router) is given no request from the
  moment it leaves, and the other engine serves the rest.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import ray

from slime_like.api import (
    EngineSettings,
    FleetWeights,
    PauseMode,
    RouterSettings,
    Transport,
    launch_fleet,
)
from slime_like.fleet.events import EngineState
from slime_like.protocol.modes import Dispatch

FLEET_YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"
SLOTS = 2
QUEUE = 1  # requests bound to an engine beyond its slots (they wait in its own queue)
PARAMS = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}


class Occupancy:
    """Each engine's running + waiting requests as its /v1/loads says, polled until stopped;
    the largest seen per engine, and the readings after `mark()`."""

    def __init__(self, fleet):
        self.handles = {e.engine_id: e.handle for e in fleet.engines}
        self.most = dict.fromkeys(self.handles, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Occupancy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            for engine, handle in self.handles.items():
                now = handle.in_flight(timeout=5.0)
                if now is not None:
                    self.most[engine] = max(self.most[engine], now)


@pytest.fixture(scope="module")
def admitted(tmp_path_factory, tiny_model_dir):
    """The fleet at version 1, its weights and the model they come from."""
    import torch

    from slime_like.models import load_pretrained

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    fleet = launch_fleet(
        FLEET_YAML, model_path=tiny_model_dir, log_dir=tmp_path_factory.mktemp("admission"),
        engine=EngineSettings(program="reference", reference_min_step_ms=5.0,
                              sglang_flags={"max_running_requests": SLOTS}),
        router=RouterSettings(flags={"policy": "round_robin"}, dispatch=Dispatch.ADMISSION,
                              dispatch_queue=QUEUE))
    try:
        weights = FleetWeights(fleet, transport=Transport.DISTRIBUTED,
                               pause_mode=PauseMode.RETRACT, update_weight_buffer_size=1 << 20)
        model = load_pretrained(tiny_model_dir, dtype=torch.float32)
        weights.push(model)  # version 1: both engines verified, routed, given slots
        yield fleet, weights, model
    finally:
        fleet.shutdown()
        ray.shutdown()


def _generate_in_thread(fleet, prompts: int, after: int, then) -> list:
    """n=2 samples of each prompt through an open generator; `then()` runs (in this
    thread) once `after` samples are back, while the others wait or run."""
    reached = threading.Event()
    out: list = []
    with fleet.generator(keep_mixed_versions=True) as gen:
        worker = threading.Thread(target=lambda: out.extend(gen.generate(
            [[1, 72, 105 + i] for i in range(prompts)], 2, PARAMS,
            on_sample=lambda done: done >= after and reached.set())))
        worker.start()
        assert reached.wait(60), "no sample came back"
        then()
        worker.join(120)
        assert not worker.is_alive()
        assert gen.aborted == 0 and gen.resubmitted == 0
    return out


def test_no_engine_is_given_more_than_its_slots_and_a_sync_loses_nothing(admitted):
    fleet, weights, model = admitted
    slots = fleet.routers.slots[fleet.updatable_model]
    assert sorted(slots.routed()) == sorted(e.engine_id for e in fleet.engines)
    with Occupancy(fleet) as seen:
        samples = _generate_in_thread(fleet, prompts=8, after=2,
                                      then=lambda: weights.push(model))  # version 2
    assert len(samples) == 16
    assert all(s.finish_reason == "length" and len(s.output_ids) == 24 for s in samples)
    assert any("2" in s.versions() for s in samples)  # the sync landed mid-rollout
    # 16 requests for 4 slots and 2 queue places: each engine was full, never beyond
    assert seen.most == dict.fromkeys(seen.handles, SLOTS + QUEUE), seen.most
    assert all(slots.bound[e] > 0 for e in seen.handles), slots.bound
    assert set(slots.in_flight().values()) == {0}


def test_an_engine_drained_mid_rollout_is_given_nothing_from_then_on(admitted):
    fleet, _, _ = admitted
    slots = fleet.routers.slots[fleet.updatable_model]
    leaving, staying = (e.engine_id for e in fleet.engines)
    at_unroute: dict[str, int] = {}
    fleet.subscribe(lambda ev: ev.subject == leaving and ev.kind == EngineState.DRAINING
                    and at_unroute.setdefault(leaving, slots.bound[leaving]))
    before = dict(slots.bound)
    samples = _generate_in_thread(
        fleet, prompts=6, after=2,
        then=lambda: fleet.drain([leaving], deadline_s=60.0))  # its running requests finish
    assert len(samples) == 12 and all(len(s.output_ids) == 24 for s in samples)
    assert slots.routed() == [staying]
    assert slots.bound[leaving] == at_unroute[leaving]  # nothing bound after it left
    assert slots.bound[staying] - before[staying] >= 12 - (at_unroute[leaving]
                                                           - before[leaving])
