"""How the framework waits for a change another process makes and only shows when asked
(a router listing a worker, or no longer listing it)."""

from __future__ import annotations

from collections.abc import Iterator

# Look again after 5 ms, then twice as long each time, up to this: most such changes show
# within milliseconds, and a fixed 0.2 s poll made each one (a hung engine taken out of
# the router mid-sync) cost 0.2 s.
MAX_POLL_S = 0.2


def poll_intervals(first_s: float = 0.005, max_s: float = MAX_POLL_S) -> Iterator[float]:
    """The sleeps between looks: 5 ms, 10 ms, 20 ms ... then `max_s`, forever."""
    wait = first_s
    while True:
        yield wait
        wait = min(max_s, 2 * wait)
