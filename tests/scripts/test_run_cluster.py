"""scripts/run_cluster.sh: hostfile parsing, the commands a start/stop runs, its errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH=$HOME/.slime_like/ray_token"


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    return subprocess.run(["bash", str(REPO / "scripts" / "run_cluster.sh"), *argv],
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


def _hostfile(tmp_path: Path, text: str, name: str = "hosts") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_dry_run_start_shares_one_token_and_points_workers_at_the_head(tmp_path):
    hosts = _hostfile(tmp_path, "# head first\nalice@10.0.0.1 gpus=8\n\n10.0.0.2  # worker\n"
                                "10.0.0.3 gpus=4")
    token = tmp_path / "token"
    r = _run("start", "--hostfile", hosts, "--token-file", str(token), "--dashboard-port",
             "8300", "--dry-run", "--", "--object-store-memory", "1000000",
             env={"NCCL_SOCKET_IFNAME": "eth0"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"# would create a new token in {token}"
    assert not token.exists()  # a dry run writes nothing
    ssh = "ssh -o BatchMode=yes"
    start = f"env RAY_AUTH_MODE=token {TOKEN_PATH} NCCL_SOCKET_IFNAME=eth0 ray start " \
            "--disable-usage-stats"
    mkdir = "'mkdir -p \"$HOME/.slime_like\" && chmod 700 \"$HOME/.slime_like\"'"
    # the token to every node first (at once), then the head, then the workers
    assert lines[1:10] == [
        f"{ssh} alice@10.0.0.1 {mkdir}",
        f"scp -q -o BatchMode=yes {token} alice@10.0.0.1:.slime_like/ray_token",
        f"{ssh} 10.0.0.2 {mkdir}",
        f"scp -q -o BatchMode=yes {token} 10.0.0.2:.slime_like/ray_token",
        f"{ssh} 10.0.0.3 {mkdir}",
        f"scp -q -o BatchMode=yes {token} 10.0.0.3:.slime_like/ray_token",
        f"{ssh} alice@10.0.0.1 '{start} --head --port 6379 --dashboard-host 0.0.0.0 "
        "--dashboard-port 8300 --num-gpus 8 --object-store-memory 1000000'",
        f"{ssh} 10.0.0.2 '{start} --address 10.0.0.1:6379 --object-store-memory 1000000'",
        f"{ssh} 10.0.0.3 '{start} --address 10.0.0.1:6379 --num-gpus 4 "
        "--object-store-memory 1000000'",
    ]
    assert f"export RAY_ADDRESS=http://10.0.0.1:8300 RAY_AUTH_MODE=token " \
           f"RAY_AUTH_TOKEN_PATH={token}" in r.stdout


def test_dry_run_gives_each_node_its_temp_dir_and_ssh_the_config(tmp_path):
    # Nodes that share /tmp (or one home) need a Ray temp dir each; a node's own wins.
    hosts = _hostfile(tmp_path, "h0 temp_dir=/tmp/r0\nh1\n")
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  User root\n")
    r = _run("start", "--hostfile", hosts, "--token-file", str(tmp_path / "token"),
             "--temp-dir", "/tmp/rx", "--ssh-config", str(config), "--dry-run")
    assert r.returncode == 0, r.stderr
    ssh = f"ssh -F {config} -o BatchMode=yes"
    starts = [x for x in r.stdout.splitlines() if "ray start" in x]
    assert starts[0].startswith(f"{ssh} h0 ") and starts[0].endswith("--temp-dir /tmp/r0'")
    assert starts[1].startswith(f"{ssh} h1 ") and starts[1].endswith("--temp-dir /tmp/rx'")
    assert f"scp -q -F {config} -o BatchMode=yes {tmp_path / 'token'} h1:.slime_like/ray_token" \
        in r.stdout.splitlines()


def test_dry_run_stop_stops_workers_before_the_head(tmp_path):
    hosts = _hostfile(tmp_path, "h0\nh1\nh2\n")
    r = _run("stop", "--hostfile", hosts, "--ray", "/opt/venv/bin/ray", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"ssh -o BatchMode=yes {h} '/opt/venv/bin/ray stop'"
                                     for h in ("h2", "h1", "h0")]


def test_bad_input_is_a_one_line_error_naming_it(tmp_path):
    cases = [
        (("strat",), "unknown command 'strat' (expected start or stop)"),
        (("start",), "--hostfile is required"),
        (("start", "--hostfile", str(tmp_path / "nope")), f"--hostfile: no such file: "
                                                          f"{tmp_path / 'nope'}"),
        (("start", "--hostfile", _hostfile(tmp_path, "# nothing\n\n", "empty")),
         f"{tmp_path / 'empty'}: no hosts (one per line, the head first)"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0\nh1 gpus=x\n", "gpus")),
         f"{tmp_path / 'gpus'}:2: gpus must be a number, got 'x'"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0 slots=2\n", "slots")),
         f"{tmp_path / 'slots'}:1: unexpected 'slots=2' "
         "(expected '[user@]host [gpus=N] [temp_dir=PATH]')"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0\n"), "--ssh-config", "/nope"),
         "--ssh-config: no such file: /nope"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0\n"), "--port", "99999"),
         "not a port: '99999'"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0\n"), "--env", "1X=2"),
         "--env: expected NAME=VALUE, got '1X=2'"),
        (("start", "--hostfile", _hostfile(tmp_path, "h0\n"), "--bogus"),
         "unknown option '--bogus'"),
    ]
    for argv, message in cases:
        r = _run(*argv, "--dry-run") if argv[0] != "strat" else _run(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert r.stderr == f"run_cluster.sh: error: {message}\n", argv
        assert r.stdout == ""
