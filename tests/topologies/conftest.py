"""Shared by the topology tests: a fresh Ray per test, loopback without proxies."""

from __future__ import annotations

import os

import pytest
import ray

for _var in ("no_proxy", "NO_PROXY"):
    os.environ[_var] = ",".join(x for x in ("127.0.0.1", "localhost", os.environ.get(_var, ""))
                                if x)


@pytest.fixture
def fresh_ray():
    yield
    if ray.is_initialized():
        ray.shutdown()
