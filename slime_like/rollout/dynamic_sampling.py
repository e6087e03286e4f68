"""Dynamic sampling (slime's `--over-sampling-batch-size`, `--dynamic-sampling-filter-path`).

A step draws `--over-sampling-batch-size` prompts per round, generates and scores their
groups, keeps the groups the filter accepts and repeats until `--rollout-batch-size`
groups are kept. The filter sees one prompt's group:
``filter(args, samples, **kwargs) -> DynamicFilterOutput | bool`` (slime's signature;
`slime_like.rollout.filters.check_reward_nonzero_std` drops groups whose rewards are all
equal: they have no GRPO advantage to learn from).

`collect_groups` is that round loop over callables, so every schedule of the job runs the
same loop whatever draws the prompts and generates.
"""

from __future__ import annotations

import argparse
import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slime_like.errors import PluginError
from slime_like.rollout.generate import Sample
from slime_like.rollout.plugins import load_function

FLAG = "--dynamic-sampling-filter-path"
UNNAMED_REASON = "filtered"  # a drop whose filter gave no reason (or returned False)

P = TypeVar("P")


@dataclass
class DynamicFilterOutput:
    """What a filter says of one group (slime's type): keep it, or why not."""

    keep: bool
    reason: str | None = None


def _as_output(out: Any, path: str, group: Sequence[Sample]) -> DynamicFilterOutput:
    """slime's DynamicFilterOutput (or anything with `.keep`) or, for older filters, a bool."""
    where = f"prompt {group[0].prompt_index}" if group else "an empty group"
    if inspect.isawaitable(out):
        if hasattr(out, "close"):
            out.close()
        raise PluginError(FLAG, f"{path} is async; a filter is a plain function")
    if isinstance(out, bool):
        return DynamicFilterOutput(keep=out)
    keep = getattr(out, "keep", None)
    if hasattr(keep, "item"):  # a 0-d tensor or numpy bool, as slime's own filter returns
        keep = keep.item()
    if not isinstance(keep, bool):
        raise PluginError(FLAG, f"{path} returned {out!r} for {where}; expected a "
                                "DynamicFilterOutput(keep, reason) or a bool")
    reason = getattr(out, "reason", None)
    return DynamicFilterOutput(keep=keep, reason=None if reason is None else str(reason))


class GroupFilter:
    """The job's group filter and its counters over the run: groups kept, dropped by reason
    (`collect_groups` also counts one step's).

    Without `--dynamic-sampling-filter-path` it is disabled and keeps every group.
    """

    def __init__(self, fn: Callable[..., Any] | None = None, path: str | None = None):
        self.fn = fn
        self.path = path or getattr(fn, "__qualname__", None)
        self.kept = 0
        self.dropped: Counter[str] = Counter()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GroupFilter:
        """Load `--dynamic-sampling-filter-path`; ConfigError naming the flag if it cannot."""
        path = getattr(args, "dynamic_sampling_filter_path", None)
        if not path:
            return cls()
        return cls(load_function(path, FLAG), path)

    @property
    def enabled(self) -> bool:
        return self.fn is not None

    def keep(self, args: argparse.Namespace, group: Sequence[Sample]) -> DynamicFilterOutput:
        """The filter's verdict on one prompt's group, counted."""
        if self.fn is None:
            verdict = DynamicFilterOutput(keep=True)
        else:
            try:
                out = self.fn(args, list(group))
            except PluginError:
                raise
            except Exception as e:  # noqa: BLE001 - a user filter failing
                where = f"prompt {group[0].prompt_index}" if group else "an empty group"
                raise PluginError(FLAG, f"{self.path} failed on {where}: "
                                        f"{type(e).__name__}: {e}") from e
            verdict = _as_output(out, str(self.path), group)
        if verdict.keep:
            self.kept += 1
        else:
            self.dropped[verdict.reason or UNNAMED_REASON] += 1
        return verdict

    def metrics(self) -> dict[str, int]:
        """Flat counters since the last `reset` (for metrics.jsonl and tracking)."""
        out = {"dynamic_sampling_kept": self.kept,
               "dynamic_sampling_dropped": sum(self.dropped.values())}
        out.update({f"dynamic_sampling_drop_{reason}": n
                    for reason, n in sorted(self.dropped.items())})
        return out

    def reset(self) -> None:
        self.kept = 0
        self.dropped.clear()


@dataclass
class Collected:
    """One step's groups: `batch_size` kept ones, in the order they were drawn."""

    groups: list[list[Sample]]
    rounds: int = 0
    prompts_drawn: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    surplus: list[list[Sample]] = field(default_factory=list)  # kept beyond batch_size

    def metrics(self) -> dict[str, int]:
        out = {"dynamic_sampling_rounds": self.rounds,
               "dynamic_sampling_prompts_drawn": self.prompts_drawn,
               "dynamic_sampling_kept": len(self.groups) + len(self.surplus),
               "dynamic_sampling_dropped": sum(self.dropped.values()),
               "dynamic_sampling_surplus": len(self.surplus)}
        out.update({f"dynamic_sampling_drop_{reason}": n
                    for reason, n in sorted(self.dropped.items())})
        return out


def collect_groups(draw_prompts: Callable[[int], list[P]],
                   generate_and_score: Callable[[list[P]], list[list[Sample]]],
                   group_filter: GroupFilter, args: argparse.Namespace, *, batch_size: int,
                   over_sampling_batch_size: int | None = None,
                   max_rounds: int = 100) -> Collected:
    """Rounds of `draw_prompts(n)` -> `generate_and_score(prompts)` (one scored group per
    prompt) -> the filter, until `batch_size` groups are kept.

    `n` is `over_sampling_batch_size` (default `batch_size`). Groups kept past `batch_size`
    in the last round come back as `surplus` (the caller may keep them for the next step
    or drop them). A filter that keeps nothing for `max_rounds` rounds fails the step with
    a PluginError naming the flag and the reasons, rather than sampling forever.
    """
    draw = over_sampling_batch_size or batch_size
    if draw < batch_size:
        raise ValueError(f"over_sampling_batch_size {draw} < batch_size {batch_size}")
    result = Collected(groups=[])
    kept: list[list[Sample]] = []
    while len(kept) < batch_size:
        if result.rounds >= max_rounds:
            reasons = ", ".join(f"{r}: {n}" for r, n in result.dropped.most_common()) or "none"
            raise PluginError(FLAG, f"{group_filter.path} kept {len(kept)} of {batch_size} "
                                    f"groups in {max_rounds} rounds of {draw} prompts "
                                    f"(dropped by reason: {reasons})")
        prompts = draw_prompts(draw)
        groups = generate_and_score(prompts)
        if len(groups) != len(prompts):
            raise ValueError(f"generate_and_score returned {len(groups)} groups for "
                             f"{len(prompts)} prompts")
        result.rounds += 1
        result.prompts_drawn += len(prompts)
        for group in groups:
            verdict = group_filter.keep(args, group)
            if verdict.keep:
                kept.append(list(group))
            else:
                result.dropped[verdict.reason or UNNAMED_REASON] += 1
    result.groups, result.surplus = kept[:batch_size], kept[batch_size:]
    return result
