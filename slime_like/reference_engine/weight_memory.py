"""Releasing and resuming one TP rank's weight memory (`/release_memory_occupation`,
`/resume_memory_occupation` with the weights tag), apart from the receiver's loads.

Release really drops the parameters' storage (shapes kept) and, with a CPU backup, copies
each arena segment into pinned host buffers allocated once; resume gives the parameters a
fresh arena of the same layout and puts the backup back one copy per segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Released:
    """What release_memory_occupation took away, so resume can put storage back."""

    shapes: dict[str, torch.Size]
    backup: list[torch.Tensor] | None  # the arena's segments, byte for byte


class WeightMemory:
    """The memory half of `WeightReceiver` (it owns `params`, `arena`, `plans`, `device`,
    `cpu_backup`, `_backup`, `released` and `_rehome`)."""

    def release_weights(self) -> None:
        """Really drop the parameter storage (shape kept), optionally backing it up on the
        host: one copy per arena segment into pinned buffers allocated once and reused."""
        if self.released is not None:
            raise ValueError("weights are already released")
        shapes = {n: p.shape for n, p in self.params.items()}
        backup = None
        if self.cpu_backup:
            backup = self._backup = self.arena.back_up(self._backup)
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.arena = None  # the arena segments hold the storage: drop them and their plans
        self.plans.clear()
        self.released = Released(shapes, backup)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_weights(self) -> bool:
        """Give parameters storage again; True when their contents came back from a backup.

        The new arena has the released one's layout (same parameters, same order), so the
        backup goes back one copy per segment."""
        if self.released is None:
            raise ValueError("weights were not released")
        for n, p in self.params.items():
            p.data = torch.empty(self.released.shapes[n], dtype=p.dtype, device=p.device)
        self._rehome(copy=False)
        backup = self.released.backup
        if backup is not None:
            self.arena.restore(backup)
        else:
            # Until the trainer pushes weights the contents are meaningless; make that visible.
            for p in self.params.values():
                p.data.fill_(float("nan")) if p.dtype.is_floating_point else p.data.zero_()
        self.released = None
        return backup is not None
