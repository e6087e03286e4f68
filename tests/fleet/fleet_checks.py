"""What the fleet tests check after a fault: who is routed, and everyone back in service."""

from __future__ import annotations

import time


def routed_urls(fleet, model: str = "policy") -> set[str]:
    """The engines the real router lists now."""
    return {w.url for w in fleet.routers[model].client.list_workers()}


def wait_all_registered(fleet, timeout: float = 60) -> None:
    """Recoveries and resyncs finished, and every engine REGISTERED (asserted)."""
    assert fleet.wait_recovered(timeout=120)
    deadline = time.monotonic() + timeout
    while set(fleet.states().values()) != {"REGISTERED"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(fleet.states().values()) == {"REGISTERED"}
