"""Flags of the asynchronous schedules (slime's and miles' names), and their cross-flag rules.

`--async-mode sync|one-step|fully-async` picks the job's schedule (`slime-like
train-async` defaults to one-step, as slime's `train_async.py`; `--fully-async`
is miles' spelling). The rest bound and correct what asynchrony changes: how engines pause
for an in-flight update, what happens to aborted samples, how stale a sample may be, and
how much of each step's samples the trainer re-checks.
"""

from __future__ import annotations

import argparse

from slime_like.config import argtypes as t
from slime_like.errors import ConfigError
from slime_like.protocol.modes import DEFAULT_PAUSE_MODE, AsyncMode, PauseMode


def add_async_flags(p: argparse.ArgumentParser) -> None:
    """The `asynchronous RL` group of the job's parser."""
    g = p.add_argument_group("asynchronous RL", "Generation that overlaps training (slime's "
                                                "train_async.py, miles' --fully-async).")
    g.add_argument("--async-mode", type=t.member_of(AsyncMode), choices=t.values_of(AsyncMode),
                   default=None,
                   help="sync (default): rollout, train, sync in turn; one-step: rollout k+1 "
                        "is generated while step k trains, drained before each weight update "
                        "(slime's train_async.py); fully-async: a producer generates without "
                        "pause and weights are updated while requests run.")
    g.add_argument("--fully-async", action="store_true", default=False,
                   help="Same as --async-mode fully-async (miles' flag).")
    g.add_argument("--pause-generation-mode", "--pause-mode", dest="pause_mode",
                   type=t.member_of(PauseMode), choices=t.values_of(PauseMode),
                   default=DEFAULT_PAUSE_MODE,
                   help="How engines pause for a weight update: abort in-flight requests "
                        "(with --partial-rollout they are resubmitted as prompt + partial "
                        "output), retract them (their KV is recomputed under the new weights) "
                        "or keep them in place (their KV, computed by the old weights, stays). "
                        "--pause-mode is the older spelling.")
    g.add_argument("--partial-rollout", action="store_true", default=False,
                   help="A sample aborted by a weight update keeps its tokens and is "
                        "resubmitted as prompt + partial output with max_new_tokens reduced "
                        "(otherwise it is generated again from its prompt).")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true", default=False,
                   help="Leave the tokens of a partial sample made at earlier weight versions "
                        "out of the loss (they are still log-probability checked).")
    g.add_argument("--max-weight-staleness", type=t.non_negative_int, default=None,
                   metavar="N",
                   help="fully-async: a sample whose oldest token is more than N weight "
                        "versions behind the trained version is dropped (counted) and "
                        "replaced; the producer runs at most N + 1 batches ahead of the "
                        "trainer. 0 reproduces the sync schedule. Default 1.")
    g.add_argument("--logprob-check-fraction", type=t.unit_fraction, default=1.0,
                   metavar="F",
                   help="Share of each step's samples whose every token is re-checked against "
                        "the trainer at that token's weight version (1.0 = all; lower it for "
                        "big models).")


def resolve_async(args: argparse.Namespace) -> None:
    """Fill `args.async_mode` and refuse combinations the schedules cannot run."""
    if args.fully_async:  # miles' spelling; it wins over an entry point's default
        args.async_mode = AsyncMode.FULLY_ASYNC
    mode = args.async_mode = AsyncMode(args.async_mode or AsyncMode.SYNC)
    args.pause_mode = PauseMode(args.pause_mode)
    if args.max_weight_staleness is not None and mode != AsyncMode.FULLY_ASYNC:
        raise ConfigError("--max-weight-staleness", "applies to --async-mode fully-async only "
                                                    f"(this run is {mode})")
    if args.partial_rollout and mode != AsyncMode.FULLY_ASYNC:
        raise ConfigError("--partial-rollout", "applies to --async-mode fully-async only "
                                               "(only it updates weights while requests run)")
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        raise ConfigError("--mask-offpolicy-in-partial-rollout", "needs --partial-rollout")
    if args.partial_rollout and args.pause_mode != PauseMode.ABORT:
        raise ConfigError("--partial-rollout", "needs --pause-generation-mode abort (retract "
                                               "and in_place keep requests running)")
    if mode == AsyncMode.SYNC:
        return
    if args.colocate:
        raise ConfigError("--async-mode", f"{mode} cannot run with --colocate: the engines "
                                          "give their memory to the trainer while it trains")
    if args.update_weights_interval != 1:
        raise ConfigError("--update-weights-interval", f"must be 1 with --async-mode {mode} "
                                                        "(staleness is bounded by "
                                                        "--max-weight-staleness instead)")
    if mode == AsyncMode.FULLY_ASYNC:
        for name, flag in (("rollout_function_path", "--rollout-function-path"),
                           ("custom_generate_function_path", "--custom-generate-function-path")):
            if getattr(args, name, None):
                raise ConfigError(flag, "not supported with --async-mode fully-async (its "
                                        "producer streams single /generate requests; use "
                                        "one-step for custom rollouts)")
        if args.pause_mode == PauseMode.IN_PLACE and args.hf_checkpoint:
            raise ConfigError("--pause-generation-mode", "in_place with --async-mode "
                                                         "fully-async is checked with a "
                                                         "KV-faithful recomputation that only "
                                                         "the built-in model implements; use "
                                                         "retract with --hf-checkpoint")
        if args.pause_mode == PauseMode.IN_PLACE and \
                not args.sglang_flags.get("disable_radix_cache", False):
            raise ConfigError("--pause-generation-mode", "in_place with --async-mode "
                                                         "fully-async needs "
                                                         "--sglang-disable-radix-cache: the "
                                                         "prefix cache would keep KV of old "
                                                         "weights that no flush can clear "
                                                         "while requests stay paused")
        if args.max_weight_staleness is None:
            args.max_weight_staleness = 1


def staleness_bound(args: argparse.Namespace) -> int:
    """How many versions behind the trained one a sample's oldest token may be."""
    return {AsyncMode.SYNC: 0, AsyncMode.ONE_STEP: 1}.get(args.async_mode,
                                                           args.max_weight_staleness or 0)
