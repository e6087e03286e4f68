"""The reference engine's step floor: a GPU's decode-step time, waited off the CPU.

The job's `--reference-min-step-ms` reaches the engine through its environment (it is not
an sglang flag, and the engine accepts exactly sglang's argv).
"""

from __future__ import annotations

import os

MIN_STEP_ENV = "SLIME_LIKE_REFERENCE_MIN_STEP_MS"


def min_step_seconds() -> float:
    """The floor on a forward step's length from MIN_STEP_ENV; 0 when unset."""
    raw = os.environ.get(MIN_STEP_ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{MIN_STEP_ENV}={raw!r}: not a number of milliseconds") from None
    if value < 0:
        raise ValueError(f"{MIN_STEP_ENV}={raw!r}: must be >= 0")
    return value / 1000.0
