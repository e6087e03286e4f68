"""The `distributed` transport's weight group, before and after it carries bytes: sglang's
rank layout, the address engines reach rank 0 at, the joins still unanswered (an engine
whose control loop is stuck is named, not waited on), and a failed group's close.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from urllib.parse import urlparse

import torch.distributed as dist

from slime_like.engine.deadlines import CallClock
from slime_like.engine.fanout import each
from slime_like.engine.session import EngineSession
from slime_like.errors import WeightSyncError
from slime_like.protocol.weight_group import destroy_process_group, free_group
from slime_like.weights.watch import EngineCall, Watch, no_answer


def engine_ranks(engines: Sequence[EngineSession]) -> tuple[list[int], int]:
    """sglang's layout: trainer rank 0, engine i at 1 + sum of earlier tp sizes."""
    offsets, offset = [], 1
    for e in engines:
        offsets.append(offset)
        offset += e.tp_size
    return offsets, offset


def master_address_for(engines: Sequence[EngineSession]) -> str:
    """An address of this host the engines can reach (loopback when they are all local)."""
    hosts = [urlparse(e.url).hostname or "127.0.0.1" for e in engines]
    if all(_is_loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # Connecting a UDP socket sends nothing; it only selects the outgoing interface.
        s.connect((hosts[0], 9))
        return s.getsockname()[0]


def host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nccl_env_hint() -> str:
    """What is wrong when this process disables NCCL transports its peers keep, or ''."""
    off = [v for v in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")
           if os.environ.get(v, "0").strip() not in ("", "0")]
    if not off:
        return ""
    return (f"{' and '.join(f'{v}={os.environ[v]}' for v in off)} is set in the trainer process "
            "(torchrl's SGLang scheme sets both at import): engines that keep P2P/SHM build "
            "other NCCL rings, and the group fails (e.g. 'ring 0 does not contain rank 1'); "
            "where it works the broadcast is ~80x slower on NVLink. Unset them in the trainer "
            "(or set the same on every engine)")


JOIN = "init_weights_update_group"
PING_S = 1.0  # how long an engine late to its join has to answer /ping
# After a failed rendezvous closed its store, how long engines get to answer their join.
UNANSWERED_GRACE_S = 5.0
# Each engine's latest join call, across transports of this process (a resync builds its own).
PENDING_JOINS: dict[str, Future] = {}


def join_pending(url: str) -> bool:
    future = PENDING_JOINS.get(url)
    if future is not None and future.done():
        PENDING_JOINS.pop(url, None)
        return False
    return future is not None


def wait_for_group(watch: Watch, formed: Callable[[], bool], joins: Sequence[EngineCall],
                   clock: CallClock | None) -> None:
    """Until rank 0 is in the group (or a join failed, or the group timeout passed).

    A join has no deadline of its own: every join of a rendezvous waits for the slowest,
    so a late one says nothing of who is late. At the join's deadline (what joins took
    lately) the engines whose join is still unanswered are pinged: one that does not
    answer at all is hung, and the group is given up naming it (`WeightSyncError.hung`);
    if every one answers, the rendezvous is slow, not stuck, and is waited for.
    """
    if clock is not None and clock.deadline(JOIN) < clock.cap_s:  # a basis to judge by
        deadline = time.monotonic() + clock.deadline(JOIN)
        watch.wait(lambda: formed() or time.monotonic() > deadline, JOIN)
        pending = [] if formed() else [c for c in joins if not c.future.done()]
        answers = each(pending, lambda c: c.engine.ping(timeout=PING_S))
        silent = sorted({c.engine.url for c, (ok, _) in zip(pending, answers, strict=True)
                         if not ok})
        if silent:
            err = WeightSyncError(JOIN, f"no answer to the join within its deadline "
                                  f"({clock.deadline(JOIN):.2f}s = {clock.basis(JOIN)}), nor "
                                  f"to /ping within {PING_S:g}s: hung", silent[0])
            err.hung, err.unresponsive = silent, list(silent)
            raise err
    watch.wait(formed, JOIN)


def never_answered(calls: Sequence[EngineCall], grace_s: float) -> list[str]:
    """Engines with no answer to their join `grace_s` after the store closed.

    An engine that was in the rendezvous fails its join as soon as the store closes; one
    that does not answer (still pending, or its HTTP call timed out) never started it: its
    control loop is busy with something else (a collective of an older group, a hang), so
    it is what kept the group from forming.
    """
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(c.future.done() for c in calls):
        time.sleep(0.05)
    return sorted({c.engine.url for c in calls if not c.future.done() or no_answer(c.error)})


def not_joined(exc: WeightSyncError, stuck: list[str]) -> WeightSyncError:
    err = WeightSyncError(exc.step, f"{exc.detail}; never answered its join (its control loop "
                          f"is busy): {', '.join(stuck)}", stuck[0])
    err.unresponsive = stuck
    return err


def backend_hint(backend: str) -> str:
    hint = nccl_env_hint() if backend == "nccl" else ""
    return f" [{hint}]" if hint else ""


def close_group(held: list[dist.ProcessGroup]) -> None:
    """Destroy the one group in `held` and drop the last reference to it (`free_group`)."""
    destroy_process_group(held[0])
    free_group(held)
