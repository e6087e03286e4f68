"""Typed slices of the job's configuration, built once from the parsed flags.

Each component takes its own slice (torchtitan style) instead of the whole argparse
namespace, so what a component depends on is visible in its signature, and the public
API (`slime_like.api`) can build the same slices without our command line.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.async_flags import staleness_bound
from slime_like.config.deadlines import DeadlinePolicy
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import DEFAULT_ROUTER
from slime_like.protocol.modes import DEFAULT_PAUSE_MODE, AsyncMode, Dispatch, PauseMode

# The defaults below are the flags' defaults too (`flags.py` reads them from here), so the
# job and `slime_like.api.launch_fleet` start the same fleet unless told otherwise.
DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS = 14400  # slime's --sglang-router-request-timeout-secs


@dataclass(frozen=True)
class EngineSettings:
    """How every engine server is started: `program` "sglang" or "reference", sglang's
    ServerArgs fields by name (`{"mem_fraction_static": 0.7}`), the seed, keys (None: fresh
    ones per run)."""

    program: str = "sglang"
    sglang_flags: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    offload_rollout: bool = False
    api_key: str | None = None
    admin_api_key: str | None = None
    server_concurrency: int = 512
    reference_min_step_ms: float = 0.0  # the reference engine's step floor (its environment)


@dataclass(frozen=True)
class RouterSettings:
    """How each model's router is started and called: `kind` "sglang-router" or "smg", its
    flags by field name (`{"policy": "round_robin"}`), the key (None: the engines' API key),
    how long one /generate through it may take, and whether it or the rollout client binds
    each request to an engine (`dispatch`)."""

    kind: str = DEFAULT_ROUTER
    flags: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    #: who binds a rollout request to an engine: the router's policy, or the client's
    #: admission (a routed engine's free slot; rollout/dispatch.py)
    dispatch: Dispatch = Dispatch.ROUTER
    #: admission: requests bound to an engine beyond its slots, waiting in its own queue so
    #: a freed slot is refilled at its next step instead of after a round trip (0: never
    #: beyond its slots; docs/ASYNC.md says when a queue wins and when it loses)
    dispatch_queue: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch", Dispatch(self.dispatch))
        if self.dispatch_queue < 0:
            raise ValueError(f"RouterSettings.dispatch_queue must be >= 0, "
                             f"got {self.dispatch_queue}")


@dataclass(frozen=True)
class HealthSettings:
    """Engine probing (`--use-fault-tolerance`); off, the monitor is nothing and no engine
    is probed. A probe unanswered past its deadline (`deadlines`: derived from what the
    engines' probes took lately, at most `timeout_s`) already makes its engine SUSPECT: out
    of the router, its requests in flight resubmitted; a death still takes
    `failure_threshold` probes that fail or time out."""

    enabled: bool = False
    interval_s: float = 30.0
    timeout_s: float = 30.0
    first_wait_s: float = 300.0
    failure_threshold: int = 3
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadlines", DeadlinePolicy.of(self.deadlines))


@dataclass(frozen=True)
class FleetSettings:
    """What the fleet needs: engines, routers, health, where logs go, what to load."""

    engine: EngineSettings
    router: RouterSettings
    health: HealthSettings
    log_dir: str
    model_paths: dict[str, str] = field(default_factory=dict)  # model name -> path override
    external_addrs: tuple[str, ...] = ()   # engines someone else runs (never launched/killed)
    external_wait_s: float = 300.0         # how long a dead external engine may take to return
    router_port: int | None = None         # fixed port of the updatable model's router
    register_timeout_s: float = 60.0
    verify_timeout_s: float = 5.0


def make_keys(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """(api key, admin key, router key): the user's, or fresh ones per run.

    Keys are on by default: every engine and router of the run gets them, and every client
    the job creates uses them, so nothing else on the network can pause, update or route.
    """
    return fresh_keys(args.sglang_flags.get("api_key"), args.sglang_flags.get("admin_api_key"),
                      args.router_flags.get("api_key"),
                      rl_plane=rl_plane_on(getattr(args, "router", None), args.router_flags))


def rl_plane_on(router: str | None, router_flags: dict[str, Any]) -> bool:
    """Whether syncs reach the engines through smg's RL control plane (`--router smg
    --router-enable-rl`)."""
    return (router or DEFAULT_ROUTER) == "smg" and bool(router_flags.get("enable_rl"))


def fresh_keys(api: str | None, admin: str | None, router: str | None, *,
               rl_plane: bool = False) -> tuple[str | None, str, str]:
    """Each key given, or a fresh one; the router's defaults to the engines' API key.

    `rl_plane`: the engines get no user key (smg calls a worker with the one key it was
    registered with, and must reach both its info and its admin routes: it is registered
    with the admin key), and the router its own key, which guards the users."""
    if rl_plane:
        if api:
            raise ConfigError("--sglang-api-key", "with --router smg --router-enable-rl the "
                              "engines run with the admin key only (smg reaches them with "
                              "it); the router's key (--router-api-key) guards the users")
        return None, admin or secrets.token_hex(24), router or secrets.token_hex(24)
    api = api or secrets.token_hex(24)
    return api, admin or secrets.token_hex(24), router or api


def engine_settings(args: argparse.Namespace, *, api_key: str | None = None,
                    admin_api_key: str | None = None) -> EngineSettings:
    flags = {k: v for k, v in args.sglang_flags.items() if k not in ("api_key", "admin_api_key")}
    return EngineSettings(program=args.engine, sglang_flags=flags, seed=args.seed,
                          offload_rollout=bool(args.offload_rollout),
                          api_key=api_key if api_key is not None else args.sglang_flags.get("api_key"),
                          admin_api_key=admin_api_key if admin_api_key is not None
                          else args.sglang_flags.get("admin_api_key"),
                          server_concurrency=args.sglang_server_concurrency,
                          reference_min_step_ms=args.reference_min_step_ms)


def fleet_settings(args: argparse.Namespace, *, log_dir: str,
                   model_paths: dict[str, str] | None = None,
                   keys: tuple[str | None, str | None, str | None] | None = None) -> FleetSettings:
    """The fleet's slice of the job's flags."""
    api, admin, router_key = keys or (None, None, None)
    router_flags = {k: v for k, v in args.router_flags.items() if k != "api_key"}
    router_flags["request_timeout_secs"] = args.sglang_router_request_timeout_secs
    return FleetSettings(
        engine=engine_settings(args, api_key=api, admin_api_key=admin),
        router=RouterSettings(kind=getattr(args, "router", None) or DEFAULT_ROUTER,
                              flags=router_flags,
                              api_key=router_key or args.router_flags.get("api_key"),
                              request_timeout_s=float(args.rollout_request_timeout),
                              dispatch=args.rollout_dispatch,
                              dispatch_queue=args.rollout_dispatch_queue),
        health=HealthSettings(enabled=bool(args.use_fault_tolerance),
                              interval_s=args.rollout_health_check_interval,
                              timeout_s=args.rollout_health_check_timeout,
                              first_wait_s=args.rollout_health_check_first_wait,
                              failure_threshold=args.rollout_health_check_failures),
        log_dir=log_dir, model_paths=dict(model_paths or {}),
        external_addrs=tuple(args.rollout_external_engine_addrs or ()),
        external_wait_s=float(args.external_engine_reconnect_timeout),
        router_port=args.sglang_router_port)


# ---- the job's own slices ------------------------------------------------------------------


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
