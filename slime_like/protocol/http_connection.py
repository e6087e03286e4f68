"""One keep-alive HTTP/1.1 connection to an engine, its answers parsed by `httptools`.

A weight sync sends each engine five small control calls, and at 64 engines the trainer's
CPU per call is the sync's control-plane time. `http.client` parses every answer's headers
through the `email` package (about 140 us of CPU for a /ping on the 2-core machine, against
35 us with `httptools`, the C parser uvicorn serves the engine with). The requests are
small and fixed in form, so they are written here; everything read is `httptools`' work.
"""

from __future__ import annotations

import select
import socket

import httptools

RECV_BYTES = 1 << 16


class ConnectionClosed(ConnectionError):
    """The engine closed the connection before its answer was complete."""


class Answer:
    """httptools' callbacks: the body's pieces, whether the connection stays open (read
    once the headers are in: the parser forgets it when the message completes), and
    whether the message is complete."""

    __slots__ = ("body", "complete", "keep_alive", "parser")

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = False
        self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.complete = True


class KeepAliveConnection:
    """A socket to host:port, opened by `connect`, one request at a time over it."""

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._host_header = f"{host}:{port}".encode()

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        if self.sock is not None:
            self.sock.settimeout(timeout)

    def request(self, method: str, path: str, body: bytes | None,
                headers: dict[str, str]) -> tuple[int, str, bool]:
        """Send one request and read its whole answer: (status, body text, whether the
        connection may be used again). Raises OSError (TimeoutError on the socket's
        timeout, ConnectionClosed when the engine closes first) or httptools'
        HttpParserError on an answer that is not HTTP."""
        assert self.sock is not None, "connect() first"
        self.sock.sendall(self.encode(method, path, body, headers))
        answer = Answer()
        while not answer.complete:
            data = self.sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionClosed(f"{self.host}:{self.port} closed the connection "
                                       "before its answer was complete")
            answer.parser.feed_data(data)
        text = b"".join(answer.body).decode("utf-8", errors="replace")
        return answer.parser.get_status_code(), text, answer.keep_alive

    def encode(self, method: str, path: str, body: bytes | None,
               headers: dict[str, str]) -> bytes:
        """The request's bytes on the wire."""
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        lines += [f"{k}: {v}".encode("latin-1") for k, v in headers.items()]
        if body is not None or method != "GET":
            lines.append(b"Content-Length: %d" % len(body or b""))
        return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")

    def closed_by_peer(self) -> bool:
        """An idle keep-alive socket that is readable has been closed (or reset) by the
        engine (its keep-alive timeout)."""
        if self.sock is None:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
