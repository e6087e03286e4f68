"""`--sglang-<field>` and `--router-<flag>`: sglang's and the routers' flags, re-exported.

Built from the flag tables in `slime_like/engine/data/` (generated from sglang 0.5.23,
sglang-router 0.3.2 and smg 1.13.0), so the trainer side never imports sglang. Pass-through
flags default to `argparse.SUPPRESS`: only what the user set reaches `args.sglang_flags` /
`args.router_flags`, and sglang's own defaults stay sglang's business.

`--router-<flag>` exists for every flag of either router (a flag both have takes the
choices of both); `validate.py` then refuses a flag or choice the router picked with
`--router` does not have, naming the router that has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from slime_like.config.argtypes import integer, number
from slime_like.protocol.flag_tables import ROUTER_ARGS, SERVER_ARGS, SMG_ARGS, ArgSpec, read_rows

# ServerArgs fields slime sets per engine itself (its `skipped_args`); YAML `overrides` may
# still set the ones that are not placement-owned (see topology.PLACEMENT_OWNED_FIELDS).
SLIME_RESERVED_SERVER_FIELDS = frozenset({
    "model_path", "config", "trust_remote_code", "random_seed", "enable_memory_saver",
    "tp_size", "port", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id",
    "nccl_port", "skip_server_warmup", "enable_return_routed_experts",
})
# Ours in addition: the engine actor reads its node's address and reserves its ports itself.
RESERVED_SERVER_FIELDS = SLIME_RESERVED_SERVER_FIELDS | {"host", "disaggregation_bootstrap_port"}

_PER_ENGINE = "set per engine by placement"
# Why a reserved field has no --sglang- flag, for the error a user gets when trying one.
RESERVED_REASONS = {
    "model_path": "use --hf-checkpoint, or model_path in --sglang-config",
    "config": "not a flag of ours",
    "trust_remote_code": "always on for rollout engines",
    "random_seed": "derived per engine from --seed",
    "enable_memory_saver": "set by --offload-rollout",
    "tp_size": "set from --rollout-num-gpus-per-engine and pp_size; a server group may set "
               "it in its YAML overrides",
    "skip_server_warmup": "always on for rollout engines",
    "enable_return_routed_experts": "set by the job when it needs routed experts",
    **{f: _PER_ENGINE for f in ("port", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step",
                                "base_gpu_id", "nccl_port", "host",
                                "disaggregation_bootstrap_port")},
}

# slime adds the router flags with exclude_host_port: the rollout side picks the router's
# address (or attaches to --sglang-router-ip/--sglang-router-port).
EXCLUDED_ROUTER_FIELDS = frozenset({"host", "port"})
# Router flags the launch layer sets itself; the value is what to use instead.
OWNED_ROUTER_FIELDS = {
    "worker_urls": "engines are registered with POST /workers as they become healthy",
    "prefill": "prefill engines come from the server groups of --sglang-config",
    "decode": "decode engines come from the server groups of --sglang-config",
    "pd_disaggregation": "set per model when its server groups hold prefill/decode workers",
    "request_timeout_secs": "use --sglang-router-request-timeout-secs",
}
# slime's changes to sglang-router's defaults (sglang_utils/arguments.py).
SLIME_ROUTER_DEFAULTS: dict[str, Any] = {
    "log_level": "warn",
    "balance_abs_threshold": 10,
    "balance_rel_threshold": 1.2,
}

SGLANG_PREFIX = "sglang_"
ROUTER_PREFIX = "router_"


@cache
def server_arg_table() -> tuple[str, tuple[ArgSpec, ...]]:
    """(sglang version, every ServerArgs flag row) from the shipped table."""
    return read_rows(SERVER_ARGS)


@cache
def router_arg_table() -> tuple[str, tuple[ArgSpec, ...]]:
    """(sglang-router version, every launch_router flag row)."""
    return read_rows(ROUTER_ARGS)


@cache
def smg_arg_table() -> tuple[str, tuple[ArgSpec, ...]]:
    """(smg version, every smg launch_router flag row)."""
    return read_rows(SMG_ARGS)


@cache
def any_router_rows() -> tuple[tuple[ArgSpec, str], ...]:
    """Every router flag row with the routers that have it ("sglang-router", "smg" or
    both): sglang-router's rows (choices widened by smg's), then smg's own fields."""
    smg_rows: dict[str, ArgSpec] = {}
    for spec in smg_arg_table()[1]:
        smg_rows.setdefault(spec.dest, spec)
    out: list[tuple[ArgSpec, str]] = []
    for spec in router_arg_table()[1]:
        other = smg_rows.get(spec.dest)
        if other is None:
            out.append((spec, "sglang-router"))
            continue
        if spec.choices and other.choices:
            merged = spec.choices + tuple(c for c in other.choices if c not in spec.choices)
            spec = dataclasses.replace(spec, choices=merged)
        out.append((spec, "both"))
    seen = {spec.dest for spec, _ in out}
    out += [(spec, "smg") for spec in smg_arg_table()[1] if spec.dest not in seen]
    return tuple(out)


def _value_type(spec: ArgSpec) -> Callable[[str], Any]:
    # sglang's own converters (json loads, "4k"-style ints, cuda-graph specs, ...) are not
    # importable here; their values stay the strings given and sglang parses them.
    return {"int": integer, "float": number}.get(spec.type or "", str)


class _StoreTrueFromChoice(argparse.Action):
    """sglang's DeprecatedStoreConstAction: `--old-flag amd` sets the new boolean field."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


# What the job itself does with a passthrough field, beside passing it on.
SERVER_FIELD_NOTES = {
    "quantization": "fp8 (only): the engines serve 128x128 block FP8 and every sync quantizes "
                    "the trainer's weights into it; the log-probability check scores with the "
                    "quantized weights, and metrics.jsonl reports the gap to the unquantized "
                    "trainer (fp8_*; docs/WEIGHT_SYNC.md, FP8 rollout)",
}

ROUTER_FIELD_NOTES = {
    "enable_rl": "slime_like then starts the engines with the admin key only (no user key), "
                 "registers them with it, and sends each sync's pause and continue to every "
                 "engine in one request through smg's /v1/rl (docs/COMPATIBILITY.md, smg's RL "
                 "control plane)",
}


def _help(spec: ArgSpec, owner: str, version: str, note: str = "") -> str:
    default = "None" if spec.default is None else json.dumps(spec.default)
    text = f"{owner} {version} `{spec.dest}` (default: {default.replace('%', '%%')})"
    if spec.kind.startswith("deprecated"):
        text += "; deprecated by sglang"
    return text + (f"; {note}" if note else "")


def _add(group: argparse._ArgumentGroup, spec: ArgSpec, prefix: str, dest: str, help_: str,
         default: Any = argparse.SUPPRESS) -> None:
    # Aliases are kept (e.g. --sglang-tp-size and --sglang-tensor-parallel-size), like slime.
    names = [f"--{prefix}{f[2:]}" for f in spec.flags if f.startswith("--")
             and not (spec.kind == "booleanoptional" and f.startswith("--no-"))]
    kw: dict[str, Any] = {"dest": dest, "default": default, "help": help_}
    if spec.kind in ("storetrue", "deprecatedstoretrue"):
        group.add_argument(*names, action="store_true", **kw)
    elif spec.kind == "booleanoptional":
        group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
    elif spec.kind == "deprecatedstoreconst":
        group.add_argument(*names, action=_StoreTrueFromChoice, choices=list(spec.choices or ()),
                           metavar="{" + ",".join(map(str, spec.choices or ())) + "}", **kw)
    elif spec.kind == "append":
        group.add_argument(*names, action="append", nargs=spec.nargs, **kw)
    else:
        extra: dict[str, Any] = {"type": _value_type(spec)}
        if spec.nargs is not None:
            extra["nargs"] = spec.nargs
        if spec.choices:
            extra["choices"] = list(spec.choices)
            extra["metavar"] = "{" + ",".join(map(str, spec.choices)) + "}"
        group.add_argument(*names, **kw, **extra)


def add_sglang_server_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--sglang-<flag>` for every ServerArgs flag except the reserved fields."""
    version, specs = server_arg_table()
    group = parser.add_argument_group(
        "sglang server args (--sglang-*)",
        f"Every sglang {version} ServerArgs flag with the prefix --sglang-, passed to each "
        "engine (lowest precedence: a server group's YAML overrides win). Not flags, because "
        "slime_like sets them per engine: "
        + ", ".join(sorted(RESERVED_SERVER_FIELDS)) + ".")
    for spec in specs:
        if spec.dest in RESERVED_SERVER_FIELDS:
            continue
        _add(group, spec, "sglang-", SGLANG_PREFIX + spec.dest,
             _help(spec, "sglang", version, SERVER_FIELD_NOTES.get(spec.dest, "")))


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--router-<flag>` for every flag of either router except host/port."""
    version, _ = router_arg_table()
    smg_version, _ = smg_arg_table()
    group = parser.add_argument_group(
        "router args (--router-*)",
        f"sglang-router {version} and smg {smg_version} flags with the prefix --router-, "
        "passed to every router slime_like starts (one per model). A flag only one of them "
        "has is refused with the other --router.")
    seen: set[str] = set()
    for spec, owner in any_router_rows():
        if spec.dest in EXCLUDED_ROUTER_FIELDS or spec.dest in seen:
            continue
        seen.add(spec.dest)
        note = ROUTER_FIELD_NOTES.get(spec.dest, "")
        if spec.dest in SLIME_ROUTER_DEFAULTS:
            note = f"slime_like default: {json.dumps(SLIME_ROUTER_DEFAULTS[spec.dest])}"
        elif spec.dest in OWNED_ROUTER_FIELDS:
            note = "not settable: " + OWNED_ROUTER_FIELDS[spec.dest]
        if owner == "smg":
            help_ = _help(spec, "smg", smg_version, note) + "; smg only"
        else:
            help_ = _help(spec, "sglang-router", version, note)
            if owner == "sglang-router":
                help_ += "; sglang-router only"
        _add(group, spec, "router-", ROUTER_PREFIX + spec.dest, help_)


def reserved_flag_hints() -> dict[str, str]:
    """`--sglang-<flag>` of a reserved field -> why it is not a flag, for error messages."""
    hints = {}
    for spec in server_arg_table()[1]:
        if spec.dest in RESERVED_SERVER_FIELDS:
            for flag in spec.flags:
                hints["--sglang-" + flag[2:]] = "not a flag: " + RESERVED_REASONS[spec.dest]
    return hints


def pop_prefixed(namespace: argparse.Namespace, prefix: str,
                 fields: Iterable[str]) -> dict[str, Any]:
    """Move the set pass-through values off the namespace into a {field: value} dict."""
    out: dict[str, Any] = {}
    for field in fields:
        dest = prefix + field
        if dest in vars(namespace):
            out[field] = vars(namespace).pop(dest)
    return out


def sglang_dests() -> dict[str, ArgSpec]:
    """Namespace dest -> row for the `--sglang-*` flags actually added to the parser."""
    return {SGLANG_PREFIX + s.dest: s for s in server_arg_table()[1]
            if s.dest not in RESERVED_SERVER_FIELDS}


def router_dests() -> dict[str, ArgSpec]:
    """Namespace dest -> row for the `--router-*` flags actually added to the parser."""
    out: dict[str, ArgSpec] = {}
    for spec, _ in any_router_rows():
        if spec.dest not in EXCLUDED_ROUTER_FIELDS:
            out.setdefault(ROUTER_PREFIX + spec.dest, spec)
    return out
