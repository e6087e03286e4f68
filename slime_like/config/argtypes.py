"""argparse value types whose errors read like the rest of our config errors."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Iterable
from enum import StrEnum

from slime_like.errors import ConfigError


def _number(kind: type, text: str) -> int | float:
    try:
        return kind(text)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def integer(text: str) -> int:
    """Any int, with our wording on error."""
    return _number(int, text)


def number(text: str) -> float:
    """Any float, with our wording on error."""
    return _number(float, text)


def positive_int(text: str) -> int:
    """An int > 0 (GPU counts, sizes)."""
    value = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (0 means 'none', e.g. --rollout-num-gpus 0 starts routers only)."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A float > 0 (intervals, timeouts)."""
    value = _number(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    """A float >= 0 (grace periods)."""
    value = _number(float, text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def unit_fraction(text: str) -> float:
    """A float in (0, 1] (a share of something, e.g. of the samples checked)."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def port(text: str) -> int:
    """A TCP port number."""
    value = _number(int, text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def member_of(kind: type[StrEnum]) -> Callable[[str], StrEnum | str]:
    """A flag value as its enum member; an unknown word is left as text for `choices` to
    refuse (so the CLI and a --config file word the error as for any other choice)."""

    def parse(text: str) -> StrEnum | str:
        try:
            return kind(text)
        except ValueError:
            return text

    parse.__name__ = kind.__name__
    return parse


def values_of(kind: type[StrEnum]) -> list[str]:
    """The flag spellings of an enum's members, for argparse `choices`."""
    return [member.value for member in kind]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'; did you mean X?' for the closest candidate, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


_ARGUMENT_RE = re.compile(r"^argument (?P<flags>[^:]+): (?P<msg>.*)$", re.DOTALL)
_UNRECOGNIZED_RE = re.compile(r"^unrecognized arguments: (?P<args>.*)$", re.DOTALL)


class ConfigArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError(flag, message) instead of exiting.

    Library callers (tests, train.py) get an exception they can catch; `main` prints it.
    """

    # Unknown flags that deserve a specific answer rather than a spelling suggestion.
    unknown_flag_hints: dict[str, str] = {}

    def error(self, message: str):  # noqa: D102 - argparse API
        m = _ARGUMENT_RE.match(message)
        if m:
            flag = m.group("flags").split("/")[0].strip()
            raise ConfigError(flag, m.group("msg"))
        m = _UNRECOGNIZED_RE.match(message)
        if m:
            first = m.group("args").split()[0]
            name = first.split("=")[0]
            if name in self.unknown_flag_hints:
                raise ConfigError(name, self.unknown_flag_hints[name])
            if name.startswith("-"):
                options = [o for a in self._actions for o in a.option_strings]
                raise ConfigError(name, "unknown flag" + did_you_mean(name, options))
            raise ConfigError(name, "unexpected positional argument")
        raise ConfigError("", message)
