"""Server arguments: slime's precedence as a pure function, and the argv for either program.

No Ray and no sglang import here: the trainer, the config loader and CPU CI all render
engine command lines, and sglang is absent from most of those environments. What sglang
0.5.23 accepts is read from `engine/data/sglang_server_args.json` (generated from its
parser by `scripts/gen_arg_tables.py`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any, Literal

from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import (
    JSON_TYPES,
    ArgSpec,
    ComposedArgs,
    render_flags,
    server_arg_table,
)
from slime_like.protocol.modes import ENGINE_WORKER_TYPES, WorkerType

# sglang's `disaggregation_mode` when an engine is not one side of a PD pair.
NO_DISAGGREGATION = "null"

# Fields slime users set in configs written for older sglang that 0.5.23 no longer has under
# that name. Each maps to what replaced it, so the warning can say what to write instead.
RENAMED_FIELDS: dict[str, str] = {
    "cuda_graph_max_bs": "cuda_graph_max_bs_decode / cuda_graph_max_bs_prefill",
    "disable_cuda_graph": "cuda_graph_backend_decode=disabled / cuda_graph_backend_prefill=disabled",
    "enable_dp_attention": "attn_dp_size=<dp_size> (with dp_size=1)",
    "enable_deepep_moe": "moe_a2a_backend=deepep",
    "enable_ep_moe": "ep_size=<n>",
    "enable_flashinfer_mla": "attention_backend=flashinfer",
    "enable_flashmla": "attention_backend=flashmla",
    "prefill_round_robin_balance": "(removed, no replacement)",
}

def forced_server_args(
    *,
    model_path: str,
    host: str,
    port: int,
    nccl_port: int | None = None,
    num_gpus_per_engine: int = 1,
    pp_size: int = 1,
    dp_size: int = 1,
    ep_size: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    base_gpu_id: int = 0,
    gpu_id_step: int = 1,
    seed: int = 1234,
    engine_rank: int = 0,
    enable_memory_saver: bool = False,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    disaggregation_bootstrap_port: int | None = None,
    trust_remote_code: bool = True,
    skip_server_warmup: bool = True,
    enable_metrics: bool = True,
) -> dict[str, Any]:
    """The values slime sets itself (lowest precedence); tp_size = GPUs per engine / pp_size.

    Every node of one engine gets the same `random_seed` (seed + engine_rank) so its TP
    ranks sample alike; engines differ so their rollouts differ.
    """
    if num_gpus_per_engine < 1:
        raise ConfigError("num_gpus_per_engine", f"must be >= 1, got {num_gpus_per_engine}")
    if pp_size < 1 or num_gpus_per_engine % pp_size:
        raise ConfigError("pp_size", f"{pp_size} must divide num_gpus_per_engine={num_gpus_per_engine}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError("node_rank", f"{node_rank} is outside 0..nnodes-1 (nnodes={nnodes})")
    if nnodes > 1 and not dist_init_addr:
        raise ConfigError("dist_init_addr", f"required for an engine spanning nnodes={nnodes}")
    args: dict[str, Any] = {
        "model_path": str(model_path),
        "trust_remote_code": trust_remote_code,
        "host": host,
        "port": int(port),
        "nccl_port": nccl_port,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "dist_init_addr": dist_init_addr,
        "base_gpu_id": base_gpu_id,
        "gpu_id_step": gpu_id_step,
        "tp_size": num_gpus_per_engine // pp_size,
        "pp_size": pp_size,
        "dp_size": dp_size,
        "ep_size": ep_size,
        "random_seed": seed + engine_rank,
        "skip_server_warmup": skip_server_warmup,
        "enable_memory_saver": enable_memory_saver,
        "enable_metrics": enable_metrics,
        "api_key": api_key,
        "admin_api_key": admin_api_key,
        "disaggregation_bootstrap_port": disaggregation_bootstrap_port,
    }
    return {k: v for k, v in args.items() if v is not None}


def _worker_type_args(worker_type: WorkerType) -> dict[str, Any]:
    if worker_type == WorkerType.PREFILL:
        return {"disaggregation_mode": WorkerType.PREFILL.value,
                "load_balance_method": "follow_bootstrap_room"}
    if worker_type == WorkerType.DECODE:
        return {"disaggregation_mode": WorkerType.DECODE.value}
    if worker_type == WorkerType.ENCODER:
        return {"encoder_only": True}
    return {}


def _normalize(key: str, where: str, warnings: list[str], *, warn_dash: bool) -> str:
    name = key.replace("-", "_")
    if name != key and warn_dash:
        warnings.append(f"{where}.{key}: written with '-'; read as '{name}'")
    return name


def _check_value(spec: ArgSpec, value: Any, path: str) -> Any:
    """Reject values sglang's parser would reject, naming the field and where it came from."""
    if value is None:
        return None
    if spec.is_switch or spec.kind == "booleanoptional":
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {value!r}")
        return value
    values = value if isinstance(value, list | tuple) else [value]
    if isinstance(value, list | tuple) and spec.nargs in (None, "?") and spec.type not in JSON_TYPES:
        raise ConfigError(path, f"expected one value, got a list {list(value)!r}")
    for v in values:
        if spec.type == "int" and not (isinstance(v, int) and not isinstance(v, bool)):
            try:
                int(str(v))
            except ValueError:
                raise ConfigError(path, f"expected an integer, got {v!r}") from None
        if spec.type == "float" and not isinstance(v, int | float):
            try:
                float(str(v))
            except ValueError:
                raise ConfigError(path, f"expected a number, got {v!r}") from None
        if spec.choices and spec.type not in JSON_TYPES and v not in spec.choices \
                and str(v) not in {str(c) for c in spec.choices}:
            raise ConfigError(path, f"{v!r} is not one of {list(spec.choices)}")
    return value


def compose_server_args(
    *,
    forced: Mapping[str, Any],
    sglang_flags: Mapping[str, Any],
    overrides: Mapping[str, Any],
    worker_type: WorkerType | str,
    overrides_path: str = "overrides",
) -> ComposedArgs:
    """slime's precedence: forced < `--sglang-*` flags < the group's YAML `overrides`.

    `sglang_flags` holds only flags the user set (a None value means unset), by field name
    with or without the `sglang_` prefix. A None in `overrides` removes the key, so sglang's
    own default applies. Unknown fields are dropped with one warning naming them.
    """
    if worker_type not in ENGINE_WORKER_TYPES:
        raise ConfigError("worker_type", f"{str(worker_type)!r} is not an engine worker type; "
                          f"expected one of {[t.value for t in ENGINE_WORKER_TYPES]}")
    worker_type = WorkerType(worker_type)
    table = server_arg_table()
    warnings: list[str] = []
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(name: str, value: Any, path: str) -> None:
        merged[name] = value
        sources[name] = path

    for k, v in forced.items():
        put(k, v, f"forced.{k}")
    for k, v in _worker_type_args(worker_type).items():
        put(k, v, f"worker_type={worker_type}")
    for k, v in sglang_flags.items():
        if v is None:
            continue
        name = _normalize(k, "sglang_flags", warnings, warn_dash=False)
        if name.startswith("sglang_") and name not in table:
            name = name[len("sglang_"):]
        put(name, v, f"--sglang-{name.replace('_', '-')}")
    for k, v in overrides.items():
        name = _normalize(k, overrides_path, warnings, warn_dash=True)
        if v is None:
            merged.pop(name, None)
            sources.pop(name, None)
            continue
        put(name, v, f"{overrides_path}.{k}")

    # Memory saver pauses allocations a breakable prefill CUDA graph would hold (as slime does).
    if merged.get("enable_memory_saver") and "cuda_graph_backend_prefill" not in merged:
        put("cuda_graph_backend_prefill", "disabled", "enable_memory_saver")

    dropped = [name for name in merged if name not in table]
    if dropped:
        parts = []
        for name in dropped:
            hint = RENAMED_FIELDS.get(name)
            parts.append(f"{name} (from {sources[name]}; in sglang {table.version}: {hint})"
                         if hint else f"{name} (from {sources[name]})")
        warnings.append(f"dropped {len(dropped)} field(s) that sglang {table.version} ServerArgs "
                        f"does not have: " + ", ".join(parts))
    args = {}
    for name, value in merged.items():
        if name in table:
            args[name] = _check_value(table[name], value, sources[name])
            if table[name].deprecated and value:
                hint = RENAMED_FIELDS.get(name, "see sglang's release notes")
                warnings.append(f"{sources[name]}: '{name}' is deprecated in sglang "
                                f"{table.version}; use {hint}")
    _check_worker_type(args, worker_type, sources)
    return ComposedArgs(args={k: v for k, v in args.items() if v is not None},
                        dropped=dropped, warnings=warnings)


def _check_worker_type(args: Mapping[str, Any], worker_type: WorkerType,
                       sources: Mapping[str, str]) -> None:
    """Overrides may tune a worker type's extras but not contradict the type itself."""
    mode = args.get("disaggregation_mode", NO_DISAGGREGATION)
    wanted = worker_type.value if worker_type.is_pd else NO_DISAGGREGATION
    if worker_type != WorkerType.ENCODER and mode != wanted:
        raise ConfigError(sources.get("disaggregation_mode", "disaggregation_mode"),
                          f"disaggregation_mode={mode!r} contradicts "
                          f"worker_type={worker_type.value!r}")
    if worker_type == WorkerType.PREFILL and args.get("disaggregation_bootstrap_port") is None:
        raise ConfigError("disaggregation_bootstrap_port",
                          "a prefill engine needs a bootstrap port (reserved by its engine actor)")
    if worker_type == WorkerType.ENCODER and not args.get("encoder_only"):
        raise ConfigError(sources.get("encoder_only", "encoder_only"),
                          "an encoder engine needs encoder_only=true")


def render_argv(
    args: Mapping[str, Any],
    program: Literal["sglang", "reference"],
    python: str = sys.executable,
) -> list[str]:
    """`python -m sglang.launch_server ...` or `python -m slime_like.reference_engine ...`.

    Both get the same flags; a switch set to False and a None value are left out, so
    sglang's default applies.
    """
    modules = {"sglang": "sglang.launch_server", "reference": "slime_like.reference_engine"}
    if program not in modules:
        raise ConfigError("program", f"{program!r} is not one of {list(modules)}")
    table = server_arg_table()
    unknown = [name for name in args if name not in table]
    if unknown:
        raise ConfigError(unknown[0], f"not a field of sglang {table.version} ServerArgs; "
                          "compose_server_args drops such fields")
    return [python, "-m", modules[program], *render_flags(table, args)]


def parse_argv(argv: list[str]) -> dict[str, Any]:
    """Our own reading of a rendered argv back into field values (inverse of render_argv).

    Used to check a command line without sglang; the reference engine reads flags with it too.
    """
    table = server_arg_table()
    by_flag = {f: spec for spec in table.specs.values() for f in spec.flags}
    # `--flag=value` is one token to argparse; split it so both spellings read alike.
    argv = [part for tok in argv
            for part in (tok.split("=", 1) if tok.startswith("--") and "=" in tok else [tok])]
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        spec = by_flag.get(tok)
        if spec is None:
            raise ConfigError(tok, f"not a flag of sglang {table.version}")
        i += 1
        if spec.is_switch:
            out[spec.dest] = True
            continue
        if spec.kind == "booleanoptional":
            out[spec.dest] = tok == spec.flags[0]
            continue
        vals = []
        while i < len(argv) and not (argv[i].startswith("--") and argv[i] in by_flag):
            vals.append(argv[i])
            i += 1
            if spec.nargs in (None, "?"):
                break
        out[spec.dest] = _coerce(spec, vals if spec.nargs not in (None, "?") else vals[0])
    return out


def _coerce(spec: ArgSpec, raw: Any) -> Any:
    if isinstance(raw, list):
        return [_coerce(spec, r) for r in raw]
    if spec.type == "int":
        return int(raw)
    if spec.type == "float":
        return float(raw)
    if spec.type in JSON_TYPES:
        return json.loads(raw)
    return raw


def worker_type_of(server_args: Mapping[str, Any]) -> WorkerType:
    """The worker type a server's args describe (as its /server_info reports them)."""
    if server_args.get("encoder_only"):
        return WorkerType.ENCODER
    mode = server_args.get("disaggregation_mode") or NO_DISAGGREGATION
    return WorkerType(mode) if mode in (WorkerType.PREFILL, WorkerType.DECODE) \
        else WorkerType.REGULAR


# What the orchestrator relies on an engine's args for: its size and weight-group ranks,
# where it listens, and its role. Compared against sglang's own parse in the contract tests.
VIEW_FIELDS: tuple[str, ...] = (
    "model_path", "host", "port", "nccl_port", "dist_init_addr", "nnodes", "node_rank",
    "base_gpu_id", "tp_size", "pp_size", "dp_size", "attn_dp_size", "ep_size",
    "disaggregation_mode", "enable_memory_saver",
)


def engine_view(args: Mapping[str, Any]) -> dict[str, Any]:
    """Our view of an engine from its server args (sglang's defaults where a field is absent),
    so a dict we composed and a ServerArgs sglang parsed can be compared field by field."""
    table = server_arg_table()
    view = {k: args.get(k, table[k].default if k in table else None) for k in VIEW_FIELDS}
    view["worker_type"] = worker_type_of(args)
    view["bootstrap_port"] = args.get("disaggregation_bootstrap_port") \
        if view["worker_type"] == WorkerType.PREFILL else None
    return view
