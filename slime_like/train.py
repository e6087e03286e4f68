"""The job: placement -> fleet -> trainer group -> first sync -> {rollout, train, sync}.

    python -m slime_like.train --config configs/quickstart.yaml

Each step takes prompts (the toy task's, or `--prompt-data`), generates through the router
(or `--rollout-function-path`), scores the completions (`--custom-rm-path`), checks that
the trainer's log-probabilities of the sampled tokens equal the engines' at the same weight
version (a stale or corrupt sync shows at once), takes one GRPO step and pushes the new
weights into every engine; with `--save` it checkpoints, and with `--load` it resumes after
the saved step with the engines serving the loaded weights. Engine deaths are handled by
the fleet in the background (see `rollout/fleet.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import ray

from slime_like.chaos import ChaosMonkey, InvariantSampler, plan_faults
from slime_like.cluster.placement import place_job
from slime_like.config.layout import layout_from_args
from slime_like.config.parse import parse_args
from slime_like.config.slices import fleet_settings, make_keys, sync_settings
from slime_like.dry_run import describe
from slime_like.errors import ConfigError, SlimeLikeError
from slime_like.job_inputs import (
    preflight,
    prepare_inputs,
    save_checkpoint,
    save_due,
    weight_versions,
)
from slime_like.observe import RunObservers
from slime_like.protocol.weight_version import WeightVersion
from slime_like.report import sync_metrics
from slime_like.rollout.fleet import Fleet
from slime_like.rollout.generate import Sample
from slime_like.trainer.group import TrainerGroup
from slime_like.trainer.grpo import group_advantages

logger = logging.getLogger("slime_like.train")


class ChaosViolation(SlimeLikeError):
    """A chaos run saw an engine routed while stale or unreachable."""


class LogprobMismatch(SlimeLikeError):
    """Engine and trainer disagree on the log-probability of sampled tokens."""


def init_ray(args: argparse.Namespace) -> None:
    """Join the cluster this job was submitted to, or start a local one on this machine.

    A local cluster on a machine without GPUs declares as many GPUs as the placement group
    has bundles, so placement runs the same code it runs on a GPU cluster.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=True)
        return
    bundles = layout_from_args(args).num_bundles
    try:
        import torch

        has_gpus = torch.cuda.is_available()
    except ImportError:
        has_gpus = False
    # address="local": a new cluster of our own, never one that `ray start` left running
    ray.init(address="local", num_cpus=max(4, bundles + 2),
             num_gpus=None if has_gpus else bundles, include_dashboard=False, log_to_driver=True)


def check_logprobs(samples: list[Sample], trainer: TrainerGroup, version: int,
                   tolerance: float, temperature: float = 1.0) -> float:
    """Largest |engine - trainer| logprob over the step's samples, all made at `version`.

    Syncs happen between steps, so every sample must claim the fleet's version; one that
    claims another is a stale serve, and fails the run like a log-probability mismatch.
    With --update-weights-interval > 1 the trainer has moved past `version` by the later
    steps of an interval; it answers from the copy of the served weights it kept at the
    last sync, so the comparison is always at the version the samples claim. Engines report
    logprobs of the temperature-scaled distribution; the trainer scales the same way.
    Every model token is compared, in every turn of a multi-turn sample; the tokens an
    environment inserted (`loss_mask` 0) carry no engine logprob and are skipped.
    """
    stale = sorted({s.weight_version for s in samples if s.weight_version != str(version)})
    if stale:
        raise LogprobMismatch(f"stale serve: samples made at weight version(s) {stale} while "
                              f"the fleet serves {version}")
    current = samples
    if not current:
        return float("nan")
    ours = trainer.completion_logprobs([(s.prompt_ids, s.output_ids) for s in current], version,
                                       temperature)
    worst = 0.0
    for s, lp in zip(current, ours, strict=True):
        for a, b, model_token in zip(s.output_logprobs, lp, s.model_token_mask(), strict=True):
            if model_token:
                worst = max(worst, abs(a - b))
    if worst > tolerance:
        raise LogprobMismatch(f"engine vs trainer log-probabilities differ by {worst:.3g} "
                              f"(> {tolerance:g}) at weight version {version}: the engines "
                              "do not serve the trainer's weights")
    return worst


def crash_midway(fleet: Fleet, total: int, model: str | None = None, node_rank: int = 0):
    """An `on_sample` hook that kills the first engine of `model` (its server on `node_rank`)
    once a quarter of the samples are back."""
    def on_sample(done: int) -> None:
        if done == max(1, total // 4):
            threading.Thread(target=fleet.kill_engine, args=(0,),
                             kwargs={"model": model, "node_rank": node_rank},
                             name="simulated-crash", daemon=True).start()
    return on_sample


def reference_kl(args: argparse.Namespace, fleet: Fleet, samples: list[Sample],
                 rewards: list[float]) -> tuple[list[list[float]] | None, dict]:
    """The frozen reference model's logprobs of the sampled tokens (through its router), the
    --kl-coef reward shaping (in place), and the step's KL metrics; (None, {}) without KL."""
    if not (args.use_kl_loss or args.kl_coef > 0):
        return None, {}
    ref = fleet.token_logprobs([(s.prompt_ids, s.output_ids) for s in samples],
                               fleet.reference_model)
    per_sample = [sum(a - b for a, b, m in zip(s.output_logprobs, r, s.model_token_mask(),
                                               strict=True) if m)
                  for s, r in zip(samples, ref, strict=True)]
    tokens = sum(sum(s.model_token_mask()) for s in samples) or 1
    out = {"kl_ref": sum(per_sample) / tokens, "kl_model": fleet.reference_model}
    if args.kl_coef > 0:
        for i, kl in enumerate(per_sample):
            rewards[i] -= args.kl_coef * kl
        out["kl_reward_penalty"] = args.kl_coef * sum(per_sample) / len(per_sample)
    return ref, out


def refuse_what_the_job_cannot_run(args: argparse.Namespace) -> None:
    """Placement modes the Python API uses but the job cannot run, refused with one line."""
    if args.debug_rollout_only:
        raise ConfigError("--debug-rollout-only", "not supported by the job: every step checks "
                                                  "the engines' samples against the trainer "
                                                  "(slime_like.api.launch_fleet places engines "
                                                  "only)")


def train(args: argparse.Namespace) -> int:
    """Run the job described by parsed flags; 0 on success.

    inputs -> placement -> fleet -> trainer group -> first sync -> {rollout, check, train,
    sync, save}.
    """
    refuse_what_the_job_cannot_run(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    plugins = preflight(args)  # a bad prompt file or plug-in fails before anything
    obs = RunObservers.from_args(args, out)  # report folder, tracking, progress
    inputs = prepare_inputs(args, out, plugins)
    model_path, source, resume = inputs.model_path, inputs.source, inputs.resume
    init_ray(args)
    placement = place_job(args, timeout_s=300)
    keys = make_keys(args)
    # The updatable model serves the job's checkpoint (or tiny model); a frozen model
    # without a model_path of its own serves it too (e.g. the reference of a KL term).
    own = [m.name for m in args.topology.models if m.update_weights or not m.model_path]
    fleet = Fleet(fleet_settings(args, log_dir=str(out / "logs"), keys=keys,
                                 model_paths={m: model_path for m in own}),
                  placement, on_event=obs.on_event)
    trainer: TrainerGroup | None = None
    n = args.n_samples_per_prompt
    sampling = {"temperature": args.rollout_temperature,
                "max_new_tokens": args.rollout_max_response_len or 16, "ignore_eos": True}
    notes: list[str] = []
    try:
        fleet.start()
        for model, router in fleet.routers.items():
            obs.add_router(model, router.prometheus_url)
        trainer = TrainerGroup(placement, model_path, lr=args.lr, seed=args.seed,
                               sync=sync_settings(args, model_path),
                               use_transformers=bool(args.hf_checkpoint),
                               engine_dtype=args.sglang_flags.get("dtype"),
                               keep_served=args.update_weights_interval > 1)
        fleet.set_weight_source(trainer.push_weights)
        start, first_version = 0, None
        if resume is not None:
            trainer.load_checkpoint(str(resume.path), resume.state.weight_version)
            start = resume.state.step + 1
            # The engines get the loaded weights as the loaded version before serving (a
            # new version only if they were trained after their last sync).
            first_version = WeightVersion(resume.state.weight_version
                                          + (0 if resume.state.weights_synced else 1))
            notes.append(f"resumed from {resume.path.name} (step {resume.state.step}, weight "
                         f"version {resume.state.weight_version})")
        with obs.progress.syncing("first weight sync"):
            first = fleet.sync(trainer.push_weights, version=first_version)
        logger.info("first sync: version %s in %.3fs", first["weight_version"], first["total_s"])
        monkey = sampler = None
        if args.chaos_seed is not None:
            updatable_engines = [e for e in fleet.engines if e.update_weights]
            monkey = ChaosMonkey(fleet, plan_faults(args.chaos_seed, args.chaos_faults,
                                                    args.num_rollout or 10,
                                                    len(updatable_engines)), trainer)
            sampler = InvariantSampler(fleet, unreachable_grace_s=(
                args.rollout_health_check_interval + args.rollout_health_check_timeout + 1.5)
            ).start()

        num_rollout = args.num_rollout or 10
        for step in range(start, num_rollout):
            t0 = time.time()
            prompts = source.next_batch(args.rollout_batch_size or 8)
            hook = (crash_midway(fleet, len(prompts) * n, args.simulate_engine_crash_model,
                                 args.simulate_engine_crash_node_rank)
                    if step == args.simulate_engine_crash_at else None)
            offload = trainer.offload() if args.offload_train else {}
            if monkey is not None:
                hook = monkey.rollout_hook(step, len(prompts) * n) or hook
            samples = plugins.rollout(args, step, prompts, router_url=fleet.router_url(),
                                      sampling_params=sampling, n=n, tokenizer=inputs.tokenizer,
                                      on_sample=hook, api_key=fleet.settings.router.api_key,
                                      generate=fleet.generate)
            if args.offload_train:
                trainer.onload()
            rollout_s = time.time() - t0
            rewards = plugins.rewards(args, samples)
            ref_logprobs, kl_metrics = reference_kl(args, fleet, samples, rewards)
            advantages = group_advantages(rewards, n)
            worst = check_logprobs(samples, trainer, int(fleet.version),
                                   args.logprob_check_tolerance, args.rollout_temperature)
            pairs = [(s.prompt_ids, s.output_ids) for s in samples]
            kl = {"ref_logprobs": ref_logprobs, "kl_loss_coef": args.kl_loss_coef,
                  "kl_loss_type": args.kl_loss_type} if args.use_kl_loss else {}
            with (fleet.offloaded() if args.offload_rollout else contextlib.nullcontext()) \
                    as released:
                masks = ([s.loss_mask for s in samples]
                         if any(s.loss_mask is not None for s in samples) else None)
                train_metrics = trainer.train_step(pairs, advantages, loss_masks=masks,
                                                   temperature=args.rollout_temperature, **kl)
            sync = {}
            if (step + 1) % args.update_weights_interval == 0:
                if monkey is not None:
                    monkey.arm_sync(step)
                with obs.progress.syncing():
                    sync = fleet.sync(trainer.push_weights)
            obs.log_step(step, {
                "reward_mean": sum(rewards) / len(rewards),
                "rollout_s": round(rollout_s, 3),
                "sync_s": round(sync.get("total_s", 0.0), 4),
                "weight_version": int(fleet.version),
                "logprob_max_abs_diff": worst,
                "samples_requested": len(prompts) * n,
                "samples_returned": len(samples),
                "response_len_mean": sum(len(s.output_ids) for s in samples) / max(1, len(samples)),
                "logprob_checked_tokens": sum(sum(s.model_token_mask()) for s in samples),
                "env_tokens": sum(len(s.output_ids) - sum(s.model_token_mask()) for s in samples),
                "requests_resubmitted": fleet.last_generation.get("resubmitted", 0),
                "retried_requests": sum(s.attempts > 1 for s in samples),
                "sample_weight_versions": weight_versions(samples),
                "engines": fleet.states(),
                **({"engines_offloaded": released} if args.offload_rollout else {}),
                **({"trainer_offloaded": offload.get("trainer_offloaded")}
                   if args.offload_train else {}),
                **kl_metrics,
                **train_metrics,
                **sync_metrics(sync),
            })
            if save_due(args, step, num_rollout):
                save_checkpoint(args.save, step, trainer, int(fleet.version), bool(sync), source)
            logger.info("step %d: reward %.3f, rollout %.2fs, sync %.3fs, logprob diff %.2g, "
                        "engines %s", step, sum(rewards) / len(rewards), rollout_s,
                        sync.get("total_s", 0.0), worst, fleet.states())
        if not fleet.wait_recovered(timeout=300):
            notes.append("a recovery was still running at the end of the run")
        if sampler is not None and monkey is not None:
            found = sampler.stop()
            chaos = {"seed": args.chaos_seed, "faults": monkey.summary(), **found,
                     "recoveries": fleet.recoveries, "router_restarts": fleet.router_restarts}
            (out / "chaos.json").write_text(json.dumps(chaos, indent=1))
            notes.append(f"chaos: {len(monkey.faults)} faults, {found['samples']} router "
                         f"samples, {len(found['violations'])} invariant violations")
            if found["violations"]:
                raise ChaosViolation(f"{len(found['violations'])} invariant violations; first: "
                                     f"{found['violations'][0]}")
        for r in fleet.recoveries:
            notes.append(f"recovery of {r['engine']}: " + (
                f"{r['recovery_s']} s from death to serving version {r['version']}"
                if "recovery_s" in r else f"FAILED: {r['error']}"))
        return 0
    finally:
        if trainer is not None:
            trainer.shutdown()
        fleet.shutdown()
        placement.release()
        path = obs.close(title="slime_like run", notes=notes)
        logger.info("report: %s", path)


PROG = "slime-like train"


def main(argv: list[str] | None = None) -> int:
    """`slime-like train`: parse and validate the flags, then run the job (or `--dry-run`)."""
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            refuse_what_the_job_cannot_run(args)
            preflight(args)
        except ConfigError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        print(describe(args))
        return 0
    try:
        return int(train(args) or 0)
    except ConfigError as e:  # a bad prompt file, plug-in, checkpoint, or a missing tracker
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
