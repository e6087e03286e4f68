"""sglang's `/weights_checker` checksums: per tensor, and per GPU over all of them.

Both sides compute them the same way, so a trainer (or a test) can compare what an engine
holds with what it sent, tensor by tensor.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """First 8 bytes of sha256 over the raw bytes, as %016x (sglang's CPU tensor hash)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(raw)).digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """sha256 over name + checksum, sorted by name (sglang's per_gpu_checksum)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
