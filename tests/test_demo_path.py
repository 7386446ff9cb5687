"""The demo's path enters no module more than twice (issue 50, "Done when").

What is measured. `specscope demo` runs in-process (the CLI, which calls `demo.run_demo`, the library entry `make
demo` reaches) on a tiny random target with a random EAGLE-3 drafter and n-gram copying in one tree, two prompts,
the verify curve and the report included, under `sys.setprofile`. At every Python call the stack of specscope
frames is read: each frame is named by its module (`demo`, `economics.probe`, `engine.batch`, ...), frames of other
code between them (torch calling our forward, click, the stdlib) are skipped, and consecutive frames of one module
are one *visit*. A stack is so a sequence of module visits from the entry, e.g.
`cli.demo > demo > economics.probe > generate > engine.batch`.

The rules, both asserted:

1. **The spine.** The stacks that reach the decoding loop (`BatchEngine.step`), every distinct one, merged into one
   tree of modules (a module's children: the modules it calls towards the loop). The demo's path walks this tree
   from the entry down to the loop and back up to the entry; a module is *entered* each time the walk arrives in
   it, going down or coming back up from a callee: a module with c callees on the tree is entered 1 + c times, once
   per place it holds. Each module is entered at most twice: once going down, once coming back. A module that
   reaches the loop through two different modules (a pairing of its own beside the shared one, say) or that is
   passed at two depths of the spine breaks it.
2. **Every stack.** Any stack during the demo (loading, the verify curve, storing, the break-even, the report; not
   only the spine) holds at most two visits of one module: a second visit is a climb back up into a module the call
   already passed through (the pairing calling the demo's UI back, for instance); a third is the path going back and
   forth.

Leaf helpers called one after another (the demo storing three records through the registry) are separate stacks, so
they are not counted as re-entries: the rules count returns into a module along a path, not how often it is used.
"""

from __future__ import annotations

import sys
import types
from collections import Counter

from cli_util import cli
from test_demo import tiny  # noqa: F401  (the same tiny target and random EAGLE-3 drafter)

MAX_ENTRIES = 2


class PathTrace:
    """Module visits along the stack, kept as calls come and go (sys.setprofile): the distinct stacks that reach
    `loop` (the spine) and every stack where a module has more than MAX_ENTRIES visits."""

    def __init__(self, loop, prefix: str = "specscope."):
        self.loop, self.prefix = loop, prefix
        self.frames: list[bool] = []          # per traced frame: did it open a visit
        self.visits: list[str] = []           # the modules of the open visits
        self.count: Counter = Counter()
        self.spine: set[tuple[str, ...]] = set()
        self.too_many: set[tuple[str, ...]] = set()

    def __call__(self, frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            opened = False
            if name.startswith(self.prefix):
                mod = name[len(self.prefix):]
                if not self.visits or self.visits[-1] != mod:
                    self.visits.append(mod)
                    self.count[mod] += 1
                    opened = True
                    if self.count[mod] > MAX_ENTRIES:
                        self.too_many.add(tuple(self.visits))
                if frame.f_code is self.loop:
                    self.spine.add(tuple(self.visits))
            self.frames.append(opened)
        elif event == "return" and self.frames:     # frames entered before the trace started return unseen
            if self.frames.pop():
                self.count[self.visits.pop()] -= 1

    def run(self, fn, *args):
        sys.setprofile(self)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)


def walk_entries(stacks) -> Counter:
    """Entries per module walking the tree of `stacks` (module sequences from the entry) down and back up."""
    tree: dict = {}
    for s in stacks:
        node = tree
        for mod in s:
            node = node.setdefault(mod, {})
    entries: Counter = Counter()

    def walk(node):
        for mod, callees in node.items():
            entries[mod] += 1 + len(callees)
            walk(callees)

    walk(tree)
    return entries


def test_demo_path_enters_no_module_more_than_twice(tiny, tmp_path, capsys):  # noqa: F811
    from specscope.engine.batch import BatchEngine

    target, drafter = tiny
    trace = PathTrace(BatchEngine.step.__code__)
    code, out, err = trace.run(cli, capsys, "demo", "--model", target, "--draft", f"{drafter}+ngram", "--prompts", 2,
                               "--max-new-tokens", 8, "--steps", 3, "--topk", 2, "--out", tmp_path / "demo",
                               "--threads", 1)
    assert code == 0, err
    assert trace.spine, "the demo never reached the decoding loop"
    assert all(s[-1] == "engine.batch" and "demo" in s for s in trace.spine), trace.spine
    entries = walk_entries(trace.spine)
    over = {m: n for m, n in entries.items() if n > MAX_ENTRIES}
    assert not over, (over, sorted(trace.spine))
    assert not trace.too_many, sorted(trace.too_many)[:5]


def _modules(src: dict[str, str]) -> dict[str, types.ModuleType]:
    """Modules named fake.NAME from source, each seeing the others by name."""
    mods = {name: types.ModuleType(f"fake.{name}") for name in src}
    for name, code in src.items():
        mods[name].__dict__.update(mods)
        exec(code, mods[name].__dict__)
    return mods


def test_the_path_checks_can_fail():
    """A path that goes back and forth is caught by both rules: front -> tools -> front -> tools -> front (a third
    visit of front on one stack), and a front end that reaches the loop both through a pairing and on its own."""
    mods = _modules({
        "front": "def run():\n    tools.pair(lambda: tools.again(back))\n    loop.step()\n"
                 "def back():\n    return 1\n",
        "tools": "def pair(cb):\n    cb()\n    loop.step()\ndef again(f):\n    front.back()\n",
        "loop": "def step():\n    return 0\n",
    })
    trace = PathTrace(mods["loop"].step.__code__, prefix="fake.")
    trace.run(mods["front"].run)
    assert trace.too_many == {("front", "tools", "front", "tools", "front")}
    assert trace.spine == {("front", "tools", "loop"), ("front", "loop")}
    assert walk_entries(trace.spine)["front"] == 3            # down, back from tools, back from loop
    assert walk_entries([("front", "tools", "loop")]) == {"front": 2, "tools": 2, "loop": 1}
