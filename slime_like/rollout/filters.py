"""Built-in dynamic-sampling filters (`--dynamic-sampling-filter-path`), as slime ships."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from slime_like.errors import PluginError
from slime_like.rollout.dynamic_sampling import FLAG, DynamicFilterOutput
from slime_like.rollout.generate import Sample

ZERO_STD = 1e-6  # rewards closer than this count as equal (slime's threshold)


def check_reward_nonzero_std(args: argparse.Namespace, samples: Sequence[Sample],
                             **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ: equal rewards give every sample a GRPO advantage
    of 0, so the group would cost a train step's compute and teach nothing.

    A dropped group's reason is `zero_std_<reward rounded to 0.1>` (slime's), so the
    counters show whether the groups were all right or all wrong.
    """
    rewards = []
    for k, s in enumerate(samples):
        if s.reward is None:
            raise PluginError(FLAG, f"check_reward_nonzero_std: sample {k} of prompt "
                                    f"{s.prompt_index} has no reward yet (filter scored "
                                    "groups)")
        rewards.append(float(s.reward))
    keep = len(rewards) > 1 and statistics.pstdev(rewards) > ZERO_STD
    if keep:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}"
                               if rewards else "empty_group")
