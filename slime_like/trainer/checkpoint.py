"""Save and resume (`--save`, `--save-interval`, `--load`): the trainer and the job's position.

Layout (Megatron's / slime's names)::

    DIR/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
    DIR/iter_0000007/model.pt                 rank 0: model state_dict (HF parameter names)
                    /optimizer.pt             rank 0: optimizer state_dict
                    /rng_rank{R}.pt           every rank: torch / python RNG states
                    /job_state.json           step, weight version, data position

                    /dcp/                     --train-backend fsdp instead of model.pt and
                                              optimizer.pt: torch.distributed.checkpoint,
                                              one file per rank (__R_0.distcp) + .metadata

A checkpoint is written into a hidden temporary directory and renamed into place once
complete, then the `latest` pointer is replaced atomically; a job killed while saving
leaves the previous checkpoint as the latest. Every trainer rank writes into the same
directory, so on several nodes DIR must be on shared storage. With ddp, ranks hold
identical weights and optimizer states, so rank 0 writes them once; with fsdp every rank
writes its shards, and DCP reshards them on load, so a job resumes at another world size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_like.errors import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
JOB_STATE = "job_state.json"
SHARDED_DIR = "dcp"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


@dataclass
class JobState:
    """What the driver needs to continue: the step saved and the version its weights are.

    `weights_synced` is False when the saved weights were trained after the last sync
    (--update-weights-interval > 1): the resumed job then pushes them as a new version.
    """

    step: int
    weight_version: int
    weights_synced: bool = True
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    state: JobState


# ---- trainer rank side ---------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_rank_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                    out_dir: str | Path) -> None:
    """Write this rank's part of a checkpoint into `out_dir` (the temporary directory)."""
    out = Path(out_dir)
    if rank == 0:
        torch.save(model.state_dict(), out / "model.pt")
        torch.save(optimizer.state_dict(), out / "optimizer.pt")
    torch.save(_rng_state(), out / f"rng_rank{rank}.pt")


def save_sharded_rank_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            rank: int, out_dir: str | Path) -> None:
    """--train-backend fsdp, every rank together: its shards through DCP, then its RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             checkpoint_id=str(Path(out_dir) / SHARDED_DIR))
    torch.save(_rng_state(), Path(out_dir) / f"rng_rank{rank}.pt")


def _check_kind(ckpt: Path, sharded: bool) -> None:
    if sharded and not (ckpt / SHARDED_DIR).is_dir():
        raise ConfigError("--load", f"{ckpt} was saved by a --train-backend ddp trainer "
                                    f"(model.pt); it has no sharded {SHARDED_DIR}/ for fsdp")
    if not sharded and not (ckpt / "model.pt").is_file() and (ckpt / SHARDED_DIR).is_dir():
        raise ConfigError("--load", f"{ckpt} was saved by a --train-backend fsdp trainer "
                                    f"({SHARDED_DIR}/); resume it with --train-backend fsdp")


def load_sharded_rank_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            rank: int, ckpt_dir: str | Path) -> None:
    """--train-backend fsdp, every rank together: this world size's shards, resharded by
    DCP from whatever world size saved them, then the RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt = Path(ckpt_dir)
    _check_kind(ckpt, sharded=True)
    model_state, optim_state = get_state_dict(model, optimizer)  # the optimizer's state made
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(ckpt / SHARDED_DIR))
    except Exception as e:  # noqa: BLE001 - DCP's errors are long; name the checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--load", f"{ckpt} holds another model's weights: {first}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    _load_rng(ckpt, rank)


def load_rank_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                    ckpt_dir: str | Path, device: str = "cpu") -> None:
    """Load model and optimizer (strict: a checkpoint of another model fails) and RNG."""
    ckpt = Path(ckpt_dir)
    _check_kind(ckpt, sharded=False)
    try:
        model.load_state_dict(torch.load(ckpt / "model.pt", map_location=device,
                                         weights_only=True))
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise ConfigError("--load", f"{ckpt} holds another model's weights: {first}") from e
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device,
                                         weights_only=True))
    _load_rng(ckpt, rank)


def _load_rng(ckpt: Path, rank: int) -> None:
    rng_path = ckpt / f"rng_rank{rank}.pt"
    if rng_path.is_file():  # a job resumed on more ranks than it saved keeps fresh RNGs there
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


# ---- driver side ---------------------------------------------------------------------------------


def begin_save(root: str | Path, step: int) -> Path:
    """A fresh hidden directory next to where the checkpoint of `step` will be."""
    root = Path(root)
    tmp = root / f".{iter_dir_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_save(tmp: Path, state: JobState) -> Path:
    """Add the job state, rename the directory into place, then move the `latest` pointer."""
    _write_atomic(tmp / JOB_STATE, json.dumps(asdict(state), indent=2))
    final = tmp.parent / iter_dir_name(state.step)
    if final.exists():  # a resumed job saving a step again: the new one wins
        old = tmp.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _write_atomic(tmp.parent / LATEST, f"{state.step}\n")
    return final


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under `root`, or None if there is none yet."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ConfigError("--load", f"{pointer} should hold a step number, got {text!r}")
    path = root / iter_dir_name(int(text))
    state_file = path / JOB_STATE
    if not state_file.is_file():
        raise ConfigError("--load", f"{pointer} names step {text}, but {state_file} is missing")
    raw = json.loads(state_file.read_text())
    return Checkpoint(path, JobState(**raw))
