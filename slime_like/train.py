"""The job: placement -> rollout manager -> trainer group -> first sync -> {rollout, train, sync}.

    python -m slime_like.train --config configs/quickstart.yaml

Each step takes prompts (the toy task's, or `--prompt-data`), generates through the router
(or `--rollout-function-path`), scores the completions (`--custom-rm-path`), checks that the trainer's log-probabilities of the sampled tokens equal the
engines' at the same weight version (a stale or corrupt sync shows at once), takes one GRPO
step and pushes the new weights into every engine; with `--save` it checkpoints, and with
`--load` it resumes after the saved step with the engines serving the loaded weights.
Engine deaths are handled by the rollout manager in the background (see `rollout/manager.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from slime_like.cluster.placement import place_job
from slime_like.config.layout import layout_from_args
from slime_like.config.parse import parse_args
from slime_like.dry_run import describe
from slime_like.errors import ConfigError, SlimeLikeError
from slime_like.models.hf_checkpoint import check_checkpoint, local_checkpoint
from slime_like.models.hf_tokenizer import Tokenizer, load_tokenizer
from slime_like.models.tiny import make_tiny_model
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.report import RunReport
from slime_like.rollout.data import PromptSource, prompt_source
from slime_like.rollout.generate import Sample
from slime_like.rollout.manager import RolloutManager
from slime_like.rollout.plugins import Plugins
from slime_like.trainer.checkpoint import (
    Checkpoint,
    JobState,
    begin_save,
    commit_save,
    latest_checkpoint,
)
from slime_like.trainer.group import TrainerGroup
from slime_like.trainer.grpo import group_advantages

logger = logging.getLogger("slime_like.train")


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
    ray.init(num_cpus=max(4, bundles + 2), num_gpus=None if has_gpus else bundles,
             include_dashboard=False, log_to_driver=True)


def sync_config(args: argparse.Namespace, model_path: str) -> dict:
    """The trainer's WeightSync settings from the job's flags."""
    transport = args.update_weight_transport
    if transport == "nccl":  # slime's name: IPC when colocated, else a broadcast group
        transport = "tensor" if args.colocate else "distributed"
    return {"transport": transport, "pause_mode": args.pause_mode,
            "update_weight_buffer_size": args.update_weight_buffer_size,
            "disk_dir": args.update_weight_disk_dir, "model_dir": model_path,
            "http_timeout_s": 120.0, "group_timeout_s": 120.0}


def sync_weights(rollout: RolloutManager, trainer: TrainerGroup, bump: bool = True) -> dict:
    """One full sync; engines pause for it and are routed again at the new version.

    A sync that fails because an engine died is retried once for the living engines (the
    weight group is rebuilt without the dead one, which recovery brings back). `bump=False`
    serves the trainer's weights under its current version (the first sync after --load).
    """
    rollout.begin_update()
    report: dict = {}
    try:
        try:
            report = trainer.sync_weights(bump)
        except Exception as e:  # noqa: BLE001 - WeightSyncError, possibly wrapped by Ray
            logger.warning("weight sync failed (%s); retrying for the living engines", e)
            report = trainer.sync_weights(bump)
    finally:
        version = int(report["weight_version"]) if report else rollout.trainer_version
        rollout.end_update(version, report.get("engines") if report else [])
    return report


def check_logprobs(samples: list[Sample], trainer: TrainerGroup, version: int,
                   tolerance: float) -> float:
    """Largest |engine - trainer| logprob over the samples made at `version`."""
    current = [s for s in samples if s.weight_version == str(version)]
    if not current:
        return float("nan")
    ours = trainer.completion_logprobs([(s.prompt_ids, s.output_ids) for s in current])
    worst = 0.0
    for s, lp in zip(current, ours, strict=True):
        for a, b in zip(s.output_logprobs, lp, strict=True):
            worst = max(worst, abs(a - b))
    if worst > tolerance:
        raise LogprobMismatch(f"engine vs trainer log-probabilities differ by {worst:.3g} "
                              f"(> {tolerance:g}) at weight version {version}: the engines "
                              "do not serve the trainer's weights")
    return worst


def weight_versions(samples: list[Sample]) -> list[int | str]:
    """The distinct weight versions the samples were generated at (ints where they are)."""
    found = {s.weight_version for s in samples}
    return sorted(int(v) for v in found) if all(v.isdigit() for v in found) else sorted(found)


def crash_midway(rollout: RolloutManager, total: int):
    """An `on_sample` hook that kills engine 0 once a quarter of the samples are back."""
    def on_sample(done: int) -> None:
        if done == max(1, total // 4):
            threading.Thread(target=rollout.simulate_crash, args=(0,), name="simulated-crash",
                             daemon=True).start()
    return on_sample


def preflight(args: argparse.Namespace) -> Plugins:
    """Checks that read files or import code, before anything starts (also for --dry-run):
    the checkpoint, the prompt file, the plug-ins, the checkpoint to resume from."""
    kind = check_checkpoint(args.hf_checkpoint) if args.hf_checkpoint else "tiny"
    if args.prompt_data and not Path(args.prompt_data).is_file():
        raise ConfigError("--prompt-data", f"no such file: {args.prompt_data}")
    if args.prompt_data and kind != "hub":  # read it: a bad line fails now, with its number
        prompt_source(args, load_tokenizer(args.hf_checkpoint) if args.hf_checkpoint
                      else ByteTokenizer())
    if args.load:
        latest_checkpoint(args.load)
    return Plugins.from_args(args)


def save_checkpoint(root: str, step: int, trainer: TrainerGroup, version: int, synced: bool,
                    source: PromptSource) -> Path:
    """Trainer ranks write into a temporary directory; the driver adds the job state and
    renames it into place (see trainer/checkpoint.py)."""
    tmp = begin_save(root, step)
    trainer.save_checkpoint(str(tmp))
    path = commit_save(tmp, JobState(step, version, synced, source.state_dict()))
    logger.info("saved step %d (weight version %d) to %s", step, version, path)
    return path


def save_due(args: argparse.Namespace, step: int, num_rollout: int) -> bool:
    """Every --save-interval steps, and after the last step (slime's rule)."""
    if not args.save:
        return False
    return bool(args.save_interval and (step + 1) % args.save_interval == 0) \
        or step == num_rollout - 1


@dataclass
class JobInputs:
    """What the job reads before anything starts: plug-ins, model, tokenizer, prompts, resume."""

    plugins: Plugins
    model_path: str
    tokenizer: Tokenizer
    source: PromptSource
    resume: Checkpoint | None


def prepare_inputs(args: argparse.Namespace, out: Path) -> JobInputs:
    """Check and load the job's inputs; the prompt source is at the resumed position."""
    plugins = preflight(args)
    if args.hf_checkpoint:
        # the reference engine reads a local directory; sglang and transformers resolve hub ids
        model_path = (local_checkpoint(args.hf_checkpoint) if args.engine == "reference"
                      else args.hf_checkpoint)
    else:
        model_path = str(make_tiny_model(out / "model", layers=args.tiny_model_layers,
                                         hidden=args.tiny_model_hidden, seed=args.seed))
    tokenizer = load_tokenizer(model_path, add_special_tokens=False)
    source = prompt_source(args, tokenizer)
    resume = resume_point(args)
    if resume is not None:
        source.load_state_dict(resume.state.data)
    return JobInputs(plugins, model_path, tokenizer, source, resume)


def resume_point(args: argparse.Namespace) -> Checkpoint | None:
    """The checkpoint `--load` resumes from; None (start afresh) if DIR has none yet."""
    if not args.load:
        return None
    found = latest_checkpoint(args.load)
    if found is None:
        logger.warning("--load %s: no checkpoint there yet; starting from step 0", args.load)
    return found


def train(args: argparse.Namespace) -> int:
    """Run the job described by parsed flags; 0 on success."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    report = RunReport(out)
    inputs = prepare_inputs(args, out)
    plugins, model_path, source, resume = (inputs.plugins, inputs.model_path, inputs.source,
                                           inputs.resume)
    init_ray(args)
    placement = place_job(args, timeout_s=300)
    rollout = RolloutManager(args, placement, model_path, out / "logs", on_event=report.log_event)
    trainer: TrainerGroup | None = None
    n = args.n_samples_per_prompt
    sampling = {"temperature": args.rollout_temperature,
                "max_new_tokens": args.rollout_max_response_len or 16, "ignore_eos": True}
    notes: list[str] = []
    try:
        rollout.start()
        trainer = TrainerGroup(placement, model_path, lr=args.lr, seed=args.seed,
                               sync_config=sync_config(args, model_path),
                               use_transformers=bool(args.hf_checkpoint),
                               engine_dtype=args.sglang_flags.get("dtype"))
        trainer.attach_engines(rollout.sync_targets())
        rollout.attach_trainer(trainer.rank0)
        start = 0
        if resume is not None:
            trainer.load_checkpoint(str(resume.path), resume.state.weight_version)
            start = resume.state.step + 1
            notes.append(f"resumed from {resume.path.name} (step {resume.state.step}, weight "
                         f"version {resume.state.weight_version})")
        # After --load the engines get the loaded weights as the loaded version before
        # serving (a new version only if they were trained after their last sync).
        first = sync_weights(rollout, trainer,
                             bump=resume is None or not resume.state.weights_synced)
        logger.info("first sync: version %s in %.3fs", first["weight_version"], first["total_s"])

        num_rollout = args.num_rollout or 10
        for step in range(start, num_rollout):
            t0 = time.time()
            prompts = source.next_batch(args.rollout_batch_size or 8)
            hook = (crash_midway(rollout, len(prompts) * n)
                    if step == args.simulate_engine_crash_at else None)
            samples = plugins.rollout(args, step, prompts, router_url=rollout.router.url,
                                      sampling_params=sampling, n=n, tokenizer=inputs.tokenizer,
                                      on_sample=hook)
            rollout_s = time.time() - t0
            rewards = plugins.rewards(args, samples)
            advantages = group_advantages(rewards, n)
            worst = check_logprobs(samples, trainer, rollout.trainer_version,
                                   args.logprob_check_tolerance)
            pairs = [(s.prompt_ids, s.output_ids) for s in samples]
            train_metrics = trainer.train_step(pairs, advantages)
            sync = {}
            if (step + 1) % args.update_weights_interval == 0:
                sync = sync_weights(rollout, trainer)
            report.log_step(step, {
                "reward_mean": sum(rewards) / len(rewards),
                "rollout_s": round(rollout_s, 3),
                "sync_s": round(sync.get("total_s", 0.0), 4),
                "weight_version": rollout.trainer_version,
                "logprob_max_abs_diff": worst,
                "retried_requests": sum(s.attempts > 1 for s in samples),
                "sample_weight_versions": weight_versions(samples),
                "engines": rollout.states(),
                **train_metrics,
            })
            if save_due(args, step, num_rollout):
                save_checkpoint(args.save, step, trainer, rollout.trainer_version, bool(sync),
                                source)
            logger.info("step %d: reward %.3f, rollout %.2fs, sync %.3fs, logprob diff %.2g, "
                        "engines %s", step, sum(rewards) / len(rewards), rollout_s,
                        sync.get("total_s", 0.0), worst, rollout.states())
        if not rollout.wait_recovered(timeout=300):
            notes.append("a recovery was still running at the end of the run")
        for r in rollout.recoveries:
            notes.append(f"recovery of {r['engine']}: " + (
                f"{r['recovery_s']} s from death to serving version {r['version']}"
                if "recovery_s" in r else f"FAILED: {r['error']}"))
        return 0
    finally:
        if trainer is not None:
            trainer.shutdown()
        rollout.shutdown()
        placement.release()
        path = report.render(title="slime_like quickstart run", notes=notes)
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
            preflight(args)
        except ConfigError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        print(describe(args))
        return 0
    try:
        return int(train(args) or 0)
    except ConfigError as e:  # a bad prompt file, plug-in or checkpoint, found before the loop
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
