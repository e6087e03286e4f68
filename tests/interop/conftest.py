"""Interop tests run sglang's own code as the other side; skip only where it cannot import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import pytest


def _import_sglang(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable sglang here"
        pytest.skip(f"sglang cannot be imported here ({name}: {type(e).__name__}: {e}); "
                    "install it with `pip install --no-deps sglang==0.5.23`")


@pytest.fixture
def import_sglang() -> Callable[[str], ModuleType]:
    """Import a module of the installed sglang (0.5.23, --no-deps) or skip saying why."""
    return _import_sglang
