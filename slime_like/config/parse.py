"""`parse_args`: flags (and `--config FILE.yaml`) to a validated namespace for the job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slime_like.config.argtypes import ConfigArgumentParser
from slime_like.config.config_file import load_config_file
from slime_like.config.flags import build_parser
from slime_like.config.passthrough import (
    SLIME_ROUTER_DEFAULTS,
    pop_prefixed,
    router_dests,
    sglang_dests,
)
from slime_like.config.validate import validate_args


def _config_path(argv: Sequence[str]) -> str | None:
    pre = ConfigArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(list(argv))
    return known.config


def parse_args(argv: Sequence[str] | None = None, *, validate: bool = True,
               defaults: dict | None = None) -> argparse.Namespace:
    """Parse and validate the job's flags; raises ConfigError naming the flag or YAML path.

    The result carries slime-style attributes (`args.rollout_num_gpus`, ...) plus
    `sglang_flags` and `router_flags` (pass-through values the user set, keyed by sglang's
    field names; router_flags also holds slime's three router defaults), `topology` and
    `nominal_plan`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if defaults:  # an entry point's own defaults (train-async: one-step); --config wins
        parser.set_defaults(**defaults)
    config = _config_path(argv)
    if config is not None:
        parser.set_defaults(**load_config_file(config, parser))
    args = parser.parse_args(argv)
    # Only fields that have a flag: `sglang_config` is ours, not sglang's `config` field.
    sglang_fields = {spec.dest for spec in sglang_dests().values()}
    router_fields = {spec.dest for spec in router_dests().values()}
    args.sglang_flags = pop_prefixed(args, "sglang_", sglang_fields)
    args.router_flags = {**SLIME_ROUTER_DEFAULTS, **pop_prefixed(args, "router_", router_fields)}
    return validate_args(args) if validate else args
