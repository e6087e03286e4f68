"""Hosts with their own network stacks: Linux network namespaces on one bridge, each with
its own sshd, PID and mount namespaces, home and hostname, sharing the filesystem.

Each host has a cluster interface (`clu0`, 198.18.K.(10+i)/24 on a bridge whose root-side
address, 198.18.K.1, is the machine jobs are submitted from; it forwards nothing) and a
decoy (`decoy0`, a bridge without ports holding 198.19.K.(10+i)/24, which no other host
can reach): the wrong NIC to name. Its init process is the host's sshd; killing it ends
every process the host started (its PID namespace goes with it), so a test that fails
leaves nothing behind, and `ray stop` on one host sees only that host's processes (not
another host's, nor the local clusters other tests run meanwhile). Every namespace and
link is named after the creating process (`slmn-<pid>-hI`, `slm<pid>...`): a leftover of a
process that is gone is found by name and removed, and live ones of another run are kept.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

SSHD = "/usr/sbin/sshd"
CLUSTER_IF = "clu0"
DECOY_IF = "decoy0"
_NS_RE = re.compile(r"^slmn-(\d+)-h\d+$")
_LINK_RE = re.compile(r"^slm(\d+)(br|h\d+)$")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, addresses, and the init (sshd) of its PID namespace."""

    index: int
    netns: str
    ip: str        # on the cluster interface
    decoy_ip: str  # on the decoy interface
    hostname: str
    home: Path
    temp_dir: str  # Ray's temp dir on this host (short: socket paths fit in 107 bytes)
    init: subprocess.Popen

    @property
    def ssh_target(self) -> str:
        return f"root@{self.ip}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def requirements_missing() -> str:
    """Why hosts cannot be made here, or ''."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter", "ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing: install openssh-server (scripts/env.sh does, as root)"
    return ""


def _free_subnet() -> int:
    """A third octet K such that 198.18.K.0/24 is used by no interface of this machine."""
    used = set()
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
        m = re.search(r"inet (198\.18\.(\d+))\.", line)
        if m:
            used.add(int(m.group(2)))
    for k in range(1, 255):
        if k not in used:
            return k
    raise RuntimeError("no free /24 in 198.18.0.0/16")


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and pid != 0


def _kill_netns(ns: str) -> None:
    """Kill every process in namespace `ns`, then remove it."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _ip("netns", "pids", ns, check=False).stdout.split() and time.monotonic() < deadline:
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def cleanup_leftovers(owner: int | None = None) -> list[str]:
    """Remove the namespaces and links of harnesses whose process is gone (and `owner`'s)."""
    removed = []

    def stale(pid: int) -> bool:
        return pid == owner or not _alive(pid)

    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and stale(int(m.group(1))):
            _kill_netns(name)
            removed.append(name)
    for path in Path("/tmp").glob("slmn*h*"):  # the hosts' Ray temp dirs
        m = re.match(r"^slmn(\d+)h\d+$", path.name)
        if m and stale(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _LINK_RE.match(name)
        if m and stale(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def leftovers(owner: int) -> list[str]:
    """Namespaces and links of `owner` still present."""
    names = [x.split()[0] for x in _ip("netns", "list", check=False).stdout.splitlines()
             if x.split()]
    links = [x.split(":")[1].strip().split("@")[0]
             for x in _ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in x]
    return [n for n in names if (m := _NS_RE.match(n)) and int(m.group(1)) == owner] + \
           [n for n in links if (m := _LINK_RE.match(n)) and int(m.group(1)) == owner]


_SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey {keys}/host_ed25519
PidFile none
AuthorizedKeysFile {keys}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
Subsystem sftp internal-sftp
LogLevel ERROR
"""

# Runs as the host's PID 1 (after `unshare --pid --fork --mount-proc --uts`): its own
# home (root's, in its /etc/passwd: /root itself holds the machine's Python), hostname and
# /etc/hosts, as a node of a real cluster has, and no DNS server (a lookup of a name it does
# not list fails at once instead of waiting for a server it cannot reach); then sshd.
_INIT = """\
set -e
mount --bind "$HOST_PASSWD" /etc/passwd
mount --bind "$HOST_ETC_HOSTS" /etc/hosts
mount --bind "$HOST_RESOLV_CONF" /etc/resolv.conf
hostname "$HOST_NAME"
mkdir -p /run/sshd
exec {sshd} -D -e -f "$HOST_SSHD_CONFIG"
"""


class Hosts:
    """N hosts on one bridge; `with Hosts(n, root) as hosts:` makes them and tears them down."""

    def __init__(self, n: int, root: Path):
        self.n = n
        self.root = Path(root)
        self.owner = os.getpid()
        self.hosts: list[Host] = []
        self.bridge = f"slm{self.owner}br"
        self.k = 0

    # ---- paths a client of the hosts uses ----------------------------------------------------

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge: where jobs are submitted from."""
        return f"198.18.{self.k}.1"

    def write_hostfile(self, path: Path, gpus: int = 1) -> Path:
        path.write_text("".join(f"{h.ssh_target} gpus={gpus}\n" for h in self.hosts))
        return path

    # ---- making and removing -----------------------------------------------------------------

    def __enter__(self) -> Hosts:
        cleanup_leftovers()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        self.keys.mkdir(parents=True, exist_ok=True)
        for name in ("host_ed25519", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "slime_like-test",
                            "-f", str(self.keys / name)], check=True, timeout=30)
        shutil.copy(self.keys / "id_ed25519.pub", self.keys / "authorized_keys")
        self.k = _free_subnet()
        host_key = (self.keys / "host_ed25519.pub").read_text().split()[:2]
        (self.keys / "known_hosts").write_text(f"198.18.{self.k}.* {' '.join(host_key)}\n")
        self.ssh_config.write_text(
            f"Host 198.18.{self.k}.*\n  User root\n  IdentityFile {self.keys}/id_ed25519\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {self.keys}/known_hosts\n"
            "  StrictHostKeyChecking yes\n  ConnectTimeout 10\n  LogLevel ERROR\n")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        etc_hosts = self.root / "etc_hosts"
        (self.root / "resolv.conf").write_text("# no DNS on the test hosts\n")
        etc_hosts.write_text(f"127.0.0.1 localhost\n{self.gateway} slmn-gw\n" + "".join(
            f"198.18.{self.k}.{10 + i} slmn-h{i}\n" for i in range(self.n)))
        for i in range(self.n):
            self.hosts.append(self._make_host(i, etc_hosts))
        for h in self.hosts:
            self._wait_ssh(h)

    def _make_host(self, i: int, etc_hosts: Path) -> Host:
        ns, veth = f"slmn-{self.owner}-h{i}", f"slm{self.owner}h{i}"
        ip, decoy = f"198.18.{self.k}.{10 + i}", f"198.19.{self.k}.{10 + i}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", CLUSTER_IF, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        for cmd in (("link", "set", "lo", "up"),
                    ("addr", "add", f"{ip}/24", "dev", CLUSTER_IF),
                    ("link", "set", CLUSTER_IF, "up"),
                    # The root namespace does not forward: nothing leaves the machine.
                    ("route", "add", "default", "via", self.gateway),
                    ("link", "add", DECOY_IF, "type", "bridge"),  # no ports: no one reaches it
                    ("addr", "add", f"{decoy}/24", "dev", DECOY_IF),
                    ("link", "set", DECOY_IF, "up")):
            _ip("-n", ns, *cmd)
        hdir = self.root / f"h{i}"
        (hdir / "home").mkdir(parents=True, exist_ok=True)
        passwd = hdir / "passwd"
        passwd.write_text("".join(
            re.sub(r"^(root:[^:]*:0:0:[^:]*:)[^:]*:", rf"\g<1>{hdir / 'home'}:", line)
            for line in Path("/etc/passwd").read_text().splitlines(keepends=True)))
        config = hdir / "sshd_config"
        config.write_text(_SSHD_CONFIG.format(ip=ip, keys=self.keys))
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
               "HOST_PASSWD": str(passwd), "HOST_ETC_HOSTS": str(etc_hosts),
               "HOST_RESOLV_CONF": str(self.root / "resolv.conf"),
               "HOST_NAME": f"slmn-h{i}", "HOST_SSHD_CONFIG": str(config)}
        log = open(hdir / "sshd.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            init = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc",
                 "--uts", "--kill-child", "bash", "-c", _INIT.format(sshd=SSHD)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            log.close()
        return Host(i, ns, ip, decoy, f"slmn-h{i}", hdir / "home",
                    f"/tmp/slmn{self.owner}h{i}", init)

    def _wait_ssh(self, host: Host, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if host.init.poll() is not None:
                log = (self.root / f"h{host.index}" / "sshd.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of {host.hostname} exited "
                                   f"({host.init.returncode}): {log[-2000:]}")
            r = self.ssh(host, "true", check=False, timeout=15)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ssh to {host.ip} after {timeout_s:.0f} s: {r.stderr}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill every host's processes, remove its namespace, links and temp dir.

        Returns once every process the hosts ran is gone: unshare exits as soon as its
        child (the host's PID 1) is sent SIGKILL, while the kernel still kills the rest of
        the PID namespace after it."""
        for h in self.hosts:
            inside = self._tree(h)
            with contextlib.suppress(ProcessLookupError):
                h.init.kill()  # unshare: --kill-child takes the host's PID 1, and with it the rest
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.init.wait(timeout=10)
            _, alive = psutil.wait_procs(inside, timeout=10)
            for p in alive:  # the kernel did not get to it: kill it ourselves
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=5)
            shutil.rmtree(h.temp_dir, ignore_errors=True)
        cleanup_leftovers(owner=self.owner)
        self.hosts = []

    # ---- running things on hosts -------------------------------------------------------------

    def ssh(self, host: Host, command: str, *, check: bool = True, timeout: float = 120,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `command` in `host`'s shell over ssh, as a user of the cluster would."""
        r = subprocess.run(["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes",
                            host.ip, command], capture_output=True, text=True,
                           timeout=timeout, env=env)
        if check and r.returncode != 0:
            raise RuntimeError(f"ssh {host.ip} {command!r} exited {r.returncode}: {r.stderr}")
        return r

    def processes(self, host: Host) -> list[str]:
        """The command lines running on `host` (its PID namespace), its sshd excluded."""
        out = []
        for p in self._tree(host)[1:]:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(" ".join(p.cmdline()))
        return out

    @staticmethod
    def _tree(host: Host) -> list[psutil.Process]:
        """The host's PID 1 (its sshd) and every process below it."""
        try:
            init = psutil.Process(host.init.pid).children()
            return [init[0], *init[0].children(recursive=True)] if init else []
        except psutil.Error:
            return []

    def addresses(self, host: Host) -> dict[str, list[str]]:
        """Interface -> IPv4 addresses inside `host`."""
        out: dict[str, list[str]] = {}
        for line in _ip("-n", host.netns, "-o", "-4", "addr", "show").stdout.splitlines():
            parts = line.split()
            out.setdefault(parts[1], []).append(parts[3].split("/")[0])
        return out

    def host_of(self, address: str) -> Host | None:
        """The host whose cluster or decoy address this is."""
        a = str(ipaddress.ip_address(address))
        return next((h for h in self.hosts if a in (h.ip, h.decoy_ip)), None)

    def set_link(self, host: Host, up: bool) -> None:
        """Take `host`'s cluster link down (its processes live on) or bring it back."""
        _ip("link", "set", f"slm{self.owner}h{host.index}", "up" if up else "down")


