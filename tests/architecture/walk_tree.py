"""A recorded walk as a tree, printed and read back (the form docs/ARCHITECTURE.md uses).

`Recording` is what a `WalkTracer` recorded (per walk: each path of modules, how often,
what it touched), as JSON on disk when the traced code runs in another process.
`WalkTree` puts a walk's paths together: counted modules as nodes, each `protocol/`
module listed on the node that called it. `problems(limit)` holds every root-to-leaf
branch to `limit` modules and refuses a module entered twice on a recorded path.

The printed form: the root's module, then `-> module` per step; where the walk branches,
each branch starts with `+->`, four columns further in. A module may be followed by
`[protocol/x.py, ...]` and, after whitespace, free text; lines that do not start with a
module are free text too. `parse_walk` reads it back, so a test can assert that a doc's
walk is the recorded one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROTOCOL = "protocol/"
Path_ = tuple[str, ...]


def merge_steps(modules: list[str] | Path_) -> Path_:
    """Consecutive frames of one module are one step of the walk."""
    out: list[str] = []
    for m in modules:
        if not out or out[-1] != m:
            out.append(m)
    return tuple(out)


@dataclass
class Recording:
    """Per walk: each recorded path, how often, and what it touched (runs, bytes, metadata)."""

    walks: dict[str, dict[Path_, tuple[int, tuple[str, ...]]]]

    def dump(self, path: str | Path) -> None:
        """Write it as JSON (atomically: a reader never sees half a file)."""
        body = {w: [{"path": list(p), "count": n, "touched": list(k)} for p, (n, k) in paths.items()]
                for w, paths in self.walks.items()}
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        body = json.loads(Path(path).read_text())
        return cls({w: {tuple(e["path"]): (e["count"], tuple(e["touched"])) for e in entries}
                    for w, entries in body.items()})

    def tree(self, walk: str) -> WalkTree:
        """The walk's paths as one tree."""
        return WalkTree.from_paths(list(self.walks.get(walk, {})))


@dataclass
class Node:
    """One step of a walk: a counted module, the protocol modules it called, what follows."""

    module: str
    protocol: set[str] = field(default_factory=set)
    children: list[Node] = field(default_factory=list)

    def child(self, module: str) -> Node:
        for c in self.children:
            if c.module == module:
                return c
        self.children.append(Node(module))
        return self.children[-1]


@dataclass
class WalkTree:
    """A walk as a tree of counted modules (None: nothing was recorded)."""

    root: Node | None
    paths: list[Path_] = field(default_factory=list)  # the recorded paths, protocol included

    @classmethod
    def from_paths(cls, paths: list[Path_]) -> WalkTree:
        tree = cls(None, sorted(paths))
        for path in tree.paths:
            node: Node | None = None
            for module in path:
                if module.startswith(PROTOCOL):
                    if node is not None:
                        node.protocol.add(module)
                    continue
                if node is None:
                    if tree.root is None:
                        tree.root = Node(module)
                    elif tree.root.module != module:
                        raise ValueError(f"paths start at {tree.root.module} and at {module}")
                    node = tree.root
                elif node.module != module:
                    node = node.child(module)
        return tree

    def branches(self) -> list[Path_]:
        """Every root-to-leaf branch (counted modules only)."""
        out: list[Path_] = []

        def walk(node: Node, above: Path_) -> None:
            here = (*above, node.module)
            if not node.children:
                out.append(here)
            for c in node.children:
                walk(c, here)

        if self.root is not None:
            walk(self.root, ())
        return out

    def problems(self, limit: int) -> list[str]:
        """Each branch longer than `limit` modules, each module entered twice on a path."""
        found = [f"{len(b)} modules (limit {limit}): {' -> '.join(b)}"
                 for b in self.branches() if len(b) > limit]
        merged = {merge_steps(p) for p in self.paths}
        longest = [p for p in merged if not any(len(q) > len(p) and q[:len(p)] == p for q in merged)]
        for runs in sorted(longest):
            twice = sorted({m for m in runs if runs.count(m) > 1 and not m.startswith(PROTOCOL)})
            if twice:
                found.append(f"{', '.join(twice)} entered twice: {' -> '.join(runs)}")
        return found

    def render(self) -> str:
        """The tree in the form `parse_walk` reads (and docs/ARCHITECTURE.md prints)."""
        lines: list[str] = []

        def line(node: Node, head: str) -> None:
            extra = f" [{', '.join(sorted(node.protocol))}]" if node.protocol else ""
            lines.append(head + node.module + extra)

        def chain(node: Node, indent: int) -> None:
            while True:
                if len(node.children) == 1:
                    node = node.children[0]
                    line(node, " " * indent + "-> ")
                    continue
                for c in node.children:
                    line(c, " " * (indent + 4) + "+-> ")
                    chain(c, indent + 5)
                return

        if self.root is None:
            return "(nothing recorded)"
        line(self.root, "")
        chain(self.root, 1)
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WalkTree):
            return NotImplemented
        return _shape(self.root) == _shape(other.root)

    __hash__ = None  # type: ignore[assignment]


def _shape(node: Node | None) -> Any:
    if node is None:
        return None
    return (node.module, tuple(sorted(node.protocol)),
            tuple(sorted((_shape(c) for c in node.children), key=repr)))


_LINE = re.compile(r"^( *)(\+?-> )?([A-Za-z0-9_]+(?:/[A-Za-z0-9_]+)*\.py)(?: \[([^\]]*)\])?(?:\s.*)?$")


def parse_walk(text: str) -> WalkTree:
    """A walk in `WalkTree.render`'s form, with free text after the modules (a doc's)."""
    tree = WalkTree(None)
    seen: list[tuple[int, Node]] = []  # (indent, node) of every module line so far
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if m is None:
            continue
        indent, marker, module, protocol = len(m.group(1)), m.group(2), m.group(3), m.group(4)
        node = Node(module, {p.strip() for p in protocol.split(",")} if protocol else set())
        if tree.root is None:
            if marker:
                raise ValueError(f"a walk starts with its root module, not {raw.strip()!r}")
            tree.root = node
        elif not marker:
            continue  # free text that happens to start with a file name
        elif marker == "-> ":
            seen[-1][1].children.append(node)
        else:
            parent = next((n for i, n in reversed(seen) if i < indent), None)
            if parent is None:
                raise ValueError(f"branch {raw.strip()!r} has no parent above it")
            parent.children.append(node)
        seen.append((indent, node))
    return tree
