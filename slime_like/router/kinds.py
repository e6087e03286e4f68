"""The routers slime_like can run: sglang-router 0.3.x and the Shepherd Model Gateway (smg).

Both speak the same worker API (`POST /workers` -> a worker id, `GET /workers`,
`DELETE /workers/{id}`, `/liveness`, `/readiness`, Prometheus on its own port), so one
`RouterClient` drives either. What differs is how each is launched and which flags it
takes: each has its own flag table (`slime_like/engine/data/`) and its own Python entry
point. Both wheels install an `smg` console script, so the name answers to whichever was
installed last: a router is always launched as `python -m <its own module>` and its
version read from its own distribution.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from slime_like.errors import ConfigError, LaunchError
from slime_like.protocol.compat import parse_version
from slime_like.protocol.flag_tables import DEFAULT_ROUTER, ROUTER_ARGS, ROUTER_TABLES, SMG_ARGS

SGLANG_ROUTER = "sglang-router"
SMG = "smg"
# DEFAULT_ROUTER (flag_tables): sglang-router, what slime users run (slime pins a fork of
# 0.3.2) and what the whole suite runs against; smg runs the quickstart, PD and
# router-fault jobs in CI (docs/COMPATIBILITY.md, "sglang-router and smg").
__all__ = ["DEFAULT_ROUTER", "ROUTER_KINDS", "SGLANG_ROUTER", "SMG", "RouterKind", "router_kind"]


@dataclass(frozen=True)
class RouterKind:
    """One router program: its distribution, launcher module and flag table."""

    name: str
    distribution: str      # the pip distribution (its version is the router's)
    module: str            # `python -m <module> FLAGS` starts it
    import_name: str       # the package that must be importable
    table: str             # flag table resource in slime_like/engine/data/
    min_version: tuple[int, int, int]
    tested: str            # the version CI runs
    why_min: str           # what an older version lacks
    # Extra fields of each `POST /workers` body.
    worker_fields: dict[str, Any] = field(default_factory=dict)

    def installed_version(self) -> str:
        """The installed version, read from the distribution (never from a console script)."""
        try:
            version = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError as e:
            raise LaunchError(f"{self.name} is not installed (pip install "
                              f"'{self.distribution}=={self.tested}')") from e
        if importlib.util.find_spec(self.import_name) is None:
            raise LaunchError(f"{self.name} {version} is listed as installed but its package "
                              f"`{self.import_name}` cannot be imported; reinstall it")
        return version

    def check_version(self) -> str:
        """The installed version; LaunchError for one whose worker API we do not speak."""
        version = self.installed_version()
        if parse_version(version) < self.min_version:
            raise LaunchError(f"{self.name} {version} is installed; slime_like needs >= "
                              f"{'.'.join(map(str, self.min_version))} (tested with "
                              f"{self.tested}): {self.why_min}")
        return version


ROUTER_KINDS: dict[str, RouterKind] = {
    SGLANG_ROUTER: RouterKind(
        name=SGLANG_ROUTER, distribution="sglang-router", module="slime_like.router.launch",
        import_name="sglang_router", table=ROUTER_ARGS, min_version=(0, 3, 0), tested="0.3.2",
        why_min="older routers add workers by URL, not by worker id"),
    SMG: RouterKind(
        name=SMG, distribution="smg", module="smg.launch_router", import_name="smg",
        table=SMG_ARGS, min_version=(1, 13, 0), tested="1.13.0",
        why_min="only 1.13 was run against slime_like (its flags are the shipped table)",
        # smg drains a removed worker for 5 s (out of selection, still listed) before it
        # drops it. The fleet removes an engine that is dead, hung or stale: nothing of it
        # is worth draining, and each removal would hold the fleet up 5 s.
        worker_fields={"health": {"drain_settle_secs": 0}}),
}


assert {k: v.table for k, v in ROUTER_KINDS.items()} == ROUTER_TABLES, "kinds and tables differ"


def router_kind(name: str | RouterKind | None) -> RouterKind:
    """The router called `name` (None: the default); ConfigError naming `--router` if unknown."""
    if isinstance(name, RouterKind):
        return name
    try:
        return ROUTER_KINDS[name or DEFAULT_ROUTER]
    except KeyError:
        raise ConfigError("--router", f"{name!r} is not one of {list(ROUTER_KINDS)}") from None
