"""What a job reads before anything starts: plug-ins, the model and its tokenizer, the prompt
source at its resumed position, the checkpoint to resume.

Everything here fails with a one-line ConfigError naming the flag, before any process
starts (also under `--dry-run`, where a hub checkpoint that cannot be reached now is only a
warning: planning does not need its files, the job will).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from slime_like.config.slices import JobSettings
from slime_like.errors import ConfigError
from slime_like.models.chat_template import TINY_CHAT_TEMPLATE
from slime_like.models.hf_checkpoint import check_checkpoint, local_checkpoint
from slime_like.models.hf_tokenizer import Tokenizer, load_tokenizer
from slime_like.models.tiny import make_tiny_model
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.rollout.dynamic_sampling import GroupFilter
from slime_like.rollout.plugins import Plugins
from slime_like.rollout.prompts import PromptSource, prompt_source
from slime_like.trainer.checkpoint import Checkpoint, latest_checkpoint

logger = logging.getLogger("slime_like.train")


@dataclass
class Preflight:
    """What the checks found: the plug-ins, the dynamic-sampling filter, and warnings for
    the operator (dry run)."""

    plugins: Plugins
    warnings: list[str]
    group_filter: GroupFilter


def preflight(settings: JobSettings, *, dry_run: bool = False) -> Preflight:
    """Checks that read files or import code, before anything starts (also for --dry-run):
    the checkpoint, the prompt file, the plug-ins (and `--dynamic-sampling-filter-path`),
    the checkpoint to resume from.

    A dry run does not need the checkpoint's files: a hub id it cannot reach now is a
    warning, not an error.
    """
    warnings: list[str] = []
    ckpt = settings.model.hf_checkpoint
    kind = "tiny"
    if ckpt:
        kind = check_checkpoint(ckpt, offline_ok=dry_run, warnings=warnings)
    prompts = settings.prompts
    if prompts.prompt_data and not Path(prompts.prompt_data).is_file():
        raise ConfigError("--prompt-data", f"no such file: {prompts.prompt_data}")
    if prompts.prompt_data and kind != "hub":  # read it: a bad line fails now, with its number
        prompt_source(prompts, load_tokenizer(ckpt) if ckpt
                      else ByteTokenizer(chat_template=TINY_CHAT_TEMPLATE))
    if settings.checkpoints.load:
        latest_checkpoint(settings.checkpoints.load)
    plugins = Plugins.from_args(settings.plugin_args)
    return Preflight(plugins, warnings, GroupFilter.from_args(settings.plugin_args))


@dataclass
class JobInputs:
    """What the job reads before anything starts: plug-ins, model, tokenizer, prompts, resume."""

    plugins: Plugins
    model_path: str
    tokenizer: Tokenizer
    source: PromptSource
    resume: Checkpoint | None


def prepare_inputs(settings: JobSettings, out: Path, plugins: Plugins | None = None) -> JobInputs:
    """Check and load the job's inputs; the prompt source is at the resumed position."""
    plugins = plugins or preflight(settings).plugins
    model = settings.model
    if model.hf_checkpoint:
        # the reference engine reads a local directory; sglang and transformers resolve hub ids
        model_path = (local_checkpoint(model.hf_checkpoint) if model.program == "reference"
                      else model.hf_checkpoint)
    else:
        model_path = str(make_tiny_model(out / "model", layers=model.tiny_layers,
                                         hidden=model.tiny_hidden,
                                         intermediate=model.tiny_intermediate,
                                         seed=model.seed))
    tokenizer = load_tokenizer(model_path, add_special_tokens=False)
    source = prompt_source(settings.prompts, tokenizer)
    resume = resume_point(settings.checkpoints.load)
    if resume is not None:
        source.load_state_dict(resume.state.data)
    return JobInputs(plugins, model_path, tokenizer, source, resume)


def resume_point(load: str | None) -> Checkpoint | None:
    """The checkpoint `--load` resumes from; None (start afresh) if DIR has none yet."""
    if not load:
        return None
    found = latest_checkpoint(load)
    if found is None:
        logger.warning("--load %s: no checkpoint there yet; starting from step 0", load)
    return found
