"""Imports run only downward through the layers of docs/ARCHITECTURE.md, with no circles.

A module may import its own layer or any layer below it. The reference engine is its own
program: it sees the protocol and the models, never the framework above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slime_like"

# Lowest first. A module's layer is the first entry its dotted name starts with.
LAYERS: list[tuple[str, ...]] = [
    ("slime_like.errors", "slime_like.flag_tables", "slime_like.models", "slime_like.version"),
    ("slime_like.config",),
    ("slime_like.cluster",),
    ("slime_like.protocol",),
    ("slime_like.reference_engine",),
    ("slime_like.engine",),
    ("slime_like.router",),
    ("slime_like.rollout",),
    ("slime_like.weights",),
    ("slime_like.trainer",),
    ("slime_like.api", "slime_like.train", "slime_like.cli", "slime_like.report",
     "slime_like.tracking", "slime_like.progress", "slime_like.job", "slime_like"),
]

# What the reference engine (a separate program) may import from the framework.
REFERENCE_ENGINE_MAY_IMPORT = ("slime_like.protocol", "slime_like.models", "slime_like.errors",
                               "slime_like.flag_tables", "slime_like.reference_engine")


def layer_of(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and ARCHITECTURE.md")
    return best[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("slime_like")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("slime_like"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            # `from slime_like.x import y` names module x.y when y is a submodule
            out += [(node.lineno, n if (PACKAGE.parent / n.replace(".", "/")).with_suffix(".py").exists()
                     or (PACKAGE.parent / n.replace(".", "/")).is_dir() else node.module)
                    for n in names]
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_downward(path: Path):
    me = module_name(path)
    mine = layer_of(me)
    upward = [f"line {line}: {target} (layer {layer_of(target)} > {mine})"
              for line, target in imports_of(path) if layer_of(target) > mine]
    assert not upward, f"{me} imports upward: " + "; ".join(upward)


def test_reference_engine_imports_only_protocol_and_models():
    for path in (PACKAGE / "reference_engine").rglob("*.py"):
        bad = [f"line {line}: {t}" for line, t in imports_of(path)
               if not t.startswith(REFERENCE_ENGINE_MAY_IMPORT)]
        assert not bad, f"{module_name(path)} imports the framework: {bad}"


def test_no_import_cycles_between_modules():
    graph = {module_name(p): {t for _, t in imports_of(p)} for p in MODULES}
    # resolve package imports to their __init__ module name
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph.get(m, ()):
            if t == m or t not in graph:
                continue
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if state.get(t) is None:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
