"""The job's entry point: `python -m slime_like.train` (and `slime-like train`).

    python -m slime_like.train --config configs/quickstart.yaml

Parses and validates the flags, runs the preflight checks, then either prints the plan
(`--dry-run`) or runs the job (`slime_like.job.Job`: placement -> fleet -> trainer group ->
first sync -> {rollout, score, check, train, sync} per step).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from slime_like.config.fleet_slices import fleet_settings, make_keys
from slime_like.config.parse import parse_args
from slime_like.config.slices import dry_run_settings, job_settings
from slime_like.errors import ConfigError
from slime_like.job.dry_run import describe
from slime_like.job.inputs import preflight
from slime_like.job.job import Job
from slime_like.weights.sync_config import WeightSyncConfig

PROG = "slime-like train"


def refuse_what_the_job_cannot_run(args: argparse.Namespace) -> None:
    """Placement modes the Python API uses but the job cannot run, refused with one line."""
    if args.debug_rollout_only:
        raise ConfigError("--debug-rollout-only", "not supported by the job: every step checks "
                                                  "the engines' samples against the trainer "
                                                  "(slime_like.api.launch_fleet places engines "
                                                  "only)")


def train(args: argparse.Namespace) -> int:
    """Run the job described by parsed flags; 0 on success."""
    refuse_what_the_job_cannot_run(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    settings = job_settings(args)
    checked = preflight(settings)  # a bad prompt file or plug-in fails before anything
    job = Job(settings, fleet_settings(args, log_dir=str(out / "logs"), keys=make_keys(args)),
              WeightSyncConfig.from_flags(args), checked.plugins, out, checked.group_filter)
    return job.run()


def main(argv: list[str] | None = None, defaults: dict | None = None) -> int:
    """`slime-like train`: parse and validate the flags, then run the job (or `--dry-run`).
    `defaults`: an entry point's own flag defaults (`slime-like train-async`)."""
    try:
        args = parse_args(argv, defaults=defaults)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            refuse_what_the_job_cannot_run(args)
            checked = preflight(job_settings(args), dry_run=True)
        except ConfigError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        for warning in checked.warnings:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        print(describe(dry_run_settings(args)))
        return 0
    try:
        return int(train(args) or 0)
    except ConfigError as e:  # a bad prompt file, plug-in, checkpoint, or a missing tracker
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
