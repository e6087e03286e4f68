"""The hosts' switch: cuts a host's cluster link on request and heals it on its own.

The chaos fault `partition` reaches a host's link through a command
(`--chaos-partition-command`). On the test hosts that command is this file run as a
script (standard library only, so any host's Python can run it):

    python tests/hosts/switch.py http://GATEWAY:PORT {node_ip} {seconds}

It asks the `LinkSwitch`, an HTTP server in the machine's own network namespace on the
bridge's address, to take the host's port (its veth's root side, as pulling its cable at
a switch would) down, and the switch brings it back `seconds` later by itself: the heal
does not depend on the job, nor on the host that asked. Closing the switch heals every
link at once, so a failing test leaves none down.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


class LinkSwitch:
    """`with LinkSwitch(hosts) as switch:` serves POST /partition?node=IP&seconds=S."""

    def __init__(self, hosts: Any):  # a tests.hosts.harness.Hosts
        self.hosts = hosts
        self.cuts: list[dict[str, Any]] = []  # node, cut_at, healed_at
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        switch = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    if url.path != "/partition":
                        raise LookupError(f"no {url.path}; POST /partition?node=IP&seconds=S")
                    cut = switch.partition(query["node"], float(query["seconds"]))
                    status, body = 200, cut
                except (LookupError, ValueError) as e:
                    status, body = 400, {"error": str(e)}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((hosts.gateway, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="hosts-switch")

    @property
    def url(self) -> str:
        return f"http://{self.hosts.gateway}:{self._server.server_address[1]}"

    def command(self, python: str) -> str:
        """The `--chaos-partition-command` template that reaches this switch."""
        return f"{python} {__file__} {self.url} {{node_ip}} {{seconds}}"

    def __enter__(self) -> LinkSwitch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partition(self, node_ip: str, seconds: float) -> dict[str, Any]:
        """Take `node_ip`'s host off the bridge now; back on after `seconds`."""
        host = self.hosts.host_of(node_ip)
        if host is None or host.ip != node_ip:
            raise LookupError(f"{node_ip} is no host's cluster address "
                              f"({[h.ip for h in self.hosts.hosts]})")
        if not 0 < seconds <= 600:
            raise ValueError(f"seconds={seconds}: want 0 < seconds <= 600")
        cut = {"node": node_ip, "cut_at": time.time(), "seconds": seconds, "healed_at": None}
        with self._lock:
            self.hosts.set_link(host, up=False)
            self.cuts.append(cut)
            timer = threading.Timer(seconds, self._heal, args=(cut,))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()
        return cut

    def wait_for_cut(self, timeout_s: float, job: Any = None) -> dict[str, Any]:
        """The first cut once it is made; an AssertionError at the deadline, or as soon as
        `job` (a Popen) ends without one."""
        deadline = time.monotonic() + timeout_s
        while not self.cuts:
            assert job is None or job.poll() is None, "the job ended before any partition"
            assert time.monotonic() < deadline, f"no partition asked for in {timeout_s:.0f} s"
            time.sleep(0.1)
        return self.cuts[0]

    def _heal(self, cut: dict[str, Any]) -> None:
        with self._lock:
            if cut["healed_at"] is None:
                self.hosts.set_link(self.hosts.host_of(cut["node"]), up=True)
                cut["healed_at"] = time.time()

    def close(self) -> None:
        """Stop serving and heal every link still cut."""
        self._server.shutdown()
        self._server.server_close()
        for t in self._timers:
            t.cancel()
        for cut in self.cuts:
            self._heal(cut)


def main(argv: list[str]) -> int:
    """`switch.py URL NODE_IP SECONDS`: ask the switch at URL for a partition."""
    if len(argv) != 3:
        print("usage: switch.py URL NODE_IP SECONDS", file=sys.stderr)
        return 2
    url, node, seconds = argv
    req = urllib.request.Request(f"{url}/partition?node={node}&seconds={seconds}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            print(r.read().decode())
    except urllib.error.HTTPError as e:
        print(f"switch {url}: {e.code} {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
