"""Regenerates the flag tables of sglang's ServerArgs and the routers' launchers.

slime_like renders argv for engines and routers without importing sglang (it is absent on
CPU machines and in the trainer's environment), so the flags sglang 0.5.23, sglang-router
0.3.2 and smg 1.13.0 accept are kept as data. Each table is written when its package is
importable (the others are left as they are):

    python scripts/gen_arg_tables.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from importlib.metadata import version as pkg_version
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "slime_like" / "engine" / "data"


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def describe(parser: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__.lstrip("_").replace("Action", "").lower() or "store"
        rows.append({
            "dest": action.dest,
            "flags": list(action.option_strings),
            "kind": kind,
            "type": getattr(action.type, "__name__", None) if action.type else None,
            "nargs": action.nargs if action.nargs is None or isinstance(action.nargs, int | str) else str(action.nargs),
            "default": _jsonable(action.default),
            "choices": [_jsonable(c) for c in action.choices] if action.choices else None,
            "required": bool(action.required),
        })
    return rows


def _write(name: str, version_key: str, version: str, parser: argparse.ArgumentParser) -> None:
    (OUT / name).write_text(json.dumps({version_key: version, "args": describe(parser)},
                                       indent=1) + "\n")
    print(f"wrote {name} ({version})")


def sglang_table() -> None:
    import sglang
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    _write("sglang_server_args.json", "sglang_version", sglang.__version__, p)


def sglang_router_table() -> None:
    from sglang_router.launch_router import RouterArgs

    r = argparse.ArgumentParser()
    RouterArgs.add_cli_args(r, use_router_prefix=False)
    _write("sglang_router_args.json", "sglang_router_version", pkg_version("sglang-router"), r)


def smg_table() -> None:
    from smg.router_args import RouterArgs

    r = argparse.ArgumentParser()
    RouterArgs.add_cli_args(r, use_router_prefix=False)
    # The distribution's version: smg 1.13.0's own `smg.__version__` still says 1.1.0.
    _write("smg_args.json", "smg_version", pkg_version("smg"), r)


TABLES = {"sglang": sglang_table, "sglang_router": sglang_router_table, "smg": smg_table}


def main() -> None:
    for module, write in TABLES.items():
        if importlib.util.find_spec(module) is None:
            print(f"skipped: {module} is not installed")
            continue
        write()


if __name__ == "__main__":
    main()
