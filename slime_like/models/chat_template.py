"""A checkpoint's chat template, rendered as `transformers` renders it, without `transformers`.

HF checkpoints keep a Jinja template in `tokenizer_config.json` (`chat_template`, a string or
a list of named templates) or in `chat_template.jinja`. `transformers` renders it in a
sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text, and the globals `raise_exception`
and `strftime_now`. The reference engine and the job use this module so the byte-level
tiny model (and any checkpoint) renders chats with jinja2 alone; the answers are the same
text `apply_chat_template(..., tokenize=False)` gives.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What `make-tiny-model` writes into tokenizer_config.json: one line per message, a role
# prefix the byte vocabulary spells out, the assistant's turn opened for generation.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed on it."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


def read_chat_template(model_dir: str | Path) -> str | None:
    """The default chat template a checkpoint directory ships, or None."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def render_chat(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, special_tokens: dict[str, str] | None = None,
                **kwargs: Any) -> str:
    """The prompt text of a conversation; ChatTemplateError when the template fails on it."""
    try:
        return _compile(template).render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **(special_tokens or {}), **kwargs)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from e
