"""The job's flags: slime's names and defaults for the rollout side, plus ours.

One parser built from small groups. `build_parser()` is what `slime-like train --help`
prints; `slime_like.config.parse_args` adds `--config FILE.yaml`, validation and the
resolved topology on top of it.
"""

from __future__ import annotations

import argparse

from slime_like.config import argtypes as t
from slime_like.config.async_flags import add_async_flags
from slime_like.config.fleet_slices import (
    DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS,
    EngineSettings,
    FleetSettings,
    HealthSettings,
    RouterSettings,
)
from slime_like.config.passthrough import (
    add_router_flags,
    add_sglang_server_flags,
    reserved_flag_hints,
)
from slime_like.config.rl_flags import add_dynamic_sampling_flags, add_off_policy_flags
from slime_like.protocol.flag_tables import DEFAULT_ROUTER, ROUTER_TABLES
from slime_like.protocol.modes import Dispatch, Transport

ENGINE_PROGRAMS = ("sglang", "reference")
# `nccl` is slime's name; like slime it means "not disk": the tensor path when colocated,
# the distributed (broadcast) path otherwise (`validate` resolves it to a Transport). On CPU
# the broadcast runs over gloo.
SLIME_TRANSPORT = "nccl"
WEIGHT_TRANSPORTS = (SLIME_TRANSPORT, *t.values_of(Transport))

DEFAULT_BUFFER_SIZE = 512 * 1024**2
UPDATE_WEIGHT_MODES = ("full", "delta")  # slime's --update-weight-mode
DEFAULT_DELTA_FULL_EVERY = 20  # a delta chain's length before a full sync
CHAOS_FAULTS = ("kill_rollout", "kill_pause", "kill_transfer", "kill_end", "kill_continue",
                "stop_engine", "kill_router")
# Faults a run chooses by name only: they need a cluster of several nodes (`node` loses one
# that hosts engines but not the trainer or the driver; `partition` cuts such a host's link
# through --chaos-partition-command, so it needs hosts with network stacks of their own).
CHAOS_NODE_FAULTS = ("node", "partition")
CHAOS_FAULT_CHOICES = CHAOS_FAULTS + CHAOS_NODE_FAULTS


def _cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster", "Trainer and rollout GPUs and how they share nodes "
                                        "(slime's names and defaults).")
    g.add_argument("--actor-num-nodes", type=t.positive_int, default=1,
                   help="Nodes of the trainer (actor) group.")
    g.add_argument("--actor-num-gpus-per-node", type=t.positive_int, default=8,
                   help="Trainer GPUs per node.")
    g.add_argument("--rollout-num-gpus", type=t.non_negative_int, default=None,
                   help="GPUs of all rollout engines together when the run starts (`slime-like "
                        "fleet scale RUN_DIR --engines N` adds or drains engines while it "
                        "runs). Default: the trainer's GPUs with --colocate, the sum of the "
                        "server groups with --sglang-config; 0 only with "
                        "--rollout-external-engine-addrs.")
    g.add_argument("--rollout-num-gpus-per-engine", type=t.positive_int, default=1,
                   help="GPUs per engine (tp_size x pp_size). An engine larger than a node "
                        "spans whole nodes, one engine actor per node.")
    g.add_argument("--num-gpus-per-node", type=t.positive_int, default=8,
                   help="GPUs per node; set it when nodes have fewer than 8.")
    g.add_argument("--colocate", action="store_true", default=False,
                   help="Engines share the trainer's GPUs; implies --offload-train and "
                        "--offload-rollout unless they are set.")
    g.add_argument("--offload", action="store_true", default=False,
                   help="Same as --offload-train --offload-rollout.")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="Move the trainer's model and optimizer state off the GPU while "
                        "engines generate (with --colocate only).")
    g.add_argument("--offload-train-weights", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="With --offload-train, whether the weights move too (default) or stay "
                        "on the GPU while the engines generate: then only the optimizer state "
                        "moves, and the weight sync sends the weights in place (one request, "
                        "no pack copy), for one copy of the weights in GPU memory.")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="Engines release their memory by tag around each train step and resume "
                        "it before the weight sync (sglang --enable-memory-saver; with "
                        "--colocate only).")
    g.add_argument("--debug-rollout-only", action="store_true", default=False,
                   help="Place engines only, no trainer slots (what slime_like.api.launch_fleet "
                        "uses); the train job refuses it: it checks every sample against the "
                        "trainer.")
    g.add_argument("--debug-train-only", action="store_true", default=False,
                   help="Refused: the job trains on samples from the engines.")


def _rollout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rollout", "What the engines serve and how the job drives them.")
    g.add_argument("--hf-checkpoint", default=None,
                   help="HF checkpoint the engines load and the trainer updates (through "
                        "transformers): a local directory with a config.json, or a hub id. "
                        "With --engine reference and no checkpoint, the job makes a tiny "
                        "model.")
    g.add_argument("--rollout-external-engine-addrs", nargs="+", default=None, metavar="HOST:PORT",
                   help="Attach engines started elsewhere instead of launching them; they take "
                        "no slots of the placement group, are health-checked, synced and "
                        "routed like ours, and are never killed.")
    g.add_argument("--external-engine-reconnect-timeout", type=t.non_negative_float,
                   default=FleetSettings.external_wait_s, metavar="SECONDS",
                   help="How long the job waits for a dead external engine to come back at its "
                        "address (it is then resynced before it serves again); 0 gives up at "
                        "once.")
    g.add_argument("--sglang-server-concurrency", type=t.positive_int,
                   default=EngineSettings.server_concurrency,
                   help="Concurrent requests per engine (the job's HTTP connection cap is this "
                        "times the number of engines).")
    g.add_argument("--seed", type=int, default=EngineSettings.seed,
                   help="Job seed; engines derive their random_seed from it.")
    g.add_argument("--num-rollout", type=t.positive_int, default=None,
                   help="Rollout steps of the job.")
    g.add_argument("--rollout-batch-size", type=t.positive_int, default=None,
                   help="Prompts per rollout step.")
    g.add_argument("--n-samples-per-prompt", type=t.positive_int, default=1,
                   help="Responses sampled per prompt.")
    g.add_argument("--rollout-max-response-len", type=t.positive_int, default=None,
                   help="max_new_tokens of each rollout request.")
    g.add_argument("--rollout-temperature", type=t.positive_float, default=1.0,
                   help="Sampling temperature of rollouts (> 0: greedy is not a policy).")
    g.add_argument("--lr", type=t.positive_float, default=1e-6, help="Trainer learning rate.")
    g.add_argument("--train-backend", choices=("ddp", "fsdp"), default="ddp",
                   help="ddp: every trainer rank holds the whole model and optimizer; fsdp: "
                        "FSDP2 (fully_shard per decoder layer) shards them over the trainer "
                        "ranks, every rank takes part in each weight sync, checkpoints are "
                        "sharded (torch.distributed.checkpoint) and resume at another world "
                        "size.")


def _kl(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KL to a reference model", "slime's names. The reference model is "
                             "the frozen model (update_weights: false) of --sglang-config; its "
                             "log-probabilities of the sampled tokens come through its router.")
    g.add_argument("--use-kl-loss", action="store_true", default=False,
                   help="Add --kl-loss-coef x KL(policy || reference) to the policy loss.")
    g.add_argument("--kl-loss-coef", type=t.non_negative_float, default=0.0,
                   help="Weight of the KL loss (with --use-kl-loss).")
    g.add_argument("--kl-loss-type", choices=("k1", "k2", "low_var_kl"), default="low_var_kl",
                   help="KL estimator per token: k1 = log p - log p_ref, k2 = (k1)^2 / 2, "
                        "low_var_kl = exp(-k1) - 1 + k1 (k3, clamped to [-10, 10]).")
    g.add_argument("--kl-coef", type=t.non_negative_float, default=0.0,
                   help="Reward shaping: each sample's reward minus --kl-coef x its summed k1 "
                        "KL to the reference model.")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and plug-ins", "Prompts, reward and generation (slime's names); "
                                                  "the toy task is the default of each.")
    g.add_argument("--prompt-data", default=None, metavar="FILE.jsonl",
                   help="JSONL prompt set, one JSON object per line; default: the toy task's "
                        "prompts.")
    g.add_argument("--input-key", default="prompt",
                   help="Key of the prompt in each JSONL line: a string, or a list of chat "
                        "messages with --apply-chat-template.")
    g.add_argument("--label-key", default=None,
                   help="Key of the label (e.g. the reference answer) handed to the reward "
                        "function as sample.label.")
    g.add_argument("--metadata-key", default="metadata",
                   help="Key of an optional object handed to the reward function as "
                        "sample.metadata.")
    g.add_argument("--apply-chat-template", action="store_true", default=False,
                   help="Render each prompt with the checkpoint's HF tokenizer chat template "
                        "(a user message, generation prompt added).")
    g.add_argument("--rollout-shuffle", action="store_true", default=False,
                   help="Shuffle the prompt set, anew each epoch (seeded by --rollout-seed).")
    g.add_argument("--rollout-seed", type=int, default=42, help="Seed of the prompt shuffle.")
    g.add_argument("--custom-rm-path", default=None, metavar="MODULE.FUNC",
                   help="Reward function, called per sample: [async] def reward_func(args, "
                        "sample, **kwargs) -> float. Default: "
                        "slime_like.rollout.plugins.toy_reward (the toy task's).")
    g.add_argument("--rollout-function-path", default=None, metavar="MODULE.FUNC",
                   help="Rollout of one step: [async] def generate_rollout(args, rollout_id, "
                        "prompts, *, router_url, sampling_params, n_samples_per_prompt, "
                        "**kwargs) -> list[Sample]. Default: "
                        "slime_like.rollout.plugins.generate_rollout (the router).")
    g.add_argument("--custom-generate-function-path", default=None, metavar="MODULE.FUNC",
                   help="Generation of one sample by the default rollout: async def "
                        "generate(args, sample, sampling_params, *, router_url, **kwargs) -> "
                        "Sample, with output_ids, output_logprobs and weight_version filled.")


def _checkpoint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint", "Save and resume the trainer and the job's position "
                                           "(slime's names).")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="Directory of checkpoints (iter_NNNNNNN/ and "
                        "latest_checkpointed_iteration.txt); shared by every trainer node.")
    g.add_argument("--save-interval", type=t.positive_int, default=None, metavar="N",
                   help="Save every N rollout steps; with --save, a checkpoint is also written "
                        "after the last step.")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="Resume from the latest checkpoint in DIR: model, optimizer, step, "
                        "weight version, RNG and data position; the engines serve the loaded "
                        "weights from the first step. A DIR without checkpoints starts afresh.")


def _topology(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server groups", "How rollout GPUs are split into engines.")
    g.add_argument("--sglang-config", default=None, metavar="FILE.yaml",
                   help="YAML list of models, each with server groups (worker_type "
                        "regular|prefill|decode|placeholder|encoder, num_gpus, "
                        "num_gpus_per_engine, overrides); groups take rollout GPUs in YAML "
                        "order. Excludes --prefill-num-servers and "
                        "--rollout-external-engine-addrs.")
    g.add_argument("--prefill-num-servers", type=t.positive_int, default=None,
                   help="Legacy PD: this many prefill engines, the remaining rollout GPUs "
                        "decode.")


def _router(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router", "The router in front of each model's engines.")
    g.add_argument("--router", choices=list(ROUTER_TABLES), default=DEFAULT_ROUTER,
                   help="Which router slime_like starts in front of each model's engines: "
                        "sglang-router (0.3.2, what slime runs) or smg (the Shepherd Model "
                        "Gateway 1.13, its successor; load-aware policies such as "
                        "--router-policy least_load). Each is launched from its own Python "
                        "package; docs/COMPATIBILITY.md says what differs.")
    g.add_argument("--rollout-dispatch", type=t.member_of(Dispatch), choices=t.values_of(Dispatch),
                   default=RouterSettings.dispatch,
                   help="Who binds a rollout request to an engine: router (its --router-policy, "
                        "when the request is sent) or admission (the rollout client, when a "
                        "routed engine has a free slot of its --sglang-max-running-requests; "
                        "the request then goes straight to that engine; not with PD). The "
                        "router keeps health and registration either way.")
    g.add_argument("--rollout-dispatch-queue", type=t.non_negative_int,
                   default=RouterSettings.dispatch_queue,
                   help="With --rollout-dispatch admission: requests bound to an engine beyond "
                        "its slots once no engine has a slot free (and while as many more wait "
                        "in the client); they wait in the engine's own queue, so a slot freed "
                        "is refilled at its next step instead of after a round trip through "
                        "the client. 0: never beyond its slots.")
    g.add_argument("--sglang-router-ip", default=None,
                   help="Refused: the job starts and owns its routers (the fleet alone adds "
                        "and removes workers); use --sglang-router-port to fix the port.")
    g.add_argument("--sglang-router-port", type=t.port, default=None,
                   help="A fixed port for the router of the updatable model (the others pick "
                        "free ports).")
    g.add_argument("--sglang-router-request-timeout-secs", type=t.positive_int,
                   default=DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS,
                   help="Request timeout of the router, seconds.")


def _weights(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("weight update", "How new weights reach the engines.")
    g.add_argument("--update-weight-transport", type=t.member_of(Transport),
                   choices=WEIGHT_TRANSPORTS, default=SLIME_TRANSPORT,
                   help="nccl (slime's default): tensor when --colocate, else distributed; "
                        "distributed: broadcast over a weight group (NCCL on GPU, gloo on "
                        "CPU); tensor: CUDA IPC / shared memory to colocated engines; disk: "
                        "safetensors under --update-weight-disk-dir, then "
                        "update_weights_from_disk.")
    g.add_argument("--update-weight-buffer-size", type=t.positive_int,
                   default=DEFAULT_BUFFER_SIZE, metavar="BYTES",
                   help="Bucket size of a weight update, bytes.")
    g.add_argument("--update-weight-mode", choices=UPDATE_WEIGHT_MODES, default="full",
                   help="full: every sync sends every byte; delta: send only what changed "
                        "since the weights every engine holds (the XOR of each bucket, zstd "
                        "compressed; over disk and distributed; the trainer keeps one host "
                        "copy of the served weights). Engines that do not advertise delta "
                        "support (sglang) get full weights.")
    g.add_argument("--update-weight-delta", dest="update_weight_mode", action="store_const",
                   const="delta", help="Same as --update-weight-mode delta.")
    g.add_argument("--update-weight-delta-full-every", type=t.positive_int,
                   default=DEFAULT_DELTA_FULL_EVERY, metavar="SYNCS",
                   help="With --update-weight-mode delta: every this many syncs is a full one "
                        "(also the first, one after a failure, and one for a new engine).")
    g.add_argument("--update-weight-disk-dir", default=None,
                   help="Directory shared by trainer and engines for --update-weight-transport "
                        "disk.")
    g.add_argument("--update-weights-interval", type=t.positive_int, default=1,
                   help="Sync weights every this many rollout steps. Between syncs the "
                        "trainer keeps a copy of the served weights, so the log-probability "
                        "check compares at the version the samples were made at.")


def _fault_tolerance(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance", "Engine health checks and recovery.")
    g.add_argument("--use-fault-tolerance", action="store_true", default=HealthSettings.enabled,
                   help="Probe engines and replace the ones that die.")
    g.add_argument("--rollout-health-check-interval", type=t.positive_float,
                   default=HealthSettings.interval_s,
                   metavar="SECONDS", help="Seconds between two probes of an engine.")
    g.add_argument("--rollout-health-check-timeout", type=t.positive_float,
                   default=HealthSettings.timeout_s,
                   metavar="SECONDS", help="Seconds a /health_generate probe may take.")
    g.add_argument("--rollout-health-check-first-wait", type=t.non_negative_float,
                   default=HealthSettings.first_wait_s, metavar="SECONDS",
                   help="Grace after start before the first probe (slime's code says 0, which "
                        "kills engines during their cold compile; its docs say 300).")
    g.add_argument("--rollout-health-check-failures", type=t.positive_int,
                   default=HealthSettings.failure_threshold,
                   metavar="N", help="Consecutive failed probes before an engine counts as dead "
                                     "(the first failed probe already takes it out of the "
                                     "router and resubmits the requests in flight).")
    g.add_argument("--rollout-request-timeout", type=t.positive_float,
                   default=RouterSettings.request_timeout_s,
                   metavar="SECONDS",
                   help="Longest a rollout waits for one /generate answer before sending the "
                        "request again (a hung engine is also left at its first failed probe).")


def _ours(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("slime_like", "Options of this framework.")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of flags (keys are flag names without dashes, e.g. "
                        "rollout_num_gpus: 4); flags on the command line win.")
    g.add_argument("--engine", choices=ENGINE_PROGRAMS, default=EngineSettings.program,
                   help="Engine program: sglang (python -m sglang.launch_server) or reference "
                        "(our CPU server speaking the same protocol).")
    g.add_argument("--reference-min-step-ms", type=t.non_negative_float,
                   default=EngineSettings.reference_min_step_ms,
                   metavar="MS",
                   help="--engine reference only: each forward step of the reference engine "
                        "lasts at least this long, the rest waited off the CPU as a GPU's "
                        "decode step is (e.g. 30 for a 7B model's step on one H200). A CPU run "
                        "then has a GPU job's ratio of generation to training time instead of "
                        "engines and trainer sharing the same cores. 0: off.")
    g.add_argument("--dry-run", action="store_true", default=False,
                   help="Validate the flags, print the resolved server groups and the nominal "
                        "placement, then exit.")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="Report folder of the run (metrics.jsonl, report.md, plots, engine "
                        "timeline, engine logs); default runs/<timestamp>.")
    g.add_argument("--simulate-engine-crash-at", type=t.non_negative_int, default=None,
                   metavar="STEP", help="Kill engine 0's server (SIGKILL) in the middle of this "
                                        "rollout step, to watch recovery.")
    g.add_argument("--simulate-engine-crash-model", default=None, metavar="NAME",
                   help="The model whose first engine --simulate-engine-crash-at kills (default: "
                        "the updatable one).")
    g.add_argument("--simulate-engine-crash-node-rank", type=t.non_negative_int, default=0,
                   metavar="RANK", help="The node of a multi-node engine whose server "
                                        "--simulate-engine-crash-at kills.")
    g.add_argument("--logprob-check-tolerance", type=t.positive_float, default=1e-4,
                   help="Largest mean |engine - trainer| log-probability over one sample's "
                        "tokens accepted by the per-step correctness check (fp32 on CPU agrees "
                        "to ~1e-6 per token); one token never fails a step alone.")
    g.add_argument("--logprob-check-probe-tokens", type=t.non_negative_int, default=256,
                   metavar="N", help="Each step every serving engine scores a fixed probe of "
                   "about N sampled tokens itself and answers by name for the version it "
                   "claims (the neighbour test catches one a version behind). 0: off.")
    g.add_argument("--simulate-stale-engine-at", type=t.non_negative_int, default=None,
                   metavar="STEP", help="Right after the sync that follows this step, put "
                   "engine 0's weights back to its launch checkpoint with its label kept (at "
                   "step 0: one version behind); the log-probability check must fail the run "
                   "naming it.")
    g.add_argument("--chaos-seed", type=int, default=None, metavar="SEED",
                   help="Chaos run: inject real faults (see --chaos-faults) at moments drawn "
                        "from this seed and check the routing invariant from outside; the run "
                        "fails on any violation. Writes chaos.json to the report folder.")
    g.add_argument("--chaos-faults", nargs="+", default=list(CHAOS_FAULTS),
                   choices=list(CHAOS_FAULT_CHOICES), metavar="FAULT",
                   help="Faults of a chaos run, one per chosen step: " + ", ".join(CHAOS_FAULTS)
                        + " by default (kill_* = SIGKILL of an engine's server during the "
                          "rollout or at that step of a weight sync; stop_engine = SIGSTOP; "
                          "kill_router); by name only: node = a whole node lost (its raylet "
                          "SIGKILLed: every engine on it dies), on a cluster with a node that "
                          "hosts engines but neither the trainer nor the driver; partition = "
                          "such a host's cluster link cut by --chaos-partition-command.")
    g.add_argument("--chaos-partition-command", default=None, metavar="TEMPLATE",
                   help="The chaos fault `partition`: a command (no shell) that cuts the host "
                        "{node_ip}'s cluster link and restores it after {seconds} by itself, "
                        "e.g. a switch's API (docs/FAULT_TOLERANCE.md, A partitioned node).")
    g.add_argument("--chaos-partition-seconds", type=t.positive_float, default=8.0,
                   metavar="S", help="How long a `partition` cut lasts: shorter than the "
                   "health checks' verdict (failures x (interval + timeout)) to be resynced, "
                   "longer for a node loss.")
    g.add_argument("--tiny-model-layers", type=t.positive_int, default=2,
                   help="Layers of the tiny model made when --hf-checkpoint is not given.")
    g.add_argument("--tiny-model-hidden", type=t.positive_int, default=64,
                   help="Hidden size of the tiny model made when --hf-checkpoint is not given.")
    g.add_argument("--tiny-model-intermediate", type=t.positive_int, default=None,
                   help="MLP size of the tiny model (default 11/4 of the hidden size); a "
                        "multiple of 128 with --sglang-quantization fp8, whose blocks are "
                        "128x128.")


def _tracking(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tracking", "Experiment tracking and the job's metrics endpoint "
                                         "(slime's wandb flag names).")
    g.add_argument("--use-wandb", action="store_true", default=False,
                   help="Log every step's metrics to wandb (pip install wandb).")
    g.add_argument("--wandb-project", default="slime_like", help="wandb project.")
    g.add_argument("--wandb-group", default=None, help="wandb group of this run.")
    g.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                   help="wandb mode; offline writes the run locally (wandb sync uploads it "
                        "later) and needs no network. Default: WANDB_MODE, else online.")
    g.add_argument("--wandb-dir", default=None, metavar="DIR",
                   help="Where wandb writes its files; default the run's --output-dir.")
    g.add_argument("--use-tensorboard", action="store_true", default=False,
                   help="Write TensorBoard event files (pip install tensorboard).")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard log directory; default <output-dir>/tensorboard.")
    g.add_argument("--job-metrics-port", type=t.non_negative_int, default=None, metavar="PORT",
                   help="Serve the job's Prometheus metrics (step, reward, sync seconds and "
                        "GB/s, engine states, recoveries) on this port; 0 picks a free one. "
                        "The URL is printed at start and written into report.md.")


GROUP_BUILDERS = (_cluster, _rollout, _kl, _data, _checkpoint, _topology, _router, _weights,
                  add_async_flags, _fault_tolerance, _ours, _tracking,
                  add_off_policy_flags, add_dynamic_sampling_flags)


def build_parser(prog: str = "slime-like train") -> argparse.ArgumentParser:
    """The full parser, grouped as `--help` shows it; raises ConfigError on bad flags."""
    parser = t.ConfigArgumentParser(
        prog=prog, allow_abbrev=False,
        usage=f"{prog} [--config FILE.yaml] [FLAG ...]  (flags by group below)",
        description="Run an RL job: trainer actors, SGLang (or reference) rollout engines "
                    "behind sglang-router, weight sync and recovery. Flags may also come from "
                    "--config FILE.yaml.")
    parser.unknown_flag_hints = reserved_flag_hints()
    for add in GROUP_BUILDERS:
        add(parser)
    add_sglang_server_flags(parser)
    add_router_flags(parser)
    return parser
