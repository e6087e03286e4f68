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
from pathlib import Path

from slime_like.models.loading import save_state_dict_atomic
from slime_like.protocol import io_struct as p
from slime_like.weights.transport import TransferContext, Transport
from slime_like.weights.watch import EngineCall

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

    def transfer(self, ctx: TransferContext) -> None:
        t0 = time.perf_counter()
        state = dict(ctx.source.tensors())
        extra = model_side_files(self.model_dir or _engine_model_dir(ctx))
        out = save_state_dict_atomic(
            state, self.directory / f"weights-{_safe_version(ctx.weight_version)}",
            extra_files=extra)
        ctx.stats.pack_s += time.perf_counter() - t0  # "pack" = writing the checkpoint
        ctx.stats.bytes += sum(t.numel() * t.element_size() for t in state.values())
        ctx.stats.buckets += 1
        del state
        calls = []
        for e in ctx.engines:
            req = p.UpdateWeightsFromDiskRequest(model_path=str(out),
                                                 flush_cache=ctx.flush_flag(e, True),
                                                 weight_version=ctx.weight_version)
            call = ctx.update_call(e.update_weights_from_disk, e, True)
            calls.append(ctx.watch.add(EngineCall(e, "update_weights_from_disk", e.submit(
                call, req, ctx.http_timeout_s))))
        ctx.watch.wait_calls(calls)
        if out in self.written:
            self.written.remove(out)
        self.written.append(out)
        while len(self.written) > self.keep:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)


def _engine_model_dir(ctx: TransferContext) -> str | None:
    """The first engine's checkpoint directory, when this host can read it."""
    for engine in ctx.engines:
        try:
            path = engine.model_info().get("model_path")
        except Exception:  # noqa: BLE001 - only a source of side files
            continue
        if path and Path(path).is_dir():
            return path
    return None
