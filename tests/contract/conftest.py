"""Contract fixtures: every registered argv parsed once by the real sglang."""

from __future__ import annotations

import importlib.util

import pytest

from tests.contract.sglang_args_check import check_argvs
from tests.contract.sglang_parse import ARGVS


@pytest.fixture(scope="session")
def sglang_parsed() -> dict:
    """{"sglang_version", "fields", "results": {key: {"ok", "args"|"error"}}}."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23; "
                    "scripts/env.sh does it with SLIME_LIKE_SGLANG=1)")
    keys = list(ARGVS)
    answer = check_argvs([ARGVS[k] for k in keys])
    answer["results"] = dict(zip(keys, answer["results"], strict=True))
    return answer
