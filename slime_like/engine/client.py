"""EngineClient: the only place that knows SGLang's URLs and bodies.

Every call has a timeout, posts `{}` rather than no body (sglang answers 400 to a bodiless
control call), and raises `EngineError` naming the engine URL, endpoint, HTTP status and
body. Only idempotent reads are retried; a weight update or a pause is never re-sent
behind the caller's back.

Plain `http://` engines are spoken to over kept connections whose answers `httptools`
parses (`engine/keepalive.py`): a weight sync is a chain of small control calls, and
`requests` adds about a third of a millisecond to each, `http.client` a tenth. `https://`
goes through `requests`. A call is first prepared (`HttpCall`: its bytes, timeout and what
counts as success), then performed: here, on the calling thread, or by the engine-call
loop (`engine/call_pool.py`), which reads its answer back through `answer`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from slime_like.engine.keepalive import KeptConnections
from slime_like.errors import EngineError
from slime_like.protocol import io_struct as p
from slime_like.protocol import paths
from slime_like.protocol.modes import PauseMode

DEFAULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class HttpCall:
    """One prepared call to one engine: what to send, and how to read its answer."""

    client: EngineClient
    method: str
    endpoint: str
    path: str  # the endpoint and its query
    data: bytes | None
    headers: dict[str, str]
    timeout: float
    params: dict | None
    expect_json: bool
    ok_statuses: tuple[int, ...]
    check_success: bool  # an answer {"success": false} is a failure too


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
        self._read_retries = read_retries
        self.kept = KeptConnections(self.url, read_retries)  # plain http:// only

    @property
    def connections_opened(self) -> int:
        """Connections opened over the client's life: few, however many threads call."""
        return self.kept.connections_opened

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

    def prepare(self, method: str, endpoint: str, *, body: Any = None,
                params: dict | None = None, timeout: float | None = None, admin: bool = False,
                expect_json: bool = True, ok_statuses: tuple[int, ...] = (200,),
                check_success: bool = False) -> HttpCall:
        """One call, ready to be performed (here or by the engine-call loop)."""
        headers = self._headers(admin)
        data = None
        if method != "GET" or body is not None:
            data = json.dumps(_dump(body)).encode()
            headers["Content-Type"] = "application/json"
        path = endpoint + (f"?{urlencode(params)}" if params else "")
        return HttpCall(self, method, endpoint, path, data, headers, timeout or self.timeout,
                        params, expect_json, ok_statuses, check_success)

    def perform(self, call: HttpCall) -> Any:
        """Send the call on this thread and read its answer; any status outside its
        `ok_statuses` raises EngineError."""
        if self.plain:
            return self.answer(call, *self.kept.call(call))
        kwargs: dict[str, Any] = {"headers": call.headers, "params": call.params,
                                  "timeout": call.timeout, "data": call.data}
        try:
            resp = self.session.request(call.method, self.url + call.endpoint, **kwargs)
        except requests.Timeout as e:
            raise EngineError(self.url, call.endpoint, None, str(e),
                              reason=f"timed out after {call.timeout}s") from e
        except requests.RequestException as e:
            raise EngineError(self.url, call.endpoint, None, str(e),
                              reason="connection failed") from e
        return self.answer(call, resp.status_code, resp.text)

    def answer(self, call: HttpCall, status: int, text: str) -> Any:
        """What the call's answer means: its JSON (or text), or EngineError."""
        if status not in call.ok_statuses:
            raise EngineError(self.url, call.endpoint, status, text)
        if not call.expect_json:
            return text
        if not text:
            return None
        try:
            out = json.loads(text)
        except json.JSONDecodeError:
            return text
        if call.check_success and isinstance(out, dict) and \
                not p.SuccessMessage.model_validate(out).success:
            raise EngineError(self.url, call.endpoint, 200, json.dumps(out))
        return out

    def request(self, method: str, endpoint: str, *, body: Any = None, params: dict | None = None,
                timeout: float | None = None, admin: bool = False, expect_json: bool = True,
                ok_statuses: tuple[int, ...] = (200,)) -> Any:
        """One HTTP call; any status outside `ok_statuses` raises EngineError."""
        return self.perform(self.prepare(method, endpoint, body=body, params=params,
                                         timeout=timeout, admin=admin, expect_json=expect_json,
                                         ok_statuses=ok_statuses))

    @property
    def plain(self) -> bool:
        """Plain http:// (kept connections), not https:// (requests)."""
        return self.url.startswith("http://")

    def abort_waiting(self) -> int:
        """Reset the connection of every call still awaiting its answer (a hung engine's),
        and fail the call at once; how many (`KeptConnections.abort_waiting`)."""
        return self.kept.abort_waiting()

    def close(self) -> None:
        """Close the idle keep-alive connections (one in use closes when its call ends)."""
        self.kept.close()

    def _success(self, endpoint: str, body: Any, timeout: float | None = None) -> dict:
        """Calls answering {"success","message"}: a 400 or success=false raises."""
        return self.perform(self._success_call(endpoint, body, timeout))

    def _success_call(self, endpoint: str, body: Any, timeout: float | None) -> HttpCall:
        return self.prepare("POST", endpoint, body=body, timeout=timeout, admin=True,
                            check_success=True)

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
        return self.perform(self.model_info_call(timeout))

    def model_info_call(self, timeout: float | None = None) -> HttpCall:
        return self.prepare("GET", paths.MODEL_INFO, timeout=timeout)

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
        return self.perform(self.pause_call(mode, timeout))

    def pause_call(self, mode: PauseMode = PauseMode.RETRACT,
                   timeout: float | None = None) -> HttpCall:
        return self.prepare("POST", paths.PAUSE_GENERATION,
                            body=p.PauseGenerationRequest(mode=mode), admin=True, timeout=timeout)

    def continue_generation(self, torch_empty_cache: bool = True,
                            timeout: float | None = None) -> dict:
        return self.perform(self.continue_call(torch_empty_cache, timeout))

    def continue_call(self, torch_empty_cache: bool = True,
                      timeout: float | None = None) -> HttpCall:
        return self.prepare("POST", paths.CONTINUE_GENERATION,
                            body=p.ContinueGenerationRequest(torch_empty_cache=torch_empty_cache),
                            admin=True, timeout=timeout)

    def abort_request(self, rid: str = "", abort_all: bool = False,
                      timeout: float | None = None) -> None:
        self.request("POST", paths.ABORT_REQUEST, body=p.AbortRequest(rid=rid, abort_all=abort_all),
                     admin=True, timeout=timeout)

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """POST /flush_cache; True when flushed, False when the engine was not idle (400)."""
        try:
            self.perform(self.flush_call(timeout_s))
            return True
        except EngineError as e:
            if e.status == 400:
                return False
            raise

    def flush_call(self, timeout_s: float = 0.0) -> HttpCall:
        """POST /flush_cache; its 400 (not idle) is the caller's to read as "refused"."""
        return self.prepare("POST", paths.FLUSH_CACHE,
                            params={"timeout": timeout_s} if timeout_s else None, admin=True,
                            expect_json=False, timeout=max(self.timeout, timeout_s + 10))

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
        return self.perform(self.init_weights_update_group_call(req, timeout))

    def init_weights_update_group_call(self, req: p.InitWeightsUpdateGroupRequest,
                                       timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.INIT_WEIGHTS_UPDATE_GROUP, req, timeout)

    def destroy_weights_update_group(self, group_name: str = p.DEFAULT_GROUP_NAME,
                                     timeout: float | None = None) -> dict:
        return self.perform(self.destroy_weights_update_group_call(group_name, timeout))

    def destroy_weights_update_group_call(self, group_name: str = p.DEFAULT_GROUP_NAME,
                                          timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.DESTROY_WEIGHTS_UPDATE_GROUP,
                                  p.DestroyWeightsUpdateGroupRequest(group_name=group_name),
                                  timeout)

    def begin_weight_update(self, timeout: float | None = None) -> dict:
        return self.perform(self.begin_weight_update_call(timeout))

    def begin_weight_update_call(self, timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.BEGIN_WEIGHT_UPDATE, p.BeginWeightUpdateRequest(),
                                  timeout)

    def end_weight_update(self, timeout: float | None = None) -> dict:
        return self.perform(self.end_weight_update_call(timeout))

    def end_weight_update_call(self, timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.END_WEIGHT_UPDATE, p.EndWeightUpdateRequest(), timeout)

    def update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest,
                                        timeout: float | None = None) -> dict:
        return self.perform(self.update_weights_from_distributed_call(req, timeout))

    def update_weights_from_distributed_call(self, req: p.UpdateWeightsFromDistributedRequest,
                                             timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.UPDATE_WEIGHTS_FROM_DISTRIBUTED, req, timeout)

    def update_weights_from_tensor(self, req: p.UpdateWeightsFromTensorRequest,
                                   timeout: float | None = None) -> dict:
        return self.perform(self.update_weights_from_tensor_call(req, timeout))

    def update_weights_from_tensor_call(self, req: p.UpdateWeightsFromTensorRequest,
                                        timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.UPDATE_WEIGHTS_FROM_TENSOR, req, timeout)

    def update_weights_from_disk(self, req: p.UpdateWeightsFromDiskRequest,
                                 timeout: float | None = None) -> dict:
        return self.perform(self.update_weights_from_disk_call(req, timeout))

    def update_weights_from_disk_call(self, req: p.UpdateWeightsFromDiskRequest,
                                      timeout: float | None = None) -> HttpCall:
        return self._success_call(paths.UPDATE_WEIGHTS_FROM_DISK, req, timeout)

    def update_weight_version(self, req: p.UpdateWeightVersionRequest,
                              timeout: float | None = None) -> dict:
        return self._success(paths.UPDATE_WEIGHT_VERSION, req, timeout)

    def get_weights_by_name(self, req: p.GetWeightsByNameRequest,
                            timeout: float | None = None) -> Any:
        return self.request("POST", paths.GET_WEIGHTS_BY_NAME, body=req, admin=True,
                            timeout=timeout)

    def weights_checker(self, req: p.WeightsCheckerRequest, timeout: float | None = None) -> dict:
        return self._success(paths.WEIGHTS_CHECKER, req, timeout)
