"""EngineHandle: the one façade every layer uses to talk to one engine.

Lifecycle (the fleet), health probes and weight sync all hold the same handle, built once
per engine with the engine's keys, so no caller can reach an engine without them. It is a
plain picklable value (URL, TP size, keys, identity); its HTTP client is private, made
lazily in whatever process uses it (a trainer actor, the driver), one keep-alive session
per thread. Each verb is one SGLang call taking the request struct of `protocol/io_struct`
and a timeout; the handle adds only what a caller must not get wrong: the pause mode it is
in (a flush never aborts requests paused to be resumed), a bounded flush, and the
version-dependent features read once from `/server_info` (see `protocol/compat.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from slime_like.engine.client import EngineClient
from slime_like.errors import EngineError, WeightSyncError
from slime_like.protocol import io_struct as p
from slime_like.protocol.compat import (
    BEGIN_END_SINCE,
    FLATTENED_DISTRIBUTED_SINCE,
    FLUSH_AFTER_RETRACT_SINCE,
    try_parse_version,
)


@dataclass(eq=False)
class EngineHandle:
    """One engine as callers see it: where it listens, its TP size, its keys, its verbs."""

    url: str
    tp_size: int = 1
    api_key: str | None = None
    admin_api_key: str | None = None
    engine_id: str | None = None
    worker_type: str = "regular"
    bootstrap_port: int | None = None
    # Read from /server_info by `probe`; None until then.
    version: tuple[int, ...] | None = None
    server_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.tp_size < 1:
            raise ValueError(f"engine {self.url}: tp_size must be >= 1, got {self.tp_size}")
        self.engine_id = self.engine_id or self.url
        self._client: EngineClient | None = None
        self._timeout: float | None = None
        self._pause_mode: str | None = None

    # Handles cross process boundaries (driver -> trainer actor); clients do not.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __str__(self) -> str:
        return self.url

    @property
    def _http(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.url, api_key=self.api_key,
                                        admin_api_key=self.admin_api_key)
            if self._timeout is not None:
                self._client.timeout = self._timeout
        return self._client

    @property
    def timeout(self) -> float:
        """The default timeout (seconds) of a verb called without one."""
        return self._http.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        if self._client is not None:
            self._client.timeout = seconds

    # ---- what this engine supports -------------------------------------------------------

    def probe(self, timeout: float | None = None) -> None:
        """Read /server_info once: the sglang version and the TP size the engine really runs."""
        self.server_info = self._http.server_info(timeout) or {}
        info = p.ServerInfo.model_validate(self.server_info)
        self.version = try_parse_version(info.version)
        if info.tp_size is not None and info.tp_size != self.tp_size:
            raise WeightSyncError("attach", f"the engine runs tp_size={info.tp_size} but the "
                                  f"sync was configured with tp_size={self.tp_size}", self.url)
        if (info.dp_size or 1) > 1:
            raise WeightSyncError("attach", "weight updates need dp_size == 1 per engine "
                                  "(sglang asserts it); run one server per DP replica", self.url)
        if (info.pp_size or 1) > 1:
            raise WeightSyncError("attach", "weight groups place ranks at rank_offset + "
                                  "tp_rank only, so pp_size must be 1", self.url)

    def _at_least(self, since: tuple[int, ...], unknown: bool) -> bool:
        return unknown if self.version is None else self.version >= since

    @property
    def has_begin_end(self) -> bool:
        return self._at_least(BEGIN_END_SINCE, unknown=True)

    @property
    def has_flattened_distributed(self) -> bool:
        return self._at_least(FLATTENED_DISTRIBUTED_SINCE, unknown=True)

    @property
    def flushes_after_retract(self) -> bool:
        return self._at_least(FLUSH_AFTER_RETRACT_SINCE, unknown=False)

    # ---- health and info -----------------------------------------------------------------

    def ping(self, timeout: float = 5.0) -> bool:
        """GET /ping: True while the server answers, even paused (unlike /health)."""
        return self._http.ping(timeout)

    def health_generate(self, timeout: float = 30.0) -> bool:
        """One real generation step; raises EngineError on failure."""
        self._http.health_generate(timeout)
        return True

    def model_info(self, timeout: float | None = None) -> dict:
        return self._http.model_info(timeout)

    def weight_version(self, timeout: float | None = None) -> str:
        """The live weight version, from `/model_info` (`/get_weight_version` is gone)."""
        return self._http.weight_version(timeout)

    def loads(self, timeout: float | None = None) -> dict:
        return self._http.loads(timeout)

    def weights_checker(self, req: p.WeightsCheckerRequest | None = None,
                        timeout: float | None = None) -> dict:
        """Per-rank checksums (`action="checksum"` by default), snapshot or compare."""
        return self._http.weights_checker(req or p.WeightsCheckerRequest(), timeout)

    def get_weights_by_name(self, req: p.GetWeightsByNameRequest,
                            timeout: float | None = None) -> Any:
        return self._http.get_weights_by_name(req, timeout)

    # ---- control -------------------------------------------------------------------------

    def pause_generation(self, mode: p.PauseMode = "retract", timeout: float | None = None) -> dict:
        out = self._http.pause_generation(mode, timeout)
        self._pause_mode = mode
        return out

    def continue_generation(self, timeout: float | None = None) -> dict:
        out = self._http.continue_generation(timeout=timeout)
        self._pause_mode = None
        return out

    def abort_request(self, rid: str = "", abort_all: bool = False,
                      timeout: float | None = None) -> None:
        self._http.abort_request(rid, abort_all, timeout)

    def try_flush_cache(self) -> bool:
        """One /flush_cache: True when flushed, False when the engine was not idle."""
        return self._http.flush_cache()

    def flush_cache(self, attempts: int = 20, interval: float = 0.5, abort_first: bool = True) -> bool:
        """Flush the prefix cache, retrying while the engine is busy (bounded).

        Stuck requests are aborted first when that loses nothing the caller wants to resume:
        not while paused in `retract` or `in_place` mode, whose requests continue afterwards.
        """
        may_abort = abort_first and self._pause_mode not in ("retract", "in_place")
        for attempt in range(attempts):
            if self._http.flush_cache():
                return True
            if may_abort and attempt == 0:
                self._http.abort_request(abort_all=True)
            time.sleep(interval)
        raise EngineError(self.url, "/flush_cache", 400,
                          f"engine still busy after {attempts} attempts over "
                          f"{attempts * interval:.1f}s", reason="busy")

    def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout: float | None = None) -> None:
        self._http.release_memory_occupation(tags, timeout)

    def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout: float | None = None) -> None:
        self._http.resume_memory_occupation(tags, timeout)

    def start_profile(self, req: p.ProfileRequest, timeout: float | None = None) -> str:
        return self._http.start_profile(req, timeout)

    def stop_profile(self, timeout: float | None = None) -> str:
        return self._http.stop_profile(timeout)

    # ---- weights -------------------------------------------------------------------------

    def init_weights_update_group(self, req: p.InitWeightsUpdateGroupRequest,
                                  timeout: float | None = None) -> dict:
        return self._http.init_weights_update_group(req, timeout)

    def destroy_weights_update_group(self, group_name: str = p.DEFAULT_GROUP_NAME,
                                     timeout: float | None = None) -> dict:
        return self._http.destroy_weights_update_group(group_name, timeout)

    def begin_weight_update(self, timeout: float | None = None) -> dict:
        return self._http.begin_weight_update(timeout)

    def end_weight_update(self, timeout: float | None = None) -> dict:
        return self._http.end_weight_update(timeout)

    def update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest,
                                        timeout: float | None = None) -> dict:
        return self._http.update_weights_from_distributed(req, timeout)

    def update_weights_from_tensor(self, req: p.UpdateWeightsFromTensorRequest,
                                   timeout: float | None = None) -> dict:
        return self._http.update_weights_from_tensor(req, timeout)

    def update_weights_from_disk(self, req: p.UpdateWeightsFromDiskRequest,
                                 timeout: float | None = None) -> dict:
        return self._http.update_weights_from_disk(req, timeout)

    def update_weight_version(self, req: p.UpdateWeightVersionRequest,
                              timeout: float | None = None) -> dict:
        return self._http.update_weight_version(req, timeout)
