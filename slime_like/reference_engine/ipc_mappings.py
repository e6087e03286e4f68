"""How long a rank keeps the shared buffers it opened from tensor payloads.

A flattened `update_weights_from_tensor` payload names a buffer of the trainer's (a CUDA
IPC handle on GPU, a named shared-memory segment on CPU). Opening it maps the trainer's
memory into this process; the mapping lives as long as the storage torch rebuilt from the
handle, and torch's rebuild finds a live storage of the same handle in its cache instead of
opening it again. So the lifetime of a mapping is the lifetime of the storage kept here:

- `LOAD`: closed right after the load (no update session open; what sglang does always);
- `SESSION`: kept until the update session ends (`end_weight_update`), up to
  `PER_SESSION` buffers, so a sender rotating two pack buffers over many buckets maps each
  once per sync, not once per bucket;
- `KEPT`: the request said `keep_ipc_mapping`: the trainer will send the same buffer again
  and keeps it allocated until then. Kept past the session's end, until the end of the
  first session that did not send it with `keep_ipc_mapping` again.

The trainer decides (`weights/tensor.py`): it asks to keep only a buffer it knows will be
the same storage at the next sync, and stops asking one sync before it frees or renews it,
so the engine has let go of it by the time the trainer's memory is given back (torch keeps
an exported CUDA block alive while any importer holds it; a shared-memory segment is
unlinked when its last mapping closes). A buffer that moved unannounced (the trainer sent a
different one) is let go of at the end of the session that did not send it.

A plain payload of (name, tensor) handles sent with `keep_ipc_mapping` (the trainer's
separate parameters sent in place, `weights/shared_params.py`) is kept whole, by its
serialized bytes: the trainer sends exactly the same bytes again while its parameters stay
where they are and this engine holds them, and the engine then copies from the tensors it
kept, without unpickling or opening anything. Equal bytes are the same handles (the same
share of the same storages), so reusing them is what opening them again would give.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

LOAD, SESSION, KEPT = "load", "session", "kept"
LIFETIMES = (LOAD, SESSION, KEPT)
PER_SESSION = 8  # buffers kept open per rank within a session (besides the kept ones)


def _key(storage: torch.UntypedStorage) -> tuple[int, int]:
    return storage.data_ptr(), storage.nbytes()


class IpcMappings:
    """The storages one rank keeps open, by lifetime (see the module docstring)."""

    def __init__(self, per_session: int = PER_SESSION):
        self.per_session = per_session
        # opened in this session: kept until it ends (oldest dropped past per_session)
        self._session: collections.OrderedDict = collections.OrderedDict()
        # storages by (address, size), and kept plain payloads by ("payload", their bytes)
        self._keep: dict[tuple, Any] = {}  # to keep past this session
        self._held: dict[tuple, Any] = {}  # kept from earlier sessions
        self.opened = 0  # loads whose buffer was not open here before (a fresh mapping)
        self.reused = 0  # loads whose buffer was still open (kept or earlier in the session)

    def hold(self, flat: torch.Tensor, lifetime: str) -> bool:
        """Keep `flat`'s storage open for `lifetime`; True if it was already open."""
        if lifetime not in LIFETIMES:
            raise ValueError(f"unknown mapping lifetime {lifetime!r}; expected one of {LIFETIMES}")
        storage = flat.untyped_storage()
        key = _key(storage)
        known = key in self._session or key in self._keep or key in self._held
        if known:
            self.reused += 1
        else:
            self.opened += 1
        if lifetime == KEPT:
            self._keep[key] = storage
        elif lifetime == SESSION:
            self._session[key] = storage
            self._session.move_to_end(key)
            while len(self._session) > self.per_session:
                self._session.popitem(last=False)
        return known

    def kept_payload(self, payload: str | bytes) -> list[tuple[str, torch.Tensor]] | None:
        """The (name, tensor) list a kept plain payload of exactly these bytes opened, or
        None. Found, it is kept past this session again (the session sent it with
        `keep_ipc_mapping`: only those are looked up) and counted as reused."""
        key = ("payload", payload)
        named = self._keep.get(key) or self._held.get(key)
        if named is not None:
            self.reused += 1
            self._keep[key] = named
        return named

    def keep_payload(self, payload: str | bytes, named: list[tuple[str, torch.Tensor]]) -> None:
        """Keep a plain payload's tensors, just opened (and with them their mappings), past
        this session, until the end of the first session that does not send the same bytes
        again."""
        self.opened += 1
        self._keep[("payload", payload)] = named

    def end_session(self) -> int:
        """The update session ended: keep what it asked to keep, close everything else
        (a kept buffer this session did not send again included). Returns how many stay."""
        self._held, self._keep = self._keep, {}
        self._session.clear()
        return len(self._held)

    def close(self) -> None:
        """Close every mapping (the weights are released, or the engine stops)."""
        self._session.clear()
        self._keep.clear()
        self._held.clear()

    def held(self) -> int:
        return len(self._held)

    def stats(self) -> dict[str, int]:
        return {"held": len(self._held), "session": len(self._session) + len(self._keep),
                "opened": self.opened, "reused": self.reused}
