"""Slime-compatible flags, `--config FILE.yaml`, and the `--sglang-config` server groups."""

from slime_like.config.flags import build_parser
from slime_like.config.parse import parse_args
from slime_like.config.sglang_config import SglangConfig, load_sglang_config, parse_sglang_config
from slime_like.config.topology import GroupSpec, ModelSpec, Topology, resolve_topology

__all__ = [
    "GroupSpec", "ModelSpec", "SglangConfig", "Topology", "build_parser", "load_sglang_config",
    "parse_args", "parse_sglang_config", "resolve_topology",
]
