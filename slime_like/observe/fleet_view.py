"""How a fleet of any size reads in a log line or a report: one entry per engine up to a
size a person can scan, grouped by state or host beyond it (64 entries are unreadable)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

# Up to this many engines each is listed (and has its own timeline row); beyond, groups.
LIST_ENGINES_UP_TO = 16
# A group this small names its members (an engine that is not serving is worth its name).
NAME_UP_TO = 4


def states_summary(states: Mapping[str, str]) -> str:
    """Each engine's state, or for a large fleet the count per state, naming the engines
    of the small groups (`64 engines: 63 REGISTERED, 1 RELAUNCHING (default/g0/e0)`)."""
    if len(states) <= LIST_ENGINES_UP_TO:
        return str(dict(states))
    by_state: dict[str, list[str]] = defaultdict(list)
    for engine, state in states.items():
        by_state[state].append(engine)
    parts = []
    for state, engines in sorted(by_state.items(), key=lambda kv: -len(kv[1])):
        names = f" ({', '.join(sorted(engines))})" if len(engines) <= NAME_UP_TO else ""
        parts.append(f"{len(engines)} {state}{names}")
    return f"{len(states)} engines: " + ", ".join(parts)


def endpoint_lines(named_urls: Sequence[tuple[str, str]]) -> list[str]:
    """`name: url` per endpoint, or for a large fleet one line per host of its engines
    (routers stay listed): the addresses are all in endpoints.json."""
    engines = [(n, u) for n, u in named_urls if n.startswith("engine ")]
    if len(engines) <= LIST_ENGINES_UP_TO:
        return [f"{n}: {u}" for n, u in named_urls]
    lines = [f"{n}: {u}" for n, u in named_urls if not n.startswith("engine ")]
    by_host: dict[str, list[str]] = defaultdict(list)
    for name, url in engines:
        by_host[urlsplit(url).hostname or url].append(name.removeprefix("engine "))
    for host, names in sorted(by_host.items()):
        lines.append(f"engines on {host}: {len(names)} (each address in endpoints.json)")
    return lines
