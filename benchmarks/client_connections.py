"""A weight sync's control calls through the engine client as it is and as it was, side by
side in one run.

N reference engines (plain processes, the tiny layout, gloo) and two `WeightSync`s over
them, alternating sync by sync: "now", the product's `EngineClient` (each client's idle
connections shared by the threads that call it, answers parsed by `httptools`), and
"earlier", how it worked before (one `http.client` connection per calling thread;
emulated here by a subclass). Each sync's calls run on
the shared engine pool's threads, whichever is free. Steady syncs back to back, then (with
`--spaced K`) syncs `--gap-s` apart, as an RL step spaces them (past the engine's
keep-alive timeout, 30 s on the reference engine, an idle connection is closed by the
engine before it is used again). Prints one JSON line per spacing: each form's median sync
wall time, the driver's CPU per sync (`time.process_time`), connections opened per sync,
and the ratios now / earlier.

    python benchmarks/client_connections.py                   # 16 engines, back to back
    python benchmarks/client_connections.py --engines 8 --spaced 3 --gap-s 35
"""

from __future__ import annotations

import argparse
import http.client
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.records import emit  # noqa: E402
from benchmarks.weight_sync import (  # noqa: E402
    Engines,
    EngineSpec,
    _ParamsModule,
    layout_config,
    layout_metas,
    make_params,
    write_model_dir,
)
from slime_like.engine.address import EngineAddress  # noqa: E402
from slime_like.engine.client import EngineClient  # noqa: E402
from slime_like.engine.session import EngineSession  # noqa: E402
from slime_like.weights import WeightSync  # noqa: E402


class _HttpClientConnection:
    """The earlier connection: `http.client`'s, behind `KeepAliveConnection`'s interface."""

    def __init__(self, host: str, port: int, timeout: float):
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout)

    @property
    def sock(self):
        return self.conn.sock

    def connect(self) -> None:
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set_timeout(self, timeout: float) -> None:
        self.conn.timeout = timeout
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)

    def request(self, method, path, body, headers):
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        text = resp.read().decode("utf-8", errors="replace")
        return resp.status, text, not resp.will_close

    def closed_by_peer(self) -> bool:
        if self.conn.sock is None:
            return True
        return bool(select.select([self.conn.sock], [], [], 0)[0])

    def close(self) -> None:
        self.conn.close()


class EarlierClient(EngineClient):
    """The client as it was: one `http.client` connection per calling thread."""

    def _connection(self, timeout: float):
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.sock is None or conn.closed_by_peer():
            if conn is not None:
                conn.close()
            parts = urlsplit(self.url)
            conn = _HttpClientConnection(parts.hostname, parts.port, timeout)
            self._local.conn = conn
        conn.set_timeout(timeout)
        return conn

    def _release(self, conn) -> None:
        pass  # it stays this thread's


def _sessions(urls: list[str], earlier: bool) -> list[EngineSession]:
    out = []
    for url in urls:
        session = EngineSession(EngineAddress(url))
        if earlier:
            session.http = EarlierClient(url, timeout=session.http.timeout)
        out.append(session)
    return out


def _one(sync: WeightSync, model: torch.nn.Module, version: int) -> tuple[float, float, int]:
    """One sync: wall seconds, this process's CPU seconds, connections opened."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)
    opened = sum(s.http.connections_opened for s in sync.engines)
    cpu, t = time.process_time(), time.perf_counter()
    sync.update(model, str(version))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    return wall, cpu, sum(s.http.connections_opened for s in sync.engines) - opened


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--steady", type=int, default=20, help="syncs of each form back to back")
    ap.add_argument("--spaced", type=int, default=0, help="syncs of each form --gap-s apart")
    ap.add_argument("--gap-s", type=float, default=35.0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="client-connections-") as work:
        config = layout_config("tiny_dense")
        model_dir = write_model_dir(config, Path(work))
        engines = Engines(model_dir, [EngineSpec(f"e{i}", 1, 0) for i in range(args.engines)],
                          False, Path(work))
        metas = layout_metas(config)
        model = _ParamsModule(metas, make_params(metas, torch.device("cpu"), seed=0))
        forms = {"now": WeightSync(_sessions(engines.urls, False), http_timeout_s=60),
                 "earlier": WeightSync(_sessions(engines.urls, True), http_timeout_s=60)}
        try:
            version = 0
            for sync in forms.values():  # groups formed, every call type answered once
                for _ in range(3):
                    version += 1
                    _one(sync, model, version)
            spacings = [("back to back", args.steady), (f"{args.gap_s} s apart", args.spaced)]
            for spacing, count in [(s, n) for s, n in spacings if n > 0]:
                samples: dict[str, list[tuple[float, float, int]]] = {f: [] for f in forms}
                for _ in range(count):
                    for name, sync in forms.items():  # alternating: both see the same machine
                        if spacing != "back to back":
                            time.sleep(args.gap_s)
                        version += 1
                        samples[name].append(_one(sync, model, version))
                rows = {}
                for name, got in samples.items():
                    rows[name] = {
                        "sync_ms": round(1e3 * statistics.median(w for w, _, _ in got), 2),
                        "driver_cpu_ms": round(1e3 * statistics.median(c for _, c, _ in got), 2),
                        "connections_per_sync": round(statistics.mean(n for _, _, n in got), 2)}
                emit({"benchmark": "client_connections", "engines": args.engines,
                      "spacing": spacing, "syncs": count, **{f"{k}_{m}": v for k, r in rows.items()
                                                            for m, v in r.items()},
                      "ratio_sync": round(rows["now"]["sync_ms"]
                                          / rows["earlier"]["sync_ms"], 3),
                      "ratio_driver_cpu": round(rows["now"]["driver_cpu_ms"]
                                                / rows["earlier"]["driver_cpu_ms"], 3),
                      "threads": threading.active_count()}, args.json_out)
        finally:
            for sync in forms.values():
                sync.close()
            engines.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
