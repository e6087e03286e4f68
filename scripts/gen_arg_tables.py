"""Regenerates the flag tables of sglang's ServerArgs and sglang-router's launcher.

slime_like renders argv for engines and routers without importing sglang (it is absent on
CPU machines and in the trainer's environment), so the flags sglang 0.5.23 and
sglang-router 0.3.2 accept are kept as data. Run with both packages importable:

    python scripts/gen_arg_tables.py
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    import sglang
    import sglang_router
    from sglang.srt.server_args import ServerArgs
    from sglang_router.launch_router import RouterArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    (OUT / "sglang_server_args.json").write_text(json.dumps(
        {"sglang_version": sglang.__version__, "args": describe(p)}, indent=1) + "\n")

    r = argparse.ArgumentParser()
    RouterArgs.add_cli_args(r, use_router_prefix=False)
    version = getattr(sglang_router, "__version__", None)
    if version is None:
        from importlib.metadata import version as pkg_version
        version = pkg_version("sglang-router")
    (OUT / "sglang_router_args.json").write_text(json.dumps(
        {"sglang_router_version": version, "args": describe(r)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
