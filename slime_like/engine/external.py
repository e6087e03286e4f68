"""External engines: servers someone else started, attached by address and never killed.

`attach` reads `/server_info`, checks the fields that must match what the job expects
(naming every one that does not), learns the worker type and bootstrap port from the
server itself. The fleet routes it like its own engines; `shutdown` leaves it running.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from slime_like.engine.launch import worker_type_of
from slime_like.engine.server import EngineConfig, EngineServer
from slime_like.errors import ConfigError, LaunchError
from slime_like.protocol.compat import EngineFeatures
from slime_like.protocol.flag_tables import server_arg_table
from slime_like.protocol.modes import WorkerType

logger = logging.getLogger(__name__)

# Fields that change what the engine computes or how weights reach it; the rest (ports,
# seeds, log levels, warm-up, ...) may differ freely between what we would launch and
# what someone else launched.
CHECKED_FIELDS: tuple[str, ...] = (
    "model_path", "tp_size", "pp_size", "dp_size", "ep_size", "attn_dp_size",
    "disaggregation_mode", "encoder_only", "dtype", "quantization", "kv_cache_dtype",
    "enable_memory_saver", "load_format", "context_length",
)


def expected_fields(server_args: Mapping[str, Any], fields: Iterable[str] = CHECKED_FIELDS) -> dict[str, Any]:
    """The part of composed server args an external engine must agree with."""
    return {k: server_args[k] for k in fields if k in server_args}


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, bool) or isinstance(actual, bool):
        return bool(expected) == bool(actual)
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        return float(expected) == float(actual)
    return str(expected) == str(actual)


def mismatches(expected: Mapping[str, Any], info: Mapping[str, Any]) -> list[str]:
    """One line per field whose value the server reports differently (or not at all)."""
    defaults = server_arg_table().specs
    out = []
    for name, want in expected.items():
        have = info.get(name, defaults[name].default if name in defaults else None)
        if not _same(want, have):
            out.append(f"{name}: expected {want!r}, the engine has {have!r}")
    return out


class ExternalEngine(EngineServer):
    """An engine at a known address; the same verbs as `EngineServer`, but no process of ours."""

    def __init__(self, address: str, *, expected: Mapping[str, Any] | None = None,
                 api_key: str | None = None, admin_api_key: str | None = None,
                 worker_type: str | None = None):
        url = address if "://" in address else f"http://{address}"
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise ConfigError("rollout_external_engine_addrs", f"{address!r} is not host:port")
        super().__init__(EngineConfig(model_path="", name=f"external {parts.hostname}:{parts.port}",
                                      api_key=api_key, admin_api_key=admin_api_key,
                                      worker_type=worker_type or WorkerType.REGULAR))
        self.host, self.port = parts.hostname, parts.port
        self.expected = dict(expected or {})
        self._declared_type = worker_type
        self.info: dict[str, Any] = {}

    @property
    def sglang_version(self) -> str | None:
        """`version` from `/server_info`, how we tell which sglang we are talking to."""
        return self.info.get("version")

    def init(self, dist_init_addr: str | None = None) -> str | None:
        """Attach: read `/server_info` and check it. Raises ConfigError naming every
        mismatching field; the engine is left untouched either way."""
        url = self.get_url()
        try:
            self.info = self.client.server_info()
        except Exception as e:
            raise LaunchError(f"external engine {url}: cannot read /server_info: {e}") from e
        actual_type = worker_type_of(self.info)
        expected = dict(self.expected)
        problems = mismatches(expected, self.info)
        if self._declared_type is not None and self._declared_type != actual_type:
            problems.append(f"worker_type: expected {str(self._declared_type)!r}, the engine "
                            f"is {actual_type.value!r}")
        if problems:
            raise ConfigError(f"external engine {url}/server_info",
                              "does not match the configuration: " + "; ".join(problems))
        self.config.worker_type = actual_type
        self.features = EngineFeatures.from_server_info(self.info)
        self.bootstrap_port = self.info.get("disaggregation_bootstrap_port") if actual_type == WorkerType.PREFILL else None
        return url

    def is_alive(self) -> bool:
        return self.client.ping(timeout=5.0) or self.client.health(timeout=5.0)

    def wait_exit(self, timeout: float | None = None) -> int | None:
        return None

    def wait_down(self, timeout: float | None = None) -> str | None:
        return None

    def server_pid(self) -> int | None:
        return None

    def shutdown(self, grace: float = 10.0) -> None:
        """Nothing to stop: the server is someone else's and keeps running."""

    def simulate_crash(self) -> None:
        raise LaunchError(f"{self.config.label}: an external engine is never killed by us")
