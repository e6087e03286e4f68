"""What a job reads before anything starts, and its checkpoints: plug-ins, the model and its
tokenizer, the prompt source at its resumed position, `--save`/`--load`.

Everything here fails with a one-line ConfigError naming the flag, before any process
starts (also under `--dry-run`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from slime_like.errors import ConfigError
from slime_like.models.chat_template import TINY_CHAT_TEMPLATE
from slime_like.models.hf_checkpoint import check_checkpoint, local_checkpoint
from slime_like.models.hf_tokenizer import Tokenizer, load_tokenizer
from slime_like.models.tiny import make_tiny_model
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.rollout.data import PromptSource, prompt_source
from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import Plugins
from slime_like.trainer.checkpoint import (
    Checkpoint,
    JobState,
    begin_save,
    commit_save,
    latest_checkpoint,
)
from slime_like.trainer.group import TrainerGroup

logger = logging.getLogger("slime_like.train")


def weight_versions(samples: list[Sample]) -> list[int | str]:
    """The distinct weight versions the samples were generated at (ints where they are)."""
    found = {s.weight_version for s in samples}
    return sorted(int(v) for v in found) if all(v.isdigit() for v in found) else sorted(found)


def preflight(args: argparse.Namespace) -> Plugins:
    """Checks that read files or import code, before anything starts (also for --dry-run):
    the checkpoint, the prompt file, the plug-ins, the checkpoint to resume from."""
    kind = check_checkpoint(args.hf_checkpoint) if args.hf_checkpoint else "tiny"
    if args.prompt_data and not Path(args.prompt_data).is_file():
        raise ConfigError("--prompt-data", f"no such file: {args.prompt_data}")
    if args.prompt_data and kind != "hub":  # read it: a bad line fails now, with its number
        prompt_source(args, load_tokenizer(args.hf_checkpoint) if args.hf_checkpoint
                      else ByteTokenizer(chat_template=TINY_CHAT_TEMPLATE))
    if args.load:
        latest_checkpoint(args.load)
    return Plugins.from_args(args)


def save_checkpoint(root: str, step: int, trainer: TrainerGroup, version: int, synced: bool,
                    source: PromptSource) -> Path:
    """Trainer ranks write into a temporary directory; the driver adds the job state and
    renames it into place (see trainer/checkpoint.py)."""
    tmp = begin_save(root, step)
    trainer.save_checkpoint(str(tmp))
    path = commit_save(tmp, JobState(step, version, synced, source.state_dict()))
    logger.info("saved step %d (weight version %d) to %s", step, version, path)
    return path


def save_due(args: argparse.Namespace, step: int, num_rollout: int) -> bool:
    """Every --save-interval steps, and after the last step (slime's rule)."""
    if not args.save:
        return False
    return bool(args.save_interval and (step + 1) % args.save_interval == 0) \
        or step == num_rollout - 1


@dataclass
class JobInputs:
    """What the job reads before anything starts: plug-ins, model, tokenizer, prompts, resume."""

    plugins: Plugins
    model_path: str
    tokenizer: Tokenizer
    source: PromptSource
    resume: Checkpoint | None


def prepare_inputs(args: argparse.Namespace, out: Path,
                   plugins: Plugins | None = None) -> JobInputs:
    """Check and load the job's inputs; the prompt source is at the resumed position."""
    plugins = plugins or preflight(args)
    if args.hf_checkpoint:
        # the reference engine reads a local directory; sglang and transformers resolve hub ids
        model_path = (local_checkpoint(args.hf_checkpoint) if args.engine == "reference"
                      else args.hf_checkpoint)
    else:
        model_path = str(make_tiny_model(out / "model", layers=args.tiny_model_layers,
                                         hidden=args.tiny_model_hidden, seed=args.seed))
    tokenizer = load_tokenizer(model_path, add_special_tokens=False)
    source = prompt_source(args, tokenizer)
    resume = resume_point(args)
    if resume is not None:
        source.load_state_dict(resume.state.data)
    return JobInputs(plugins, model_path, tokenizer, source, resume)


def resume_point(args: argparse.Namespace) -> Checkpoint | None:
    """The checkpoint `--load` resumes from; None (start afresh) if DIR has none yet."""
    if not args.load:
        return None
    found = latest_checkpoint(args.load)
    if found is None:
        logger.warning("--load %s: no checkpoint there yet; starting from step 0", args.load)
    return found
