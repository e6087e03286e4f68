"""The public Python API: a fleet of engines for a trainer of your own.

    import ray
    from slime_like.api import launch_fleet, FleetWeights

    ray.init()
    fleet = launch_fleet("fleet.yaml", model_path="/models/my-model", engine="sglang")
    weights = FleetWeights(fleet, transport="distributed")
    weights.push(model)                       # engines serve version 1, verified
    samples = fleet.generate(prompt_ids, n=4, sampling_params={"temperature": 1.0})
    LogprobChecker(fleet, my_score).check(samples)   # every engine by name, every sample
    fleet.subscribe(lambda event: print(event.subject, event.kind, event.details))
    with fleet.stream(prompts, n=4, sampling_params=..., batch_size=8) as stream:
        batch = stream.next_batch()           # generation never waits for your loop
        weights.push(model)                   # updated while requests run
    fleet.shutdown()

`fleet.router_url()` is the router to send your own `/generate` traffic to; the job
(`slime_like.train`) uses exactly this API with the trainer's rank 0 as weight source.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from slime_like.cluster.placement import JobPlacement, place_job
from slime_like.config.parse import parse_args
from slime_like.config.slices import fleet_settings, make_keys, placement_settings
from slime_like.errors import FleetError
from slime_like.fleet.attempts import Update
from slime_like.fleet.events import EngineState, EventSink, FleetEvent, Happening, RouterState
from slime_like.fleet.fleet import Fleet
from slime_like.fleet.push import FleetWeights
from slime_like.fleet.stream import RolloutStream
from slime_like.fleet.verify import LogprobChecker
from slime_like.protocol.weight_version import WeightVersion
from slime_like.rollout.logprob_check import LogprobCheck, LogprobMismatch
from slime_like.rollout.producer import Batch, ProducerCounts

__all__ = ["Batch", "EngineState", "Fleet", "FleetError", "FleetEvent", "FleetWeights",
           "Happening", "LogprobCheck", "LogprobChecker", "LogprobMismatch", "ProducerCounts",
           "RolloutStream", "RouterState", "Update", "WeightVersion", "launch_fleet"]


def launch_fleet(sglang_config: str | Path | None = None, *, model_path: str | Path,
                 engine: str = "sglang", flags: Sequence[str] = (),
                 log_dir: str | Path | None = None, on_event: EventSink | None = None,
                 placement_timeout_s: float = 300.0) -> Fleet:
    """Place and start the engines of `sglang_config` (slime's YAML) on the Ray cluster.

    `flags` are any of the job's flags (`--rollout-num-gpus-per-engine 2`, `--sglang-*`,
    `--router-*`, `--use-fault-tolerance`, ...). No trainer slots are placed: the caller
    trains wherever it likes. Keys are generated per fleet unless `--sglang-api-key` is set.
    """
    argv = ["--engine", engine, "--hf-checkpoint", str(model_path), "--debug-rollout-only",
            *flags]
    if sglang_config is not None:
        argv += ["--sglang-config", str(sglang_config)]
    args = parse_args(argv)
    placement: JobPlacement = place_job(placement_settings(args), timeout_s=placement_timeout_s)
    logs = Path(log_dir) if log_dir else Path("runs") / "fleet-logs"
    updatable = {m.name: str(model_path) for m in args.topology.models if m.update_weights}
    fleet = Fleet(fleet_settings(args, log_dir=str(logs.resolve()), keys=make_keys(args),
                                 model_paths=updatable), placement, on_event=on_event)
    try:
        fleet.start()
    except BaseException:
        fleet.shutdown()
        placement.release()
        raise
    fleet.on_shutdown(placement.release)
    return fleet
