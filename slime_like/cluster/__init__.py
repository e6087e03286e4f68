"""Placement: one placement group, bundles sorted by (node IP, GPU id), slots per actor.

`layout` is pure (no Ray) and holds the plan; `placement` creates and probes the
placement group on a Ray cluster.
"""

from slime_like.cluster.layout import (
    Bundle,
    EnginePlacement,
    JobPlan,
    PlacementGroupLayout,
    RouterPlan,
    TrainerSlot,
    layout_from_args,
    nominal_bundles,
    placement_group_layout,
    plan_job,
    sort_bundles,
)

__all__ = [
    "Bundle", "EnginePlacement", "JobPlan", "PlacementGroupLayout", "RouterPlan", "TrainerSlot",
    "layout_from_args", "nominal_bundles", "placement_group_layout", "plan_job", "sort_bundles",
]
