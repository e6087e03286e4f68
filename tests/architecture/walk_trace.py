"""Which framework modules a weight bucket walks through, recorded on every thread.

`WalkTracer` is a profile hook, installed with `threading.setprofile` (every thread started
after `install()`; on Python 3.12+ also those already running) and `sys.setprofile` (the
installing thread). It records, at every event that touches a bucket, the `slime_like`
modules on the stack, outermost first:

- the bucket's bytes: a torch function or tensor method (`torch.empty`, `Tensor.copy_`, a
  `_foreach_copy_`), a collective of `torch.distributed` (broadcast, ...);
- its metadata: the entry of the walk's root (the function that receives it, such as an
  HTTP route's handler), every call into `protocol/` (the request structs, the bucket
  layout, the tensor payloads), every socket send (an HTTP request leaving).

Only what runs under a root counts. On the root's own thread the path starts at the root
(the frames outside it are the process's machinery: a server loop, a test). Work handed to
another thread carries the path of the code that handed it over, and its own thread's
frames follow: a thread started under a root (`threading.Thread.start`), a
`concurrent.futures` work item (`ThreadPoolExecutor.submit`, `asyncio.to_thread`), and any
callable given to a function named as a `Handoff` (a queue of our own, such as the
reference engine's scheduler) when it starts on another thread. Nothing is filtered by
module: a detour through any `slime_like` module shows up in the path.

`protocol/` modules (the value types both programs share) are listed on the tree, after
the module that called them, but not counted. A recording is a tree per root: each path a
branch (work fanned out to several threads or engines shows as branches); `WalkTree.problems`
holds each root-to-leaf branch to a limit and refuses a module entered twice on a branch.
`WalkTree.render` prints it; `parse_walk` reads the same form back (from a doc), so a test
can assert the documented walk is the recorded one:

    tracer = WalkTracer({"tensor": "reference_engine/http_server.py:update_weights_from_tensor"})
    with tracer:
        ...  # drive a sync
    tree = tracer.recording().tree("tensor")
    print(tree.render())
    assert not tree.problems(limit=5)
    assert tree == parse_walk(doc_block)

The rendered form: the root's module, then `-> module` per step; where the walk branches,
each branch starts with `+->`, four columns further in. A module may be followed by
`[protocol/x.py, ...]` (the shared modules it called) and, after two spaces, free text.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

PROTOCOL = "protocol/"
# torch.distributed's collectives: a call into one sends or receives a bucket's bytes.
COLLECTIVES = frozenset({
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "gather", "scatter",
    "broadcast_object_list", "all_to_all", "all_to_all_single",
})
_C10D = "torch/distributed/distributed_c10d.py"
_SOCKET_SENDS = frozenset({"send", "sendall", "sendmsg", "sendto"})

# What a code object is to the hook (computed once per code object).
_PLAIN, _ROOT, _HANDOFF, _ITEM_INIT, _ITEM_RUN, _THREAD_START, _COLLECTIVE, _PROTOCOL, _OURS = range(9)

Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Handoff:
    """A function that takes a callable (`argument`) to run later on another thread.

    `function` is the code's qualified name (`Scheduler.call`) or plain name."""

    module: str  # relative to the package, e.g. "reference_engine/scheduler.py"
    function: str
    argument: str


@dataclass(frozen=True)
class _Carried:
    """The path handed to other code: the walk it belongs to and its modules so far."""

    walk: str
    modules: Path_


def _code_of(fn: Any) -> CodeType | None:
    """The code a callable starts in (through partials and bound methods)."""
    for _ in range(8):
        if hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
            fn = fn.func
        elif hasattr(fn, "__func__"):  # a bound method
            fn = fn.__func__
        elif hasattr(fn, "__code__"):
            return fn.__code__
        else:
            return None
    return None


def _merge(modules: list[str] | Path_) -> Path_:
    """Consecutive frames of one module are one step of the walk."""
    out: list[str] = []
    for m in modules:
        if not out or out[-1] != m:
            out.append(m)
    return tuple(out)


class _ThreadState:
    __slots__ = ("carried", "anchors")

    def __init__(self, carried: _Carried | None):
        self.carried = carried  # handed over when the thread started (None: not under a root)
        self.anchors: list[tuple[FrameType, _Carried | None]] = []  # handed-over callables


class WalkTracer:
    """Records, per root, the module paths of every event that touches a bucket."""

    def __init__(self, roots: dict[str, str], *, handoffs: tuple[Handoff, ...] | list[Handoff] = (),
                 package: str = "slime_like"):
        """`roots`: walk name -> "module.py:function" (relative to the package; the
        function's qualified or plain name). `handoffs`: the package's own queues."""
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{package} is not an importable package")
        self._root_dir = str(Path(list(spec.submodule_search_locations)[0]).resolve()) + "/"
        self._roots = {}
        for walk, where in roots.items():
            module, _, function = where.partition(":")
            self._roots[(module, function)] = walk
        self._handoffs = {(h.module, h.function): h.argument for h in handoffs}
        self._kinds: dict[CodeType, tuple[int, Any]] = {}
        self._package = package
        self._code_modules: dict[CodeType, str | None] = {}
        self._lock = threading.Lock()
        self._threads: dict[threading.Thread, _ThreadState] = {}
        self._new_threads: dict[threading.Thread, _Carried | None] = {}
        self._items: dict[int, tuple[Any, _Carried | None]] = {}  # id(work item) -> (item, path)
        self._pending: dict[CodeType, list[tuple[Any, _Carried | None]]] = {}
        self._anchor_frames: set[int] = set()
        self._active = 0  # roots on a stack + carried paths alive: 0 skips most events at once
        self._walks: dict[str, Counter] = {w: Counter() for w in roots}
        self._kinds_seen: dict[tuple[str, Path_], set[str]] = {}
        self.installed = False

    # ---- installing --------------------------------------------------------------------------

    def install(self) -> None:
        """Watch every thread started from now on, and this one (3.12+: every running one)."""
        threading.setprofile(self._hook)
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(self._hook)
        sys.setprofile(self._hook)
        self.installed = True

    def uninstall(self) -> None:
        """Stop watching (threads started meanwhile keep a hook that records nothing)."""
        self.installed = False
        sys.setprofile(None)
        threading.setprofile(None)
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)

    def __enter__(self) -> WalkTracer:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ---- what a frame is -----------------------------------------------------------------------

    def _module(self, frame: FrameType) -> str | None:
        """The package module a frame runs in, by its file; code made at run time (a
        dataclass's `__init__`, `<string>`) belongs to the module whose globals it runs in."""
        code = frame.f_code
        m = self._code_modules.get(code, ...)
        if m is ...:
            filename = code.co_filename
            if filename.startswith("<"):
                name = frame.f_globals.get("__name__", "")
                spec = importlib.util.find_spec(name) if name.startswith(self._package + ".") else None
                filename = spec.origin if spec is not None and spec.origin else filename
            resolved = filename
            with contextlib.suppress(OSError, ValueError):
                resolved = str(Path(filename).resolve())
            m = resolved[len(self._root_dir):] if resolved.startswith(self._root_dir) else None
            self._code_modules[code] = m
        return m

    def _classify(self, frame: FrameType) -> tuple[int, Any]:
        code = frame.f_code
        module = self._module(frame)
        names = (getattr(code, "co_qualname", code.co_name), code.co_name)
        if module is not None:
            for name in names:
                if (module, name) in self._roots:
                    return _ROOT, self._roots[(module, name)]
                if (module, name) in self._handoffs:
                    return _HANDOFF, self._handoffs[(module, name)]
            if module.startswith(PROTOCOL):
                return _PROTOCOL, None
            return _OURS, None
        filename = code.co_filename.replace("\\", "/")
        if filename.endswith("concurrent/futures/thread.py"):
            if names[0] == "_WorkItem.__init__":
                return _ITEM_INIT, None
            if names[0] == "_WorkItem.run":
                return _ITEM_RUN, None
        elif filename.endswith("/threading.py") and names[0] == "Thread.start":
            return _THREAD_START, None
        elif filename.endswith(_C10D) and code.co_name in COLLECTIVES:
            return _COLLECTIVE, None
        return _PLAIN, None

    # ---- paths ---------------------------------------------------------------------------------

    def _state(self) -> _ThreadState:
        thread = threading.current_thread()
        state = self._threads.get(thread)
        if state is None:
            with self._lock:
                state = self._threads[thread] = _ThreadState(self._new_threads.pop(thread, None))
        return state

    def _path(self, frame: FrameType | None) -> _Carried | None:
        """The walk and modules of `frame`'s stack, or None when no root is above it."""
        modules: list[str] = []
        f = frame
        while f is not None:
            module = self._module(f)
            if module is not None:
                modules.append(module)
                kind = self._kinds.get(f.f_code)
                if kind is not None and kind[0] == _ROOT:
                    return _Carried(kind[1], _merge(modules[::-1]))
            f = f.f_back
        state = self._state()
        carried = state.anchors[-1][1] if state.anchors else state.carried
        if carried is None:
            return None
        return _Carried(carried.walk, _merge([*carried.modules, *modules[::-1]]))

    def _record(self, frame: FrameType | None, what: str) -> None:
        carried = self._path(frame)
        if carried is None or carried.walk not in self._walks:
            return
        with self._lock:
            self._walks[carried.walk][carried.modules] += 1
            self._kinds_seen.setdefault((carried.walk, carried.modules), set()).add(what)

    # ---- the hook ------------------------------------------------------------------------------

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            if self._active and self.installed:
                self._c_call(frame, arg)
        elif event == "call":
            code = frame.f_code
            kind = self._kinds.get(code)
            if kind is None:
                kind = self._kinds[code] = self._classify(frame)
            if code in self._pending:  # first: the callable's own entry is on the walk
                self._start_handed(frame, code)
            if kind[0] != _PLAIN:
                self._call(frame, kind)
        elif event == "return":
            if id(frame) in self._anchor_frames:
                self._end_handed(frame)
            elif self._kinds.get(frame.f_code, (_PLAIN,))[0] == _ROOT:
                with self._lock:
                    self._active -= 1

    def _c_call(self, frame: FrameType, fn: Any) -> None:
        owner = getattr(fn, "__self__", None)
        module = getattr(fn, "__module__", None) or ""
        torch = sys.modules.get("torch")
        if module.startswith("torch") or (torch is not None and isinstance(owner, torch.Tensor)):
            self._record(frame, "bytes")  # a torch function, a tensor's method
        elif isinstance(owner, socket.socket) and getattr(fn, "__name__", "") in _SOCKET_SENDS:
            self._record(frame, "metadata")

    def _call(self, frame: FrameType, kind: tuple[int, Any]) -> None:
        what = kind[0]
        if what == _ROOT:
            with self._lock:
                self._active += 1
            if self.installed:  # the request arrives (or, a coroutine, resumes)
                self._record(frame, "metadata")
        elif not self.installed:
            return
        elif what == _OURS:
            if self._active:
                self._record(frame, "runs")
        elif what in (_PROTOCOL, _COLLECTIVE):
            if self._active:
                self._record(frame, "metadata" if what == _PROTOCOL else "bytes")
        elif what == _HANDOFF:
            carried = self._path(frame) if self._active else None
            if carried is not None:
                self._record(frame, "runs")
            fn = frame.f_locals.get(kind[1])
            code = _code_of(fn)
            if code is not None:  # out of a walk too: its run must not take a walk's path
                with self._lock:
                    self._pending.setdefault(code, []).append((fn, carried))
        elif what == _ITEM_INIT:
            carried = self._path(frame.f_back) if self._active else None
            if carried is not None:
                with self._lock:
                    item = frame.f_locals.get("self")
                    self._items[id(item)] = (item, carried)
        elif what == _ITEM_RUN:
            entry = self._items.pop(id(frame.f_locals.get("self")), None)
            self._anchor(frame, entry[1] if entry else None)
        elif what == _THREAD_START:
            thread = frame.f_locals.get("self")
            carried = self._path(frame.f_back) if self._active else None
            if carried is not None:
                with self._lock:
                    self._new_threads[thread] = carried
                    self._active += 1

    def _anchor(self, frame: FrameType, carried: _Carried | None) -> None:
        self._state().anchors.append((frame, carried))
        with self._lock:
            self._anchor_frames.add(id(frame))
            if carried is not None:
                self._active += 1

    def _start_handed(self, frame: FrameType, code: CodeType) -> None:
        """Code that was handed over starts: it is a handed-over callable when its caller
        holds that very callable (in a local, or in a tuple or list in one: a queue entry);
        a direct call of the same code is not."""
        caller = frame.f_back
        if caller is None:
            return
        held = set()
        for value in caller.f_locals.values():
            held.add(id(value))
            if isinstance(value, tuple | list):
                held.update(id(v) for v in value[:8])
        with self._lock:
            waiting = self._pending.get(code, [])
            pick = next((i for i, (fn, _) in enumerate(waiting) if id(fn) in held), None)
            if pick is None:
                return
            _, carried = waiting.pop(pick)
            if not waiting:
                del self._pending[code]
        self._anchor(frame, carried)

    def _end_handed(self, frame: FrameType) -> None:
        state = self._state()
        if state.anchors and state.anchors[-1][0] is frame:
            _, carried = state.anchors.pop()
            with self._lock:
                self._anchor_frames.discard(id(frame))
                if carried is not None:
                    self._active -= 1

    # ---- results -------------------------------------------------------------------------------

    def recording(self) -> Recording:
        """What was recorded so far."""
        with self._lock:
            return Recording({w: {p: (n, tuple(sorted(self._kinds_seen.get((w, p), ()))))
                                  for p, n in c.items()} for w, c in self._walks.items()})


@dataclass
class Recording:
    """Per walk: each recorded path, how often, and what it touched (bytes, metadata)."""

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
        merged = {_merge(p) for p in self.paths}
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
