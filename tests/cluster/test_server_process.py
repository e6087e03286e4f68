"""ServerProcess: start, wait healthy with a deadline, see exits at once, leave nothing behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import requests

from slime_like.cluster.ports import reserve_ports
from slime_like.cluster.process import ServerProcess, server_env
from slime_like.errors import LaunchError

TOY = str(Path(__file__).with_name("_toy_server.py"))


def _probe(port: int):
    def ok() -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False
    return ok


@pytest.fixture
def toy(tmp_path):
    """Start a toy server in a given mode; every one started is killed at the end."""
    started: list[ServerProcess] = []

    def start(mode: str, env: dict | None = None) -> tuple[ServerProcess, int]:
        with reserve_ports(1) as r:
            port = r.ports[0]
            r.release_for_server()
            sp = ServerProcess([sys.executable, TOY, str(port), mode],
                               log_path=tmp_path / f"{mode}.log", env=env, name=f"toy-{mode}")
            sp.start()
            started.append(sp)
        return sp, port

    yield start
    for sp in started:
        sp.terminate(grace=2)


def test_healthy_server_is_reported_and_terminate_frees_its_port(toy):
    sp, port = toy("serve")
    sp.wait_healthy(_probe(port), timeout=30)
    assert sp.is_alive()
    sp.terminate(grace=5)
    assert not sp.is_alive() and not psutil.pid_exists(sp.pid)
    # A server restarted on the port binds as uvicorn does (SO_REUSEADDR, past TIME_WAIT).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_server_exiting_during_start_up_fails_at_once_with_its_log_tail(toy):
    sp, port = toy("exit_early")
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        # A long probe interval: only the exit watcher can end this wait quickly.
        sp.wait_healthy(_probe(port), timeout=120, interval=60)
    assert time.monotonic() - t0 < 10
    assert "exited with code 3" in str(e.value)
    assert "weights file is corrupt" in e.value.log_tail


def test_server_never_healthy_fails_at_the_deadline_naming_it(toy):
    sp, port = toy("never_healthy")
    with pytest.raises(LaunchError, match=r"not healthy after 2s") as e:
        sp.wait_healthy(_probe(port), timeout=2)
    assert "mode=never_healthy" in e.value.log_tail
    assert sp.is_alive()


def test_exit_is_reported_to_callbacks_without_polling(toy):
    sp, port = toy("serve")
    sp.wait_healthy(_probe(port), timeout=30)
    seen: list[tuple[int, float]] = []
    sp.on_exit(lambda code: seen.append((code, time.monotonic())))
    t_kill = time.monotonic()
    os.kill(sp.pid, signal.SIGKILL)
    assert sp.wait_exit(10) == -signal.SIGKILL
    assert seen and seen[0][0] == -signal.SIGKILL and seen[0][1] - t_kill < 5


def test_terminate_kills_the_whole_process_tree(toy):
    sp, port = toy("grandchild")
    sp.wait_healthy(_probe(port), timeout=30)
    grandchild = int(re.search(r"grandchild pid=(\d+)", sp.log_tail()).group(1))
    assert psutil.pid_exists(grandchild)
    sp.terminate(grace=2)
    gone = not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert gone


def test_environment_drops_alloc_conf_and_exempts_local_hosts_from_proxy(toy):
    env = server_env({"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                      "no_proxy": "corp.example"}, local_hosts=["10.9.8.7", "[fd00::1]"])
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    sp, port = toy("serve", env=env)
    sp.wait_healthy(_probe(port), timeout=30)
    line = sp.log_tail()
    assert "PYTORCH_CUDA_ALLOC_CONF=None" in line
    assert "no_proxy=corp.example,127.0.0.1,localhost,::1,10.9.8.7,fd00::1" in line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_parent_even_when_started_from_a_finished_thread(tmp_path):
    """A Ray actor may call start() on a pool thread; killing the actor must kill the server."""
    script = textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from slime_like.cluster.process import ServerProcess
        sp = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                           log_path={str(tmp_path / "orphan.log")!r})
        t = threading.Thread(target=sp.start)
        t.start(); t.join()
        print(sp.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = -1
    try:
        server_pid = int(parent.stdout.readline())
        time.sleep(0.5)  # the starting thread has finished; the server must still run
        assert psutil.pid_exists(server_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(server_pid)
    finally:
        parent.kill()
        parent.wait()
        if server_pid > 0 and psutil.pid_exists(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_address_in_use_at_start_up_is_recognised(tmp_path):
    with reserve_ports(1) as r:  # held bound: the toy server cannot bind it
        port = r.ports[0]
        sp = ServerProcess([sys.executable, TOY, str(port), "serve"], log_path=tmp_path / "aiu.log")
        sp.start()
        try:
            with pytest.raises(LaunchError, match="exited with code 1"):
                sp.wait_healthy(_probe(port), timeout=30)
            assert sp.exit_looks_like_address_in_use()
        finally:
            sp.terminate(grace=1)
