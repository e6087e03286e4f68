"""Prompt sources of the job: a JSONL prompt set (`--prompt-data`) or the toy task (default).

Both hand out batches of `PromptItem`s and keep their position as a small JSON-able state
(`state_dict` / `load_state_dict`), which a checkpoint stores so that a resumed job goes on
with the prompts it would have seen next. The shuffle order of an epoch is a function of
(seed, epoch), so the position is just (epoch, cursor).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from slime_like.config.slices import PromptSettings
from slime_like.errors import ConfigError
from slime_like.models.hf_tokenizer import Tokenizer
from slime_like.rollout.task import SayTheLetterTask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One prompt: its text as sent (after any chat template), token ids, label, metadata."""

    text: str
    input_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource(Protocol):
    """Where the job's prompts come from; its state is the position in the data."""

    def next_batch(self, n: int) -> list[PromptItem]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _render(prompt: Any, tokenizer: Tokenizer, chat_template: bool, where: str) -> str:
    """The prompt text sent to the engines: raw, or through the tokenizer's chat template."""
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages)  # type: ignore[attr-defined]
    if not isinstance(prompt, str):
        raise ConfigError("--apply-chat-template", f"{where}: the prompt is a list of messages; "
                                                   "render it with --apply-chat-template")
    return prompt


class PromptDataset:
    """A JSONL prompt set: one JSON object per line, read once, tokenized as it is served."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, *, input_key: str = "prompt",
                 label_key: str | None = None, metadata_key: str = "metadata",
                 apply_chat_template: bool = False, shuffle: bool = False, seed: int = 0):
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.shuffle = shuffle
        self.seed = seed
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--apply-chat-template", "the checkpoint's tokenizer has no chat "
                                                       "template")
        self.rows = self._read(input_key, label_key, metadata_key)
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)

    def _read(self, input_key: str, label_key: str | None,
              metadata_key: str) -> list[tuple[Any, Any, dict, str]]:
        if not self.path.is_file():
            raise ConfigError("--prompt-data", f"no such file: {self.path}")
        rows = []
        with self.path.open() as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ConfigError("--prompt-data", f"{where}: not a JSON object ({e})") from e
                if not isinstance(obj, dict):
                    raise ConfigError("--prompt-data", f"{where}: not a JSON object")
                if input_key not in obj:
                    raise ConfigError("--input-key", f"{where}: no key {input_key!r} "
                                                     f"(keys: {sorted(obj)})")
                if label_key is not None and label_key not in obj:
                    raise ConfigError("--label-key", f"{where}: no key {label_key!r} "
                                                     f"(keys: {sorted(obj)})")
                if not self.apply_chat_template:
                    _render(obj[input_key], self.tokenizer, False, where)
                meta = obj.get(metadata_key) or {}
                rows.append((obj[input_key], obj.get(label_key) if label_key else None,
                             dict(meta) if isinstance(meta, dict) else {"value": meta}, where))
        if not rows:
            raise ConfigError("--prompt-data", f"{self.path} holds no prompts")
        # Render the first prompt now: a template that fails fails before engines start.
        _render(rows[0][0], self.tokenizer, self.apply_chat_template, rows[0][3])
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next n prompts; the data wraps around into a new (re-shuffled) epoch."""
        out = []
        for _ in range(n):
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
            prompt, label, meta, where = self.rows[self._order[self.cursor]]
            self.cursor += 1
            text = _render(prompt, self.tokenizer, self.apply_chat_template, where)
            out.append(PromptItem(text, self.tokenizer.encode(text), label, meta))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "jsonl", "epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "shuffle": self.shuffle, "size": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "jsonl":
            raise ConfigError("--load", f"the checkpoint's data position is for a "
                                        f"{state.get('kind')!r} source, not --prompt-data")
        if state["size"] != len(self.rows):
            logger.warning("--prompt-data has %d prompts, the checkpoint was saved with %d: "
                           "the position is kept, the order differs", len(self.rows),
                           state["size"])
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)


class ToyPrompts:
    """The default prompt source: the toy task's 'Say x: ' prompts, label = the letter."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.task = SayTheLetterTask(seed=seed)
        self.tokenizer = tokenizer

    def next_batch(self, n: int) -> list[PromptItem]:
        return [PromptItem(p.text, self.tokenizer.encode(p.text), p.target)
                for p in self.task.sample_prompts(n)]

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.task.rng.getstate()
        return {"kind": "toy", "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "toy":
            raise ConfigError("--load", f"the checkpoint's data position is for a "
                                        f"{state.get('kind')!r} source, not the toy task")
        version, internal, gauss = state["rng"]
        self.task.rng.setstate((version, tuple(internal), gauss))


def prompt_source(settings: PromptSettings, tokenizer: Tokenizer) -> PromptSource:
    """`--prompt-data` if given, else the toy task."""
    if settings.prompt_data:
        return PromptDataset(settings.prompt_data, tokenizer, input_key=settings.input_key,
                             label_key=settings.label_key, metadata_key=settings.metadata_key,
                             apply_chat_template=settings.apply_chat_template,
                             shuffle=settings.shuffle, seed=settings.rollout_seed)
    if settings.apply_chat_template:
        raise ConfigError("--apply-chat-template", "applies to --prompt-data only (the toy task "
                                                   "has its own prompts)")
    return ToyPrompts(tokenizer, seed=settings.seed)
