"""What an engine of a given sglang version can do, from the `version` of its /server_info.

The orchestrator never guesses from the program it launched: it asks the server. The
reference engine reports the sglang version whose contract it follows. See
docs/COMPATIBILITY.md for the table this encodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slime_like.errors import ConfigError

SUPPORTED_SGLANG = "0.5.23"
# The routers' versions: slime_like/router/kinds.py.

# Weight-sync gates (the sender reads them from each engine's /server_info version).
BEGIN_END_SINCE = (0, 5, 21)  # begin/end_weight_update exist, and are required around updates
FLATTENED_DISTRIBUTED_SINCE = (0, 5, 9)  # flattened_bucket over update_weights_from_distributed
FLUSH_AFTER_RETRACT_SINCE = (0, 5, 23)  # retracted requests give their KV back, so a flush works


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.5.23', '0.5.23.post1', 'v0.5.9rc0' -> (0, 5, 23)."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    if not m:
        raise ConfigError("version", f"cannot read a version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def try_parse_version(text: object) -> tuple[int, int, int] | None:
    """Like parse_version, but None for a missing or unreadable version."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


@dataclass(frozen=True)
class EngineFeatures:
    """The version-dependent parts of sglang's HTTP contract that the orchestrator uses."""

    version: tuple[int, int, int]

    @classmethod
    def from_server_info(cls, info: dict) -> EngineFeatures:
        """From `/server_info`; an answer without `version` is sglang older than 0.5.9."""
        return cls(parse_version(info.get("version", "0.5.2")))

    @property
    def weight_update_session(self) -> bool:
        """`/begin_weight_update` + `/end_weight_update` must bracket distributed/tensor updates."""
        return self.version >= (0, 5, 21)

    @property
    def model_info(self) -> bool:
        """`/model_info` (with the live `weight_version`); older servers only have `/get_model_info`."""
        return self.version >= (0, 5, 9)

    @property
    def get_load(self) -> bool:
        """`/get_load` exists (removed in 0.5.21); sglang-router <= 0.3.2 reads it for power_of_two."""
        return self.version < (0, 5, 21)

    @property
    def ready_endpoint(self) -> bool:
        """`/ready` (200 only when serving and not paused), since 0.5.20."""
        return self.version >= (0, 5, 20)

    @property
    def pause_modes(self) -> bool:
        """`/pause_generation` takes `mode` (abort|retract|in_place); 0.5.2 only aborts."""
        return self.version >= (0, 5, 9)

    @property
    def failed_flush_after_update_is_400(self) -> bool:
        """A flush refused after a weight update answers 400; before 0.5.23 it kills the server."""
        return self.version >= (0, 5, 23)
