"""The seed's settings as torchrl reads them: its two environment variables, the pause and
flush rule, devices given as CUDA ordinals, and the group's address and port defaults.

torchrl reads `TORCHRL_SGLANG_PAUSE_GENERATION_MODE` when no `pause_mode` is given and
`TORCHRL_SGLANG_WEIGHT_SYNC_FLUSH_CACHE` to override `flush_cache_on_update`, both at every
update; the façade resolves them the same way (`resolved_pause_mode`/`resolved_flush_cache`
of the transport), so a torchrl deployment configured through its environment keeps working.
"""

from __future__ import annotations

import os

import torch

from slime_like.engine.address import EngineAddress
from slime_like.errors import ConfigError
from slime_like.protocol.modes import PauseMode
from slime_like.weights.group_setup import master_address_for

PAUSE_MODE_ENV = "TORCHRL_SGLANG_PAUSE_GENERATION_MODE"
FLUSH_CACHE_ENV = "TORCHRL_SGLANG_WEIGHT_SYNC_FLUSH_CACHE"
# torchrl's default when neither the argument nor the environment names a mode.
SEED_PAUSE_MODE = PauseMode.RETRACT
STRATEGIES = ("tensordict", "state_dict")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def pause_mode_from(value: object, where: str) -> PauseMode:
    """A pause mode from its word (or member); `where` names the argument or variable."""
    try:
        return PauseMode(value)
    except ValueError:
        raise ConfigError(where, f"expected one of {[m.value for m in PauseMode]}, "
                          f"got {value!r}") from None


def resolve_pause_mode(explicit: PauseMode | None) -> PauseMode:
    """The argument, else `TORCHRL_SGLANG_PAUSE_GENERATION_MODE`, else retract (torchrl's)."""
    if explicit is not None:
        return explicit
    word = os.environ.get(PAUSE_MODE_ENV, "").strip()
    return pause_mode_from(word, PAUSE_MODE_ENV) if word else SEED_PAUSE_MODE


def resolve_flush_cache(flag: bool | None) -> bool:
    """Whether updates flush the prefix cache (where the pause mode allows it, see
    docs/WEIGHT_SYNC.md): `TORCHRL_SGLANG_WEIGHT_SYNC_FLUSH_CACHE` when set, else the flag
    (None: yes)."""
    word = os.environ.get(FLUSH_CACHE_ENV, "").strip().lower()
    if not word:
        return flag is not False
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(FLUSH_CACHE_ENV, f"expected one of {sorted(_TRUE | _FALSE)}, "
                      f"got {os.environ[FLUSH_CACHE_ENV]!r}")


def check_flush_needs_abort(flush_cache_on_update: bool | None, mode: PauseMode,
                            explained: str = "") -> None:
    """torchrl's rule: an explicit flush needs the abort pause mode, because sglang flushes
    only an idle scheduler and retract/in_place keep requests queued."""
    if flush_cache_on_update and mode is not PauseMode.ABORT:
        raise ConfigError("flush_cache_on_update", f"True needs pause_mode='abort' (got "
                          f"{mode.value!r}{explained}): sglang refuses to flush while paused "
                          "requests are kept; leave it None to flush wherever the pause mode "
                          "allows")


def device_index(device: torch.device | str | int | None) -> int:
    """The CUDA ordinal torchrl keeps as `transport.device` ("cuda:1" -> 1, None -> 0)."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return 0 if index is None else index


def pack_device(device: torch.device | str | int | None) -> torch.device:
    """Where buckets are packed: a device named as such, else the CUDA ordinal, or the CPU
    (gloo) on a machine without CUDA."""
    if isinstance(device, str | torch.device):
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", device_index(device))
    return torch.device("cpu")


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", f"expected one of {list(STRATEGIES)}, got {strategy!r}")
    return strategy


def local_address_for(server_url: str) -> str:
    """This host's address as the server reaches it: loopback for a local server, else the
    interface the route to it leaves from (nothing is sent to find it)."""
    return master_address_for([EngineAddress(server_url, 1)])  # only the URL is read
