"""Shared fixtures: the repo on every subprocess's path, a tiny model, free ports."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Engine processes, Ray workers and routers started by tests import the package from here.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p
)
os.environ.setdefault("RAY_AUTH_MODE", "token")
# One token for every Ray cluster this test session starts: Ray caches the token it first
# loads for the life of the process, so clusters with different tokens cannot follow one
# another in one pytest run, and ~/.ray/auth_token (shared with anything else on the
# machine) is never read or written.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer byte-level Llama checkpoint in HF layout, made once per session."""
    from slime_like.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """A real sglang-router (round robin) on loopback, one per test module."""
    from slime_like.router.router import Router

    r = Router(host="127.0.0.1", router_flags={"policy": "round_robin"},
               log_dir=tmp_path_factory.mktemp("router"))
    r.start()
    yield r
    r.stop()


# The modules that take longest (seconds of one worker, measured on a 2-core machine),
# heaviest first. scripts/test.sh hands whole modules to pytest-xdist workers in collection
# order (--dist loadscope --no-loadscope-reorder): starting the long ones first keeps one
# long module from starting last and running alone, and a module's fixtures start once.
HEAVY_MODULES = (
    "tests/hosts/test_hosts_cluster.py",
    "tests/job/test_train_job.py",
    "tests/job/test_async_job.py",
    "tests/job/test_rl_job.py",
    "tests/chaos/test_chaos.py",
    "tests/fleet/test_fleet_sync_failure.py",
    "tests/weights/test_session_undo.py",
    "tests/engine/test_engine_launch.py",
    "tests/topologies/test_external.py",
    "tests/job/test_fsdp_job.py",
    "tests/fleet/test_public_api.py",
    "tests/fleet/test_elastic.py",
    "tests/fleet/test_hung_engine.py",
    "tests/weights/test_sharded_sync.py",
    "tests/scripts/test_run_job.py",
    "tests/weights/test_benchmark_tiny.py",
    "tests/topologies/test_multi_model.py",
    "tests/job/test_agentic_job.py",
    "tests/engine/test_engine_actors.py",
    "tests/topologies/test_colocate.py",
    "tests/topologies/test_smg.py",
    "tests/job/test_logprob_rule_job.py",
    "tests/topologies/test_multinode.py",
    "tests/topologies/test_pd.py",
    "tests/weights/test_failed_group.py",
    "tests/reference_engine/test_multinode.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Heaviest modules first; every other module after them, in collection order."""
    rank = {path: i for i, path in enumerate(HEAVY_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
