"""The public Python API: a fleet of engines for a trainer of your own.

    import ray
    from slime_like.api import FleetWeights, HealthSettings, launch_fleet

    ray.init()
    fleet = launch_fleet("fleet.yaml", model_path="/models/my-model", engine="sglang",
                         health=HealthSettings(enabled=True))
    weights = FleetWeights(fleet, transport=Transport.DISTRIBUTED)
    weights.push(model)                       # engines serve version 1, verified
    samples = fleet.generate(prompt_ids, n=4, sampling_params={"temperature": 1.0})
    LogprobChecker(fleet, my_score).check(samples)   # every engine by name, every sample
    fleet.subscribe(lambda event: print(event.subject, event.kind, event.details))
    with fleet.stream(prompts, n=4, sampling_params=..., batch_size=8) as stream:
        batch = stream.next_batch()           # generation never waits for your loop
        weights.push(model)                   # updated while requests run
    fleet.add_engines(2)                      # serving at the fleet's version, verified
    fleet.drain(["policy/g0/e0"], deadline_s=30)   # no request lost; stops at the next push
    fleet.shutdown()

Settings are the job's own typed slices (`EngineSettings`, `RouterSettings`,
`HealthSettings`) and `FleetLayout`; each default is the job's flag default.
`fleet.router_url()` is the router to send your own `/generate` traffic to; the job
(`slime_like.train`) uses exactly this fleet with the trainer's rank 0 as weight source.
"""

from __future__ import annotations

from pathlib import Path

from slime_like.cluster.placement import JobPlacement, place_job
from slime_like.config.deadlines import DeadlinePolicy
from slime_like.config.fleet_config import FleetLayout, fleet_config
from slime_like.config.fleet_slices import EngineSettings, HealthSettings, RouterSettings
from slime_like.errors import FleetError
from slime_like.fleet.attempts import Update
from slime_like.fleet.draining import Drained, DrainReport
from slime_like.fleet.events import EngineState, EventSink, FleetEvent, Happening, RouterState
from slime_like.fleet.fleet import Fleet
from slime_like.fleet.push import FleetWeights
from slime_like.fleet.stream import RolloutStream
from slime_like.fleet.verify import LogprobChecker
from slime_like.protocol.modes import PauseMode, Transport, WorkerType
from slime_like.protocol.weight_version import WeightVersion
from slime_like.rollout.logprob_check import LogprobCheck, LogprobMismatch
from slime_like.rollout.producer import Batch, ProducerCounts

__all__ = ["Batch", "DeadlinePolicy", "DrainReport", "Drained", "EngineSettings",
           "EngineState", "Fleet", "FleetError", "FleetEvent", "FleetLayout", "FleetWeights",
           "Happening", "HealthSettings", "LogprobCheck", "LogprobChecker", "LogprobMismatch",
           "PauseMode", "ProducerCounts", "RolloutStream", "RouterSettings", "RouterState",
           "Transport", "Update", "WeightVersion", "WorkerType", "launch_fleet"]


def launch_fleet(sglang_config: str | Path | None = None, *, model_path: str | Path,
                 engine: str | EngineSettings = EngineSettings.program,
                 router: RouterSettings = RouterSettings(),
                 health: HealthSettings = HealthSettings(),
                 layout: FleetLayout = FleetLayout(),
                 log_dir: str | Path | None = None, on_event: EventSink | None = None,
                 placement_timeout_s: float = 300.0) -> Fleet:
    """Place and start the engines of `sglang_config` (slime's YAML) on the Ray cluster.

    `engine` is the program ("sglang" or "reference") or its whole `EngineSettings`
    (sglang's ServerArgs fields, seed, keys); `router`, `health` and `layout` default to
    what the job does without flags (no probing: `HealthSettings(enabled=True)` is
    `--use-fault-tolerance`). No trainer slots are placed: the caller trains wherever it
    likes. Keys are fresh per fleet unless the settings give them.
    """
    settings = EngineSettings(program=engine) if isinstance(engine, str) else engine
    logs = (Path(log_dir) if log_dir else Path("runs") / "fleet-logs").resolve()
    placement_settings, fleet_settings = fleet_config(
        sglang_config, model_path=str(model_path), log_dir=str(logs), engine=settings,
        router=router, health=health, layout=layout)
    placement: JobPlacement = place_job(placement_settings, timeout_s=placement_timeout_s)
    fleet = Fleet(fleet_settings, placement, on_event=on_event)
    try:
        fleet.start()
    except BaseException:
        fleet.shutdown()
        placement.release()
        raise
    fleet.on_shutdown(placement.release)
    return fleet
