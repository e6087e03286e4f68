"""Your own trainer, our fleet: a Ray driver that launches engines from a YAML file,
generates through the router, pushes weights after each step and watches lifecycle events.

    python examples/own_trainer/train_loop.py            # reference engines on CPU
    python examples/own_trainer/train_loop.py --engine sglang --model-path /models/Qwen3-4B
    python examples/own_trainer/train_loop.py --fully-async   # generation never waits
    python examples/own_trainer/train_loop.py --fsdp 2     # the model sharded over 2 ranks

Nothing here is slime_like's trainer: the "training" is a plain torch loop over the model
the engines serve, standing in for Megatron, FSDP or a torchrl loss module. With `--fsdp N`
the model is FSDP2-sharded (`fully_shard`) over N processes: this driver is rank 0 and
N-1 spawned processes are the others; every rank calls `weights.push(model)` (collective),
and rank 0 gathers the shards bucket by bucket into the engines.
"""

from __future__ import annotations

import argparse
import tempfile
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_like.api import (
    EngineSettings,
    FleetWeights,
    LogprobChecker,
    PauseMode,
    Transport,
    launch_fleet,
)
from slime_like.cluster.ports import free_port
from slime_like.models import load_pretrained
from slime_like.models.tiny import make_tiny_model

HERE = Path(__file__).resolve().parent
BUCKET_BYTES = 1 << 20


def _join(rank: int, world: int, port: int) -> None:
    # An explicit address, not MASTER_ADDR/MASTER_PORT: processes this one starts later
    # (engines, routers) must not inherit a rendezvous that is not theirs.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=5))


def _sharded_model(model_path: str) -> torch.nn.Module:
    """The model, FSDP2-sharded over the process group: one unit per decoder layer."""
    from torch.distributed.fsdp import fully_shard

    model = load_pretrained(model_path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """Stand-in for your loss: push the logits of the sampled tokens down a little."""
    loss = model(ids).float().logsumexp(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@torch.no_grad()
def _score(model: torch.nn.Module, fleet, version: int,
           pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Per pair, the log-probability of each output token under `model`, which holds the
    fleet's current version (older ones are not kept here: the checker keeps their
    numbers)."""
    if version != int(fleet.version):
        raise LookupError(f"this loop holds only version {fleet.version}, not {version}")
    out = []
    for prompt, output in pairs:
        ids = torch.tensor([prompt + output])
        logprobs = torch.log_softmax(model(ids)[0].float(), dim=-1)
        out.append([logprobs[len(prompt) + t - 1, tok].item() for t, tok in enumerate(output)])
    return out


def fsdp_peer(rank: int, world: int, port: int, model_path: str, steps: int) -> None:
    """Ranks 1..N-1 with --fsdp N: train on the batch rank 0 shares, take part in pushes."""
    _join(rank, world, port)
    model = _sharded_model(model_path)
    weights = FleetWeights(None, update_weight_buffer_size=BUCKET_BYTES)  # no fleet here
    weights.push(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = [None]
        dist.broadcast_object_list(ids, src=0)
        _step(model, opt, torch.tensor(ids[0]))
        weights.push(model)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="reference", choices=["reference", "sglang"])
    p.add_argument("--model-path", default=None, help="HF checkpoint (default: a tiny model)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="logs folder (default: a temp dir)")
    p.add_argument("--fully-async", action="store_true",
                   help="pull batches from fleet.stream() while pushes update the engines "
                        "with requests in flight (retract)")
    p.add_argument("--fsdp", type=int, default=1, metavar="N",
                   help="shard the model with FSDP2 over N processes (gloo on CPU)")
    a = p.parse_args(argv)
    if a.fully_async and a.fsdp > 1:
        p.error("--fully-async runs one trainer process here; drop --fsdp")
    out = Path(a.out or tempfile.mkdtemp(prefix="own-trainer-"))
    model_path = a.model_path or str(make_tiny_model(out / "model", seed=0))

    if not ray.is_initialized():
        # A CPU box declares GPUs so placement runs the same code as on a GPU cluster.
        # address="local": a cluster of our own, not one that `ray start` left running.
        ray.init(address="local", num_cpus=4,
                 num_gpus=None if torch.cuda.is_available() else 2, include_dashboard=False)
    events: list[tuple[str, str]] = []  # (engine id, state name)
    fleet = launch_fleet(HERE / "fleet.yaml", model_path=model_path,
                         engine=EngineSettings(program=a.engine),
                         log_dir=out / "logs",
                         on_event=lambda ev: events.append((ev.subject, ev.kind.value)))
    peers = []
    try:
        if a.fsdp > 1:
            port = free_port()
            ctx = mp.get_context("spawn")
            peers = [ctx.Process(target=fsdp_peer, args=(r, a.fsdp, port, model_path, a.steps))
                     for r in range(1, a.fsdp)]
            for peer in peers:
                peer.start()
            _join(0, a.fsdp, port)
            model = _sharded_model(model_path)
        else:
            model = load_pretrained(model_path, dtype=torch.float32)
        weights = FleetWeights(fleet, transport=Transport.DISTRIBUTED,
                               update_weight_buffer_size=BUCKET_BYTES, pause_mode=PauseMode.RETRACT)
        weights.push(model)  # version 1: the engines are routed only now, verified
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if a.fully_async:
            return {**fully_async(fleet, weights, model, opt, a.steps), "events": events}
        served, checks = [], []
        # The job's log-probability check with this model as the trainer's side (one
        # process: with --fsdp the forward would be collective, so it is left out there).
        checker = None if a.fsdp > 1 else LogprobChecker(
            fleet, lambda version, pairs, temperature: _score(model, fleet, version, pairs))
        for step in range(a.steps):
            samples = fleet.generate([[1, 72, 105], [1, 83, 97], [1, 72, 97], [1, 83, 105]],
                                     n=2, sampling_params={"temperature": 1.0,
                                                           "max_new_tokens": 16})
            served.append(sorted({s.weight_version for s in samples}))
            if checker is not None:  # the engines serve what `model` is now, by name
                checks.append(checker.check(samples).metrics())
            ids = [[s.prompt_ids + s.output_ids for s in samples[:1]]]
            if a.fsdp > 1:
                dist.broadcast_object_list(ids, src=0)  # every rank trains on the same batch
            _step(model, opt, torch.tensor(ids[0]))
            report = weights.push(model)  # with --fsdp: every rank pushes (collective)
            print(f"step {step}: served versions {served[-1]}, pushed version "
                  f"{report['weight_version']} in {report['total_s']:.3f}s, router "
                  f"{fleet.router_url()}, engines {fleet.states()}")
        if a.fsdp == 1:  # (a sharded model's resync waits for a next push, which never comes)
            fleet.wait_recovered(timeout=120)  # an engine a push left out (hung) resynced
        weights.close()
        for peer in peers:
            peer.join(timeout=120)
        return {"served": served, "checks": checks, "version": int(fleet.version),
                "events": events,
                "states": fleet.states(), "peer_exit_codes": [p.exitcode for p in peers]}
    finally:
        for peer in peers:
            if peer.is_alive():
                peer.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        fleet.shutdown()


def fully_async(fleet, weights: FleetWeights, model, opt, steps: int) -> dict:
    """The same loop on the streaming side: batches pulled while generation goes on, each
    push an in-flight update; samples are at most one version behind."""
    prompts = ([1, 72 + i % 20, 105] for i in range(10_000))
    stale, mixed = [], 0
    with fleet.stream(prompts, n=2, batch_size=2, max_staleness=1,
                      sampling_params={"temperature": 1.0, "max_new_tokens": 24}) as stream:
        for step in range(steps):
            batch = stream.next_batch()
            stale.append(batch.staleness)
            mixed += sum(len(s.versions()) > 1 for s in batch.samples)
            ids = torch.tensor([batch.samples[0].prompt_ids + batch.samples[0].output_ids])
            loss = model(ids).float().logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            report = weights.push(model)  # requests keep running through it
            print(f"step {step}: staleness {batch.staleness}, pushed version "
                  f"{report['weight_version']}, {stream.generator.aborted} aborted")
        counts = stream.close()
    fleet.wait_recovered(timeout=120)  # an engine a push left out (hung) resynced meanwhile
    weights.close()
    return {"staleness": stale, "mixed_samples": mixed, "counts": vars(counts),
            "balanced": counts.balanced(), "version": int(fleet.version),
            "states": fleet.states()}


if __name__ == "__main__":
    main()
