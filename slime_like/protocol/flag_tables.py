"""The flag tables of sglang's ServerArgs and the routers' launchers, read once.

slime_like renders, parses and checks sglang/router command lines without importing
those packages (absent on CPU machines and in trainer images), so the flags sglang 0.5.23,
sglang-router 0.3.2 and smg 1.13.0 accept are shipped as data in `slime_like/engine/data/`
(regenerate with `scripts/gen_arg_tables.py`). Every layer that needs them (flags, launch,
the reference engine, the router) reads them through this module, and renders composed
args back into flags (`render_flags`) the same way for both tools. It lives in `protocol/`
because both programs read it: a command line is as much their contract as a request body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

SERVER_ARGS = "sglang_server_args.json"
ROUTER_ARGS = "sglang_router_args.json"
SMG_ARGS = "smg_args.json"


@dataclass(frozen=True)
class ArgSpec:
    """One flag as the tool's argparse declares it (one row of a table)."""

    dest: str
    flags: tuple[str, ...]
    kind: str
    type: str | None
    nargs: int | str | None
    default: Any
    choices: tuple[Any, ...] | None

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def is_switch(self) -> bool:
        return self.kind in ("storetrue", "deprecatedstoretrue")

    @property
    def deprecated(self) -> bool:
        return self.kind.startswith("deprecated")


@cache
def read_rows(resource: str) -> tuple[str, tuple[ArgSpec, ...]]:
    """(tool version, every row in declaration order, aliases and deprecated spellings too)."""
    raw = json.loads(resources.files("slime_like.engine").joinpath("data", resource).read_text())
    version = (raw.get("sglang_version") or raw.get("sglang_router_version")
               or raw.get("smg_version") or "?")
    rows = tuple(ArgSpec(r["dest"], tuple(r["flags"]), r["kind"], r["type"], r["nargs"],
                         r["default"], tuple(r["choices"]) if r["choices"] else None)
                 for r in raw["args"])
    return version, rows


@dataclass(frozen=True)
class ArgTable:
    """The flags one tool version accepts, by field name (one spec per field)."""

    version: str
    specs: Mapping[str, ArgSpec]

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __getitem__(self, name: str) -> ArgSpec:
        return self.specs[name]


def load_arg_table(resource: str, skip: frozenset[str] = frozenset()) -> ArgTable:
    """One spec per field: a field declared twice keeps its current (non-deprecated) flag."""
    version, rows = read_rows(resource)
    specs: dict[str, ArgSpec] = {}
    for spec in rows:
        if spec.dest in skip or not spec.flags:
            continue
        if spec.dest not in specs or specs[spec.dest].deprecated:
            specs[spec.dest] = spec
    return ArgTable(version, specs)


# The routers slime_like can start (`--router`), each with its flag table; the rest of what
# launching one takes is in `slime_like/router/kinds.py`. sglang-router stays the default
# (docs/COMPATIBILITY.md, "sglang-router and smg").
ROUTER_TABLES = {"sglang-router": ROUTER_ARGS, "smg": SMG_ARGS}
DEFAULT_ROUTER = "sglang-router"


@cache
def router_table(router: str) -> ArgTable:
    """The launcher flags of router `router` (a key of ROUTER_TABLES), loaded once."""
    return load_arg_table(ROUTER_TABLES[router])


# Parser-only options that are not ServerArgs fields: a YAML `--config` would bypass our
# composition, so it is never passed through.
_NOT_SERVER_FIELDS = frozenset({"config"})


@cache
def server_arg_table() -> ArgTable:
    """sglang's ServerArgs flags, loaded once from the packaged table."""
    return load_arg_table(SERVER_ARGS, _NOT_SERVER_FIELDS)


# Types whose parser function reads JSON text.
JSON_TYPES = frozenset({"loads", "json_list_type"})


@dataclass
class ComposedArgs:
    """The server args of one engine, plus what was dropped and what the user should know."""

    args: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def render_value(spec: ArgSpec, value: Any) -> list[str]:
    if spec.type in JSON_TYPES and not isinstance(value, str):
        return [json.dumps(value)]
    if isinstance(value, dict):
        return [json.dumps(value)]
    if isinstance(value, list | tuple):
        return [json.dumps(v) if isinstance(v, dict) else str(v) for v in value]
    if isinstance(value, bool):
        return [str(value).lower()]
    return [str(value)]


def render_flags(table: ArgTable, args: Mapping[str, Any]) -> list[str]:
    """Flags for `args` as the table's argparse reads them back; None means "leave default"."""
    argv: list[str] = []
    for name, value in args.items():
        spec = table[name]
        if value is None:
            continue
        if spec.is_switch:
            if value:
                argv.append(spec.flag)
        elif spec.kind == "booleanoptional":
            argv.append(spec.flags[0] if value else spec.flags[1])
        elif spec.kind == "deprecatedstoreconst":
            if value:
                argv += [spec.flag, str(spec.choices[0])] if spec.choices else [spec.flag]
        elif spec.kind == "append":
            for entry in value:
                argv += [spec.flag, *render_value(spec, entry)]
        elif isinstance(value, list | tuple) and not value and spec.nargs == "+":
            continue  # `--flag` with no value is a parse error for nargs='+'; [] is the default
        else:
            argv += [spec.flag, *render_value(spec, value)]
    return argv
