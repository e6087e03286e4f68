"""Where every trainer rank and engine actor goes: a pure function over sorted bundles.

The job holds one placement group of `{GPU: 1, CPU: 1}` bundles. Sorted by (node IP, GPU
id), its slots are: trainer ranks first, rollout groups after in YAML order (colocate: the
rollout groups start at slot 0 and share the trainer's slots). An engine's node and GPUs
are read from the bundles it lands on, never derived from its rank, so a group that starts
mid-node gets the right node (slime's bug #2373). Engines larger than a node get one actor
per node (`nnodes`, `node_rank`, a shared `dist_init_host`). Placeholder groups reserve slots.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from slime_like.errors import ConfigError
from slime_like.protocol.modes import WorkerType

if TYPE_CHECKING:  # config imports this module to dry-run placement at parse time
    from slime_like.config.topology import GroupSpec, Topology


@dataclass(frozen=True)
class Bundle:
    """One `{GPU: 1, CPU: 1}` bundle: its index in the placement group and where it landed."""

    index: int
    node_ip: str
    gpu_id: int
    node_id: str = ""


def bundle_sort_key(b: Bundle) -> tuple:
    """(node IP numerically, GPU id); hostnames that are not IPs sort after, by name."""
    try:
        ip = ipaddress.ip_address(b.node_ip)
        node: tuple = (0, ip.version, int(ip))
    except ValueError:
        node = (1, 0, b.node_ip)
    return (*node, b.gpu_id, b.index)


def sort_bundles(bundles: Sequence[Bundle]) -> list[Bundle]:
    """Bundles in slot order: by node IP, then GPU id."""
    return sorted(bundles, key=bundle_sort_key)


@dataclass(frozen=True)
class PlacementGroupLayout:
    """Size of the job's placement group and the slot where rollout groups start."""

    num_bundles: int
    rollout_offset: int
    num_trainer_slots: int


def placement_group_layout(*, actor_gpus: int, rollout_gpus: int, colocate: bool = False,
                           debug_rollout_only: bool = False, debug_train_only: bool = False,
                           rollout_external: bool = False) -> PlacementGroupLayout:
    """slime's table: PG size and rollout offset per mode (see tests/cluster/test_layout.py)."""
    if debug_rollout_only:
        # External engines take no slots, so an external rollout-only job needs none.
        n = 0 if rollout_external else rollout_gpus
        return PlacementGroupLayout(n, 0, 0)
    if debug_train_only:
        return PlacementGroupLayout(actor_gpus, 0, actor_gpus)
    if rollout_external:
        return PlacementGroupLayout(actor_gpus, actor_gpus, actor_gpus)
    if colocate:
        return PlacementGroupLayout(max(actor_gpus, rollout_gpus), 0, actor_gpus)
    return PlacementGroupLayout(actor_gpus + rollout_gpus, actor_gpus, actor_gpus)


def layout_from_args(args: Any) -> PlacementGroupLayout:
    """`placement_group_layout` for parsed (and validated) flags."""
    return placement_group_layout(
        actor_gpus=args.actor_num_nodes * args.actor_num_gpus_per_node,
        rollout_gpus=args.rollout_num_gpus or 0, colocate=args.colocate,
        debug_rollout_only=args.debug_rollout_only, debug_train_only=args.debug_train_only,
        rollout_external=bool(args.rollout_external_engine_addrs))


def nominal_bundles(num_bundles: int, gpus_per_node: int) -> list[Bundle]:
    """The bundles a packed placement group gets on nodes of `gpus_per_node` GPUs each.

    Used to check a config before any GPU is allocated; the real bundles are probed later.
    """
    return [Bundle(i, f"node{i // gpus_per_node}", i % gpus_per_node)
            for i in range(num_bundles)]


@dataclass(frozen=True)
class TrainerSlot:
    """Where trainer rank `rank` runs."""

    rank: int
    slot: int
    bundle_index: int
    node_ip: str
    gpu_id: int


@dataclass(frozen=True)
class EnginePlacement:
    """Everything one engine actor needs from placement (one per engine per node).

    `bundle_index` is the placement-group bundle to schedule the actor on; the sglang
    process uses `gpus_on_node` GPUs from `base_gpu_id` (gpu_id_step 1) on `node_ip`.
    `dist_init_host` is the node of node_rank 0 for multi-node engines (that actor reserves
    the port), else None. An engine added mid-run (`fleet.add_engines`) may sit in a
    placement group of its own (`placement_group` > 0).
    """

    model_name: str
    group_index: int
    engine_index: int
    worker_type: WorkerType
    num_gpus: int
    nnodes: int
    node_rank: int
    bundle_index: int
    node_ip: str
    base_gpu_id: int
    gpus_on_node: int
    overrides: Mapping[str, Any]
    model_path: str | None = None
    update_weights: bool = False
    slot: int = 0
    bundle_indices: tuple[int, ...] = ()
    dist_init_host: str | None = None
    shares_trainer_gpus: bool = False
    group_where: str = ""
    placement_group: int = 0  # 0: the job's own group; k: the k-th added for new engines

    @property
    def engine_id(self) -> str:
        """Stable name of the engine (not the actor): model/group/engine."""
        return f"{self.model_name}/g{self.group_index}/e{self.engine_index}"

    @property
    def serves_http(self) -> bool:
        """Only node_rank 0 of an engine serves HTTP and registers with the router."""
        return self.node_rank == 0


@dataclass(frozen=True)
class RouterPlan:
    """One router per model; `pd_disaggregation` when its groups are prefill/decode."""

    model_name: str
    model_path: str | None
    update_weights: bool
    pd_disaggregation: bool
    num_engines: int


@dataclass(frozen=True)
class JobPlan:
    """The placement of a whole job over the sorted bundles of its placement group."""

    layout: PlacementGroupLayout
    bundles: tuple[Bundle, ...]
    trainer: tuple[TrainerSlot, ...]
    engines: tuple[EnginePlacement, ...]
    routers: tuple[RouterPlan, ...]
    reserved_slots: tuple[tuple[str, int, int], ...] = field(default=())

    @property
    def updatable_model(self) -> str:
        """The model weight updates go to (the first with update_weights, else the first)."""
        names = [r.model_name for r in self.routers if r.update_weights]
        return names[0] if names else self.routers[0].model_name

    def engines_of(self, model_name: str) -> list[EnginePlacement]:
        """Engine actors of one model, in slot order."""
        return [e for e in self.engines if e.model_name == model_name]

    def http_engines(self, model_name: str | None = None) -> list[EnginePlacement]:
        """node_rank-0 actors: one per engine."""
        return [e for e in self.engines if e.serves_http
                and (model_name is None or e.model_name == model_name)]


def _node_chunk(bundles: Sequence[Bundle], start: int, size: int, group: GroupSpec,
                engine: int, node_rank: int) -> list[Bundle]:
    chunk = list(bundles[start:start + size])
    first = chunk[0]
    for k, b in enumerate(chunk):
        if b.node_ip != first.node_ip:
            raise ConfigError(group.where, (
                f"engine {engine} of this group would span nodes {first.node_ip} and "
                f"{b.node_ip} (slots {start}..{start + size - 1}); make num_gpus_per_engine "
                "divide the GPUs per node, or put a placeholder group before it to start it "
                "on a node boundary"))
        if b.gpu_id != first.gpu_id + k:
            raise ConfigError(group.where, (
                f"engine {engine} (node rank {node_rank}) gets GPUs "
                f"{[c.gpu_id for c in chunk]} on {first.node_ip}, which are not consecutive"))
    return chunk


def plan_job(topology: Topology, bundles: Sequence[Bundle],
             layout: PlacementGroupLayout) -> JobPlan:
    """Place trainer ranks and engine actors on `bundles` (already in slot order)."""
    if len(bundles) != layout.num_bundles:
        raise ValueError(f"{len(bundles)} bundles for a placement group of {layout.num_bundles}")
    trainer = tuple(TrainerSlot(r, r, b.index, b.node_ip, b.gpu_id)
                    for r, b in enumerate(bundles[:layout.num_trainer_slots]))
    engines: list[EnginePlacement] = []
    reserved: list[tuple[str, int, int]] = []
    cursor = layout.rollout_offset
    for model in ([] if topology.external else topology.models):
        engine_index = 0
        for group in model.groups:
            start, cursor = cursor, cursor + group.num_gpus
            if cursor > len(bundles):
                raise ConfigError(group.where, (
                    f"needs slots {start}..{cursor - 1}, but the placement group has "
                    f"{len(bundles)} (rollout starts at slot {layout.rollout_offset})"))
            if group.is_placeholder:
                reserved.append((group.where, start, group.num_gpus))
                continue
            per_node = group.gpus_per_node
            for e in range(group.num_engines):
                base = start + e * group.num_gpus_per_engine
                chunks = [_node_chunk(bundles, base + r * per_node, per_node, group, e, r)
                          for r in range(group.nnodes)]
                nodes = [c[0].node_ip for c in chunks]
                if len(set(nodes)) != len(nodes):
                    raise ConfigError(group.where, (
                        f"engine {e} of this group puts two of its node ranks on {nodes}; a "
                        "multi-node engine needs one whole node per node rank"))
                for r, chunk in enumerate(chunks):
                    slot = base + r * per_node
                    engines.append(EnginePlacement(
                        model_name=model.name, group_index=group.group_index,
                        engine_index=engine_index, worker_type=group.worker_type,
                        num_gpus=group.num_gpus_per_engine, nnodes=group.nnodes, node_rank=r,
                        bundle_index=chunk[0].index, node_ip=chunk[0].node_ip,
                        base_gpu_id=chunk[0].gpu_id, gpus_on_node=per_node,
                        overrides=group.overrides, model_path=model.model_path,
                        update_weights=model.update_weights, slot=slot,
                        bundle_indices=tuple(b.index for b in chunk),
                        dist_init_host=nodes[0] if group.nnodes > 1 else None,
                        shares_trainer_gpus=slot < layout.num_trainer_slots,
                        group_where=group.where))
                engine_index += 1
    routers = tuple(RouterPlan(m.name, m.model_path, m.update_weights, m.pd_disaggregation,
                               m.num_engines) for m in topology.models)
    return JobPlan(layout, tuple(bundles), trainer, tuple(engines), routers, tuple(reserved))


def consecutive_gpus(bundles: Sequence[Bundle]) -> bool:
    """Whether `bundles` are on one node with consecutive GPU ids (one engine's GPUs)."""
    first = bundles[0]
    return all(b.node_ip == first.node_ip and b.gpu_id == first.gpu_id + k
               for k, b in enumerate(bundles))


def added_engine(template: EnginePlacement, bundles: Sequence[Bundle], engine_index: int,
                 placement_group: int) -> EnginePlacement:
    """An engine like `template` (its group's model, size, worker type and overrides) on
    `bundles` (already in slot order) of placement group `placement_group`: an engine added
    mid-run. Only engines of one node are added; ConfigError names what does not fit."""
    if template.nnodes != 1:
        raise ConfigError(template.group_where or template.engine_id,
                          f"engines of {template.nnodes} nodes cannot be added mid-run yet")
    if len(bundles) != template.num_gpus or not consecutive_gpus(bundles):
        where = [(b.node_ip, b.gpu_id) for b in bundles]
        raise ConfigError(template.group_where or template.engine_id,
                          f"an added engine needs {template.num_gpus} consecutive GPUs of "
                          f"one node; got (node, GPU) {where}")
    first = bundles[0]
    return replace(template, engine_index=engine_index, node_rank=0, bundle_index=first.index,
                   node_ip=first.node_ip, base_gpu_id=first.gpu_id,
                   gpus_on_node=template.num_gpus, slot=-1,
                   bundle_indices=tuple(b.index for b in bundles), dist_init_host=None,
                   shares_trainer_gpus=False, placement_group=placement_group)
