"""Weight versions: one type everywhere, a string only on the wire.

SGLang carries `weight_version` as a string ("default" until the first update). Inside
slime_like a version is a `WeightVersion` (an int: 0 = the checkpoint the engines loaded,
k = the k-th sync), converted at the protocol edge.
"""

from __future__ import annotations


class WeightVersion(int):
    """The number of syncs behind a set of weights (0 = as loaded from the checkpoint)."""

    @property
    def wire(self) -> str:
        """How SGLang's `weight_version` field carries it."""
        return str(int(self))

    def next(self) -> WeightVersion:
        return WeightVersion(self + 1)

    def __repr__(self) -> str:
        return f"WeightVersion({int(self)})"

    def __str__(self) -> str:
        return str(int(self))


def parse_weight_version(text: object) -> WeightVersion | None:
    """A `weight_version` as an engine reports it; None for "default" or anything unset."""
    try:
        return WeightVersion(int(str(text)))
    except (TypeError, ValueError):
        return None
