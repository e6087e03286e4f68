"""A relay in front of one real engine that injects one fault at a chosen call.

Armed with (endpoint, n, fault), it acts at the n-th call of that endpoint:
- "kill": SIGKILLs the engine's whole server (a real crash), then relays the call (refused);
- "hang": SIGSTOPs the engine's server (a real hang: it stops answering without exiting),
  then relays the call, which waits like any call to a hung server;
- "500": answers 500 itself without relaying. A real engine cannot be made to answer an
  error on demand at a given call, so this one fault is a fake, and says so in its body.
Apart from the armed fault, `slow(endpoint, seconds)` holds the first call of an endpoint
after the fault fired that long before relaying it: a host too loaded to answer in time (also a fake: a real
engine cannot be made slow at one call without stopping it).
Every other call is relayed unchanged (keys, bodies, statuses), and the relay records the
weight-group names engines were asked to join.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from slime_like.cluster.process import ServerProcess


class FaultProxy:
    """An HTTP relay to `target`, with at most one armed fault."""

    def __init__(self, target: str, process: ServerProcess):
        self.target, self.process = target, process
        self.calls: Counter[str] = Counter()
        self.groups: list[str] = []
        self.fault: tuple[str, int, str] | None = None
        self.fired = threading.Event()
        self.delays: dict[str, float] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._relay(self, "GET")

            def do_POST(self) -> None:
                proxy._relay(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def retarget(self, target: str, process: ServerProcess) -> None:
        """A relaunched engine (new port) behind the same relay address."""
        self.target, self.process = target, process

    def arm(self, endpoint: str, n: int, fault: str) -> None:
        with self._lock:
            self.calls.clear()
            self.fault, self.fired = (endpoint, n, fault), threading.Event()

    def disarm(self) -> None:
        with self._lock:
            self.fault = None
            self.delays.clear()

    def slow(self, endpoint: str, seconds: float) -> None:
        """The first call of `endpoint` after the armed fault fired waits `seconds`."""
        with self._lock:
            self.delays[endpoint] = seconds

    def _relay(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        path = handler.path.split("?", 1)[0]
        with self._lock:
            self.calls[path] += 1
            fault = self.fault
            fire = fault is not None and fault[0] == path and fault[1] == self.calls[path]
            if fire:
                self.fault = None
            delay = self.delays.pop(path, 0.0) if self.fired.is_set() else 0.0
        time.sleep(delay)
        if path == "/init_weights_update_group" and body:
            self.groups.append(json.loads(body)["group_name"])
        if fire:
            self.fired.set()
            if fault[2] == "500":
                return _answer(handler, 500, b'{"error": "injected by the test\'s fault proxy"}')
            self.process.kill(signal.SIGKILL if fault[2] == "kill" else signal.SIGSTOP)
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        try:
            r = requests.request(method, self.target + handler.path, data=body, headers=headers,
                                 timeout=120)
        except requests.RequestException:
            handler.close_connection = True
            return None  # the engine is gone: the caller sees its connection dropped
        _answer(handler, r.status_code, r.content)
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _answer(handler: BaseHTTPRequestHandler, status: int, content: bytes) -> None:
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)
    except OSError:  # the caller gave up (its timeout) while the engine was hung
        handler.close_connection = True
