"""EngineHandle: the one object every layer uses to talk to one engine.

Lifecycle (the fleet), health probes and weight sync all hold the same handle, built once
per engine with the engine's keys, so no caller can reach an engine without them. It is a
plain picklable value (URL, TP size, keys, identity); its HTTP client is made lazily in
whatever process uses it (a trainer actor, the driver), one keep-alive session per thread.
Each method is one thin SGLang verb (slime's `SGLangEngine` style); version-dependent
behaviour is read once from `/server_info` (see `protocol/compat.py`).
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
        self._pause_mode: str | None = None
        self._weight_groups: list[str] = []

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
    def client(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.url, api_key=self.api_key,
                                        admin_api_key=self.admin_api_key)
        return self._client

    # ---- what this engine supports -------------------------------------------------------

    def probe(self) -> None:
        """Read /server_info once: the sglang version and the TP size the engine really runs."""
        self.server_info = self.client.server_info() or {}
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

    def health_generate(self, timeout: float = 30.0) -> bool:
        """One real generation step; raises EngineError on failure."""
        self.client.health_generate(timeout=timeout)
        return True

    def weight_version(self) -> str:
        """The live weight version, from `/model_info` (`/get_weight_version` is gone)."""
        return self.client.weight_version()

    def metrics_url(self) -> str:
        return self.url + "/metrics"

    # ---- control -------------------------------------------------------------------------

    def pause_generation(self, mode: p.PauseMode = "retract") -> dict:
        out = self.client.pause_generation(mode)
        self._pause_mode = mode
        return out

    def continue_generation(self) -> dict:
        out = self.client.continue_generation()
        self._pause_mode = None
        return out

    def flush_cache(self, attempts: int = 20, interval: float = 0.5, abort_first: bool = True) -> bool:
        """Flush the prefix cache, retrying while the engine is busy (bounded).

        Stuck requests are aborted first when that loses nothing the caller wants to resume:
        not while paused in `retract` or `in_place` mode, whose requests continue afterwards.
        """
        may_abort = abort_first and self._pause_mode not in ("retract", "in_place")
        for attempt in range(attempts):
            if self.client.flush_cache():
                return True
            if may_abort and attempt == 0:
                self.client.abort_request(abort_all=True)
            time.sleep(interval)
        raise EngineError(self.url, "/flush_cache", 400,
                          f"engine still busy after {attempts} attempts over "
                          f"{attempts * interval:.1f}s", reason="busy")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.client.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.client.resume_memory_occupation(tags)

    # ---- weights -------------------------------------------------------------------------

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = p.DEFAULT_GROUP_NAME,
                                  backend: str = "nccl", timeout: float | None = None) -> dict:
        out = self.client.init_weights_update_group(p.InitWeightsUpdateGroupRequest(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend), timeout=timeout)
        if group_name not in self._weight_groups:
            self._weight_groups.append(group_name)
        return out

    def destroy_weights_update_group(self, group_name: str = p.DEFAULT_GROUP_NAME) -> dict:
        out = self.client.destroy_weights_update_group(group_name)
        if group_name in self._weight_groups:
            self._weight_groups.remove(group_name)
        return out

    def reset_weights_update_groups(self) -> list[str]:
        """Destroy every weight group this handle asked the engine to join; the names destroyed.

        A group the engine no longer knows (it restarted, or was destroyed already) is
        skipped, not an error.
        """
        destroyed = []
        for name in list(self._weight_groups):
            try:
                self.client.destroy_weights_update_group(name)
                destroyed.append(name)
            except EngineError as e:
                if e.status not in (200, 400, 404):
                    raise
            self._weight_groups.remove(name)
        return destroyed

    def begin_weight_update(self) -> dict:
        return self.client.begin_weight_update()

    def end_weight_update(self) -> dict:
        return self.client.end_weight_update()

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str = p.DEFAULT_GROUP_NAME,
                                        flush_cache: bool = False, weight_version: str | None = None,
                                        load_format: str | None = None,
                                        timeout: float | None = None) -> dict:
        return self.client.update_weights_from_distributed(p.UpdateWeightsFromDistributedRequest(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
            flush_cache=flush_cache, weight_version=weight_version, load_format=load_format),
            timeout=timeout)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                   load_format: str | None = None, flush_cache: bool = False,
                                   weight_version: str | None = None,
                                   timeout: float | None = None) -> dict:
        return self.client.update_weights_from_tensor(p.UpdateWeightsFromTensorRequest(
            serialized_named_tensors=serialized_named_tensors, load_format=load_format,
            flush_cache=flush_cache, weight_version=weight_version), timeout=timeout)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 timeout: float | None = None) -> dict:
        return self.client.update_weights_from_disk(p.UpdateWeightsFromDiskRequest(
            model_path=model_path, load_format=load_format, weight_version=weight_version,
            flush_cache=flush_cache), timeout=timeout)

    def check_weights(self, action: str = "checksum") -> dict:
        return self.client.weights_checker(action)

    # ---- profiling -----------------------------------------------------------------------

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return self.client.start_profile(output_dir=output_dir, num_steps=num_steps)

    def stop_profile(self) -> str:
        return self.client.stop_profile()

    def describe(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "url": self.url, "tp_size": self.tp_size,
                "worker_type": self.worker_type, "bootstrap_port": self.bootstrap_port}
