"""One sglang parse per test session: test modules register argvs at import, the
`sglang_parsed` fixture (conftest.py) parses them all in a single child process."""

from __future__ import annotations

ARGVS: dict[str, list[str]] = {}


def register_argv(key: str, argv: list[str]) -> str:
    """Queue `argv` (without the `python -m module` head) for the session's sglang parse."""
    if key in ARGVS and ARGVS[key] != argv:
        raise KeyError(f"argv key {key!r} registered twice with different argvs")
    ARGVS[key] = list(argv)
    return key
