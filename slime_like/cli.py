"""The `slime-like` console script: one subcommand per task, each with its own flags.

The top-level parser only lists the commands (with descriptions) and answers `--help` and
`--version`; everything after the command name goes to that command's own parser, so
`slime-like train --help` shows the job's flags.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROG = "slime-like"


def package_version() -> str:
    """This package's version from its installed metadata ("unknown" when not installed)."""
    from slime_like.observe.run_info import package_version as installed

    return installed("slime_like") or "unknown"


def _make_tiny_model(argv: list[str]) -> int:
    from slime_like.models.tiny import make_tiny_model

    p = argparse.ArgumentParser(prog=f"{PROG} make-tiny-model",
                                description=COMMANDS["make-tiny-model"].help)
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-word-embeddings", action="store_true")
    a = p.parse_args(argv)
    out = make_tiny_model(a.dir, layers=a.layers, hidden=a.hidden, heads=a.heads,
                          kv_heads=a.kv_heads, seed=a.seed,
                          tie_word_embeddings=a.tie_word_embeddings)
    print(out)
    return 0


def _train(argv: list[str]) -> int:
    from slime_like.train import main as train_main

    return train_main(argv)


def _train_async(argv: list[str]) -> int:
    """slime's `train_async.py`: the job with `--async-mode one-step` unless a flag or
    `--config` says otherwise (`--fully-async` runs the producer that never stops)."""
    from slime_like.protocol.modes import AsyncMode
    from slime_like.train import main as train_main

    return train_main(argv, defaults={"async_mode": AsyncMode.ONE_STEP})


def _report(argv: list[str]) -> int:
    from slime_like.observe.report import RunReport

    p = argparse.ArgumentParser(prog=f"{PROG} report", description=COMMANDS["report"].help)
    p.add_argument("run_dir", help="A run folder (holds metrics.jsonl and engine_timeline.jsonl).")
    p.add_argument("--title", default="slime_like run")
    a = p.parse_args(argv)
    report = RunReport(a.run_dir)
    if not report.metrics_path.is_file() and not report.timeline_path.is_file():
        print(f"{PROG} report: error: {a.run_dir}: no metrics.jsonl or engine_timeline.jsonl "
              "(not a run folder?)", file=sys.stderr)
        return 2
    print(report.render(title=a.title))
    return 0


def _fleet(argv: list[str]) -> int:
    """`slime-like fleet scale RUN_DIR --engines N`: resize a running job's fleet."""
    import json

    from slime_like.job.scaling import ScaleError, request_scale

    p = argparse.ArgumentParser(prog=f"{PROG} fleet", description=COMMANDS["fleet"].help)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    scale = sub.add_parser(
        "scale", help="Add or drain engines of a running job until it has N.",
        description="Ask the job running in RUN_DIR (its --output-dir) for N engines of a "
                    "model: engines are added (routed once they serve the job's weight "
                    "version) or drained (out of the router; requests still running after "
                    "the deadline move to other engines). Prints the job's answer as JSON.")
    scale.add_argument("run_dir", metavar="RUN_DIR")
    scale.add_argument("--engines", type=int, required=True, metavar="N")
    scale.add_argument("--model", default=None,
                       help="The model's engines to scale (default: the updatable model).")
    scale.add_argument("--drain-deadline", type=float, default=30.0, metavar="S",
                       help="Seconds a drained engine's running requests may take before "
                            "they are moved (default: 30).")
    scale.add_argument("--wait", type=float, default=900.0, metavar="S",
                       help="Seconds to wait for the job's answer; 0 only queues the "
                            "command (default: 900).")
    a = p.parse_args(argv)
    try:
        answer = request_scale(a.run_dir, a.engines, model=a.model,
                               drain_deadline_s=a.drain_deadline, wait_s=a.wait)
    except ScaleError as err:
        print(f"{PROG} fleet scale: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=1))
    return 0


@dataclass(frozen=True)
class Command:
    """A subcommand: what `--help` says about it, and what runs it."""

    help: str
    run: Callable[[list[str]], int]


COMMANDS: dict[str, Command] = {
    "train": Command("Run an RL job (or validate its flags with --dry-run): trainer, rollout "
                     "engines behind sglang-router, weight sync and recovery.", _train),
    "train-async": Command("slime's train_async.py: the job, generating rollout k+1 while "
                           "step k trains (--async-mode one-step) unless a flag or --config "
                           "says otherwise; see docs/ASYNC.md.", _train_async),
    "make-tiny-model": Command("Write a tiny HF-layout Llama checkpoint (for the reference "
                               "engine and tests).", _make_tiny_model),
    "report": Command("Re-render report.md and the plots of a run folder.", _report),
    "fleet": Command("Change a running job's fleet: `fleet scale RUN_DIR --engines N` adds "
                     "or drains engines while it trains.", _fleet),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: commands with descriptions, --version."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Ray-orchestrated SGLang rollout engines for RL.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's flags.")
    p.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, description=command.help, add_help=False)
    return p


def unknown_command(word: str) -> str:
    """The one-line error for a command we do not have, with the closest one if any."""
    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f" (commands: {', '.join(COMMANDS)})"
    return f"{PROG}: error: unknown command {word!r}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """`slime-like [--help | --version | COMMAND ...]`; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]].run(argv[1:])
    if argv and not argv[0].startswith("-"):
        print(unknown_command(argv[0]), file=sys.stderr)
        return 2
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    parser.parse_args(argv)  # --help, --version, or an error for an unknown option: exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
