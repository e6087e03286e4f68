"""The engine side of a weight bucket's walk, recorded in the reference engine's own process.

A real reference engine runs under `traced_engine.py` (a `WalkTracer` on every thread,
installed before the engine's entry point); this process pushes a model into it through
`WeightSync`'s public API over both transports that carry bytes into the engine: the
`distributed` one (a real gloo weight group) and `tensor` (payloads through shared memory).
From each update route's handler until it answers (the parameter copy included), every
path the engine's threads took must hold at most five modules, none entered twice, and
together they must be the tree docs/ARCHITECTURE.md prints for that transport. The trees
are printed (`pytest -s`); a change that moves the walk changes the doc with it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from walk_trace import Recording, parse_walk

from tests.reference_engine.conftest import start_engine, stop_engine

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
ENGINE_LIMIT = 5
ROUTES = "reference_engine/weight_api.py"
SPEC = {
    "roots": {"distributed": f"{ROUTES}:update_weights_from_distributed",
              "tensor": f"{ROUTES}:update_weights_from_tensor"},
    # The scheduler thread runs what the routes hand it (between forward steps).
    "handoffs": [["reference_engine/scheduler.py", "Scheduler.call", "fn"]],
}
TITLES = {"distributed": "A weight tensor's walk, engine side, `distributed` transport",
          "tensor": "A weight tensor's walk, engine side, `tensor` transport"}


def documented(title: str) -> str:
    """The code block that follows `title` in ARCHITECTURE.md."""
    return ARCHITECTURE.read_text().split(title, 1)[1].split("```", 2)[1]


@pytest.fixture(scope="module")
def recording(tiny_model_dir, tmp_path_factory) -> Recording:
    from slime_like.models.loading import init_dummy_weights, load_pretrained
    from slime_like.weights import WeightSync

    work = tmp_path_factory.mktemp("engine-walk")
    out = work / "walk.json"
    wrapper = str(Path(__file__).with_name("traced_engine.py"))
    engine = start_engine(tiny_model_dir, work, program=(wrapper, str(out), json.dumps(SPEC)))
    try:
        for seed, transport in enumerate(("distributed", "tensor")):
            model = load_pretrained(tiny_model_dir)
            init_dummy_weights(model, seed=seed + 1)
            sync = WeightSync([(engine.url, 1)], transport=transport,
                              update_weight_buffer_size=16 << 10, http_timeout_s=60,
                              group_timeout_s=60)
            try:
                sync.update(model)  # raises unless every engine verified the new version
            finally:
                sync.close()
        os.kill(engine.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop_engine(engine)
    return Recording.load(out)


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_the_engine_side_walk_is_short_and_documented(recording, transport):
    tree = recording.tree(transport)
    print(f"\n{transport}:\n{tree.render()}")
    assert tree.root is not None, f"nothing recorded for {transport}"
    touched = {k for _, kinds in recording.walks[transport].values() for k in kinds}
    assert {"bytes", "metadata"} <= touched, touched
    assert not tree.problems(ENGINE_LIMIT), "\n".join(tree.problems(ENGINE_LIMIT))
    assert tree == parse_walk(documented(TITLES[transport])), tree.render()
