"""Which framework modules a weight bucket walks through, recorded on every thread.

`WalkTracer` is a profile hook, installed with `threading.setprofile` (every thread started
after `install()`; on Python 3.12+ also those already running, through
`threading.setprofile_all_threads`) and `sys.setprofile` (the installing thread). Under a
walk's root (the function that receives the bucket: an HTTP route's handler, a job's push)
it records the `slime_like` modules on the stack, outermost first, at every event:

- every entry of a `slime_like` function ("runs"): a detour through any module shows, even
  one that touches neither bytes nor metadata;
- the bucket's bytes: a torch function or tensor method (`torch.empty`, `Tensor.copy_`,
  `_foreach_copy_`), a collective of `torch.distributed` (broadcast, ...);
- its metadata: the root's entry, every call into `protocol/` (request structs, the
  bucket layout, tensor payloads), every socket send (an HTTP request leaving).

On the root's own thread a path starts at the root (the frames outside it are the process's
machinery: a server loop, a test). Work handed to another thread carries the path of the
code that handed it over, followed by its own frames from the handed callable's down (the
frames above it are the machinery of the thread that runs it: a pool's, a queue's loop): a thread started
under a root (`threading.Thread.start`), a `concurrent.futures` work item
(`ThreadPoolExecutor.submit`, `asyncio.to_thread`), and a callable given to a function
named as a `Handoff` (a queue of our own, such as the reference engine's scheduler), when
its caller on the other thread holds that very callable. Nothing is filtered by module.
Not followed: other processes (trace each in its own, as `traced_engine.py` does for the
reference engine), and asyncio tasks spawned under a root (awaited coroutines are on the
root's stack and count).

    tracer = WalkTracer({"tensor": "reference_engine/weight_api.py:update_weights_from_tensor"},
                        handoffs=[Handoff("reference_engine/scheduler.py", "Scheduler.call", "fn")])
    with tracer:
        ...  # drive a sync
    tree = tracer.recording().tree("tensor")   # walk_tree.WalkTree
    print(tree.render())
    assert not tree.problems(limit=5)          # each branch <= 5 modules, none entered twice
    assert tree == parse_walk(doc_block)       # the doc prints the recorded walk

`protocol/` modules (the value types both programs share) are listed on the tree but not
counted (`walk_tree.py`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from walk_tree import PROTOCOL, Path_, Recording, WalkTree, merge_steps, parse_walk

__all__ = ["Handoff", "Recording", "WalkTracer", "WalkTree", "parse_walk"]

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


class _ThreadState:
    __slots__ = ("carried", "anchors")

    def __init__(self, carried: _Carried | None):
        self.carried = carried  # handed over when the thread started (None: not under a root)
        self.anchors: list[tuple[FrameType, _Carried | None]] = []  # handed-over callables


class WalkTracer:
    """Records, per walk (root), the module path of every event under the root."""

    def __init__(self, roots: dict[str, str], *, handoffs: tuple[Handoff, ...] | list[Handoff] = (),
                 package: str = "slime_like", every_call: bool = True):
        """`roots`: walk name -> "module.py:function" (relative to the package; the
        function's qualified or plain name). `handoffs`: the package's own queues.
        `every_call=False` records only the touches of bytes and metadata, not every
        function entry (a weaker walk: a detour that touches neither goes unseen)."""
        self.every_call = every_call
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
        self._file_modules: dict[str, str | None] = {}
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
            m = self._file_modules.get(filename, ...)
            if m is ...:
                resolved = filename
                with contextlib.suppress(OSError, ValueError):
                    resolved = str(Path(filename).resolve())
                m = resolved[len(self._root_dir):] if resolved.startswith(self._root_dir) else None
                self._file_modules[filename] = m
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
        """The walk and modules of `frame`'s stack, or None when no root is above it. Under
        handed-over work the stack ends at the anchor (the handed callable's frame): what is
        above it is the machinery of the thread that runs it (a pool's, a queue's loop)."""
        modules: list[str] = []
        state = self._state()
        stop = state.anchors[-1][0] if state.anchors else None
        f = frame
        while f is not None:
            module = self._module(f)
            if module is not None:
                modules.append(module)
                kind = self._kinds.get(f.f_code)
                if kind is not None and kind[0] == _ROOT:
                    return _Carried(kind[1], merge_steps(modules[::-1]))
            if f is stop:
                break
            f = f.f_back
        carried = state.anchors[-1][1] if state.anchors else state.carried
        if carried is None:
            return None
        return _Carried(carried.walk, merge_steps([*carried.modules, *modules[::-1]]))

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
            if self._active and self.every_call:
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
