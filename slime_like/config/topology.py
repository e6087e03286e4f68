"""Models and server groups of the rollout side, resolved from `--sglang-config` or flags.

slime's order: `--sglang-config`; else `--rollout-num-gpus 0` (routers, no engines); else
`--prefill-num-servers` (legacy PD); else one regular group. Defaults are filled in here
(num_gpus_per_engine: group > model > flag; model_path: model > --hf-checkpoint;
update_weights inferred) and slime's rules checked, each error naming its YAML path or flag.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.argtypes import did_you_mean
from slime_like.config.config_file import InlineSglangConfig, show
from slime_like.config.sglang_config import (
    ModelConfig,
    ServerGroupConfig,
    SglangConfig,
    load_sglang_config,
    parse_sglang_config,
)
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import server_arg_table
from slime_like.protocol.modes import WorkerType

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
# Set for each engine from its placement; a group-wide value would give every engine the
# same port or rank.
PLACEMENT_OWNED_FIELDS = {
    "host": "set per engine from the node its actor runs on",
    "port": "set per engine (each engine reserves its own port)",
    "nccl_port": "set per engine (each engine reserves its own port)",
    "disaggregation_bootstrap_port": "set per prefill engine (each reserves its own port)",
    "nnodes": "set from num_gpus_per_engine and --num-gpus-per-node",
    "node_rank": "set per engine actor by placement",
    "dist_init_addr": "set per multi-node engine by placement",
    "base_gpu_id": "set per engine by placement",
    "gpu_id_step": "placement gives each engine consecutive GPUs",
    "disaggregation_mode": "set from worker_type (prefill or decode)",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class GroupSpec:
    """One resolved server group: `num_engines` engines of `num_gpus_per_engine` GPUs each."""

    model_name: str
    group_index: int
    worker_type: WorkerType
    num_gpus: int
    num_gpus_per_engine: int
    nnodes: int
    overrides: Mapping[str, Any]
    where: str

    @property
    def is_placeholder(self) -> bool:
        return self.worker_type == WorkerType.PLACEHOLDER

    @property
    def num_engines(self) -> int:
        return 0 if self.is_placeholder else self.num_gpus // self.num_gpus_per_engine

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one engine on each of its nodes (one engine actor per node)."""
        return self.num_gpus_per_engine // self.nnodes


@dataclass(frozen=True)
class ModelSpec:
    """One resolved model: one router in front of its engines."""

    name: str
    model_path: str | None
    update_weights: bool
    groups: tuple[GroupSpec, ...]
    where: str

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    @property
    def num_engines(self) -> int:
        return sum(g.num_engines for g in self.groups)

    @property
    def pd_disaggregation(self) -> bool:
        return any(g.worker_type.is_pd for g in self.groups)

    @property
    def has_encoders(self) -> bool:
        return any(g.worker_type == WorkerType.ENCODER for g in self.groups)


@dataclass(frozen=True)
class Topology:
    """Every model of the job in YAML order; groups take rollout GPU slots in this order."""

    models: tuple[ModelSpec, ...]
    source: str
    external: bool = False
    warnings: tuple[str, ...] = field(default=())

    @property
    def num_gpus(self) -> int:
        return sum(m.num_gpus for m in self.models)

    @property
    def updatable_model(self) -> ModelSpec | None:
        return next((m for m in self.models if m.update_weights), None)

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


@dataclass(frozen=True)
class TopologyInputs:
    """The flags topology resolution reads (a slice of the parsed args)."""

    hf_checkpoint: str | None = None
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    num_gpus_per_node: int = 8
    sglang_pp_size: int | None = None
    engine: str = "sglang"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TopologyInputs:
        return cls(hf_checkpoint=args.hf_checkpoint, rollout_num_gpus=args.rollout_num_gpus,
                   rollout_num_gpus_per_engine=args.rollout_num_gpus_per_engine,
                   num_gpus_per_node=args.num_gpus_per_node,
                   sglang_pp_size=args.sglang_flags.get("pp_size"), engine=args.engine)


# ---- overrides ---------------------------------------------------------------------------

def _check_override_value(key: str, value: Any, where: str) -> None:
    spec = server_arg_table()[key]
    if value is None:
        return
    if spec.kind in ("storetrue", "deprecatedstoretrue", "booleanoptional"):
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {show(value)}")
        return
    if spec.nargs in ("+", "*"):
        return
    if spec.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(where, f"must be an integer, got {show(value)}")
    if spec.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(where, f"must be a number, got {show(value)}")
    if spec.choices and value not in spec.choices:
        raise ConfigError(where, f"must be one of {', '.join(map(str, spec.choices))}; "
                                 f"got {show(value)}")


def normalize_overrides(raw: Mapping[str, Any], where: str,
                        warnings: list[str]) -> dict[str, Any]:
    """Overrides with `-` -> `_` keys, each a known ServerArgs field with a plausible value."""
    fields = server_arg_table().specs
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        path = f"{where}.overrides.{key}"
        if name in out:
            raise ConfigError(path, f"given twice (as {name!r} too)")
        if name in PLACEMENT_OWNED_FIELDS:
            raise ConfigError(path, f"cannot be overridden: {PLACEMENT_OWNED_FIELDS[name]}")
        if name not in fields:
            hint = did_you_mean(name, fields)
            if hint:
                # Close to a real field: a typo, which would otherwise be dropped silently.
                raise ConfigError(path, "not a ServerArgs field" + hint)
            warnings.append(f"{path}: not a ServerArgs field of the sglang version the flag "
                            "table was made from; it is dropped when the engine is launched")
        else:
            _check_override_value(name, value, path)
        out[name] = value
    return out


# ---- groups and models -------------------------------------------------------------------

def _nnodes(gpe: int, gpe_where: str, gpn: int) -> int:
    if gpe <= gpn:
        return 1
    if gpe % gpn:
        raise ConfigError(gpe_where, "an engine larger than a node spans whole nodes: must be "
                                     f"a multiple of --num-gpus-per-node ({gpn}), got {gpe}")
    return gpe // gpn


def _resolve_group(model: ModelConfig, m_where: str, j: int, g: ServerGroupConfig,
                   inputs: TopologyInputs, warnings: list[str]) -> GroupSpec:
    where = f"{m_where}.server_groups[{j}]"
    if g.worker_type == WorkerType.PLACEHOLDER:
        for name in ("num_gpus_per_engine", "overrides"):
            if name in g.model_fields_set and getattr(g, name):
                raise ConfigError(f"{where}.{name}", "a placeholder group only reserves GPU "
                                                     "slots and starts no engine; remove it")
        return GroupSpec(model.name, j, g.worker_type, g.num_gpus, g.num_gpus, 1, {}, where)
    if g.num_gpus_per_engine is not None:
        gpe, gpe_where = g.num_gpus_per_engine, f"{where}.num_gpus_per_engine"
    elif model.num_gpus_per_engine is not None:
        gpe, gpe_where = model.num_gpus_per_engine, f"{m_where}.num_gpus_per_engine"
    else:
        gpe, gpe_where = inputs.rollout_num_gpus_per_engine, "--rollout-num-gpus-per-engine"
    if g.num_gpus % gpe:
        raise ConfigError(f"{where}.num_gpus", f"must be a multiple of num_gpus_per_engine "
                                                f"({gpe}), got {g.num_gpus}")
    nnodes = _nnodes(gpe, gpe_where, inputs.num_gpus_per_node)
    overrides = normalize_overrides(g.overrides, where, warnings)
    _check_parallelism(gpe, gpe_where, overrides, where, inputs)
    return GroupSpec(model.name, j, g.worker_type, g.num_gpus, gpe, nnodes,
                     overrides, where)


def _check_parallelism(gpe: int, gpe_where: str, overrides: Mapping[str, Any], where: str,
                       inputs: TopologyInputs) -> None:
    # A None override means "sglang's default", i.e. unset here.
    if overrides.get("pp_size") is not None:
        pp, pp_where = overrides["pp_size"], f"{where}.overrides.pp_size"
    else:
        pp, pp_where = inputs.sglang_pp_size or 1, "--sglang-pp-size"
    if not isinstance(pp, int) or pp <= 0:
        raise ConfigError(pp_where, f"must be > 0, got {show(pp)}")
    if gpe % pp:
        raise ConfigError(pp_where, f"must divide num_gpus_per_engine ({gpe} at {gpe_where}), "
                                    f"got {pp}")
    if overrides.get("tp_size") is not None:
        tp = overrides["tp_size"]
        if tp <= 0:
            raise ConfigError(f"{where}.overrides.tp_size", f"must be > 0, got {tp}")
        if tp * pp != gpe:
            raise ConfigError(f"{where}.overrides.tp_size",
                              f"tp_size {tp} x pp_size {pp} = {tp * pp} GPUs, but "
                              f"num_gpus_per_engine is {gpe}")


def _check_worker_mix(groups: list[GroupSpec], m_where: str, name: str) -> None:
    types = [g.worker_type for g in groups]
    has_pd = any(t.is_pd for t in types)
    if has_pd:
        for g in groups:
            if g.worker_type == WorkerType.REGULAR:
                raise ConfigError(f"{g.where}.worker_type",
                                  "regular groups cannot be mixed with prefill/decode groups in "
                                  f"one model (model {name!r} is served by one PD router)")
        for need, other in ((WorkerType.PREFILL, WorkerType.DECODE),
                            (WorkerType.DECODE, WorkerType.PREFILL)):
            if need not in types:
                raise ConfigError(f"{m_where}.server_groups",
                                  f"model {name!r} has {other} groups but no {need} group")
    if WorkerType.ENCODER in types and \
            not any(t in (WorkerType.REGULAR, WorkerType.PREFILL) for t in types):
        first = next(g for g in groups if g.worker_type == WorkerType.ENCODER)
        raise ConfigError(f"{first.where}.worker_type",
                          f"encoder groups need a regular or prefill group in model {name!r} "
                          "to send their embeddings to")


def _resolve_model(i: int, model: ModelConfig, inputs: TopologyInputs,
                   warnings: list[str]) -> tuple[ModelSpec, bool]:
    m_where = f"sglang[{i}]"
    if not _NAME_RE.match(model.name):
        raise ConfigError(f"{m_where}.name", "must start with a letter or digit and hold only "
                                             f"letters, digits, '_', '.', '-'; got "
                                             f"{model.name!r}")
    groups = [_resolve_group(model, m_where, j, g, inputs, warnings)
              for j, g in enumerate(model.server_groups)]
    _check_worker_mix(groups, m_where, model.name)

    default_path = model.model_path or inputs.hf_checkpoint
    default_where = f"{m_where}.model_path" if model.model_path else "--hf-checkpoint"
    served = [(g.overrides["model_path"], f"{g.where}.overrides.model_path")
              if "model_path" in g.overrides else (default_path, default_where)
              for g in groups if not g.is_placeholder]
    path, path_where = served[0] if served else (default_path, default_where)
    for here, here_where in served[1:]:
        if here != path:
            raise ConfigError(here_where, f"every group of model {model.name!r} must serve one "
                                          f"model_path: {show(here)} here, {show(path)} at "
                                          f"{path_where}")
    if path is None and inputs.engine == "sglang" and any(not g.is_placeholder for g in groups):
        raise ConfigError(f"{m_where}.model_path", "required: no --hf-checkpoint to default to")
    inferred = model.update_weights is None
    update = (path == inputs.hf_checkpoint) if inferred else bool(model.update_weights)
    if inferred and not update:
        warnings.append(f"{m_where}.update_weights: inferred false, because its model_path "
                        f"{path!r} differs from --hf-checkpoint; set it to silence this")
    spec = ModelSpec(model.name, path, update, tuple(groups), m_where)
    return spec, inferred


def resolve_sglang_config(config: SglangConfig, inputs: TopologyInputs) -> Topology:
    """Apply defaults and slime's rules to a parsed `--sglang-config`."""
    warnings: list[str] = []
    models: list[ModelSpec] = []
    first_seen: dict[str, int] = {}
    updatable: tuple[int, bool] | None = None
    for i, model in enumerate(config.sglang):
        if model.name in first_seen:
            raise ConfigError(f"sglang[{i}].name", f"duplicate model name {model.name!r} "
                                                   f"(also sglang[{first_seen[model.name]}])")
        first_seen[model.name] = i
        spec, inferred = _resolve_model(i, model, inputs, warnings)
        if spec.update_weights:
            if updatable is not None:
                j, j_inferred = updatable
                why = " (inferred from model_path == --hf-checkpoint)" if inferred else ""
                raise ConfigError(f"sglang[{i}].update_weights",
                                  f"only one model may receive weight updates, and "
                                  f"{config.sglang[j].name!r} (sglang[{j}]) already does{why}; "
                                  "set update_weights: false on the frozen one")
            updatable = (i, inferred)
        models.append(spec)
    total = config.total_num_gpus
    if inputs.rollout_num_gpus is not None and total != inputs.rollout_num_gpus:
        raise ConfigError("sglang", f"the server groups hold {total} GPUs in total, but "
                                    f"--rollout-num-gpus is {inputs.rollout_num_gpus}")
    return Topology(tuple(models), source="sglang_config", warnings=tuple(warnings))


# ---- flag-only topologies ---------------------------------------------------------------

def _single_model(groups: list[tuple[WorkerType, int, str]], inputs: TopologyInputs,
                  source: str) -> Topology:
    gpe = inputs.rollout_num_gpus_per_engine
    nnodes = _nnodes(gpe, "--rollout-num-gpus-per-engine", inputs.num_gpus_per_node)
    specs = []
    for j, (worker_type, num_gpus, where) in enumerate(groups):
        if num_gpus % gpe:
            raise ConfigError(where, f"must be a multiple of --rollout-num-gpus-per-engine "
                                     f"({gpe}), got {num_gpus}")
        specs.append(GroupSpec(DEFAULT_MODEL_NAME, j, worker_type, num_gpus, gpe, nnodes, {},
                               where))
    _check_parallelism(gpe, "--rollout-num-gpus-per-engine", {}, "", inputs)
    if specs and inputs.hf_checkpoint is None and inputs.engine == "sglang":
        raise ConfigError("--hf-checkpoint", "required to launch sglang engines")
    model = ModelSpec(DEFAULT_MODEL_NAME, inputs.hf_checkpoint, True, tuple(specs),
                      "--rollout-num-gpus")
    return Topology((model,), source=source)


def resolve_topology(args: argparse.Namespace) -> Topology:
    """The job's topology from parsed flags (slime's priority order, see module doc)."""
    if args.debug_train_only:
        return Topology((), source="debug_train_only")
    return topology_of(TopologyInputs.from_args(args), sglang_config=args.sglang_config,
                       external=bool(args.rollout_external_engine_addrs),
                       prefill_num_servers=args.prefill_num_servers)


def topology_of(inputs: TopologyInputs, *, sglang_config: Any = None, external: bool = False,
                prefill_num_servers: int | None = None) -> Topology:
    """Models and groups from a `--sglang-config` (a path, or YAML already read), external
    engines, or the GPU count alone: what the job's flags and `slime_like.api` both say."""
    if external:
        model = ModelSpec(DEFAULT_MODEL_NAME, inputs.hf_checkpoint, True, (), "--rollout-"
                          "external-engine-addrs")
        return Topology((model,), source="external", external=True)
    if sglang_config is not None:
        source = sglang_config
        config = (parse_sglang_config(source.data) if isinstance(source, InlineSglangConfig)
                  else load_sglang_config(source))
        return resolve_sglang_config(config, inputs)
    n = inputs.rollout_num_gpus or 0
    if n == 0:
        return _single_model([], inputs, source="router_only")
    if prefill_num_servers is not None:
        prefill = prefill_num_servers * inputs.rollout_num_gpus_per_engine
        if prefill >= n:
            raise ConfigError("--prefill-num-servers",
                              f"{prefill_num_servers} prefill engines of "
                              f"{inputs.rollout_num_gpus_per_engine} GPUs leave no decode GPUs "
                              f"of --rollout-num-gpus {n}")
        return _single_model([(WorkerType.PREFILL, prefill, "--prefill-num-servers"),
                              (WorkerType.DECODE, n - prefill, "--rollout-num-gpus")], inputs,
                             source="prefill_num_servers")
    return _single_model([(WorkerType.REGULAR, n, "--rollout-num-gpus")], inputs,
                         source="flags")
