"""What a weight sync is asked to do (`WeightSyncConfig`) and what it reports (`SyncReport`).

`WeightSyncConfig` is the one sync config: frozen, typed (`PauseMode`, `Transport`), checked
once when it is made, and handed as itself to whoever syncs (the trainer gets it over Ray,
pickled). Field names double as the flag and YAML names in errors. `StepClock` times each
named step of the transaction and remembers which one runs, so a failure names its step.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from slime_like.config.deadlines import SYNC_CALLS, DeadlinePolicy
from slime_like.config.flags import DEFAULT_DELTA_FULL_EVERY, UPDATE_WEIGHT_MODES
from slime_like.errors import ConfigError
from slime_like.protocol import io_struct as p
from slime_like.protocol.modes import DEFAULT_PAUSE_MODE, DEFAULT_TRANSPORT, PauseMode, Transport

# The words, for messages and `x in PAUSE_MODES` checks (a member is its word).
PAUSE_MODES: tuple[str, ...] = tuple(m.value for m in PauseMode)
TRANSPORTS: tuple[str, ...] = tuple(m.value for m in Transport)
LOAD_FORMATS = (p.FLATTENED_BUCKET, "per_tensor")
DEFAULT_BUFFER_BYTES = 512 << 20  # slime's --update-weight-buffer-size default

JOB_SYNC_TIMEOUT_S = 120.0  # the job's cap on a sync's HTTP and group waits (below)


@dataclass(frozen=True)
class WeightSyncConfig:
    """Settings of a WeightSync; field names double as the flag/YAML names in errors.

    `transport` and `pause_mode` take their members or their words ("retract"); either way
    the field holds the member once the config exists.
    """

    transport: Transport = DEFAULT_TRANSPORT
    pause_mode: PauseMode = DEFAULT_PAUSE_MODE
    update_weight_buffer_size: int = DEFAULT_BUFFER_BYTES
    load_format: str = p.FLATTENED_BUCKET
    device: str | None = None          # where buckets are packed; default: cuda if available
    backend: str | None = None         # weight-group backend; default nccl on cuda, else gloo
    master_address: str | None = None  # this host as the engines reach it; default: probed
    master_port: int | None = None     # the weight group's store port; default: a free one
    http_timeout_s: float = 300.0
    group_timeout_s: float = 300.0
    flush_cache: bool = True           # flush where the pause mode allows it
    check_engine_metadata: bool = True
    disk_dir: str | None = None        # disk transport: where checkpoints are written
    model_dir: str | None = None       # disk transport: config/tokenizer files to copy along
    liveness_timeout_s: float = 3.0
    # Each call's deadline (pause, begin, a bucket update, end, continue, a group join):
    # derived from what that call took on the engines lately, at most http_timeout_s. A
    # call past it while other engines answered (a join: unanswered, and no /ping either)
    # fails the sync naming that engine as hung (`WeightSyncError.hung`); a retry goes on
    # without it. By default (None) a sync the fleet settles (`resume_on_failure=False`)
    # has a 0.1 s floor (`SYNC_CALLS`): the fleet holds a hung engine SUSPECT until it
    # answers again, then resyncs it, so a wrong verdict costs a resync; a standalone sync
    # keeps 1 s (`DeadlinePolicy()`): there a wrong verdict fails the sync
    # (config/deadlines.py says why).
    deadlines: DeadlinePolicy | None = None
    # "delta": send only what changed since the base every engine holds (weights/delta.py);
    # every `update_weight_delta_full_every`-th sync is full
    update_weight_mode: str = "full"
    update_weight_delta_full_every: int = DEFAULT_DELTA_FULL_EVERY
    # After a failed sync: resume every paused engine (standalone use), or leave them paused
    # for the caller (the fleet), which first takes unverified engines out of the router.
    resume_on_failure: bool = True

    def __post_init__(self) -> None:
        """The one check of a sync's settings (flags, the API and the trainer all get here)."""
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(name, f"expected {expected}, got {getattr(self, name)!r}")

        object.__setattr__(self, "deadlines", DeadlinePolicy.of(self.deadlines) if
                           self.deadlines is not None else
                           DeadlinePolicy() if self.resume_on_failure else SYNC_CALLS)
        for name, kind in (("transport", Transport), ("pause_mode", PauseMode)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise bad(name, f"one of {[m.value for m in kind]}") from None
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"one of {list(LOAD_FORMATS)}")
        if int(self.update_weight_buffer_size) <= 0:
            raise bad("update_weight_buffer_size", "a positive number of bytes")
        for name in ("http_timeout_s", "group_timeout_s", "liveness_timeout_s"):
            if float(getattr(self, name)) <= 0:
                raise bad(name, "a positive number of seconds")
        if self.update_weight_mode not in UPDATE_WEIGHT_MODES:
            raise bad("update_weight_mode", f"one of {list(UPDATE_WEIGHT_MODES)}")
        if int(self.update_weight_delta_full_every) < 1:
            raise bad("update_weight_delta_full_every", "a number of syncs >= 1")
        if self.update_weight_mode == "delta" and self.transport == Transport.TENSOR:
            raise ConfigError("update_weight_mode", "delta updates run over the disk and "
                              "distributed transports; the tensor transport shares the "
                              "trainer's memory, so there are no bytes to save")
        if self.transport == Transport.DISK and not self.disk_dir:
            raise ConfigError("disk_dir", "the disk transport needs a directory the engines can read")

    @classmethod
    def from_flags(cls, args: argparse.Namespace, model_dir: str | None = None) -> WeightSyncConfig:
        """The job's sync from its validated flags (`--update-weight-*`, the pause mode).

        The fleet settles a failed sync itself (unroute, then resume), and a hung engine holds
        a sync no longer than a hung request holds a rollout.
        """
        timeout = min(JOB_SYNC_TIMEOUT_S, float(args.rollout_request_timeout))
        return cls(transport=args.update_weight_transport, pause_mode=args.pause_mode,
                   update_weight_buffer_size=args.update_weight_buffer_size,
                   update_weight_mode=args.update_weight_mode,
                   update_weight_delta_full_every=args.update_weight_delta_full_every,
                   disk_dir=args.update_weight_disk_dir, model_dir=model_dir,
                   http_timeout_s=timeout, group_timeout_s=timeout, resume_on_failure=False)


@dataclass
class SyncReport:
    """What one update did and where its time went."""

    weight_version: str
    transport: Transport
    pause_mode: PauseMode
    engines: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    transfer: dict = field(default_factory=dict)
    flush: dict[str, str] = field(default_factory=dict)
    in_flight_at_pause: dict[str, int] = field(default_factory=dict)
    #: engines updated without a pause: the caller held them out of the router, idle
    not_paused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: seconds of each control round trip (slowest engine) and of an average bucket update
    round_trips: dict[str, float] = field(default_factory=dict)
    #: per step, the engines smg's RL control plane reached (`--router-enable-rl`); the
    #: others were called directly
    via_rl_plane: dict[str, list[str]] = field(default_factory=dict)
    #: engines found hung before any update went out, left behind by this sync (URL: why;
    #: `left_behind.py`); the fleet holds them out as SUSPECT
    hung: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"weight_version": self.weight_version, "transport": self.transport,
                "pause_mode": self.pause_mode, "engines": self.engines,
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
                "total_s": round(self.total_s, 6), "transfer": self.transfer,
                "flush": self.flush, "in_flight_at_pause": self.in_flight_at_pause,
                "not_paused": self.not_paused,
                "warnings": self.warnings, "round_trips": self.round_trips,
                "via_rl_plane": self.via_rl_plane, "hung": self.hung}


class StepClock:
    """Times each named step and remembers which one is running (for error messages)."""

    def __init__(self, report: SyncReport, on_step: Callable[[str], None] | None = None):
        self.report = report
        self.current = "check_metadata"
        self.on_step = on_step

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        if self.on_step is not None:
            self.on_step(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.report.seconds[name] = self.report.seconds.get(name, 0.0) + (
                time.perf_counter() - start)
