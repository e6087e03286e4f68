"""The trainer side of a weight bucket's walk in docs/ARCHITECTURE.md is the code's.

The walk runs from the job's push to the bytes and metadata leaving for the engines, in two
parts:

- the hops that cross into the trainer's rank (job -> trainer group -> Ray -> trainer rank
  -> WeightSync): the doc's chain, each module importing the next and calling its entry
  point (a Ray call is not a Python call a profiler can follow, so this part is read);
- the transfer itself, recorded: a trainer rank (the plain class the Ray actor wraps) pushes
  its model into a real reference engine over each transport that carries bytes (the
  `distributed` one over gloo, `tensor` through shared memory) while a `WalkTracer`
  (`walk_trace.py`) watches every thread from `WeightSync._transfer` on: the rank's own
  thread packing and broadcasting, and every per-engine call on the pool's threads. Each
  root-to-leaf branch, the chain above it included, holds at most six modules and enters
  none twice, and the recorded tree is the one the doc prints for that transport.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from walk_trace import Handoff, Recording, WalkTracer, parse_walk

from tests.reference_engine.conftest import start_engine, stop_engine

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
PACKAGE = REPO / "slime_like"
TRAINER_LIMIT = 6
ROOT = "weights/sync.py:WeightSync._transfer"
LOOP_HANDOFF = Handoff("engine/session.py", "EngineSession.submit_steps", "fn")
TITLES = {"distributed": "A weight bucket's walk, trainer side, `distributed` transport",
          "tensor": "A weight bucket's walk, trainer side, `tensor` transport"}


def documented(title: str) -> str:
    """The code block that follows `title` in ARCHITECTURE.md."""
    return ARCHITECTURE.read_text().split(title, 1)[1].split("```", 2)[1]


def module(path: str) -> str:
    return "slime_like." + path.removesuffix(".py").replace("/", ".")


CHAIN = [m.group(1) for m in re.finditer(
    r"^\s*(?:->\s*)?([a-z_/]+\.py)\b", documented("A weight bucket's walk, into the trainer"),
    re.M)]
# Each module's entry point on the chain, and the call it makes into the next one.
ENTRY_CALLS = {
    "job/job.py": ("push_weights", "push_weights"),
    "trainer/group.py": ("push_weights", "push_weights"),
    "trainer/actor.py": ("push_weights", "update"),
}


def test_the_chain_into_the_trainer_is_the_code():
    assert CHAIN == ["job/job.py", "trainer/group.py", "trainer/actor.py", "weights/sync.py"]
    for here, there in zip(CHAIN, CHAIN[1:], strict=False):
        source = (PACKAGE / here).read_text()
        assert module(there) in source, f"{here} does not import {there}"
        function, call = ENTRY_CALLS[here]
        assert call in _calls_in(PACKAGE / here, function), \
            f"{here}:{function} does not call {call} (the walk goes {here} -> {there})"


def _calls_in(path: Path, function: str) -> set[str]:
    """Every name a call in `function` goes through (`a.b.remote()`: b and remote)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            names = set()
            for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
                func = call.func
                while isinstance(func, ast.Attribute):
                    names.add(func.attr)
                    func = func.value
                if isinstance(func, ast.Name):
                    names.add(func.id)
            return names
    raise AssertionError(f"{path.relative_to(REPO)} has no function {function}")


@pytest.fixture(scope="module")
def recording(tiny_model_dir, tmp_path_factory) -> dict[str, Recording]:
    import slime_like.engine.call_pool as call_pool
    from slime_like.engine.address import EngineAddress
    from slime_like.engine.session import EngineSession
    from slime_like.trainer.actor import TrainerRank
    from slime_like.weights.sync_config import WeightSyncConfig

    engine = start_engine(tiny_model_dir, tmp_path_factory.mktemp("walk-engine"))
    out: dict[str, Recording] = {}
    try:
        for transport in ("distributed", "tensor"):
            rank = TrainerRank(0, 1, str(tiny_model_dir), lr=1e-3, seed=0, sync=WeightSyncConfig(
                transport=transport, update_weight_buffer_size=1 << 16))
            rank.init("127.0.0.1", 0)
            try:
                target = [EngineSession(EngineAddress(engine.url))]
                rank.push_weights(target, version=1, full=True)  # attached: the group formed
                # The engine calls run on the process's one pool, whose threads start
                # lazily: a fresh pool starts them under the tracer, which then sees them.
                call_pool._POOL = None
                if call_pool._LOOP is not None:  # the same for the engine-call loop
                    call_pool._LOOP.stop()
                    call_pool._LOOP = None
                # A lane call written as steps is handed to the engine-call loop's thread
                # where the session queues it; the loop runs its first step in the frame
                # that holds it.
                tracer = WalkTracer({transport: ROOT}, handoffs=[LOOP_HANDOFF])
                with tracer:
                    report = rank.push_weights(target, version=2, full=True)
                assert report["weight_version"] == "2" and report["transfer"]["bytes"] > 0
                out[transport] = tracer.recording()
            finally:
                rank.shutdown()
    finally:
        stop_engine(engine)
    return out


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_the_trainer_side_walk_is_short_and_documented(recording, transport):
    tree = recording[transport].tree(transport)
    print(f"\n{transport}:\n{tree.render()}")
    assert tree.root is not None, f"nothing recorded for {transport}"
    touched = {k for _, kinds in recording[transport].walks[transport].values() for k in kinds}
    assert {"bytes", "metadata"} <= touched, touched
    # Every per-engine call was seen on its own thread, down to the HTTP client.
    assert any(branch[-1] == "engine/client.py" for branch in tree.branches()), tree.render()
    above = len(CHAIN) - 1  # the chain's modules above weights/sync.py, where the tree starts
    problems = tree.problems(TRAINER_LIMIT - above)
    assert not problems, "\n".join(problems)
    assert tree == parse_walk(documented(TITLES[transport])), tree.render()
