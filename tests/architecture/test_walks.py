"""The weight tensor's walk in docs/ARCHITECTURE.md is the code's, module by module.

The trainer side of the walk, from the `Job` to the bytes on the wire, is read two ways:

- the doc's list, and each module on it names the next one's entry point (an import and a
  call: the Job hands the fleet's update to the trainer group itself, no callback);
- a real CPU sync: a trainer rank (the plain class the Ray actor wraps) pushes its model
  into a real reference engine over the `distributed` transport (gloo) while a profiler
  hook records, at every torch call that reads, copies or sends the weights' bytes during
  the transfer, which framework modules are on the stack. Every such stack must be a path
  down the doc's list, no module entered twice, and together they must cover it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.reference_engine.conftest import start_engine, stop_engine

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
PACKAGE = REPO / "slime_like"


def documented_walk(title: str) -> list[str]:
    """The modules of a walk block in ARCHITECTURE.md (the lines after its `title` line)."""
    text = ARCHITECTURE.read_text()
    block = text.split(title, 1)[1].split("```", 2)[1]
    return [m.group(1) for m in re.finditer(r"^\s*(?:->\s*)?([a-z_/]+\.py)\b", block, re.M)]


def module(path: str) -> str:
    return "slime_like." + path.removesuffix(".py").replace("/", ".")


TRAINER_SIDE = documented_walk("A weight tensor's walk, trainer side")
# Each module's entry point on the walk, and the call it makes into the next one.
ENTRY_CALLS = {
    "job/job.py": ("push_weights", "push_weights"),
    "trainer/group.py": ("push_weights", "push_weights"),
    "trainer/actor.py": ("push_weights", "update"),
    "weights/sync.py": ("_update", "transfer"),
    "weights/distributed.py": ("_send_flattened", "bucket_tensors"),
}


def test_the_trainer_side_walk_is_at_most_six_modules_none_twice():
    assert TRAINER_SIDE[0] == "job/job.py", TRAINER_SIDE
    assert len(TRAINER_SIDE) <= 6 and len(set(TRAINER_SIDE)) == len(TRAINER_SIDE), TRAINER_SIDE


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


def test_each_module_on_the_walk_imports_and_calls_the_next():
    for here, there in zip(TRAINER_SIDE, TRAINER_SIDE[1:], strict=False):
        source = (PACKAGE / here).read_text()
        assert module(there) in source, f"{here} does not import {there}"
        function, call = ENTRY_CALLS[here]
        assert call in _calls_in(PACKAGE / here, function), \
            f"{here}:{function} does not call {call} (the walk goes {here} -> {there})"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    e = start_engine(tiny_model_dir, tmp_path_factory.mktemp("walk-engine"))
    yield e
    stop_engine(e)


def _framework_path(frame) -> list[str]:
    """slime_like modules on the stack, outermost first, from the trainer rank down."""
    out = []
    while frame is not None:
        name = frame.f_code.co_filename
        if "/slime_like/" in name and "/tests/" not in name:
            mod = name.split("/slime_like/", 1)[1]
            if not mod.startswith("protocol/"):  # the structs both sides share: not counted
                out.append(mod)
        frame = frame.f_back
    out.reverse()
    start = out.index("trainer/actor.py") if "trainer/actor.py" in out else len(out)
    path: list[str] = []
    for m in out[start:]:
        if not path or path[-1] != m:
            path.append(m)
    return path


def _touches_bytes(frame, event: str, arg) -> bool:
    """A torch call on tensors (a Tensor method, a torch function such as `cat`), or a
    collective sending them; waiting on a collective's completion is not one."""
    if event == "c_call":
        return str(getattr(arg, "__qualname__", "")).startswith("TensorBase.") or \
            getattr(arg, "__module__", None) in ("torch", "torch._C._VariableFunctions")
    return event == "call" and frame.f_code.co_name == "broadcast" and \
        frame.f_code.co_filename.endswith("torch/distributed/distributed_c10d.py")


def test_a_real_sync_moves_the_bytes_through_exactly_the_documented_modules(
        engine, tiny_model_dir):
    from slime_like.engine.address import EngineAddress
    from slime_like.engine.session import EngineSession
    from slime_like.protocol.modes import Transport
    from slime_like.trainer.actor import TrainerRank
    from slime_like.weights.sync_config import WeightSyncConfig

    rank = TrainerRank(0, 1, str(tiny_model_dir), lr=1e-3, seed=0,
                       sync=WeightSyncConfig(transport=Transport.DISTRIBUTED,
                                             update_weight_buffer_size=1 << 16))
    rank.init("127.0.0.1", 0)
    paths: list[list[str]] = []

    def hook(frame, event, arg):
        if not _touches_bytes(frame, event, arg):
            return
        path = _framework_path(frame if event == "c_call" else frame.f_back)
        if "weights/distributed.py" in path:  # the transfer: the bytes themselves
            paths.append(path)

    sys.setprofile(hook)
    try:
        report = rank.push_weights([EngineSession(EngineAddress(engine.url, 1))], version=1, full=True)
    finally:
        sys.setprofile(None)
        rank.shutdown()
    assert report["weight_version"] == "1" and report["transfer"]["bytes"] > 0
    rank_side = TRAINER_SIDE[TRAINER_SIDE.index("trainer/actor.py"):]
    assert paths, "no torch call recorded during the transfer"
    for path in paths:  # each a path down the documented walk: no detour, no re-entry
        assert path == rank_side[:len(path)], (path, rank_side)
    assert sorted({m for p in paths for m in p}) == sorted(rank_side), (paths[:3], rank_side)
