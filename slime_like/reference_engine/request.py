"""One request on the scheduler: what it asked for, what it has produced, how it ended.

A `Req` is one sequence being generated (a batch item, or one of n samples): its tokens,
logprobs, KV slot, the weight versions its tokens were made at, and the PD hand-off hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slime_like.reference_engine.sampling import SamplingSpec


def finish_abort() -> dict:
    """finish_reason of a running request aborted by a user, a pause or abort_all."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def finish_abort_waiting() -> dict:
    """finish_reason of a request aborted before it got a KV slot."""
    return {"type": "abort", "message": "Abort in waiting queue"}


@dataclass(eq=False)
class Req:
    """One sequence being generated (a batch item or one of n samples)."""

    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_len: int  # prompt + the most tokens this request may hold
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    log_metrics: bool = True
    sink: Callable[[Req, int, bool], None] | None = None  # (req, num_output, finished)
    ids: list[int] = field(default_factory=list)  # prompt + output so far
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprob_start: int | None = None  # prompt position the input-logprob window opens at
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    slot: int | None = None
    kv_len: int = 0  # positions of `ids` whose KV sits in the slot
    cached_tokens: int = 0
    finish: dict | None = None
    matched_stop_str: str | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old version, n_out)
    num_retractions: int = 0
    generator: torch.Generator | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # PD disaggregation. Prefill side: called once when the request finishes, with the
    # prompt's KV (None if it was aborted) and its seeded generator's state. Decode side:
    # the prompt's KV and generator state handed over, consumed at admission.
    on_finish_kv: Callable[[Req, torch.Tensor | None, torch.Tensor | None], None] | None = None
    kv_import: torch.Tensor | None = None
    generator_state: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = list(self.prompt_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far (kept across retractions)."""
        return len(self.ids) - len(self.prompt_ids)


def weight_version_spans(events: list[tuple[str, int]], current: str, num_output: int) -> list[dict]:
    """Partition [0, num_output) by the weight version in force when each token was produced."""
    spans: list[dict] = []
    for version, end in [*events, (current, num_output)]:
        end = min(end, num_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
