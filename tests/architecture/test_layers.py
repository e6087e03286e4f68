"""Imports run only downward through the layers of docs/ARCHITECTURE.md, with no circles
(not even through imports under `if TYPE_CHECKING:`).

A module may import its own layer or any layer below it. The reference engine is its own
program: it sees the protocol and the models, never the framework above them. The package
root holds only the entry points, the public API and the exceptions; `weights/`,
`protocol/` and the reference engine run without Ray or sglang; a fleet event's kind is
always one of the fleet's enums, never a bare state name, and so is each of the four modes
(pause mode, transport, async mode, worker type) wherever code compares, looks up, passes
or defaults one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slime_like"

# Lowest first. A module's layer is the first entry its dotted name starts with.
LAYERS: list[tuple[str, ...]] = [
    ("slime_like.errors", "slime_like.models"),
    ("slime_like.protocol",),
    ("slime_like.config",),
    ("slime_like.cluster",),
    ("slime_like.reference_engine",),
    ("slime_like.engine",),
    ("slime_like.router",),
    ("slime_like.rollout",),
    ("slime_like.weights",),
    ("slime_like.fleet",),
    ("slime_like.trainer",),
    ("slime_like.chaos",),
    ("slime_like.observe",),
    ("slime_like.submit",),
    ("slime_like.job",),
    ("slime_like.api",),
    ("slime_like.train",),
    ("slime_like.cli",),
]
# The package's own __init__ (its version) sits at the bottom: anything may import it.
PACKAGE_INIT = "slime_like"

# What the reference engine (a separate program) may import from the framework.
REFERENCE_ENGINE_MAY_IMPORT = ("slime_like.protocol", "slime_like.models", "slime_like.errors",
                               "slime_like.reference_engine")


def layer_of(module: str) -> int:
    if module == PACKAGE_INIT:
        return 0
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


def _typing_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (they name types, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out.update(id(n) for child in node.body for n in ast.walk(child))
    return out


def _import_nodes(path: Path, typing: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module (functions too); `typing=False` leaves out the
    ones under `if TYPE_CHECKING:` (a part naming the type of the object that owns it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if typing else _typing_only(tree)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
            and id(n) not in skip]


def imports_of(path: Path, *, typing: bool = True) -> list[tuple[int, str]]:
    """(line, module) of every slime_like import."""
    out = []
    for node in _import_nodes(path, typing):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("slime_like")]
        elif node.module and node.level == 0 and node.module.startswith("slime_like"):
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t == m or t not in graph:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if state.get(t) is None and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles_between_modules():
    """Counting the imports under `if TYPE_CHECKING:`: a part that names its owner's type
    there still knows its owner (a circle the interpreter never sees, but a reader does)."""
    cycle = find_cycle({module_name(p): {t for _, t in imports_of(p)} for p in MODULES})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_circle_through_type_checking_imports_is_a_cycle(tmp_path: Path):
    (tmp_path / "owner.py").write_text("from slime_like.fleet.part import Part\n")
    (tmp_path / "part.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                      "    from slime_like.fleet.owner import Owner\n")
    graph = {f"slime_like.fleet.{p.stem}": {t for _, t in imports_of(p)}
             for p in tmp_path.glob("*.py")}
    assert find_cycle(graph) == ["slime_like.fleet.owner", "slime_like.fleet.part",
                                 "slime_like.fleet.owner"]


# The package root: the entry points (train, cli), the public API and the exceptions.
ROOT_MODULES = {"__init__", "api", "cli", "errors", "train"}


def test_package_root_holds_only_the_allowed_modules():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_MODULES)
    assert not loose, (f"modules at the package root outside {sorted(ROOT_MODULES)}: {loose}; "
                       "put them in the package of their concern (see ARCHITECTURE.md)")
    packages = [d for d in PACKAGE.iterdir() if d.is_dir() and any(d.glob("*.py"))]
    assert all((d / "__init__.py").is_file() for d in packages), \
        [d.name for d in packages if not (d / "__init__.py").is_file()]


def _third_party(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every import that runs, wherever it sits (functions too)."""
    out = []
    for node in _import_nodes(path, typing=False):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif node.module and node.level == 0:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


# Plain processes on a GPU host (the benchmarks run them so): no Ray, no sglang, down to
# everything they import from the framework.
WITHOUT_RAY = ("slime_like.weights", "slime_like.protocol", "slime_like.reference_engine")


@pytest.mark.parametrize("package", WITHOUT_RAY)
def test_weights_protocol_and_reference_engine_import_neither_ray_nor_sglang(package: str):
    by_name = {module_name(p): p for p in MODULES}
    graph = {m: {t for _, t in imports_of(p, typing=False) if t in by_name}
             for m, p in by_name.items()}
    for start in [m for m in by_name if m == package or m.startswith(package + ".")]:
        seen, todo = set(), [start]
        while todo:  # every framework module it imports, directly or through others
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo += graph.get(m, ())
        bad = [f"{m} line {line}: {name}" for m in sorted(seen)
               for line, name in _third_party(by_name[m]) if name in ("ray", "sglang")]
        assert not bad, f"{start} reaches Ray or sglang: {bad}"


def _state_names() -> set[str]:
    from slime_like.fleet.events import KINDS

    return {member.value for kind in KINDS for member in kind}


# Calls that make or move a fleet event: their kind is an enum member, never its name.
EVENT_CALLS = {"emit", "move", "_moved", "FleetEvent"}


def literal_of(node: ast.AST, words: set[str]) -> str | None:
    """The first of `words` a node spells as a string literal (alone or in a tuple, list or
    set), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
        return node.value
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        found = [literal_of(e, words) for e in node.elts]
        return next((f for f in found if f), None)
    return None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_fleet_event_kinds_are_the_enums_not_strings(path: Path):
    names = _state_names()
    tree = ast.parse(path.read_text(), filename=str(path))

    def literal(node: ast.AST) -> str | None:
        return literal_of(node, names)

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            if func in EVENT_CALLS:
                bad += [(node.lineno, x) for a in node.args if (x := literal(a))]
        elif isinstance(node, ast.Compare):
            bad += [(node.lineno, x) for o in [node.left, *node.comparators] if (x := literal(o))]
        elif isinstance(node, ast.Dict):
            bad += [(node.lineno, x) for k in node.keys if k is not None and (x := literal(k))]
    assert not bad, (f"{module_name(path)} names fleet states as strings (use EngineState, "
                     f"RouterState, Happening): {bad}")


def test_a_fleet_event_refuses_a_kind_that_is_not_an_enum():
    from slime_like.fleet.events import EngineState, FleetEvent, Happening

    with pytest.raises(TypeError, match="not a fleet enum"):
        FleetEvent("default/g0/e0", "DEAD")
    with pytest.raises(TypeError, match="no previous"):
        FleetEvent("default/g0/e0", Happening.RECOVERED, EngineState.REGISTERED)
    assert FleetEvent("default/g0/e0", EngineState.DEAD, EngineState.REGISTERED).is_state_change


# ---- the four modes (protocol/modes.py) are their enums, never their words -----------------

# Where code holds a mode: a name, attribute, `x["key"]` or `x.get("key")` spelled like this.
MODE_HOLDER = re.compile(r"(^|_)(mode|transport|worker_type)$")
# Modules of the engine-session and weights/ rewrite (converted after it is merged) and the
# reference engine (a program of its own, which has not imported the enums yet). Their words
# still compare equal to the members (StrEnum); once a module is converted it must leave
# this list (a test says so).
NOT_YET_TYPED: set[str] = set()


def _mode_words() -> set[str]:
    from slime_like.protocol.modes import MODES

    return {member.value for kind in MODES for member in kind}


def _holder(node: ast.AST) -> str | None:
    """The name a value is held under: `mode`, `cfg.transport`, `view["worker_type"]`,
    `args.get("pause_mode")`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    key = node.slice if isinstance(node, ast.Subscript) else \
        node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr == "get" and node.args else None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def mode_words_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, word) of every mode spelled as a string where code compares, looks up, passes
    or defaults one: `mode == "abort"`, `transport in ("tensor", "disk")`,
    `{"sync": run}[mode]`, `case "prefill":`, `worker_type="regular"`, `mode: str = "retract"`."""
    words = _mode_words()

    def held(node: ast.AST) -> bool:
        name = _holder(node)
        return name is not None and MODE_HOLDER.search(name) is not None

    def spelled(nodes: list) -> list[tuple[int, str]]:
        return [(n.lineno, x) for n in nodes if n is not None and (x := literal_of(n, words))]

    bad: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(map(held, [node.left, *node.comparators])):
            bad += spelled([node.left, *node.comparators])
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and \
                held(node.slice):
            bad += spelled(node.value.keys)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Dict) and node.func.attr == "get" and \
                node.args and held(node.args[0]):
            bad += spelled(node.func.value.keys)
        elif isinstance(node, ast.Match) and held(node.subject):
            bad += [(c.pattern.lineno, x) for c in node.cases
                    if isinstance(c.pattern, ast.MatchValue)
                    and (x := literal_of(c.pattern.value, words))]
        elif isinstance(node, ast.Call):
            bad += spelled([k.value for k in node.keywords
                            if k.arg and MODE_HOLDER.search(k.arg)])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
                     *zip(a.kwonlyargs, a.kw_defaults, strict=True)]
            bad += spelled([d for arg, d in pairs if MODE_HOLDER.search(arg.arg)])
        elif isinstance(node, ast.AnnAssign) and held(node.target):
            bad += spelled([node.value])
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_modes_are_the_enums_not_strings(path: Path):
    me = module_name(path)
    if me in NOT_YET_TYPED:
        pytest.skip("rewritten on another branch; converted when it lands")
    bad = mode_words_in(ast.parse(path.read_text(), filename=str(path)))
    assert not bad, (f"{me} spells modes as strings (use PauseMode, Transport, AsyncMode, "
                     f"WorkerType from slime_like.protocol.modes): {bad}")


def test_a_module_waiting_for_its_rewrite_still_spells_modes_as_strings():
    """A module converted since must leave NOT_YET_TYPED, so the guard covers it again."""
    by_name = {module_name(p): p for p in MODULES}
    done = sorted(m for m in NOT_YET_TYPED if m not in by_name
                  or not mode_words_in(ast.parse(by_name[m].read_text())))
    assert not done, f"remove from NOT_YET_TYPED (converted or gone): {done}"


@pytest.mark.parametrize("source, words", [
    ('if cfg.pause_mode == "abort": pass', ["abort"]),
    ('ok = transport not in ("tensor", "disk")', ["tensor"]),
    ('run = {"sync": a, "one-step": b}[args.async_mode]', ["sync", "one-step"]),
    ('add(url, worker_type="prefill")', ["prefill"]),
    ('def pause(mode: str = "retract"): pass', ["retract"]),
    ('x = view["worker_type"] == "decode"', ["decode"]),
    ('match mode:\n    case "in_place": pass', ["in_place"]),
    # not modes: a finish reason and a utilization kind that share a word
    ('done = sample.finish_reason == "abort" or kind == "sync"', []),
    ('if cfg.pause_mode == PauseMode.ABORT: pass', []),
])
def test_the_mode_guard_sees_each_way_of_spelling_a_mode(source, words):
    assert [w for _, w in mode_words_in(ast.parse(source))] == words
