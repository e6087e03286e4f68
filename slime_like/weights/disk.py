"""The `disk` transport: an atomically written safetensors checkpoint, then a reload.

Each sync writes `<dir>/weights-<version>/` (model.safetensors plus the model's config and
tokenizer files, so the directory is a complete HF checkpoint) by writing a temporary
sibling and renaming it into place; engines then `update_weights_from_disk` from it. The
directory must be visible to the engines (same host or a shared filesystem). The two newest
checkpoints are kept: the engines' current one, and the one before, from which an engine
rolls back if the next reload fails.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from slime_like.engine.session import EngineSession
from slime_like.models.loading import save_state_dict_atomic
from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import Bucket
from slime_like.weights.packing import WeightSource
from slime_like.weights.transport import Payload, TransferStats, Transport
from slime_like.weights.watch import Watch

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MAX_EXTRA_FILE_BYTES = 64 << 20


def model_side_files(model_dir: str | Path | None) -> dict[str, str]:
    """config.json, tokenizer and generation files of a checkpoint (everything but weights)."""
    if not model_dir or not Path(model_dir).is_dir():
        return {}
    out = {}
    for f in sorted(Path(model_dir).iterdir()):
        if (f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and "index.json" not in f.name
                and f.stat().st_size <= _MAX_EXTRA_FILE_BYTES):
            try:
                out[f.name] = f.read_text()
            except UnicodeDecodeError:
                continue  # a binary side file (e.g. a sentencepiece model) is not needed here
    return out


def _safe_version(version: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", version)


class DiskTransport(Transport):
    """Checkpoint on a filesystem the engines can read; not gated by begin/end (as sglang)."""

    name = "disk"
    gated = False

    def __init__(self, *, directory: str | Path, model_dir: str | Path | None = None, keep: int = 2):
        self.directory = Path(directory)
        self.model_dir = model_dir
        self.keep = max(2, keep)
        self.written: list[Path] = []

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        t0 = time.perf_counter()
        state = dict(source.tensors())
        extra = model_side_files(self.model_dir or _engine_model_dir(engines))
        out = save_state_dict_atomic(state, self.directory / f"weights-{_safe_version(version)}",
                                     extra_files=extra)
        stats.pack_s += time.perf_counter() - t0  # "pack" = writing the checkpoint
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        stats.bytes += nbytes
        stats.buckets += 1
        del state

        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromDiskRequest(model_path=str(out), flush_cache=flush,
                                                  weight_version=version)

        yield Payload("update_weights_from_disk", "update_weights_from_disk", request, nbytes,
                      last=True)
        if out in self.written:
            self.written.remove(out)
        self.written.append(out)
        while len(self.written) > self.keep:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)


def _engine_model_dir(engines: Sequence[EngineSession]) -> str | None:
    """The first engine's checkpoint directory, when this host can read it."""
    for engine in engines:
        try:
            path = engine.model_info().get("model_path")
        except Exception:  # noqa: BLE001 - only a source of side files
            continue
        if path and Path(path).is_dir():
            return path
    return None
