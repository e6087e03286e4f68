"""Writes docs/flags.md from the parser, so the page cannot drift from the flags.

    python -m slime_like.config.flags_doc            # rewrite docs/flags.md
    python -m slime_like.config.flags_doc --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slime_like.config.flags import build_parser

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action, argparse._StoreTrueAction) and action.default is False:
        return "off"
    return "" if action.default is None else f"`{action.default}`"


def render() -> str:
    """docs/flags.md as text."""
    parser = build_parser()
    out = [
        "# Flags of `slime-like train`",
        "",
        "Generated from the parser by `python -m slime_like.config.flags_doc`; do not edit by "
        "hand (`tests/config/test_flags_doc.py` fails when this page is stale).",
        "",
        "Any flag may also be a key of `--config FILE.yaml`: the flag name without the leading "
        "dashes, e.g. `rollout_num_gpus: 4`; flags on the command line win over the file.",
        "",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"## {group.title}", ""]
        if group.description:
            out += [_cell(group.description), ""]
        out += ["| flag | default | description |", "|---|---|---|"]
        for a in actions:
            flags = ", ".join(f"`{f}`" for f in a.option_strings)
            out.append(f"| {flags} | {_cell(_default(a))} | {_cell(a.help or '')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the page, or with --check report whether it is current."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/flags.md is stale")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is stale; run python -m slime_like.config.flags_doc",
                  file=sys.stderr)
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text)
    print(DOC_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
