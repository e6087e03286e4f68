"""Flags of the RL algorithm itself (slime's names): the off-policy correction of the loss
and dynamic sampling, declared and checked here so the job's other flag groups stay small.
"""

from __future__ import annotations

import argparse

from slime_like.config import argtypes as t
from slime_like.errors import ConfigError

DEFAULT_TIS_CLIP = 2.0
DEFAULT_TIS_CLIP_LOW = 0.0
DEFAULT_EPS_CLIP = 0.2


def add_off_policy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "off-policy correction", "slime's names. Samples made by older weights (an "
        "asynchronous schedule) or by an engine whose numerics differ from the trainer's: "
        "the PPO ratio against the engine's log-probabilities and truncated importance "
        "sampling. Without either flag the loss is on-policy GRPO.")
    g.add_argument("--use-rollout-logprobs", action="store_true", default=False,
                   help="The PPO ratio's old log-probabilities are the engine's behaviour "
                        "log-probabilities of the sampled tokens (clipped by --eps-clip / "
                        "--eps-clip-high) instead of the trainer's own recomputation.")
    g.add_argument("--use-tis", action="store_true", default=False,
                   help="Truncated importance sampling: each token's policy-gradient loss is "
                        "multiplied by clamp(exp(trainer logprob - engine logprob), "
                        "--tis-clip-low, --tis-clip), no gradient through the weight.")
    g.add_argument("--tis-clip", type=t.positive_float, default=None,
                   help=f"Upper bound of the TIS weight (default {DEFAULT_TIS_CLIP}; with "
                        "--use-tis).")
    g.add_argument("--tis-clip-low", type=t.non_negative_float, default=None,
                   help=f"Lower bound of the TIS weight (default {DEFAULT_TIS_CLIP_LOW}; with "
                        "--use-tis); must be < --tis-clip.")
    g.add_argument("--eps-clip", type=t.positive_float, default=None,
                   help=f"PPO clip range below 1 (default {DEFAULT_EPS_CLIP}; with "
                        "--use-rollout-logprobs: the trainer's own log-probabilities make the "
                        "ratio 1).")
    g.add_argument("--eps-clip-high", type=t.positive_float, default=None,
                   help="PPO clip range above 1 (default: --eps-clip; with "
                        "--use-rollout-logprobs).")


def add_dynamic_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "dynamic sampling", "slime's names. Draw more prompts per round than the step "
        "trains on, drop the groups a filter rejects, repeat until --rollout-batch-size "
        "groups are kept.")
    g.add_argument("--over-sampling-batch-size", type=t.positive_int, default=None,
                   metavar="N", help="Prompts drawn per round of sampling (>= "
                                     "--rollout-batch-size; default: --rollout-batch-size).")
    g.add_argument("--dynamic-sampling-filter-path", default=None, metavar="MODULE.FUNC",
                   help="Filter of one prompt's group: def filter(args, samples, **kwargs) "
                        "-> DynamicFilterOutput(keep, reason) or bool (slime's signature). "
                        "Built in: slime_like.rollout.filters.check_reward_nonzero_std (drop "
                        "groups whose rewards are all equal).")


def _no_effect(args: argparse.Namespace, name: str, flag: str, needs: str, why: str) -> None:
    if getattr(args, name) is not None:
        raise ConfigError(flag, f"has no effect without {needs} ({why})")


def resolve_off_policy(args: argparse.Namespace) -> None:
    """Refuse clip flags that would do nothing, check the bounds, fill slime's defaults."""
    if not args.use_tis:
        _no_effect(args, "tis_clip", "--tis-clip", "--use-tis", "it bounds the TIS weight")
        _no_effect(args, "tis_clip_low", "--tis-clip-low", "--use-tis",
                   "it bounds the TIS weight")
    if not args.use_rollout_logprobs:
        why = "the trainer's own log-probabilities make the PPO ratio 1"
        _no_effect(args, "eps_clip", "--eps-clip", "--use-rollout-logprobs", why)
        _no_effect(args, "eps_clip_high", "--eps-clip-high", "--use-rollout-logprobs", why)
    args.tis_clip = DEFAULT_TIS_CLIP if args.tis_clip is None else args.tis_clip
    args.tis_clip_low = DEFAULT_TIS_CLIP_LOW if args.tis_clip_low is None else args.tis_clip_low
    if args.tis_clip_low >= args.tis_clip:
        raise ConfigError("--tis-clip-low", f"must be < --tis-clip ({args.tis_clip:g}), got "
                                            f"{args.tis_clip_low:g}")
    args.eps_clip = DEFAULT_EPS_CLIP if args.eps_clip is None else args.eps_clip
    if args.eps_clip >= 1.0:
        raise ConfigError("--eps-clip", f"must be < 1 (the ratio's lower bound is "
                                        f"1 - eps-clip), got {args.eps_clip:g}")


def check_dynamic_sampling(args: argparse.Namespace, batch_size: int) -> None:
    """--over-sampling-batch-size draws at least the step's prompts (`batch_size`)."""
    over = args.over_sampling_batch_size
    if over is not None and over < batch_size:
        raise ConfigError("--over-sampling-batch-size", f"must be >= --rollout-batch-size "
                                                        f"({batch_size}), got {over}")
