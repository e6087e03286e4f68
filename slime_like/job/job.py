"""The job: inputs -> placement -> fleet -> trainer group -> first sync -> steps -> the end.

    Job(job_settings(args)).run()

Each step is named methods read top to bottom: `rollouts.make` (prompts from the prompt
source, the rollout function, default `fleet.generate`: `job/rollouts.py`), `score` (the reward function, and the
frozen reference's KL term), `check` (the engines' log-probabilities of the sampled tokens
equal the trainer's at the same weight version: a stale or corrupt sync shows at once),
`train` (one GRPO step; colocated engines give their memory back meanwhile) and `sync`
(the new weights into every engine), then `log` and `save`. A schedule of another shape
(asynchronous RL) reuses the same steps in another order. Engine deaths are handled by the
fleet in the background (`fleet/recovery.py`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slime_like.chaos import (
    ChaosMonkey,
    InvariantSampler,
    Partitioner,
    loseable_nodes,
    partitioner_for,
    plan_faults,
    revert_weights,
    simulated_crash,
)
from slime_like.chaos.served import stale_serves
from slime_like.cluster.placement import JobPlacement, place_job
from slime_like.config.fleet_slices import FleetSettings
from slime_like.config.slices import JobSettings
from slime_like.errors import ConfigError, SlimeLikeError
from slime_like.fleet.fleet import Fleet
from slime_like.job.checkpoints import save_checkpoint, save_due
from slime_like.job.checks import LogprobCheck, StepChecker, weight_versions
from slime_like.job.inputs import JobInputs, prepare_inputs
from slime_like.job.kl import reference_kl
from slime_like.job.rollouts import StepRollouts
from slime_like.job.samples import Rollout, staleness_of, train_masks
from slime_like.job.scaling import ScaleWatcher
from slime_like.job.schedules import client_view, run_schedule
from slime_like.observe.fleet_view import states_summary
from slime_like.observe.observers import RunObservers
from slime_like.observe.report import sync_metrics
from slime_like.protocol.weight_version import WeightVersion
from slime_like.rollout.dynamic_sampling import GroupFilter
from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import Plugins
from slime_like.rollout.producer import RolloutProducer
from slime_like.submit.connect import init_ray
from slime_like.trainer.group import TrainerGroup
from slime_like.trainer.grpo import group_advantages
from slime_like.weights.sync_config import WeightSyncConfig

logger = logging.getLogger("slime_like.train")


class ChaosViolation(SlimeLikeError):
    """A chaos run saw an engine routed while stale or unreachable."""


@dataclass
class Scores:
    """The step's rewards (KL-shaped where asked), advantages and the reference's logprobs."""

    rewards: list[float]
    advantages: list[float]
    ref_logprobs: list[list[float]] | None
    kl_metrics: dict[str, Any]


class Job:
    """One RL job built from its typed settings; `run()` is the whole of it."""

    def __init__(self, settings: JobSettings, fleet_settings: FleetSettings,
                 sync_settings: WeightSyncConfig, plugins: Plugins, out_dir: Path,
                 group_filter: GroupFilter | None = None):
        self.settings = settings
        self.checker = StepChecker(settings)
        self.out = out_dir
        self.plugins = plugins
        # --dynamic-sampling-filter-path: which prompt groups are trained on.
        self.group_filter = group_filter or GroupFilter()
        self._fleet_settings = fleet_settings
        self._sync_settings = sync_settings
        self.notes: list[str] = []
        self.obs: RunObservers | None = None
        self.inputs: JobInputs | None = None
        self.placement: JobPlacement | None = None
        self.fleet: Fleet | None = None
        self.trainer: TrainerGroup | None = None
        self.rollouts: StepRollouts | None = None
        self.start_step = 0
        self.chaos: ChaosMonkey | None = None
        self.sampler: InvariantSampler | None = None
        self.crash: ChaosMonkey | None = None
        self.partitioner: Partitioner | None = None  # the chaos fault `partition`
        self.utilization = None
        self.producer: RolloutProducer | None = None  # the fully-async schedule's, while it runs
        self.scaler: ScaleWatcher | None = None  # the operator's scale commands
        self._step_started = 0.0
        self.phases: dict[str, float] = {}  # this step's phase seconds (docs/COLOCATE.md)
        self._weight_bytes = 0  # what one engine's weights take (from the last sync)

    # ---- the whole job -----------------------------------------------------------------------

    def run(self) -> int:
        """Run every step; 0 on success. Whatever happens, everything started is stopped."""
        self.obs = RunObservers.start(self.settings.observe, self.out)
        ended = None
        try:
            self.prepare()
            self.place()
            self.launch()
            self.first_sync()
            self.start_chaos()
            self.start_utilization()
            self.scaler = ScaleWatcher(self.fleet, self.out).start()  # `slime-like fleet scale`
            run_schedule(self)
            self.finish()
            return 0
        except BaseException as err:
            ended = f"the job failed ({type(err).__name__}: {err})"
            raise
        finally:
            self.close(ended)

    def prepare(self) -> None:
        """The model, its tokenizer, the prompt source (at the resumed position)."""
        self.inputs = prepare_inputs(self.settings, self.out, self.plugins)

    def place(self) -> None:
        """Ray (the submitted-to cluster, or a local one), then the placement group."""
        init_ray(self.settings.placement.layout.num_bundles)
        self.placement = place_job(self.settings.placement, timeout_s=300)
        self.partitioner = partitioner_for(self.settings.chaos, self.placement.plan)

    def launch(self) -> None:
        """The fleet (routers, engines) and the trainer group on its slots, started side by
        side: each is seconds of process start-up (imports, a model) that need not wait for
        the other. Colocated, the trainer starts after the engines, as in slime: an engine
        sizes its KV cache from the memory it finds free."""
        model_path = self.inputs.model_path
        # The updatable model serves the job's checkpoint (or tiny model); a frozen model
        # without a model_path of its own serves it too (e.g. the reference of a KL term).
        own = [m.name for m in self.settings.placement.topology.models
               if m.update_weights or not m.model_path]
        fleet_settings = replace(self._fleet_settings, model_paths={m: model_path for m in own})
        self.fleet = Fleet(fleet_settings, self.placement, on_event=self.obs.on_event)
        layout = self.settings.placement.layout
        side_by_side = layout.rollout_offset >= layout.num_trainer_slots
        with ThreadPoolExecutor(1, thread_name_prefix="trainer-start") as pool:
            trainer = pool.submit(self.start_trainer, model_path) if side_by_side else None
            try:
                self.fleet.start()
            except BaseException:
                if trainer is not None:  # started or not, it is shut down by close()
                    with contextlib.suppress(Exception):
                        self.trainer = trainer.result()
                raise
            self.trainer = trainer.result() if trainer is not None else \
                self.start_trainer(model_path)
        for model, router in self.fleet.routers.items():
            self.obs.add_router(model, router.prometheus_url)
        self.fleet.set_weight_source(self.trainer.push_weights)
        self.rollouts = StepRollouts(self.settings, self.plugins, self.group_filter,
                                     self.inputs, self.fleet, self.trainer, self.fault_hooks)

    def start_trainer(self, model_path: str) -> TrainerGroup:
        """The trainer group's ranks on their slots, each with the job's model loaded."""
        trainer = self.settings.trainer
        return TrainerGroup(
            self.placement, model_path, lr=trainer.lr, seed=trainer.seed,
            sync=replace(self._sync_settings, model_dir=model_path),
            use_transformers=bool(self.settings.model.hf_checkpoint),
            engine_dtype=self.settings.model.engine_dtype,
            keep_versions=self.kept_versions(), backend=trainer.train_backend,
            engine_quantization=self.settings.model.engine_quantization)

    def fault_hooks(self, step: int, total: int) -> list:
        """This step's rollout hooks of the demo crash and the chaos plan (both may fire)."""
        return [h for m in (self.crash, self.chaos) if m and (h := m.rollout_hook(step, total))]

    def kept_versions(self) -> int:
        """How many pushed versions the trainer keeps a copy of to check samples against:
        every version a sample may still claim after the trainer moved on."""
        asynchrony = self.settings.asynchrony
        if asynchrony.enabled:
            return asynchrony.max_staleness + 1
        return 1 if self.settings.update_weights_interval > 1 else 0

    def first_sync(self) -> None:
        """The engines serve the trainer's weights (after `--load`: the loaded ones, as the
        loaded version, a new one only if they were trained after their last sync)."""
        version = None
        resume = self.inputs.resume
        if resume is not None:
            self.trainer.load_checkpoint(str(resume.path), resume.state.weight_version)
            self.start_step = resume.state.step + 1
            version = WeightVersion(resume.state.weight_version
                                    + (0 if resume.state.weights_synced else 1))
            self.notes.append(f"resumed from {resume.path.name} (step {resume.state.step}, "
                              f"weight version {resume.state.weight_version})")
        with self.obs.progress.syncing("first weight sync"):
            first = self.push_weights(version)
        logger.info("first sync: version %s in %.3fs", first["weight_version"], first["total_s"])

    def start_utilization(self) -> None:
        """Engine busy/idle sampled from the engines' loads, trainer phases marked by
        `learn`: the idle ratios and the utilization picture of the report."""
        fleet = self.fleet
        self.utilization = self.obs.start_utilization(
            lambda: {e.engine_id: e.handle for e in fleet.engines
                     if e.handle is not None and e.update_weights},
            client=functools.partial(client_view, self))
        self._step_started = time.time()

    def start_chaos(self) -> None:
        """`--chaos-seed`: faults planned over the run, and the outside sampler started;
        `--simulate-engine-crash-at`: a plan of one fault."""
        chaos, fleet = self.settings.chaos, self.fleet
        if chaos.crash_at is not None:
            self.crash = ChaosMonkey(fleet, [simulated_crash(chaos.crash_at, chaos.crash_model,
                                                             chaos.crash_node_rank)])
        if chaos.seed is None:
            return
        updatable = [e for e in fleet.engines if e.update_weights]
        if "node" in chaos.faults and not loseable_nodes(fleet):
            raise ConfigError("--chaos-faults", "node: no node of this run can be lost: every "
                              "node with engines also hosts the trainer or this driver "
                              f"({sorted({p.node_ip for e in updatable for p in e.placements})})")
        self.chaos = ChaosMonkey(fleet, plan_faults(chaos.seed, list(chaos.faults),
                                                    self.settings.num_steps, len(updatable)),
                                 self.trainer, self.partitioner)
        self.sampler = InvariantSampler(fleet,
                                        unreachable_grace_s=chaos.detection_grace_s).start()

    # ---- one step ------------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """rollout -> score -> check -> train -> sync, then log and save."""
        self.learn(step, self.rollouts.make(step))

    def learn(self, step: int, rollout: Rollout,
              before_sync: Callable[[], None] | None = None) -> None:
        """What the trainer does with one step's samples: score -> check -> train ->
        (`before_sync`, e.g. drain the next rollout) -> sync, then log and save. Colocated
        engines give their memory back for the check and the train step. Each phase is
        timed (docs/COLOCATE.md) and marked busy for the trainer's idle ratio; the sync's
        span goes on the utilization picture."""
        self.phases = {}
        busy = self.utilization.trainer.busy
        rollout.metrics.setdefault("staleness", staleness_of(rollout.samples,
                                                             int(self.fleet.version)))
        with busy("score"), self._phase("score"):
            scores = self.score(rollout.samples)
        # With the sync right after the train step (nothing drains in between), the engines
        # stay out of the router from their memory resume until it: it need not pause them.
        hold = before_sync is None and self.syncs_after(step)
        with busy("check"), self._phase("probe"):
            answers = self.checker.ask_engines(self.fleet, rollout.samples)
        with self.engines_released(hold_for_sync=hold) as released:
            with busy("check"), self._phase("check"):
                checked = self.checker.check(rollout.samples, self.trainer,
                                             int(self.fleet.version), step, answers)
                rollout.metrics.update(self.checker.quantization_mismatch(
                    rollout.samples, self.trainer))
            with busy("train"), self._phase("train"):
                train_metrics = self.train(rollout.samples, scores)
        if before_sync is not None:
            before_sync()
        started = time.time()
        with busy("sync"):
            sync = self.sync(step)
        if sync:
            self.utilization.record_sync(started, time.time(), int(self.fleet.version))
        rollout.metrics.update(self.utilization.step_metrics(self._step_started,
                                                             samples=len(rollout.samples)))
        rollout.metrics.setdefault("async_mode", self.settings.asynchrony.mode)
        self.phases["step_s"] = round(time.time() - self._step_started, 4)
        self._step_started = time.time()
        self.log(step, rollout, scores, checked, train_metrics, released, sync)
        self.save(step, sync)

    def score(self, samples: list[Sample]) -> Scores:
        """Rewards from the reward function (kept where dynamic sampling already scored the
        samples), shaped by the reference's KL where asked, and the group advantages."""
        if self.group_filter.enabled and all(s.reward is not None for s in samples):
            rewards = [float(s.reward) for s in samples]
        else:
            rewards = self.plugins.rewards(self.settings.plugin_args, samples)
        ref_logprobs, kl_metrics = reference_kl(self.settings.kl, self.fleet, samples, rewards)
        advantages = group_advantages(rewards, self.settings.rollout.n_samples_per_prompt)
        return Scores(rewards, advantages, ref_logprobs, kl_metrics)

    @contextlib.contextmanager
    def engines_released(self, hold_for_sync: bool = False):
        """--offload-rollout: colocated engines release their memory for the body (the
        engines released, or None). The release (device to host) overlaps the trainer's
        onload (host to device): opposite directions of the host link. `hold_for_sync`:
        a sync follows the body, so the engines stay unrouted until it (`Offload`)."""
        if not self.settings.offload_rollout:
            yield None
            return
        with self.fleet.offloaded(hold_for_sync=hold_for_sync) as released:
            yield released
        self.phases.update(self._engine_phases())

    def train(self, samples: list[Sample], scores: Scores) -> dict:
        """One GRPO step; its metrics."""
        kl = self.settings.kl
        extra = {"ref_logprobs": scores.ref_logprobs, "kl_loss_coef": kl.kl_loss_coef,
                 "kl_loss_type": kl.kl_loss_type} if kl.use_kl_loss else {}
        pairs = [(s.prompt_ids, s.output_ids) for s in samples]
        masks = train_masks(samples,
                            self.settings.asynchrony.mask_offpolicy_in_partial_rollout)
        off_policy = self.settings.off_policy
        if off_policy.enabled:  # --use-rollout-logprobs / --use-tis: the engines' logprobs
            extra.update(rollout_logprobs=[s.output_logprobs for s in samples],
                         off_policy=off_policy)
        return self.trainer.train_step(pairs, scores.advantages, loss_masks=masks,
                                       temperature=self.settings.rollout.temperature, **extra)

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[f"{name}_s"] = round(time.perf_counter() - t0, 4)

    def _engine_phases(self) -> dict[str, float]:
        """The colocated engines' release and resume; GB/s where a weights backup moved
        bytes (the engine's weights, as the last sync counted them)."""
        last = self.fleet.offload.last
        moved = self._weight_bytes if self._fleet_settings.engine.sglang_flags.get(
            "enable_weights_cpu_backup") else 0
        out: dict[str, float] = {}
        for phase in ("engine_release", "engine_resume"):
            seconds = last.get(f"{phase}_s")
            if seconds is not None:
                out[f"{phase}_s"] = round(seconds, 4)
                if moved and seconds > 0:
                    out[f"{phase}_gbps"] = round(moved / seconds / 1e9, 3)
        return out

    def syncs_after(self, step: int) -> bool:
        """Whether `step` ends with a sync (every --update-weights-interval steps)."""
        return (step + 1) % self.settings.update_weights_interval == 0

    def sync(self, step: int) -> dict:
        """Every --update-weights-interval steps: the new weights into every engine."""
        if not self.syncs_after(step):
            return {}
        if self.chaos is not None:
            self.chaos.arm_sync(step)
        with self.obs.progress.syncing():
            report = self.push_weights()
        if self.settings.chaos.stale_at == step:
            revert_weights(self.fleet, 0)
        return report

    def push_weights(self, version: WeightVersion | None = None) -> dict:
        """One full update, retried for the living engines: the fleet opens each attempt
        (targets, version), the trainer's rank 0 pushes into it."""
        for attempt in self.fleet.sync_attempts(version=version):
            with attempt as update:
                update.report = self.trainer.push_weights(update) or {}
        self._weight_bytes = (update.report.get("transfer") or {}).get("bytes") or \
            self._weight_bytes
        return update.report

    def log(self, step: int, rollout: Rollout, scores: Scores, checked: LogprobCheck,
            train_metrics: dict, released: list[str] | None, sync: dict) -> None:
        """metrics.jsonl, tracking, the console."""
        settings, fleet, samples = self.settings, self.fleet, rollout.samples
        rewards = scores.rewards
        self.obs.log_step(step, {
            "reward_mean": sum(rewards) / len(rewards),
            "rollout_s": round(rollout.seconds, 3),
            "sync_s": round(sync.get("total_s", 0.0), 4),
            "weight_version": int(fleet.version),
            **checked.metrics(),
            "samples_requested": len(rollout.prompts) * settings.rollout.n_samples_per_prompt,
            "samples_returned": len(samples),
            "response_len_mean": sum(len(s.output_ids) for s in samples) / max(1, len(samples)),
            "env_tokens": sum(len(s.output_ids) - sum(s.model_token_mask()) for s in samples),
            "requests_resubmitted": fleet.generation.last.get("resubmitted", 0),
            "retried_requests": sum(s.attempts > 1 for s in samples),
            "sample_weight_versions": weight_versions(samples),
            "engines": fleet.states(),
            **({"engines_offloaded": released} if settings.offload_rollout else {}),
            **({"trainer_offloaded": rollout.trainer_offloaded.get("trainer_offloaded")}
               if settings.trainer.offload_train else {}),
            **rollout.metrics,
            **scores.kl_metrics,
            **train_metrics,
            **sync_metrics(sync),
            **self.phases,
        })
        logger.info("step %d: reward %.3f, rollout %.2fs, sync %.3fs, logprob diff %.2g, "
                    "engines %s", step, sum(rewards) / len(rewards), rollout.seconds,
                    sync.get("total_s", 0.0), checked.worst, states_summary(fleet.states()))

    def save(self, step: int, sync: dict) -> None:
        """Every --save-interval steps (and after the last) a checkpoint."""
        checkpoints = self.settings.checkpoints
        if save_due(checkpoints, step, self.settings.num_steps):
            save_checkpoint(checkpoints.save, step, self.trainer, int(self.fleet.version),
                            bool(sync), self.inputs.source)

    # ---- the end --------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for recoveries still running (an external engine's return included: the
        run's promise is every engine back); the chaos verdict; a note per recovery."""
        fleet = self.fleet
        if not fleet.wait_recovered(timeout=300):
            self.notes.append("a recovery was still running at the end of the run")
        for engine_id in sorted(fleet.nodes.waiting):
            self.notes.append(f"{engine_id}: no room for it since its node was lost; the run "
                              "ended without it")
        if self.sampler is not None and self.chaos is not None:
            found = self.sampler.stop()
            chaos = {"seed": self.settings.chaos.seed, "faults": self.chaos.summary(), **found,
                     "recoveries": fleet.recoveries, "router_restarts": fleet.router_restarts,
                     "stale_serves": stale_serves(self.out)}  # the engines' own served logs
            (self.out / "chaos.json").write_text(json.dumps(chaos, indent=1))
            self.notes.append(f"chaos: {len(self.chaos.faults)} faults, {found['samples']} "
                              f"router samples, {len(found['violations'])} invariant violations")
            if found["violations"]:
                raise ChaosViolation(f"{len(found['violations'])} invariant violations; first: "
                                     f"{found['violations'][0]}")
        for r in fleet.recoveries:
            self.notes.append(f"recovery of {r['engine']}: " + (
                f"{r['recovery_s']} s from death to serving version {r['version']}"
                if "recovery_s" in r else f"FAILED: {r['error']}"))

    def close(self, ended: str | None = None) -> None:
        """Trainer, fleet and placement stopped (saying why, if the job failed); the report
        rendered."""
        try:
            if self.scaler is not None:
                self.scaler.stop()
            if self.trainer is not None:
                self.trainer.shutdown()
        finally:
            try:
                if self.fleet is not None:
                    self.fleet.shutdown(reason=ended)
                if self.placement is not None:
                    self.placement.release()
            finally:
                path = self.obs.close(title="slime_like run", notes=self.notes)
                logger.info("report: %s", path)
