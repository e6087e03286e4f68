"""The README's multi-node commands against the hosts of `harness.Hosts`: run_cluster.sh
start/stop over ssh, `ray status` on a node, run_job.sh from the submitting machine."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests.hosts.harness import Host, Hosts

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# What a node's shell finds first: the same environment on every node, as the README asks.
NODE_PATH = f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def submitter_env(**extra: str) -> dict[str, str]:
    """This machine's environment without the test session's own Ray settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return {**env, **extra}


class RayOnHosts:
    """One Ray cluster over `hosts`, started and stopped by scripts/run_cluster.sh."""

    def __init__(self, hosts: Hosts, workdir: Path, gpus: int = 1):
        self.hosts = hosts
        self.token = workdir / "ray_token"
        self.hostfile = workdir / "hosts.txt"
        self.hostfile.write_text("".join(f"{h.ssh_target} gpus={gpus} temp_dir={h.temp_dir}\n"
                                         for h in hosts.hosts))
        self.head = hosts.hosts[0]

    @property
    def address(self) -> str:
        return f"http://{self.head.ip}:8265"

    def _script(self, command: str, *args: str, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "scripts" / "run_cluster.sh"), command, "--hostfile",
             str(self.hostfile), "--ssh-config", str(self.hosts.ssh_config), "--ray",
             str(VENV_BIN / "ray"), *args],
            capture_output=True, text=True, timeout=timeout, env=env or submitter_env())

    def start(self, **node_env: str) -> subprocess.CompletedProcess:
        """`run_cluster.sh start`; `node_env` (e.g. GLOO_SOCKET_IFNAME) as a user exports it."""
        import matplotlib  # the run's plots: reuse this machine's font cache, as a shared home would

        return self._script("start", "--token-file", str(self.token), "--env",
                            f"PATH={NODE_PATH}", "--env",
                            f"MPLCONFIGDIR={matplotlib.get_cachedir()}",
                            env=submitter_env(**node_env))

    def stop(self) -> subprocess.CompletedProcess:
        return self._script("stop")

    def status(self, on_index: int = 1) -> str:
        """`ray status` as a user runs it on a node, with the token scp put there."""
        host = self.hosts.hosts[on_index]
        r = self.hosts.ssh(host, f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.slime_like/"
                                 f"ray_token {VENV_BIN / 'ray'} status --address "
                                 f"{self.head.ip}:6379", check=False, timeout=60)
        return r.stdout + r.stderr

    def wait_nodes(self, n: int, timeout_s: float = 60) -> str:
        """`ray status` once it lists `n` active nodes; an AssertionError with it at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.status()
            active = out.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if sum(line.strip().startswith("1 node_") for line in active.splitlines()) == n:
                return out
            assert time.monotonic() < deadline, f"ray status never listed {n} nodes:\n{out}"
            time.sleep(1)

    def start_job(self, run_dir: Path, *flags: str) -> subprocess.Popen:
        """scripts/run_job.sh from this machine with the cluster's token (README: Multi-node);
        its output goes to run_dir's sibling `<name>.out`."""
        env = submitter_env(RAY_ADDRESS=self.address, RAY_AUTH_MODE="token",
                            RAY_AUTH_TOKEN_PATH=str(self.token))
        out = open(run_dir.with_suffix(".out"), "w")  # noqa: SIM115 - the child holds it
        try:
            return subprocess.Popen(["bash", str(REPO / "scripts" / "run_job.sh"), *flags,
                                     "--output-dir", str(run_dir)], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=REPO, text=True)
        finally:
            out.close()

    def run_job(self, run_dir: Path, *flags: str, timeout: float = 600) -> tuple[int, str]:
        """The job's exit status and output, once it ended (killed at `timeout`)."""
        job = self.start_job(run_dir, *flags)
        try:
            rc = job.wait(timeout=timeout)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        return rc, run_dir.with_suffix(".out").read_text(errors="replace")

    def wait_no_processes(self, timeout_s: float = 20) -> list[list[str]]:
        """Every host's processes once none is left, or what is left at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [self.hosts.processes(h) for h in self.hosts.hosts]
            if not any(left) or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


def start_engine(hosts: Hosts, host: Host, model_dir: Path, log: Path, port: int = 30000,
                 **env: str) -> str:
    """A reference engine on `host` (started over ssh, `env` in its environment); its URL
    (`wait_healthy` waits for it)."""
    words = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # The subshell's own stdout is ssh's: only the engine's, redirected, may outlive it.
    hosts.ssh(host, f"cd {shlex.quote(str(REPO))} && ({words} nohup {VENV_BIN / 'python'} -m "
                    f"slime_like.reference_engine --model-path {shlex.quote(str(model_dir))} "
                    f"--host {host.ip} --port {port} > {shlex.quote(str(log))} 2>&1 "
                    "< /dev/null &)")
    return f"http://{host.ip}:{port}"


def wait_healthy(url: str, log: Path) -> None:
    """Until the engine at `url` answers /health from this machine (180 s)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"engine {url} never healthy: " \
                                            f"{log.read_text(errors='replace')[-2000:]}"
        time.sleep(0.5)


@dataclass
class JobOnHosts:
    """A job running across the hosts' Ray cluster (made by `job_on_hosts`)."""

    ray: RayOnHosts
    run_dir: Path
    job: subprocess.Popen
    phases: dict[str, float] = field(default_factory=dict)  # seconds each part took

    @property
    def output(self) -> str:
        return self.run_dir.with_suffix(".out").read_text(errors="replace")

    def wait_for_step(self, step: int, timeout_s: float = 300) -> None:
        """Until the run's metrics record `step`; fails at once if the job ended first."""
        deadline = time.monotonic() + timeout_s
        path = self.run_dir / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) > step):
            assert self.job.poll() is None, self.output[-4000:]
            assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s:.0f} s"
            time.sleep(0.5)

    def succeeded(self, timeout_s: float = 600) -> None:
        """Until the job ends; an AssertionError with its output's tail unless it succeeded."""
        t0 = time.monotonic()
        rc = self.job.wait(timeout=timeout_s)
        self.phases["job_wait"] = round(time.monotonic() - t0, 1)
        assert rc == 0, self.output[-5000:]


@contextlib.contextmanager
def job_on_hosts(hosts: Hosts, workdir: Path, steps: int, *flags: str,
                 **node_env: str) -> Iterator[JobOnHosts]:
    """`run_cluster.sh start` on every host (`node_env` exported there), `ray status`
    listing them all, `run_job.sh` submitted from this machine; on the way out the job
    killed if still running, `run_cluster.sh stop`, and nothing of Ray or the job left on
    any host (checked unless the body failed: its error is the one to see)."""
    ray = RayOnHosts(hosts, workdir)
    phases: dict[str, float] = {}

    def timed(name: str, t0: float) -> None:
        phases[name] = round(time.monotonic() - t0, 1)

    failed = False
    try:
        t0 = time.monotonic()
        r = ray.start(**node_env)
        assert r.returncode == 0, r.stderr[-3000:]
        timed("cluster_start", t0)
        t0 = time.monotonic()
        ray.wait_nodes(len(hosts.hosts))
        timed("nodes_listed", t0)
        run = JobOnHosts(ray, workdir / "run", ray.start_job(
            workdir / "run", *flags, "--num-rollout", str(steps)), phases)
        try:
            yield run
        finally:
            if run.job.poll() is None:
                run.job.kill()
                run.job.wait()
    except BaseException:
        failed = True
        raise
    finally:
        t0 = time.monotonic()
        stop = ray.stop()
        left = ray.wait_no_processes()
        timed("cluster_stop", t0)
        print(f"hosts job phases (s): {phases}")
        if not failed:
            assert stop.returncode == 0, stop.stderr[-2000:]
            assert left == [[]] * len(hosts.hosts), f"processes outlived run_cluster.sh stop: {left}"
