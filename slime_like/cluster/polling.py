"""How the framework waits for a change another process makes and only shows when asked
(a router listing a worker, or no longer listing it)."""

from __future__ import annotations

from collections.abc import Iterator

# Look again after 2 ms, then half as long again each time, up to this: most such changes
# show within milliseconds (smg takes a removed worker off its list 3-7 ms after the DELETE),
# and a fixed 0.2 s poll made each one (a hung engine taken out of the router mid-sync)
# cost 0.2 s; from 5 ms doubling, a removal that missed the first look waited for 15 ms.
MAX_POLL_S = 0.2
GROWTH = 1.5


def poll_intervals(first_s: float = 0.002, max_s: float = MAX_POLL_S) -> Iterator[float]:
    """The sleeps between looks: 2 ms, 3 ms, 4.5 ms ... then `max_s`, forever."""
    wait = first_s
    while True:
        yield wait
        wait = min(max_s, GROWTH * wait)
