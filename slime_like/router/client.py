"""RouterClient: the routers' control plane (readiness, add/list/remove workers); the same
API in sglang-router 0.3.x and smg.

Worker management in 0.3.x is asynchronous: `POST /workers` answers 202 with a worker id
before the worker is live, and `DELETE /workers/{id}` (a UUID, not the URL) answers 202
before it is gone. Every call here waits for the effect it asked for, with a deadline, and
says what it waited for when it gives up.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import requests

from slime_like.cluster.polling import poll_intervals
from slime_like.errors import RouterError
from slime_like.protocol.modes import ROUTED_WORKER_TYPES, WorkerType


@dataclass(frozen=True)
class WorkerInfo:
    """One entry of `GET /workers`."""

    id: str
    url: str
    worker_type: WorkerType | str  # a type this package does not know stays the router's word
    is_healthy: bool
    bootstrap_port: int | None
    raw: dict

    @classmethod
    def from_json(cls, d: dict) -> WorkerInfo:
        word = d.get("worker_type") or WorkerType.REGULAR
        kind = WorkerType(word) if word in set(WorkerType) else word
        return cls(id=d["id"], url=d["url"], worker_type=kind,
                   is_healthy=bool(d.get("is_healthy")), bootstrap_port=d.get("bootstrap_port"),
                   raw=d)


# A removal is looked for again at once this many times before the waits between looks
# grow: smg drops a removed worker from its list 2-5 ms after the DELETE, and one listing
# takes about 1 ms (2 ms at 64 workers), so looks back to back see the change within a
# listing of it. From a 2 ms wait growing 1.5x, a removal was seen 4.7 ms after the DELETE at
# 4 workers and 6 ms at 64 (two cores); back to back, 3.6-4.0 ms at both.
REMOVAL_SPIN_LOOKS = 8


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class RouterClient:
    """Typed calls to one sglang-router; errors are RouterError naming the router and call."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 10.0,
                 worker_fields: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        # Extra fields of every `POST /workers` body this router kind needs (kinds.py).
        self.worker_fields = dict(worker_fields or {})
        self._session = requests.Session()
        self._session.trust_env = False  # a proxy between us and our own router only breaks things
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def _call(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kw) -> requests.Response:
        try:
            resp = self._session.request(method, self.url + path, timeout=kw.pop("timeout", self.timeout), **kw)
        except requests.RequestException as e:
            raise RouterError(f"router {self.url}{path}: {method} failed: {e}") from e
        if resp.status_code not in ok:
            raise RouterError(f"router {self.url}{path}: {method} answered HTTP "
                              f"{resp.status_code}: {resp.text[:2000]}")
        return resp

    # ---- liveness and readiness ------------------------------------------------------------

    def is_live(self) -> bool:
        try:
            return self._session.get(self.url + "/liveness", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def readiness(self) -> dict:
        """`GET /readiness` as a dict; `status` is "ready" or "not ready" (503)."""
        return self._call("GET", "/readiness", ok=(200, 503)).json()

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.2) -> dict:
        """Wait until the router has enough healthy workers (PD: one prefill and one decode)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.readiness()
                if last.get("status") == "ready":
                    return last
            except RouterError as e:
                last = str(e)
            time.sleep(interval)
        raise RouterError(f"router {self.url} not ready after {timeout:.0f}s; last /readiness: {last}")

    # ---- workers ---------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerInfo]:
        return [WorkerInfo.from_json(w) for w in self._listing()]

    def _listing(self) -> list[dict]:
        """`GET /workers` as the router wrote it: what a look that needs only ids and URLs
        reads, without a `WorkerInfo` per worker."""
        return self._call("GET", "/workers").json()["workers"]

    def find_worker(self, url: str) -> WorkerInfo | None:
        return next((w for w in self.list_workers() if _same_url(w.url, url)), None)

    def _job_status(self, worker_id: str) -> dict | None:
        resp = self._call("GET", f"/workers/{worker_id}", ok=(200, 404))
        return None if resp.status_code == 404 else resp.json().get("job_status")

    def add_worker(self, url: str, *, worker_type: WorkerType = WorkerType.REGULAR,
                   bootstrap_port: int | None = None,
                   api_key: str | None = None, timeout: float = 60.0, post_retries: int = 3) -> WorkerInfo:
        """Register a worker and wait until `GET /workers` lists it healthy.

        The POST is retried (bounded) when the router cannot be reached. A registration
        that does not complete in time is asked to be removed, but sglang-router 0.3 cannot
        cancel an add it is still probing: it lands once the worker answers its health
        check. So do not register a worker that cannot answer now (e.g. one paused for a
        weight update) unless it may serve whenever it answers.
        """
        if worker_type not in ROUTED_WORKER_TYPES:
            raise RouterError(f"worker_type {str(worker_type)!r} for {url} is not one of "
                              f"{tuple(t.value for t in ROUTED_WORKER_TYPES)}")
        worker_type = WorkerType(worker_type)
        if worker_type == WorkerType.PREFILL and bootstrap_port is None:
            raise RouterError(f"prefill worker {url} needs a bootstrap_port")
        existing = self.find_worker(url)
        if existing is not None and existing.is_healthy:
            return existing
        body: dict[str, Any] = {**self.worker_fields, "url": url, "worker_type": worker_type.value}
        if bootstrap_port is not None:
            body["bootstrap_port"] = int(bootstrap_port)
        if api_key:
            body["api_key"] = api_key
        for attempt in range(post_retries):
            try:
                worker_id = self._call("POST", "/workers", ok=(200, 201, 202), json=body).json()["worker_id"]
                break
            except RouterError:
                if attempt == post_retries - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
        deadline = time.monotonic() + timeout
        job: Any = None
        waits = poll_intervals()
        while time.monotonic() < deadline:
            found = self.find_worker(url)
            if found is not None and found.is_healthy:
                return found
            job = self._job_status(worker_id) or job
            if isinstance(job, dict) and job.get("status") == "failed":
                raise RouterError(f"router {self.url} could not add worker {url}: {job.get('message')}")
            time.sleep(next(waits))
        self._withdraw(worker_id)
        raise RouterError(f"router {self.url}: worker {url} ({worker_type}) not listed healthy "
                          f"after {timeout:.0f}s; removal requested (it may still land when the worker "
                          f"answers); last job status: {job}")

    def _withdraw(self, worker_id: str) -> None:
        # Best effort: the caller is already failing with the more useful error.
        with contextlib.suppress(RouterError):
            self._delete(worker_id)

    def remove_worker(self, worker_id: str | None = None, *, url: str | None = None,
                      timeout: float = 30.0) -> bool:
        """Remove a worker by id (or look it up by URL) and wait until it is gone.

        With a URL, until that URL is gone too: an id can be stale (the router re-keyed the
        worker, and a chaos run once left an engine routed that way), so a worker still
        listed at the URL under another id is removed as well, checked in the same listings
        rather than one more. False when there was nothing to remove.
        """
        if worker_id is None:
            if url is None:
                raise RouterError("remove_worker needs a worker id or a URL")
            found = self.find_worker(url)
            if found is None:
                return False
            worker_id = found.id
        removed = self._delete(worker_id)
        if not removed and url is None:
            return False
        deadline = time.monotonic() + timeout
        waits = itertools.chain(itertools.repeat(0.0, REMOVAL_SPIN_LOOKS), poll_intervals())
        while time.monotonic() < deadline:
            workers = self._listing()  # ids and URLs are all a look reads
            if all(w.get("id") != worker_id for w in workers):
                other = None if url is None else next(
                    (w for w in workers if _same_url(w.get("url", ""), url)), None)
                if other is None:
                    return removed
                worker_id = other["id"]  # listed under another id: that one goes too
                removed = self._delete(worker_id) or removed
                continue
            time.sleep(next(waits))
        raise RouterError(f"router {self.url}: worker {worker_id}{f' ({url})' if url else ''} "
                          f"still listed {timeout:.0f}s after DELETE /workers")

    def _delete(self, worker_id: str) -> bool:
        """Ask the router to remove one worker; False when it knows no such id."""
        resp = self._call("DELETE", f"/workers/{worker_id}", ok=(200, 202, 404))
        return resp.status_code != 404

    # ---- data plane (tests, probes) --------------------------------------------------------

    def generate(self, body: dict, timeout: float = 60.0) -> Any:
        return self._call("POST", "/generate", json=body, timeout=timeout).json()
