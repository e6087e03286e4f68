"""One engine's kept HTTP/1.1 connections: taken by a call, returned when it is answered.

`EngineClient` sends every plain `http://` call over these (`protocol/http_connection.py`
writes the request and parses the answer). A call takes the connection used last,
whichever thread it runs on (with a connection per thread a thread's connection often sat
idle until the engine closed it, so a call opened a new one: a sync of 16 engines opened
about 17). The engine-call loop (`call_pool.EngineIoLoop`) takes one for a lane call,
writes the request without blocking and reads the answer as it arrives (`send_nowait`,
`InFlight`).
The connections of calls awaiting an answer are tracked, so a hung engine's calls can be
cut at once (`abort_waiting`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Protocol
from urllib.parse import urlsplit

from httptools import HttpParserError

from slime_like.errors import EngineError
from slime_like.protocol.http_connection import (
    RECV_BYTES,
    Answer,
    ConnectionClosed,
    KeepAliveConnection,
)

#: idle connections a client keeps: a session's calls go one at a time, but reads (probes,
#: /v1/loads, checks) may overlap them
MAX_IDLE_CONNECTIONS = 8


class Request(Protocol):
    """What a call sends (`EngineClient.prepare` makes one: `client.HttpCall`)."""

    method: str
    endpoint: str
    path: str
    data: bytes | None
    headers: dict[str, str]
    timeout: float


class KeptConnections:
    """The idle connections to one engine, and the sockets of calls awaiting an answer."""

    def __init__(self, url: str, read_retries: int):
        self.url = url
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.read_retries = read_retries
        self.connections_opened = 0  # over the client's life: few, however many threads call
        self._idle: list[KeepAliveConnection] = []  # the last returned at the end
        self._idle_lock = threading.Lock()
        self._waiting: set[socket.socket] = set()
        self._waiting_lock = threading.Lock()

    def take_idle(self) -> KeepAliveConnection | None:
        """The idle connection used last, still open (one the engine closed meanwhile, at
        its keep-alive timeout, is dropped); None when there is none."""
        while True:
            with self._idle_lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if not conn.closed_by_peer():
                return conn
            conn.close()

    def release(self, conn: KeepAliveConnection) -> None:
        """A connection whose answer was read in full goes back for the next call."""
        if conn.sock is None:
            return
        with self._idle_lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def call(self, call: Request) -> tuple[int, str]:
        """Send one call and read its answer on this thread: (status, body text). A GET is
        sent again on a fresh connection when a kept one turns out closed, and after a 502
        or 504; nothing else is ever sent twice."""
        reads = self.read_retries if call.method == "GET" else 0
        for attempt in range(reads + 1):
            conn = self.take_idle()
            reused = conn is not None
            if conn is None:
                conn = KeepAliveConnection(self.host, self.port, call.timeout)
                self._connect(conn, call.endpoint)
            conn.set_timeout(call.timeout)
            try:
                with self.awaiting(conn.sock):
                    status, text, keep_alive = conn.request(call.method, call.path, call.data,
                                                            call.headers)
            except TimeoutError as e:
                conn.close()
                raise self.failure(call, e) from e
            except (OSError, HttpParserError) as e:
                conn.close()
                if call.method == "GET" and reused and attempt < reads:
                    continue  # the engine had just closed the kept connection
                raise self.failure(call, e) from e
            if keep_alive:
                self.release(conn)
            else:
                conn.close()
            if call.method == "GET" and status in (502, 504) and attempt < reads:
                time.sleep(0.05 * (2 ** attempt))
                continue
            return status, text
        raise AssertionError("unreachable")

    def failure(self, call: Request, exc: BaseException) -> EngineError:
        """The EngineError for a call whose connection failed or timed out."""
        if isinstance(exc, TimeoutError):
            return EngineError(self.url, call.endpoint, None, str(exc),
                               reason=f"timed out after {call.timeout}s")
        return EngineError(self.url, call.endpoint, None, f"{type(exc).__name__}: {exc}",
                           reason="connection failed")

    def _connect(self, conn: KeepAliveConnection, endpoint: str) -> None:
        """Open the connection, retrying a refusal briefly (nothing was sent yet)."""
        for attempt in range(3):
            try:
                conn.connect()
                self.connections_opened += 1  # a race may lose a count: it is a statistic
                return
            except ConnectionRefusedError as e:
                conn.close()
                if attempt == 2:
                    raise EngineError(self.url, endpoint, None, str(e),
                                      reason="connection failed") from e
                time.sleep(0.05 * (2 ** attempt))
            except TimeoutError as e:
                conn.close()
                raise EngineError(self.url, endpoint, None, str(e),
                                  reason=f"timed out after {conn.timeout}s") from e
            except OSError as e:
                conn.close()
                raise EngineError(self.url, endpoint, None, f"{type(e).__name__}: {e}",
                                  reason="connection failed") from e

    # ---- calls awaiting an answer -------------------------------------------------------------

    def add_waiting(self, sock: socket.socket) -> None:
        with self._waiting_lock:
            self._waiting.add(sock)

    def discard_waiting(self, sock: socket.socket) -> None:
        with self._waiting_lock:
            self._waiting.discard(sock)

    @contextlib.contextmanager
    def awaiting(self, sock: socket.socket | None):
        assert sock is not None
        self.add_waiting(sock)
        try:
            yield
        finally:
            self.discard_waiting(sock)

    def abort_waiting(self) -> int:
        """Reset the connection of every call still awaiting its answer (a hung engine's),
        and fail the call at once; how many. Reset, not closed: a request a cut-off host
        has not received yet is dropped with the connection, where TCP would retransmit it
        once the link returns (a pause landing after the engine's resync would leave it
        paused while it is routed again)."""
        with self._waiting_lock:
            socks = list(self._waiting)
        for sock in socks:
            with contextlib.suppress(OSError):
                # No linger: the close that follows purges what was not sent and resets.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RD)  # the waiting call wakes, and closes it
        return len(socks)

    def close(self) -> None:
        """Close the idle connections (one in use closes when its call ends)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class InFlight:
    """A request written on a kept connection without blocking, its answer read as it
    arrives: what the engine-call loop (`call_pool.EngineIoLoop`) waits on."""

    __slots__ = ("answer", "call", "conn", "done", "kept", "out", "owner")

    def __init__(self, kept: KeptConnections, call: Request, conn: KeepAliveConnection,
                 out: bytes, owner: object):
        self.kept, self.call, self.conn, self.out, self.owner = kept, call, conn, out, owner
        self.answer = Answer()
        self.done = False

    @property
    def sock(self) -> socket.socket | None:
        return self.conn.sock

    def writable(self) -> bool:
        """Write what is left of the request; True once all of it is written."""
        assert self.conn.sock is not None
        if self.out:
            self.out = self.out[self.conn.sock.send(self.out):]
        return not self.out

    def readable(self) -> bool:
        """Read what arrived; True once the answer is complete. Raises OSError (the engine
        closed or reset the connection) or HttpParserError."""
        assert self.conn.sock is not None
        data = self.conn.sock.recv(RECV_BYTES)
        if not data:
            raise ConnectionClosed(f"{self.conn.host}:{self.conn.port} closed the connection "
                                   "before its answer was complete")
        self.answer.parser.feed_data(data)
        return self.answer.complete

    def finish(self, error: BaseException | None) -> tuple[int, str]:
        """The call's (status, body text), its connection kept for the next call; or, with
        the `error` that ended it, its connection closed and the EngineError raised."""
        self.done = True
        self.out = b""
        if self.conn.sock is not None:
            self.kept.discard_waiting(self.conn.sock)
        if error is not None:
            self.conn.close()
            raise self.kept.failure(self.call, error) from error
        answer = self.answer
        if answer.keep_alive:
            self.kept.release(self.conn)
        else:
            self.conn.close()
        return answer.parser.get_status_code(), b"".join(answer.body).decode("utf-8", "replace")

    def release(self) -> None:
        """Forget the call, its answer and its owner (the flight outlives them in a timer)."""
        self.call = self.owner = None  # type: ignore[assignment]
        self.answer = None  # type: ignore[assignment]


def send_nowait(kept: KeptConnections, call: Request, owner: object) -> InFlight | None:
    """Write `call` on an idle kept connection without blocking (the rest of a large request
    is written as the socket drains); None when no connection is idle. A write that fails
    at once raises the call's EngineError (the connection is closed)."""
    conn = kept.take_idle()
    if conn is None:
        return None
    assert conn.sock is not None
    data = conn.encode(call.method, call.path, call.data, call.headers)
    try:
        conn.sock.setblocking(False)
        sent = conn.sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError as e:
        conn.close()
        raise kept.failure(call, e) from e
    kept.add_waiting(conn.sock)
    return InFlight(kept, call, conn, data[sent:], owner)
