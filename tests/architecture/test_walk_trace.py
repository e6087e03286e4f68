"""The walk tracer itself, on a small package written for the test: what it joins, what it
refuses, and that its printed tree reads back."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
from walk_trace import Handoff, WalkTracer, parse_walk

MODULES = {
    "__init__.py": "",
    "protocol/__init__.py": "",
    "protocol/layout.py": """
        def sizes(names):
            return [len(n) for n in names]
        """,
    "api.py": """
        import threading
        from concurrent.futures import ThreadPoolExecutor
        from functools import partial

        from walkpkg import back, ranks
        from walkpkg.protocol.layout import sizes


        def route(queue, names):
            sizes(names)
            done = queue.call(partial(ranks.load, names))
            done.wait(10)
            t = threading.Thread(target=ranks.load, args=(names,))
            t.start()
            t.join()
            with ThreadPoolExecutor(1) as pool:
                pool.submit(ranks.load, names).result()


        def detour(names):
            back.again(names)


        def other(names):
            ranks.load(names)
        """,
    "queue.py": """
        import threading


        class Queue:
            def __init__(self):
                self.items, self.cv = [], threading.Condition()
                threading.Thread(target=self.loop, daemon=True).start()

            def call(self, fn):
                done = threading.Event()
                with self.cv:
                    self.items.append((fn, done))
                    self.cv.notify()
                return done

            def loop(self):
                while True:
                    with self.cv:
                        while not self.items:
                            self.cv.wait()
                        entry = self.items.pop(0)
                    entry[0]()
                    entry[1].set()
        """,
    "ranks.py": """
        import torch


        def load(names):
            torch.zeros(len(names)).add_(1)
        """,
    "back.py": """
        from walkpkg import api


        def again(names):
            api.other(names)
        """,
}


@pytest.fixture
def walkpkg(tmp_path, monkeypatch):
    for name, body in MODULES.items():
        path = tmp_path / "walkpkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("walkpkg.api")
    for name in [m for m in sys.modules if m == "walkpkg" or m.startswith("walkpkg.")]:
        del sys.modules[name]


def _tracer(walkpkg) -> WalkTracer:
    return WalkTracer({"route": "api.py:route", "detour": "api.py:detour"},
                      handoffs=[Handoff("queue.py", "Queue.call", "fn")], package="walkpkg")


def test_work_handed_to_other_threads_continues_the_roots_walk(walkpkg):
    tracer = _tracer(walkpkg)
    with tracer:
        from walkpkg.queue import Queue

        queue = Queue()
        walkpkg.route(queue, ["a", "bb"])
        walkpkg.other(["outside any root"])  # not under a root: not recorded
    tree = tracer.recording().tree("route")
    text = tree.render()
    # a queue of our own (the Handoff), a thread started, an executor's work item
    assert text == "api.py [protocol/layout.py]\n     +-> queue.py\n      -> ranks.py\n" \
                   "     +-> ranks.py", text
    assert not tree.problems(limit=3)
    assert tree.problems(limit=2) == ["3 modules (limit 2): api.py -> queue.py -> ranks.py"]
    assert parse_walk(text) == tree
    recorded = tracer.recording().walks["route"]
    assert recorded[("api.py", "queue.py", "ranks.py")][1] == ("bytes", "runs")


def test_a_module_entered_twice_is_refused(walkpkg):
    tracer = _tracer(walkpkg)
    with tracer:
        walkpkg.detour(["x"])
    tree = tracer.recording().tree("detour")
    assert tree.problems(limit=5) == [
        "api.py entered twice: api.py -> back.py -> api.py -> ranks.py"]


def test_a_doc_block_with_free_text_reads_as_its_tree():
    doc = """
    a/root.py                  what the root does,
                               over two lines
         +-> a/left.py [protocol/x.py]  the left branch
          -> a/deeper.py       and its next step
         +-> a/right.py
    """
    tree = parse_walk(textwrap.dedent(doc))
    assert tree.branches() == [("a/root.py", "a/left.py", "a/deeper.py"), ("a/root.py", "a/right.py")]
    assert tree.root.children[0].protocol == {"protocol/x.py"}
    assert parse_walk(tree.render()) == tree
    assert parse_walk(tree.render().replace("a/right.py", "a/wrong.py")) != tree
