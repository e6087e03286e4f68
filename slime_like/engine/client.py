"""EngineClient: the only place that knows SGLang's URLs and bodies.

Every call has a timeout, posts `{}` rather than no body (sglang answers 400 to a bodiless
control call), and raises `EngineError` naming the engine URL, endpoint, HTTP status and
body. Only idempotent reads are retried; a weight update or a pause is never re-sent
behind the caller's back.

Plain `http://` engines are spoken to over persistent connections whose answers
`httptools` parses (`protocol/http_connection.py`): a weight sync is a chain of small control
calls, and `requests` adds about a third of a millisecond to each, `http.client` a tenth.
Each client keeps its idle connections and a call takes the one used last, whichever
thread it runs on: calls run on a shared pool's threads, and with a connection per thread
a thread's connection often sat idle until the engine closed it, so a call opened a new
one (a sync of 16 engines opened about 17). `https://` goes through `requests`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from typing import Any
from urllib.parse import urlencode, urlsplit

import requests
from httptools import HttpParserError
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from slime_like.errors import EngineError
from slime_like.protocol import io_struct as p
from slime_like.protocol import paths
from slime_like.protocol.http_connection import KeepAliveConnection
from slime_like.protocol.modes import PauseMode

DEFAULT_TIMEOUT_S = 60.0
#: idle connections a client keeps: a session's calls go one at a time, but reads (probes,
#: /v1/loads, checks) may overlap them
MAX_IDLE_CONNECTIONS = 8


def _dump(body: Any) -> dict:
    if body is None:
        return {}
    if hasattr(body, "model_dump"):
        return body.model_dump(exclude_none=False)
    return dict(body)


class EngineClient:
    """Typed calls to one SGLang (or reference) engine over HTTP."""

    def __init__(self, url: str, *, api_key: str | None = None, admin_api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, read_retries: int = 3):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout = timeout
        self._local = threading.local()  # requests' sessions (https://), one per thread
        self._idle: list[KeepAliveConnection] = []  # the last returned at the end
        self._idle_lock = threading.Lock()
        self.connections_opened = 0  # over the client's life: few, however many threads call
        self._read_retries = read_retries
        self._waiting: set[socket.socket] = set()  # connections of calls awaiting an answer
        self._waiting_lock = threading.Lock()

    # ---- plumbing --------------------------------------------------------------------------

    @property
    def session(self) -> requests.Session:
        """One keep-alive session per thread (requests.Session is not thread-safe)."""
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            # Orchestrator <-> engine traffic never goes through a machine-wide HTTP proxy
            # (a proxy on the head node is a classic cause of router/engine failures).
            s.trust_env = False
            # Connection attempts are retried briefly for any verb (nothing was sent yet), so
            # a dead engine is still known within a fraction of a second; answered reads are
            # retried only for GETs on a gateway error.
            retry = Retry(total=self._read_retries, connect=2, read=0, backoff_factor=0.05,
                          allowed_methods=frozenset({"GET"}), status_forcelist=(502, 504),
                          raise_on_status=False)
            s.mount("http://", HTTPAdapter(max_retries=retry, pool_maxsize=16))
            s.mount("https://", HTTPAdapter(max_retries=retry, pool_maxsize=16))
            self._local.session = s
        return s

    def _headers(self, admin: bool) -> dict[str, str]:
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def request(self, method: str, endpoint: str, *, body: Any = None, params: dict | None = None,
                timeout: float | None = None, admin: bool = False, expect_json: bool = True,
                ok_statuses: tuple[int, ...] = (200,)) -> Any:
        """One HTTP call; any status outside `ok_statuses` raises EngineError."""
        if self._plain:
            status, text = self._keepalive_call(method, endpoint, body, params, timeout or self.timeout,
                                                admin)
            if status not in ok_statuses:
                raise EngineError(self.url, endpoint, status, text)
            if not expect_json:
                return text
            if not text:
                return None
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text
        url = self.url + endpoint
        kwargs: dict[str, Any] = {"headers": self._headers(admin), "params": params,
                                  "timeout": timeout or self.timeout}
        if method != "GET" or body is not None:
            kwargs["json"] = _dump(body)
        try:
            resp = self.session.request(method, url, **kwargs)
        except requests.Timeout as e:
            raise EngineError(self.url, endpoint, None, str(e),
                              reason=f"timed out after {kwargs['timeout']}s") from e
        except requests.RequestException as e:
            raise EngineError(self.url, endpoint, None, str(e), reason="connection failed") from e
        if resp.status_code not in ok_statuses:
            raise EngineError(self.url, endpoint, resp.status_code, resp.text)
        if not expect_json:
            return resp.text
        if not resp.content:
            return None
        try:
            return resp.json()
        except json.JSONDecodeError:
            return resp.text

    # ---- keep-alive http:// -------------------------------------------------------------------

    @property
    def _plain(self) -> bool:
        return self.url.startswith("http://")

    def _connection(self, timeout: float) -> KeepAliveConnection:
        """The idle connection used last (one the engine closed meanwhile is dropped), or a
        new one, not yet connected. It is the caller's until `_release`d."""
        conn = None
        while conn is None:
            with self._idle_lock:
                if not self._idle:
                    break
                conn = self._idle.pop()
            if conn.closed_by_peer():
                conn.close()  # the engine dropped the idle connection (its keep-alive timeout)
                conn = None
        if conn is None:
            parts = urlsplit(self.url)
            conn = KeepAliveConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout)
        conn.set_timeout(timeout)
        return conn

    def _release(self, conn: KeepAliveConnection) -> None:
        """A connection whose answer was read in full goes back for the next call."""
        if conn.sock is None:
            return
        with self._idle_lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

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

    def _keepalive_call(self, method: str, endpoint: str, body: Any, params: dict | None,
                        timeout: float, admin: bool) -> tuple[int, str]:
        path = endpoint + (f"?{urlencode(params)}" if params else "")
        headers = self._headers(admin)
        data = None
        if method != "GET" or body is not None:
            data = json.dumps(_dump(body)).encode()
            headers["Content-Type"] = "application/json"
        reads = self._read_retries if method == "GET" else 0
        for attempt in range(reads + 1):
            conn = self._connection(timeout)
            reused = conn.sock is not None
            try:
                if not reused:
                    self._connect(conn, endpoint)
                with self._awaiting(conn.sock):
                    status, text, keep_alive = conn.request(method, path, data, headers)
            except EngineError:
                raise
            except TimeoutError as e:
                conn.close()
                raise EngineError(self.url, endpoint, None, str(e),
                                  reason=f"timed out after {timeout}s") from e
            except (OSError, HttpParserError) as e:
                conn.close()
                # A GET on a reused connection the engine had just closed is sent again.
                if method == "GET" and reused and attempt < reads:
                    continue
                raise EngineError(self.url, endpoint, None, f"{type(e).__name__}: {e}",
                                  reason="connection failed") from e
            if keep_alive:
                self._release(conn)
            else:
                conn.close()
            if method == "GET" and status in (502, 504) and attempt < reads:
                time.sleep(0.05 * (2 ** attempt))
                continue
            return status, text
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _awaiting(self, sock: socket.socket):
        with self._waiting_lock:
            self._waiting.add(sock)
        try:
            yield
        finally:
            with self._waiting_lock:
                self._waiting.discard(sock)

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
                sock.shutdown(socket.SHUT_RD)  # the waiting thread wakes, and closes it
        return len(socks)

    def close(self) -> None:
        """Close the idle keep-alive connections (one in use closes when its call ends)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _success(self, endpoint: str, body: Any, timeout: float | None = None) -> dict:
        """Calls answering {"success","message"}: a 400 or success=false raises."""
        out = self.request("POST", endpoint, body=body, timeout=timeout, admin=True)
        if isinstance(out, dict) and not p.SuccessMessage.model_validate(out).success:
            raise EngineError(self.url, endpoint, 200, json.dumps(out))
        return out

    # ---- health and info -------------------------------------------------------------------

    def health(self, timeout: float = 5.0) -> bool:
        """GET /health (200 once warm); False on any failure."""
        try:
            self.request("GET", paths.HEALTH, timeout=timeout, expect_json=False)
            return True
        except EngineError:
            return False

    def health_generate(self, timeout: float = 30.0) -> None:
        """GET /health_generate: one real generation step; raises on failure."""
        self.request("GET", paths.HEALTH_GENERATE, timeout=timeout, expect_json=False)

    def ping(self, timeout: float = 5.0) -> bool:
        """GET /ping: alive even while paused (unlike /health)."""
        try:
            self.request("GET", paths.PING, timeout=timeout, expect_json=False)
            return True
        except EngineError:
            return False

    def model_info(self, timeout: float | None = None) -> dict:
        return self.request("GET", paths.MODEL_INFO, timeout=timeout)

    def server_info(self, timeout: float | None = None) -> dict:
        """GET /server_info, falling back to the pre-0.5.9 name."""
        try:
            return self.request("GET", paths.SERVER_INFO, timeout=timeout)
        except EngineError as e:
            if e.status != 404:
                raise
            return self.request("GET", paths.GET_SERVER_INFO, timeout=timeout)

    def weight_version(self, timeout: float | None = None) -> str:
        """The live weight version (from /model_info; /get_weight_version is gone in 0.5.21+)."""
        return p.ModelInfo.model_validate(self.model_info(timeout)).weight_version

    def loads(self, timeout: float | None = None) -> dict:
        return self.request("GET", paths.V1_LOADS, timeout=timeout)

    # ---- generation ------------------------------------------------------------------------

    def generate(self, body: dict, timeout: float | None = None) -> Any:
        return self.request("POST", paths.GENERATE, body=body, timeout=timeout)

    # ---- control ---------------------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = PauseMode.RETRACT,
                         timeout: float | None = None) -> dict:
        return self.request("POST", paths.PAUSE_GENERATION, body=p.PauseGenerationRequest(mode=mode),
                            admin=True, timeout=timeout)

    def continue_generation(self, torch_empty_cache: bool = True,
                            timeout: float | None = None) -> dict:
        return self.request("POST", paths.CONTINUE_GENERATION,
                            body=p.ContinueGenerationRequest(torch_empty_cache=torch_empty_cache),
                            admin=True, timeout=timeout)

    def abort_request(self, rid: str = "", abort_all: bool = False,
                      timeout: float | None = None) -> None:
        self.request("POST", paths.ABORT_REQUEST, body=p.AbortRequest(rid=rid, abort_all=abort_all),
                     admin=True, timeout=timeout)

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """POST /flush_cache; True when flushed, False when the engine was not idle (400)."""
        try:
            self.request("POST", paths.FLUSH_CACHE, params={"timeout": timeout_s} if timeout_s else None,
                         admin=True, expect_json=False, timeout=max(self.timeout, timeout_s + 10))
            return True
        except EngineError as e:
            if e.status == 400:
                return False
            raise

    def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout: float | None = None) -> None:
        self.request("POST", paths.RELEASE_MEMORY_OCCUPATION,
                     body=p.MemoryOccupationRequest(tags=tags), admin=True, timeout=timeout)

    def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout: float | None = None) -> None:
        self.request("POST", paths.RESUME_MEMORY_OCCUPATION,
                     body=p.MemoryOccupationRequest(tags=tags), admin=True, timeout=timeout)

    def start_profile(self, req: p.ProfileRequest, timeout: float | None = None) -> str:
        return self.request("POST", paths.START_PROFILE, body=req, admin=True, expect_json=False,
                            timeout=timeout)

    def stop_profile(self, timeout: float | None = None) -> str:
        return self.request("POST", paths.STOP_PROFILE, body={}, admin=True, expect_json=False,
                            timeout=timeout)

    # ---- weights ---------------------------------------------------------------------------

    def init_weights_update_group(self, req: p.InitWeightsUpdateGroupRequest,
                                  timeout: float | None = None) -> dict:
        return self._success(paths.INIT_WEIGHTS_UPDATE_GROUP, req, timeout)

    def destroy_weights_update_group(self, group_name: str = p.DEFAULT_GROUP_NAME,
                                     timeout: float | None = None) -> dict:
        return self._success(paths.DESTROY_WEIGHTS_UPDATE_GROUP,
                             p.DestroyWeightsUpdateGroupRequest(group_name=group_name), timeout)

    def begin_weight_update(self, timeout: float | None = None) -> dict:
        return self._success(paths.BEGIN_WEIGHT_UPDATE, p.BeginWeightUpdateRequest(), timeout)

    def end_weight_update(self, timeout: float | None = None) -> dict:
        return self._success(paths.END_WEIGHT_UPDATE, p.EndWeightUpdateRequest(), timeout)

    def update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest,
                                        timeout: float | None = None) -> dict:
        return self._success(paths.UPDATE_WEIGHTS_FROM_DISTRIBUTED, req, timeout)

    def update_weights_from_tensor(self, req: p.UpdateWeightsFromTensorRequest,
                                   timeout: float | None = None) -> dict:
        return self._success(paths.UPDATE_WEIGHTS_FROM_TENSOR, req, timeout)

    def update_weights_from_disk(self, req: p.UpdateWeightsFromDiskRequest,
                                 timeout: float | None = None) -> dict:
        return self._success(paths.UPDATE_WEIGHTS_FROM_DISK, req, timeout)

    def update_weight_version(self, req: p.UpdateWeightVersionRequest,
                              timeout: float | None = None) -> dict:
        return self._success(paths.UPDATE_WEIGHT_VERSION, req, timeout)

    def get_weights_by_name(self, req: p.GetWeightsByNameRequest,
                            timeout: float | None = None) -> Any:
        return self.request("POST", paths.GET_WEIGHTS_BY_NAME, body=req, admin=True,
                            timeout=timeout)

    def weights_checker(self, req: p.WeightsCheckerRequest, timeout: float | None = None) -> dict:
        return self._success(paths.WEIGHTS_CHECKER, req, timeout)
