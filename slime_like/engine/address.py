"""EngineAddress: where one engine listens and what it takes to be let in.

An immutable value (URL, TP size, keys, identity, worker type, PD bootstrap port) that
crosses process boundaries freely: the fleet, the trainer's rank 0 and the health probes
each build their own `EngineSession` from it, so no caller can reach an engine without its
keys, and nothing one process did (a pause, a joined group) is copied into another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slime_like.protocol.modes import WorkerType


@dataclass(frozen=True)
class EngineAddress:
    """One engine as every process names it; `engine_id` defaults to the URL."""

    url: str
    tp_size: int = 1
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    engine_id: str = ""
    worker_type: WorkerType = WorkerType.REGULAR
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        url = self.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine address {self.url!r}: the URL must start with http:// "
                             "or https://")
        if self.tp_size < 1:
            raise ValueError(f"engine {url}: tp_size must be >= 1, got {self.tp_size}")
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "engine_id", self.engine_id or url)
        object.__setattr__(self, "worker_type", WorkerType(self.worker_type))

    def __str__(self) -> str:
        return self.url
