"""`--config FILE.yaml`: any flag as a YAML key; the command line wins over the file.

Keys are flag names without the leading dashes (`rollout_num_gpus: 4`,
`sglang_mem_fraction_static: 0.7`, `router_policy: round_robin`). Each value is checked
with the flag's own type and choices, so a mistake in the file reads like a mistake on
the command line, with `FILE:key` as its path. `sglang_config` may be a path (relative to
the file) or the server-group YAML itself, inline; `prompt_data` is relative to the file too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from slime_like.config.argtypes import did_you_mean
from slime_like.config.passthrough import RESERVED_REASONS, _StoreTrueFromChoice, sglang_dests
from slime_like.errors import ConfigError

_BOOL_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction,
                 argparse.BooleanOptionalAction, _StoreTrueFromChoice)
# sglang flags whose values sglang parses from JSON text.
_JSON_TYPES = ("loads", "json_list_type")


@dataclass(frozen=True)
class InlineSglangConfig:
    """The `sglang_config` of a config file given inline rather than as a path."""

    data: Any
    source: str

    def __str__(self) -> str:
        return self.source


def show(value: Any) -> str:
    """A YAML value the way a user wrote it, for error messages."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def read_yaml(path: str | Path, what: str) -> Any:
    """Load one YAML file; a missing file or a syntax error is a ConfigError on `what`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(what, f"no such file: {str(path)!r}")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(path), f"not valid YAML{where}: {problem}") from None


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        # Two flags may share a dest (sglang's deprecated spelling); keep the first.
        out.setdefault(action.dest, action)
    for action in parser._actions:
        # Every spelling of a flag is a key too (pause_generation_mode and pause_mode).
        for option in action.option_strings:
            if option.startswith("--"):
                out.setdefault(option[2:].replace("-", "_"), action)
    return out


def _scalar(action: argparse.Action, value: Any, where: str, json_text: bool) -> Any:
    if value is None:
        if action.default is None:
            return None
        raise ConfigError(where, "must not be null")
    if isinstance(value, (dict, list)):
        if json_text:
            return json.dumps(value)
        raise ConfigError(where, f"must be a single value, got {show(value)}")
    convert = action.type or str
    if isinstance(value, bool) and convert is not str:
        raise ConfigError(where, f"must be a number, got {show(value)}")
    if isinstance(value, bool):
        raise ConfigError(where, f"must be a string, got {show(value)}")
    try:
        out = convert(value if isinstance(value, str) else str(value))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(where, str(e)) from None
    except (TypeError, ValueError):
        raise ConfigError(where, f"invalid value {show(value)}") from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(where, f"must be one of {choices}; got {show(value)}")
    return out


def convert_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value for `action`, checked like argparse would check it on the CLI."""
    json_text = getattr(sglang_dests().get(action.dest), "type", None) in _JSON_TYPES
    if isinstance(action, _BOOL_ACTIONS):
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {show(value)}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
            raise ConfigError(where, "must be a list of lists (one per use of the flag)")
        return [[_scalar(action, v, f"{where}[{i}][{j}]", False) for j, v in enumerate(row)]
                for i, row in enumerate(value)]
    nargs = action.nargs
    if value is None:
        return _scalar(action, value, where, json_text)
    if nargs in ("+", "*") or isinstance(nargs, int):
        items = value if isinstance(value, list) else [value]
        if nargs == "+" and not items:
            raise ConfigError(where, "must not be empty")
        return [_scalar(action, v, f"{where}[{i}]", json_text) for i, v in enumerate(items)]
    return _scalar(action, value, where, json_text)


# Keys naming files that belong with the config file: relative paths are read from its folder.
FILE_RELATIVE = frozenset({"sglang_config", "prompt_data"})


def load_config_file(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: value} from a flags YAML file, to install with `parser.set_defaults`."""
    data = read_yaml(path, "--config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"must be a mapping of flag names to values, got {show(data)}")
    actions = _actions_by_dest(parser)
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}:{key}"
        if not isinstance(key, str):
            raise ConfigError(where, "keys must be flag names")
        dest = key.replace("-", "_")
        if dest == "config":
            raise ConfigError(where, "a config file cannot name another config file")
        if dest == "sglang_config" and isinstance(value, (dict, list)):
            out[dest] = InlineSglangConfig(value, source=where)
            continue
        reserved = dest.removeprefix("sglang_")
        if dest not in actions and dest.startswith("sglang_") and reserved in RESERVED_REASONS:
            raise ConfigError(where, "not a flag: " + RESERVED_REASONS[reserved])
        if dest not in actions:
            raise ConfigError(where, "unknown flag" + did_you_mean(dest, actions))
        converted = convert_value(actions[dest], value, where)
        if dest in FILE_RELATIVE and converted is not None:
            converted = str(Path(path).parent / converted)
        out[actions[dest].dest] = converted
    return out
