"""Typed slices of the job's configuration, built once from the parsed flags.

Each component takes its own slice (torchtitan style) instead of the whole argparse
namespace, so what a component depends on is visible in its signature, and the public
API (`slime_like.api`) can build the same slices without our command line. The fleet's
slices (engines, routers, health) are in `config/fleet_slices.py`; these are the job's own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.async_flags import staleness_bound
from slime_like.config.fleet_slices import EngineSettings, engine_settings
from slime_like.protocol.modes import DEFAULT_PAUSE_MODE, AsyncMode, PauseMode


@dataclass(frozen=True)
class PlacementSettings:
    """What placement needs: the resolved topology and the placement group's layout."""

    topology: Any          # config.topology.Topology
    layout: Any            # config.layout.PlacementGroupLayout


def placement_settings(args: argparse.Namespace) -> PlacementSettings:
    from slime_like.config.layout import layout_from_args

    return PlacementSettings(topology=args.topology, layout=layout_from_args(args))


@dataclass(frozen=True)
class TrackingSettings:
    """wandb, TensorBoard and the job's own Prometheus endpoint (`--use-*`, `--job-metrics-port`)."""

    job_metrics_port: int | None = None
    use_tensorboard: bool = False
    tensorboard_dir: str | None = None
    use_wandb: bool = False
    wandb_project: str | None = None
    wandb_group: str | None = None
    wandb_mode: str | None = None
    wandb_dir: str | None = None


@dataclass(frozen=True)
class ObserveSettings:
    """The operator's view: how many steps, how many engines to wait for, tracking, and the
    resolved flags written into config.json."""

    num_steps: int
    expected_engines: int | None
    tracking: TrackingSettings
    flags: dict[str, Any] = field(default_factory=dict)


DEFAULT_STEPS = 10  # the job's step count when --num-rollout is not given


def observe_settings(args: argparse.Namespace) -> ObserveSettings:
    plan = getattr(args, "nominal_plan", None)
    try:
        engines = len(plan.http_engines()) if plan is not None else None
    except (AttributeError, TypeError):
        engines = None
    return ObserveSettings(
        num_steps=args.num_rollout or DEFAULT_STEPS, expected_engines=engines,
        tracking=TrackingSettings(
            job_metrics_port=args.job_metrics_port, use_tensorboard=bool(args.use_tensorboard),
            tensorboard_dir=args.tensorboard_dir, use_wandb=bool(args.use_wandb),
            wandb_project=args.wandb_project, wandb_group=args.wandb_group,
            wandb_mode=args.wandb_mode, wandb_dir=args.wandb_dir),
        flags=dict(vars(args)))


@dataclass(frozen=True)
class PromptSettings:
    """Where prompts come from: `--prompt-data` (with its keys) or the toy task."""

    prompt_data: str | None = None
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str | None = None
    apply_chat_template: bool = False
    shuffle: bool = False
    rollout_seed: int = 42
    seed: int = 1234


def prompt_settings(args: argparse.Namespace) -> PromptSettings:
    return PromptSettings(prompt_data=args.prompt_data, input_key=args.input_key,
                          label_key=args.label_key, metadata_key=args.metadata_key,
                          apply_chat_template=bool(args.apply_chat_template),
                          shuffle=bool(args.rollout_shuffle), rollout_seed=args.rollout_seed,
                          seed=args.seed)


@dataclass(frozen=True)
class ChaosSettings:
    """`--chaos-seed` faults, the `--simulate-engine-crash-*` demo crash and the
    `--simulate-stale-engine-at` engine that claims weights it does not serve."""

    seed: int | None = None
    faults: tuple[str, ...] = ()
    detection_grace_s: float = 3.0  # how long a routed engine may not answer
    crash_at: int | None = None
    crash_model: str | None = None
    crash_node_rank: int = 0
    stale_at: int | None = None
    partition_command: str | None = None  # the `partition` fault's (chaos/partition.py)
    partition_seconds: float = 8.0


def chaos_settings(args: argparse.Namespace) -> ChaosSettings:
    return ChaosSettings(seed=args.chaos_seed, faults=tuple(args.chaos_faults or ()),
                         # the monitor's own budget: `failures` probes in a row, each an
                         # interval apart and up to a timeout long, then the unrouting
                         detection_grace_s=args.rollout_health_check_failures
                         * (args.rollout_health_check_interval
                            + args.rollout_health_check_timeout) + 1.5,
                         crash_at=args.simulate_engine_crash_at,
                         crash_model=args.simulate_engine_crash_model,
                         crash_node_rank=args.simulate_engine_crash_node_rank,
                         stale_at=args.simulate_stale_engine_at,
                         partition_command=args.chaos_partition_command,
                         partition_seconds=args.chaos_partition_seconds)


@dataclass(frozen=True)
class RolloutSettings:
    """One step's rollout: how many prompts, samples per prompt, and how they are sampled."""

    batch_size: int = 8
    n_samples_per_prompt: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 16
    deterministic: bool = False   # sglang's --enable-deterministic-inference: seeded samples

    @property
    def sampling_params(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
                "ignore_eos": True}


@dataclass(frozen=True)
class KLSettings:
    """The KL term against a frozen reference model (slime's flags)."""

    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    kl_coef: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.use_kl_loss or self.kl_coef > 0


@dataclass(frozen=True)
class OffPolicySettings:
    """The loss's off-policy correction (slime's `--use-rollout-logprobs`, `--use-tis`, ...).

    Neither flag set: on-policy GRPO, exactly today's loss. `eps_clip_high` None means
    `eps_clip` (slime's default).
    """

    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None

    @property
    def enabled(self) -> bool:
        return self.use_rollout_logprobs or self.use_tis

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def off_policy_settings(args: argparse.Namespace) -> OffPolicySettings:
    return OffPolicySettings(use_rollout_logprobs=bool(args.use_rollout_logprobs),
                             use_tis=bool(args.use_tis), tis_clip=args.tis_clip,
                             tis_clip_low=args.tis_clip_low, eps_clip=args.eps_clip,
                             eps_clip_high=args.eps_clip_high)


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """`--over-sampling-batch-size` prompts per round, groups kept by `--dynamic-sampling-
    filter-path` (loaded with the plug-ins: `rollout.dynamic_sampling.GroupFilter`)."""

    over_sampling_batch_size: int | None = None
    filter_path: str | None = None

    def draw_size(self, batch_size: int) -> int:
        """Prompts drawn per round for a step of `batch_size` prompts."""
        return self.over_sampling_batch_size or batch_size


@dataclass(frozen=True)
class CheckpointSettings:
    """`--save DIR` every `--save-interval` steps (and after the last), `--load DIR`."""

    save: str | None = None
    save_interval: int | None = None
    load: str | None = None


@dataclass(frozen=True)
class ModelSettings:
    """What the trainer and the engines load: `--hf-checkpoint`, or a tiny model made here."""

    hf_checkpoint: str | None = None
    program: str = "reference"
    tiny_layers: int = 2
    tiny_hidden: int = 64
    tiny_intermediate: int | None = None
    seed: int = 1234
    engine_dtype: str | None = None
    engine_quantization: str | None = None  # --sglang-quantization (fp8: weights/fp8.py)


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer group: learning rate, seed, and what it moves off the GPU."""

    lr: float = 1e-6
    seed: int = 1234
    offload_train: bool = False
    offload_train_weights: bool = True  # with offload_train: the weights move too
    train_backend: str = "ddp"


@dataclass(frozen=True)
class AsyncSettings:
    """The job's schedule and what bounds and corrects its asynchrony (docs/ASYNC.md)."""

    mode: AsyncMode = AsyncMode.SYNC
    pause_mode: PauseMode = DEFAULT_PAUSE_MODE
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    max_staleness: int = 0             # versions a sample's oldest token may lag the trainer
    check_fraction: float = 1.0        # share of samples whose every token is re-checked

    @property
    def enabled(self) -> bool:
        return self.mode != AsyncMode.SYNC


def async_settings(args: argparse.Namespace) -> AsyncSettings:
    return AsyncSettings(mode=args.async_mode, pause_mode=args.pause_mode,
                         partial_rollout=bool(args.partial_rollout),
                         mask_offpolicy_in_partial_rollout=bool(
                             args.mask_offpolicy_in_partial_rollout),
                         max_staleness=staleness_bound(args),
                         check_fraction=args.logprob_check_fraction)


@dataclass(frozen=True)
class JobSettings:
    """Every slice of one job, built once from the parsed flags (`job_settings`)."""

    num_steps: int
    rollout: RolloutSettings
    kl: KLSettings
    checkpoints: CheckpointSettings
    model: ModelSettings
    trainer: TrainerSettings
    placement: PlacementSettings
    observe: ObserveSettings
    prompts: PromptSettings
    chaos: ChaosSettings
    off_policy: OffPolicySettings = OffPolicySettings()
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()
    offload_rollout: bool = False
    update_weights_interval: int = 1
    logprob_check_tolerance: float = 1e-4
    logprob_probe_tokens: int = 256
    output_dir: str | None = None
    asynchrony: AsyncSettings = AsyncSettings()
    # Plug-ins (`--custom-rm-path`, `--rollout-function-path`, ...) get slime's `args`.
    plugin_args: argparse.Namespace | None = None


def job_settings(args: argparse.Namespace) -> JobSettings:
    """The job's slices; the fleet's and the sync's are built once the model path is known."""
    return JobSettings(
        num_steps=args.num_rollout or DEFAULT_STEPS,
        rollout=RolloutSettings(batch_size=args.rollout_batch_size or 8,
                                n_samples_per_prompt=args.n_samples_per_prompt,
                                temperature=args.rollout_temperature,
                                max_new_tokens=args.rollout_max_response_len or 16,
                                deterministic=bool(args.sglang_flags.get(
                                    "enable_deterministic_inference"))),
        kl=KLSettings(use_kl_loss=bool(args.use_kl_loss), kl_loss_coef=args.kl_loss_coef,
                      kl_loss_type=args.kl_loss_type, kl_coef=args.kl_coef),
        checkpoints=CheckpointSettings(save=args.save, save_interval=args.save_interval,
                                       load=args.load),
        model=ModelSettings(hf_checkpoint=args.hf_checkpoint, program=args.engine,
                            tiny_layers=args.tiny_model_layers,
                            tiny_hidden=args.tiny_model_hidden,
                            tiny_intermediate=args.tiny_model_intermediate, seed=args.seed,
                            engine_dtype=args.sglang_flags.get("dtype"),
                            engine_quantization=args.sglang_flags.get("quantization")),
        trainer=TrainerSettings(lr=args.lr, seed=args.seed,
                                offload_train=bool(args.offload_train),
                                offload_train_weights=args.offload_train_weights is not False,
                                train_backend=args.train_backend),
        placement=placement_settings(args), observe=observe_settings(args),
        prompts=prompt_settings(args), chaos=chaos_settings(args),
        off_policy=off_policy_settings(args),
        dynamic_sampling=DynamicSamplingSettings(
            over_sampling_batch_size=args.over_sampling_batch_size,
            filter_path=args.dynamic_sampling_filter_path),
        offload_rollout=bool(args.offload_rollout),
        update_weights_interval=args.update_weights_interval,
        logprob_check_tolerance=args.logprob_check_tolerance,
        logprob_probe_tokens=args.logprob_check_probe_tokens,
        output_dir=args.output_dir, asynchrony=async_settings(args), plugin_args=args)


@dataclass(frozen=True)
class DryRunSettings:
    """What `--dry-run` prints: the nominal plan, the models, and how engines start."""

    plan: Any                       # config.layout.JobPlan over nominal bundles
    topology: Any                   # config.topology.Topology
    gpus_per_node: int
    engine: EngineSettings
    external_addrs: tuple[str, ...] = ()


def dry_run_settings(args: argparse.Namespace) -> DryRunSettings:
    return DryRunSettings(plan=args.nominal_plan, topology=args.topology,
                          gpus_per_node=args.num_gpus_per_node, engine=engine_settings(args),
                          external_addrs=tuple(args.rollout_external_engine_addrs or ()))
