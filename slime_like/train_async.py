"""`python -m slime_like.train_async`: slime's `train_async.py` — the job, one-step by default.

Rollout k+1 is generated while step k trains (`--async-mode one-step`); `--fully-async`
(miles' flag) or `--async-mode fully-async` runs the producer that never stops, with
weights updated while requests run. Every other flag is the job's (see docs/ASYNC.md).
"""

from __future__ import annotations

import sys

from slime_like.protocol.modes import AsyncMode
from slime_like.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    """The job with --async-mode one-step unless a flag or --config says otherwise."""
    return train_main(argv, defaults={"async_mode": AsyncMode.ONE_STEP})


if __name__ == "__main__":
    sys.exit(main())
