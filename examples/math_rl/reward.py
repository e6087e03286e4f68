"""Rule-based reward of the math example: is the first number of the answer the label?

Used as ``--custom-rm-path examples.math_rl.reward.reward_func``. The job calls it once per
sample with slime's signature; it may also be an ``async def``.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """1.0 for the right sum; else a little credit for answering with digits at all.

    The partial credit gives a tiny model's first GRPO groups some reward variance.
    """
    response = sample.response.strip()
    match = _NUMBER.match(response)
    if match is not None and match.group() == str(sample.label):
        return 1.0
    digits = sum(ch.isdigit() for ch in response)
    return 0.2 * digits / max(1, len(response))
