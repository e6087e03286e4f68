"""Command-line flags of the reference engine: every sglang 0.5.23 flag, parsed from its table.

The engine is started with the argv an orchestrator renders for real sglang, so it must
accept any valid sglang argv (aliases included) and refuse what sglang refuses. The flags
come from `engine/data/sglang_server_args.json` (generated from sglang's own ServerArgs);
the few the engine acts on are resolved into `EngineArgs`, the rest are accepted with one
warning that names them.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import SERVER_ARGS, ArgSpec, read_rows
from slime_like.protocol.fp8 import check_quantization

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
WEIGHT_UPDATE_GATES = ("strict", "optional")
# The HTTP server under the engine: `auto` is uvloop + httptools where installed (as sglang
# serves), `asyncio` the pure-Python loop and h11 parser (for side-by-side measurement).
HTTP_STACKS = ("auto", "asyncio")
OWN_DESTS = ("reference_weight_update_gate", "reference_http_stack")

# ServerArgs fields the reference engine acts on; any other flag given is warned about once.
USED_DESTS = frozenset({
    "model_path", "tokenizer_path", "host", "port", "tp_size", "base_gpu_id", "gpu_id_step",
    "device", "api_key", "admin_api_key", "served_model_name", "weight_version", "load_format",
    "dtype", "context_length", "max_running_requests", "max_total_tokens", "random_seed",
    "enable_metrics", "skip_server_warmup", "disaggregation_mode", "disaggregation_bootstrap_port",
    "nnodes", "node_rank", "dist_init_addr", "enable_memory_saver", "enable_weights_cpu_backup",
    "incremental_streaming_output", "skip_tokenizer_init", "dp_size", "pp_size", "log_level",
    "soft_watchdog_timeout", "disable_radix_cache", "quantization",
})

_SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "float32": torch.float32}


def human_readable_int(value: str) -> int:
    """sglang's integer syntax for token counts: '32768', '32k' (SI) or '32Ki' (IEC)."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid integer {value!r} (e.g. 32768, 32k, 32Ki)")
    number, suffix = m.groups()
    if suffix is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"invalid integer {value!r}")
        return int(number)
    if suffix.endswith("i"):
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with IEC suffix {suffix!r}")
        return int(number) * 1024 ** ("KMGT".index(suffix[0]) + 1)
    return int(float(number) * 1000 ** ("kMGT".index(suffix) + 1))


def _json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {value!r} ({e})") from e


def _nullable_str(value: str) -> str | None:
    return None if value.lower() in ("none", "null", "") else value


_TYPES = {"str": str, "int": int, "float": float, "human_readable_int": human_readable_int,
          "loads": _json_value, "json_list_type": _json_value, "nullable_str": _nullable_str}


def sglang_arg_table() -> tuple[ArgSpec, ...]:
    """Rows of the sglang 0.5.23 flag table (dest, flags, kind, type, nargs, default, choices)."""
    return read_rows(SERVER_ARGS)[1]


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """An argparse parser accepting exactly sglang's flags plus the engine's own `--reference-*`."""
    p = argparse.ArgumentParser(
        prog="python -m slime_like.reference_engine",
        usage="%(prog)s --model-path DIR [--host H] [--port P] [any sglang 0.5.23 flag ...]",
        description="SGLang-protocol reference engine over a small torch model.",
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    for row in sglang_arg_table():
        kwargs: dict[str, Any] = {"dest": row.dest}
        if not suppress_defaults:
            kwargs["default"] = row.default
        kind = row.kind
        flags = row.flags
        if kind in ("storetrue", "deprecatedstoretrue"):
            kwargs["action"] = "store_true"
        elif kind == "booleanoptional":
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = [f for f in flags if not f.startswith("--no-")] or flags[:1]
        else:
            kwargs["type"] = _TYPES.get(row.type or "str", str)
            if row.nargs is not None:
                kwargs["nargs"] = row.nargs
            if row.choices and row.type in ("str", "int", None):
                kwargs["choices"] = row.choices
        # sglang's parser enforces --model-path itself; here a missing one gets our error text.
        p.add_argument(*flags, **kwargs)
    p.add_argument(
        "--reference-weight-update-gate", dest="reference_weight_update_gate",
        choices=WEIGHT_UPDATE_GATES, **({} if suppress_defaults else {"default": "strict"}),
        help="strict (sglang >= 0.5.21): tensor/distributed updates need begin_weight_update; "
             "optional (sglang <= 0.5.20): updates outside a session are accepted.")
    p.add_argument(
        "--reference-http-stack", dest="reference_http_stack", choices=HTTP_STACKS,
        **({} if suppress_defaults else {"default": "auto"}),
        help="auto: uvloop and httptools where installed (each control call of a weight sync "
             "answers faster); asyncio: the standard event loop and the h11 parser.")
    return p


@dataclass
class EngineArgs:
    """The resolved arguments the reference engine acts on, plus every sglang arg for /server_info."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    device: str = "cpu"
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str = ""
    weight_version: str = "default"
    load_format: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    random_seed: int = 0
    enable_metrics: bool = False
    skip_server_warmup: bool = False
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    disable_radix_cache: bool = False
    incremental_streaming_output: bool = False
    skip_tokenizer_init: bool = False
    # sglang dumps a stuck scheduler's stack after this long (off by default there); the
    # reference engine always does, after 20 s unless the flag says otherwise.
    soft_watchdog_timeout: float | None = None
    weight_update_gate: str = "strict"
    http_stack: str = "auto"
    # --quantization fp8: linear projections served as sglang's FP8 blocks (fp8.py)
    quantization: str | None = None
    all_args: dict[str, Any] = field(default_factory=dict)
    ignored_flags: list[str] = field(default_factory=list)

    def torch_dtype(self, config_dtype: torch.dtype) -> torch.dtype:
        """--dtype auto = the checkpoint's dtype, except fp16/bf16 become fp32 on CPU (as sglang)."""
        if self.dtype == "auto":
            if self.device == "cpu" and config_dtype in (torch.float16, torch.bfloat16):
                return torch.float32
            return config_dtype
        return _DTYPES[self.dtype]

    @property
    def ranks_per_node(self) -> int:
        """TP ranks each node runs (sglang: tp_size // nnodes)."""
        return self.tp_size // self.nnodes

    def node_ranks(self, node_rank: int | None = None) -> range:
        """The global TP ranks on a node (this one by default): node r has r*k .. r*k+k-1."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def rank_device(self, tp_rank: int) -> str:
        """cuda:(base_gpu_id + local_rank * gpu_id_step) on GPUs, as sglang places TP ranks
        (the local rank is the rank's index on its node)."""
        if self.device == "cuda":
            return f"cuda:{self.base_gpu_id + (tp_rank % self.ranks_per_node) * self.gpu_id_step}"
        return "cpu"


def split_host_port(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port (IPv6 as [addr]:port), got {addr!r}")
    return host.strip("[]"), int(port)


def _given_flags(argv: list[str]) -> dict[str, Any]:
    """The dests the user set explicitly (parsed again with every default suppressed)."""
    ns, _ = build_parser(suppress_defaults=True).parse_known_args(argv)
    return vars(ns)


def parse_args(argv: list[str]) -> EngineArgs:
    """argv (sglang flags) -> EngineArgs; an unknown flag exits with argparse's usage error."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    if not values.get("model_path"):
        parser.error("the following arguments are required: --model-path/--model")
    given = _given_flags(argv)
    ignored = sorted(d for d in given if d not in USED_DESTS and d not in OWN_DESTS)
    if ignored:
        flag_of = {row.dest: row.flag for row in sglang_arg_table()}
        logger.warning("reference engine: accepted but ignored sglang flags: %s",
                       " ".join(flag_of.get(d, d) for d in ignored))

    def check(cond: bool, flag: str, msg: str) -> None:
        if not cond:
            raise ConfigError(flag, msg)

    device = values["device"] or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device in ("cpu", "cuda"), "--device", f"the reference engine runs on cpu or cuda, got {device!r}")
    check(device != "cuda" or torch.cuda.is_available(), "--device", "cuda requested but no CUDA device is visible")
    check(values["load_format"] in _SUPPORTED_LOAD_FORMATS, "--load-format",
          f"the reference engine loads {list(_SUPPORTED_LOAD_FORMATS)}, got {values['load_format']!r}")
    check(values["dtype"] == "auto" or values["dtype"] in _DTYPES, "--dtype",
          f"must be auto or one of {sorted(_DTYPES)}, got {values['dtype']!r}")
    check(values["tp_size"] >= 1, "--tp-size", f"must be >= 1, got {values['tp_size']}")
    check(values["dp_size"] == 1, "--dp-size",
          "the reference engine serves one DP replica; run one engine per replica (sglang's weight "
          "updates also require dp_size == 1)")
    check(values["pp_size"] == 1, "--pp-size", "pipeline parallelism is not supported by the reference engine")
    nnodes, node_rank = values["nnodes"], values["node_rank"]
    check(nnodes >= 1, "--nnodes", f"must be >= 1, got {nnodes}")
    check(0 <= node_rank < nnodes, "--node-rank", f"must be in [0, {nnodes}) with --nnodes {nnodes}, "
          f"got {node_rank}")
    check(values["tp_size"] % nnodes == 0, "--tp-size",
          f"{values['tp_size']} TP ranks cannot be spread evenly over --nnodes {nnodes}")
    check(nnodes == 1 or bool(values["dist_init_addr"]), "--dist-init-addr",
          "required with --nnodes > 1: host:port of node 0, where every node's TP ranks join")
    if values["dist_init_addr"]:
        try:
            split_host_port(values["dist_init_addr"])
        except ValueError as e:
            raise ConfigError("--dist-init-addr", str(e)) from e
    try:
        check_quantization(values["quantization"], "--quantization")
    except ValueError as e:
        raise ConfigError("--quantization", str(e)) from e
    mrr = values["max_running_requests"]
    check(mrr is None or mrr >= 1, "--max-running-requests", f"must be >= 1, got {mrr}")
    return EngineArgs(
        model_path=values["model_path"], host=values["host"], port=values["port"],
        tp_size=values["tp_size"], base_gpu_id=values["base_gpu_id"],
        gpu_id_step=values["gpu_id_step"], device=device, api_key=values["api_key"],
        admin_api_key=values["admin_api_key"],
        served_model_name=values["served_model_name"] or values["model_path"],
        weight_version=values["weight_version"], load_format=values["load_format"],
        dtype=values["dtype"], context_length=values["context_length"],
        max_running_requests=mrr, max_total_tokens=values["max_total_tokens"],
        random_seed=values["random_seed"] if values["random_seed"] is not None else 0,
        enable_metrics=values["enable_metrics"], skip_server_warmup=values["skip_server_warmup"],
        disaggregation_mode=values["disaggregation_mode"],
        disaggregation_bootstrap_port=values["disaggregation_bootstrap_port"],
        nnodes=values["nnodes"], node_rank=values["node_rank"],
        dist_init_addr=values["dist_init_addr"], enable_memory_saver=values["enable_memory_saver"],
        enable_weights_cpu_backup=values["enable_weights_cpu_backup"],
        disable_radix_cache=bool(values["disable_radix_cache"]),
        incremental_streaming_output=values["incremental_streaming_output"],
        skip_tokenizer_init=values["skip_tokenizer_init"],
        soft_watchdog_timeout=values["soft_watchdog_timeout"],
        weight_update_gate=values["reference_weight_update_gate"],
        http_stack=values["reference_http_stack"],
        quantization=values["quantization"],
        all_args={k: v for k, v in values.items() if k not in OWN_DESTS},
        ignored_flags=ignored,
    )
