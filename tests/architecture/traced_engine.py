"""The reference engine with a `WalkTracer` installed: `python traced_engine.py OUT SPEC ARGS`.

OUT is where the recording goes (JSON), SPEC a JSON object `{"roots": {walk: "module.py:
function"}, "handoffs": [[module, function, argument], ...]}` and ARGS the engine's own
flags. The tracer is installed before the engine's normal entry point runs (runpy), so
every thread the engine starts is watched and the production code carries no test hook.
The recording is written on SIGUSR1 and at a normal exit; read it after SIGUSR1 (an engine
with TP ranks, its process group sent SIGTERM, leaves through `os._exit` when its ranks
die first, as a crashed sglang scheduler takes its server down).
"""

from __future__ import annotations

import atexit
import importlib
import json
import runpy
import signal
import sys

from walk_trace import Handoff, WalkTracer

ENGINE = "slime_like.reference_engine"
# What the entry point imports (server.py, then engine.py and http_server.py), before it runs.
PREIMPORT = ("uvicorn", "slime_like.reference_engine.engine", "slime_like.reference_engine.http_server")


def main() -> None:
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    tracer = WalkTracer(spec["roots"], handoffs=[Handoff(*h) for h in spec.get("handoffs", [])])

    def write(*_: object) -> None:
        tracer.recording().dump(out)

    atexit.register(write)
    signal.signal(signal.SIGUSR1, write)
    sys.argv = [ENGINE, *sys.argv[3:]]
    # The engine's imports first: module bodies are no walk, and under the hook they take
    # seconds more. Nothing else runs: no thread is started, no engine built.
    for name in PREIMPORT:
        importlib.import_module(name)
    tracer.install()
    runpy.run_module(ENGINE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
