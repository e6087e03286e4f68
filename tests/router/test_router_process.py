"""The real router processes (sglang-router and smg, each from its own package): readiness
without sleeps, metrics, failures, clean stop."""

from __future__ import annotations

import socket
import sys
import time

import psutil
import pytest
import requests

from slime_like.errors import LaunchError, RouterError
from slime_like.router.kinds import ROUTER_KINDS
from slime_like.router.router import Router

KINDS = list(ROUTER_KINDS)


@pytest.fixture(scope="module", params=KINDS)
def router(request, tmp_path_factory):
    """A real router of each kind (round robin) on loopback, one per kind for the module."""
    r = Router(host="127.0.0.1", router_flags={"policy": "round_robin"}, kind=request.param,
               log_dir=tmp_path_factory.mktemp(f"router-{request.param}"))
    r.start()
    yield r
    r.stop()


def test_each_router_runs_from_its_own_package_at_its_version(router):
    # (the routers retitle their process, so its argv is read from what we launched)
    argv = router.process.argv
    assert argv[:3] == [sys.executable, "-m", router.kind.module], argv
    assert router.kind.module.split(".")[0] in ("slime_like", router.kind.import_name)
    assert router.version == router.kind.installed_version()
    assert router.version == router.kind.tested


def test_started_router_is_live_but_not_ready_without_workers(router):
    assert router.client.is_live()
    ready = router.client.readiness()
    assert ready["status"] == "not ready"
    assert router.client.list_workers() == []


def test_prometheus_metrics_are_served_on_their_own_port(router):
    router.client.readiness()  # something to count
    text = requests.get(router.prometheus_url, timeout=5).text
    assert "smg_" in text and router.prometheus_port != router.port


def test_wait_ready_without_workers_gives_up_saying_what_it_waited_for(router):
    with pytest.raises(RouterError, match=r"not ready after 1s; last /readiness: .*insufficient"):
        router.client.wait_ready(timeout=1)


def test_registering_an_unreachable_worker_fails_in_time(router):
    with socket.socket() as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(RouterError, match=rf"worker {dead} \(regular\) not listed healthy after 3s"):
        router.client.add_worker(dead, timeout=3)
    assert time.monotonic() - t0 < 15
    assert router.client.find_worker(dead) is None


def test_prefill_registration_needs_a_bootstrap_port(router):
    with pytest.raises(RouterError, match="bootstrap_port"):
        router.client.add_worker("http://127.0.0.1:1", worker_type="prefill")


@pytest.mark.parametrize("kind", KINDS)
def test_router_that_exits_during_start_up_fails_at_once_with_its_log(tmp_path, kind):
    r = Router(host="127.0.0.1", router_flags={"max_payload_size": "lots"}, log_dir=tmp_path,
               kind=kind)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="exited with code") as e:
        r.start()
    assert time.monotonic() - t0 < 30
    assert "max-payload-size" in e.value.log_tail


@pytest.mark.parametrize("kind", KINDS)
def test_stop_leaves_no_router_process_and_frees_its_ports(tmp_path, kind):
    r = Router(host="127.0.0.1", log_dir=tmp_path, kind=kind).start()
    pid, port = r.process.pid, r.port
    r.stop()
    assert not psutil.pid_exists(pid)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
