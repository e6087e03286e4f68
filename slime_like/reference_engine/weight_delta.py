"""Delta weight updates on one TP rank: a bucket's XOR applied onto the exact base it names.

Each rank holds the whole model by HF name, so every rank applies the same bucket. A bucket
is checked three times before any parameter changes: the engine serves the base version the
delta names, the bucket's current bytes have the base digest, and the bytes after the XOR
have the result digest; only then is the result copied into the parameters. A refused
bucket leaves the parameters as they were. From disk, a bucket refused after others of the
same manifest landed undoes those (XOR is its own inverse: the same delta applied again
gives the base back), so a manifest lands whole or not at all, like a checkpoint reload
(the trainer sends one manifest per bucket, so the engine applies one while the next is
encoded).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime_like.protocol import delta_codec
from slime_like.protocol import weight_delta as wd
from slime_like.protocol.buckets import dtype_from_name
from slime_like.reference_engine import rank_ops as op

APPLIED = "Succeeded to apply the weight delta."


class DeltaRefused(ValueError):
    """A delta bucket that does not fit this rank's weights (nothing was changed)."""


class WeightDeltas:
    """Mixed into `WeightReceiver`: receives and applies delta buckets."""

    params: dict[str, torch.nn.Parameter]
    tied: bool
    device: torch.device
    groups: dict[str, dist.ProcessGroup]

    def delta_handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The rank operations of delta updates, for the receiver's table."""
        return {op.ReceiveDelta: self.receive_delta,
                op.LoadDeltaFromDisk: lambda o: self.load_delta_from_disk(o.path,
                                                                          o.engine_version)}

    # ---- distributed -----------------------------------------------------------------------

    def receive_delta(self, o: op.ReceiveDelta) -> tuple[bool, str]:
        """Receive one compressed bucket from the trainer's broadcast, then apply it (done
        when it returns: the CPU path; a CUDA engine would overlap as for full buckets)."""
        pg = self.groups.get(o.group_name)
        if pg is None:
            return False, (f"Failed to receive weights: Group {o.group_name} not in "
                           f"{list(self.groups)}. Please call `init_weights_update_group` first.")
        header = wd.DeltaHeader.model_validate(o.header)
        buffer = torch.empty(header.encoded_nbytes, dtype=torch.uint8, device=self.device)
        try:
            dist.broadcast(buffer, src=0, group=pg, async_op=True).wait()
        except Exception as e:  # noqa: BLE001 - answered as sglang's 400 message
            message = f"Failed to receive weights: {e}"
            traceback.clear_frames(e.__traceback__)
            self.abandon_group(o.group_name)  # type: ignore[attr-defined]
            return False, message
        try:
            self.apply_delta(list(o.names), list(o.dtypes), [list(s) for s in o.shapes],
                             header, buffer.cpu().numpy(), o.engine_version)
        except DeltaRefused as e:
            return False, f"Failed to update parameter online: {wd.REFUSED}: {e}"
        return True, APPLIED

    # ---- disk ------------------------------------------------------------------------------

    def load_delta_from_disk(self, path: str, engine_version: str) -> tuple[bool, str]:
        """Apply every bucket of a delta directory, or none (undone on a refusal)."""
        try:
            manifest = wd.DeltaManifest.model_validate_json(
                (Path(path) / wd.MANIFEST).read_text())
        except (OSError, ValueError) as e:
            return False, f"Failed to update weights: no readable delta manifest in {path}: {e}"
        applied: list[tuple[wd.DeltaBucketFile, bytes]] = []
        try:
            for entry in manifest.buckets:
                blob = (Path(path) / entry.file).read_bytes()
                self.apply_delta(entry.names, entry.dtypes, entry.shapes, entry.header,
                                 np.frombuffer(blob, dtype=np.uint8), engine_version)
                applied.append((entry, blob))
        except (DeltaRefused, OSError) as e:
            for entry, blob in reversed(applied):  # XOR again: each bucket back to its base
                self._xor_in(entry.names, entry.dtypes, entry.shapes, blob,
                             entry.header.frames)
            return False, (f"Failed to update weights: {wd.REFUSED}: {e}.\nRolling back to "
                           "original weights.")
        return True, APPLIED

    # ---- one bucket ------------------------------------------------------------------------

    def apply_delta(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    header: wd.DeltaHeader, blob: np.ndarray, engine_version: str) -> None:
        """Check version, base digest and result digest, then copy the bucket in."""
        if header.encoding != wd.XOR_ZSTD:
            raise DeltaRefused(f"unknown delta encoding {header.encoding!r}; this engine "
                               f"applies {list(wd.DELTA_FORMATS)}")
        if header.base_version != engine_version:
            raise DeltaRefused(f"the delta's base is weight version {header.base_version!r} "
                               f"but this engine serves {engine_version!r}")
        params = self._bucket_params(names, dtypes, shapes)
        size = sum(p.numel() * p.element_size() for p in params)
        if size != header.nbytes:
            raise DeltaRefused(f"the delta's bucket holds {header.nbytes} bytes, "
                               f"{names[0]!r}..{names[-1]!r} here hold {size}")
        result, base_digest, decode_error, got = self._decode_onto(params, size, blob,
                                                                   header.frames)
        if base_digest != header.base_checksum:
            raise DeltaRefused(f"the weights of {names[0]!r}..{names[-1]!r} are not the delta's "
                               f"base (digest {base_digest}, expected {header.base_checksum})")
        if decode_error is not None:
            raise DeltaRefused(f"the delta of {names[0]!r}.. does not decode: {decode_error}")
        if got != header.checksum:
            raise DeltaRefused(f"{names[0]!r}..{names[-1]!r} after the delta have digest {got}, "
                               f"the trainer's is {header.checksum}")
        self._scatter(names, params, result)

    @staticmethod
    def _decode_onto(params: list[torch.Tensor], size: int, blob: np.ndarray,
                     frames: list[int]) -> tuple[np.ndarray, str, str | None, str | None]:
        """The bucket's bytes after the delta, in a new host buffer (the parameters are only
        read). Each frame is decoded, its current bytes hashed as the base, XORed in and the
        result hashed on a codec thread of its own (`delta_codec.decode_onto`). Returns
        (result, the base's digest, why the blob did not decode or None, the result's
        digest). From a GPU the current bytes are copied to the host first, piece by piece."""
        result = np.empty(size, dtype=np.uint8)
        pieces = (flat[start:start + wd.CHUNK_BYTES].cpu().numpy()
                  for flat in (p.reshape(-1).view(torch.uint8) for p in params)
                  for start in range(0, flat.numel(), wd.CHUNK_BYTES))
        decoded = delta_codec.decode_onto(pieces, blob, frames, result)
        return result, decoded.base_checksum, decoded.error, decoded.checksum

    def _bucket_params(self, names: list[str], dtypes: list[str],
                       shapes: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            param = self.params.get(name)
            if param is None and self.tied and name == "lm_head.weight":
                param = self.params.get("model.embed_tokens.weight")
            if param is None:
                raise DeltaRefused(f"unknown parameter {name!r}")
            if tuple(param.shape) != tuple(shape) or param.dtype != dtype_from_name(dtype):
                raise DeltaRefused(f"{name!r} is {param.dtype}{list(param.shape)} here, the "
                                   f"delta's is {dtype}{list(shape)} (a delta needs the dtype "
                                   "the engine holds)")
            out.append(param.detach())
        return out

    @staticmethod
    def _gather(params: list[torch.Tensor]) -> np.ndarray:
        """The bucket's current bytes in flat layout (a host copy)."""
        flat = [p.reshape(-1).view(torch.uint8) for p in params]
        return torch.cat(flat).cpu().numpy() if flat else np.empty(0, dtype=np.uint8)

    def _scatter(self, names: list[str], params: list[torch.Tensor], data: np.ndarray) -> None:
        src = torch.from_numpy(data)
        dsts, srcs, offset = [], [], 0
        for name, p in zip(names, params, strict=True):
            n = p.numel() * p.element_size()
            if not (self.tied and name == "lm_head.weight"):
                dsts.append(p.view(-1).view(torch.uint8))
                srcs.append(src[offset:offset + n].to(p.device))
            offset += n
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _xor_in(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                blob: bytes, frames: list[int]) -> None:
        """Apply a bucket's XOR without checks (the undo of one that was checked)."""
        params = self._bucket_params(names, dtypes, shapes)
        current = self._gather(params)
        delta_codec.apply(current, blob, frames)
        self._scatter(names, params, current)
