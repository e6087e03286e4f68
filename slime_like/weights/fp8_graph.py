"""The rewrite of a kept FP8 copy as one CUDA graph, replayed at each sync.

Why: quantizing a model launches one kernel per projection (196 for a dense 7B model), and
on a trainer's host each launch costs about 50 us, so a sync spent about 9 ms of host time
queueing a GPU pass that itself took less. The colocated FP8 sync waited on those launches
(1.66-1.77x the bf16 sync on a 1xH200 machine). The kept copy is held only while the
parameters it is made from stay where they are (`Fp8Weights.keeping`), so the pass (the
same kernels, reading and writing the same addresses every sync) is captured once and
replayed as one launch.

A graph holds the addresses it was captured with. It is keyed by the address of every
parameter it reads and every kept tensor it writes, and captured afresh when any of them
moved. Capture runs nothing: the copy's bytes come only from replays and eager passes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)


def addresses(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Where each tensor's bytes start: what a captured graph reads or writes."""
    return tuple(t.data_ptr() for t in tensors)


class CapturedRewrite:
    """One captured pass over the kept copy, valid while nothing it touches moved."""

    def __init__(self, key: tuple[int, ...], graph: torch.cuda.CUDAGraph):
        self.key = key
        self.graph = graph
        self.replays = 0

    def replay(self) -> None:
        """Queue the whole pass on the current stream (after the optimizer's writes)."""
        self.graph.replay()
        self.replays += 1


def capture(write: Callable[[], None], key: tuple[int, ...],
            device: torch.device) -> CapturedRewrite:
    """Record `write`'s kernels into a graph; nothing runs. The capture is on a side stream
    in thread-local mode, so other threads' CUDA calls (an engine-call loop, a transport
    sharing handles) neither break it nor are recorded in it. `write` must launch only GPU
    work on the current stream and have run eagerly once before (Triton compiles its kernel
    on first use, which a capture cannot do)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            write()
        except BaseException:
            with contextlib.suppress(Exception):  # ends the capture; the first error is what counts
                graph.capture_end()
            raise
        graph.capture_end()
    return CapturedRewrite(key, graph)
