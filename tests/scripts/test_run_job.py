"""scripts/run_job.sh: bad flags stop it before anything starts; submission waits, then gives up."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from slime_like.cluster.ports import free_port
from slime_like.submit.ray_job import NO_AGENT, JobSubmitError, wait_and_submit
from tests.scripts.port_helpers import RAY_FIXED_DEFAULT_PORTS, hold

REPO = Path(__file__).resolve().parents[2]


def test_a_bad_flag_is_the_clis_one_line_error_and_exit_2(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}
    r = subprocess.run(["bash", "scripts/run_job.sh", "--config", "configs/quickstart.yaml",
                        "--num-rollout", "zero", "--output-dir", str(tmp_path / "run")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "slime-like train: error: --num-rollout: must be an integer, got 'zero'\n"
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stdout == ""  # no Ray cluster was started
    assert not (tmp_path / "run").exists()


def test_a_job_runs_while_another_cluster_holds_rays_default_ports(tmp_path):
    # 52365: the dashboard agent's default port, 10001: the client server's. A private
    # cluster that took the defaults would get no job agent and never accept the job.
    held = [hold(p) for p in RAY_FIXED_DEFAULT_PORTS]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        r = subprocess.run(["bash", "scripts/run_job.sh", "--config", "configs/quickstart.yaml",
                            "--num-rollout", "1", "--simulate-engine-crash-at", "5",
                            "--output-dir", str(tmp_path / "run")],
                           cwd=REPO, env={**env, "SLIME_LIKE_SUBMIT_TIMEOUT": "240"},
                           capture_output=True, text=True, timeout=600)
    finally:
        for s in held:
            if s is not None:
                s.close()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[slime_like] step 1/1" in r.stdout
    assert (tmp_path / "run" / "report.md").is_file()
    temp_dir = r.stdout.split("stopped the Ray cluster in ")[1].split(":")[0]
    assert not Path(temp_dir).exists()
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if temp_dir in " ".join(p.info["cmdline"] or [])]
    assert left == [], "processes of the private cluster outlived the script"


def test_a_flag_without_its_value_is_named_too():
    r = subprocess.run(["bash", "scripts/run_job.sh", "--config"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "slime-like train: error: --config: expected one argument\n"


def test_submission_gives_up_at_the_deadline_naming_what_it_waited_for():
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(JobSubmitError) as err:
        wait_and_submit(address, "true", timeout_s=1, say=lambda _: None)
    assert str(err.value).startswith(
        f"gave up after 1 s waiting for the Ray dashboard to answer at {address}")


class _AgentlessDashboard(http.server.BaseHTTPRequestHandler):
    """Answers as Ray's dashboard does while the head node's job agent is not registered
    (dashboard/modules/job/job_head.py), then accepts once `ready` is set."""

    ready = threading.Event()
    submitted: list[dict] = []

    def log_message(self, *a):  # keep test output clean
        pass

    def _reply(self, status: int, body: str, ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/api/version":
            self._reply(200, json.dumps({"version": "4", "ray_version": "2.60.0",
                                         "ray_commit": "x", "session_name": "s"}))
        else:
            self._reply(404, "not found", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self.ready.is_set():
            self.ready.set()  # the next attempt finds the agent
            self._reply(500, "No available agent to submit job, please try again later.",
                        "text/plain")
            return
        self.submitted.append(body)
        self._reply(200, json.dumps({"job_id": body["submission_id"],
                                     "submission_id": body["submission_id"]}))


def test_submission_retries_while_no_job_agent_is_available(monkeypatch):
    monkeypatch.setattr("slime_like.submit.ray_job.POLL_S", 0.1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AgentlessDashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    said = []
    try:
        _, sid = wait_and_submit(f"http://127.0.0.1:{server.server_port}", "python -m x",
                                 timeout_s=30, say=said.append)
    finally:
        server.shutdown()
        server.server_close()
    assert [b["submission_id"] for b in _AgentlessDashboard.submitted] == [sid]
    assert said and "waiting for the head node's job agent" in said[0]
    assert NO_AGENT == "No available agent"
