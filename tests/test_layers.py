"""The layers of src/specscope, as docs/layout.md describes them: no module imports a higher layer,
and no import cycle exists between modules. Read from the source with `ast` (imports at module top and inside
functions alike), so an import hidden in a function counts as much as one at the top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "specscope"

# lowest first; a module may import its own layer and the layers below it. Names are top-level packages or
# modules of specscope ("specscope" itself: the package's __init__, i.e. __version__).
LAYERS = [
    ("base", {"specscope", "errors", "jsonio", "fileio", "prompts", "cachedir", "progress", "serverproc",
              "watchdog", "cpuload"}),
    ("outside engines", {"engines"}),                        # vLLM, SGLang: launch, args, knobs, versions, phases
    ("runtime", {"runtime"}),                                # KV cache, sampling (+ params), tokenizer
    ("models", {"models"}),                                  # configs, the forward, loaders, CPU kernels
    ("decoding", {"generate", "speculative", "engine", "profile"}),   # decoding loops (engine: batched), profiler
    ("records", {"registry"}),
    ("tools", {"economics", "train", "ingest"}),
    ("outputs", {"report", "plugins", "benchserve"}),
    ("runs", {"session", "check_drafter", "served_check", "sweep"}),         # what one command's run does, end to end
    ("front ends", {"demo", "server"}),
    ("cli", {"cli", "__main__"}),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module under root (a package is its __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a specscope module, at any depth in the file.
    `from pkg import name` is an import of pkg.name when that is a module, else of pkg."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = []
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:       # relative: from the importer's package, up level - 1
                    up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                if name == "specscope" or name.startswith("specscope."):
                    target = resolve(name)
                    if target and target != mod:
                        edges.append((mod, target, node.lineno))
    return edges


def layer_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward(mods, edges, root: Path = ROOT) -> list[str]:
    bad = []
    for src, dst, line in edges:
        a, b = layer_of(src), layer_of(dst)
        if LEVEL[b] > LEVEL[a]:
            bad.append(f"{mods[src].relative_to(root.parent)}:{line} imports {dst} "
                       f"({LAYERS[LEVEL[b]][0]}) from the lower layer {LAYERS[LEVEL[a]][0]}")
    return bad


def cycles(mods, edges) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected group of modules."""
    graph = {m: sorted({d for s, d, _ in edges if s == m}) for m in mods}
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in graph:
        if v not in index:
            visit(v)
    out = []
    for group in groups:             # a shortest way back to the start, within the group
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = [w for w in graph[path[-1]] if w in group]
            if start in nxt:
                out.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return out


def test_every_module_has_a_layer():
    mods = modules()
    missing = sorted({layer_of(m) for m in mods} - set(LEVEL))
    assert not missing, f"declare the layer of {missing} in tests/test_layers.py (and docs/layout.md)"


def test_no_module_imports_a_higher_layer():
    mods = modules()
    bad = upward(mods, imports(mods))
    assert not bad, "imports that climb a layer:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = modules()
    found = cycles(mods, imports(mods))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


# within the decoding layer, the order a request goes down: generate.py (one request) -> engine/ (the loop) ->
# speculative/ (drafters, shapes, acceptance); no arrow back up (the τ predictor, which replays the engine's loop, is
# engine/predict.py; the target's greedy output it replays on comes from generate.py's truths_from_target)
DECODING_ORDER = ["generate", "engine", "speculative"]
BACK_UP_LEFT: set = set()


def test_decoding_layer_has_no_arrow_back_up():
    mods = modules()
    rank = {name: i for i, name in enumerate(DECODING_ORDER)}
    bad = [f"{mods[s].relative_to(ROOT.parent)}:{line} imports {d}" for s, d, line in imports(mods)
           if layer_of(s) in rank and layer_of(d) in rank and rank[layer_of(d)] < rank[layer_of(s)]
           and (s, d) not in BACK_UP_LEFT]
    assert not bad, "decoding modules that import one above them (" + " -> ".join(DECODING_ORDER) + "):\n" + \
        "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    """The checks see an import inside a function, name a climb, and find a cycle."""
    pkg = tmp_path / "specscope"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "session.py").write_text("from specscope.models import llama\n")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("def f():\n    from specscope import session\n")
    mods = modules(pkg)
    edges = imports(mods)
    assert ("specscope.models.llama", "specscope.session", 2) in edges
    bad = upward(mods, edges, pkg)
    assert len(bad) == 1 and "imports specscope.session (runs) from the lower layer models" in bad[0]
    assert cycles(mods, edges) == [["specscope.models.llama", "specscope.session", "specscope.models.llama"]]


# room to live in: a function a reader can hold on one screen, a module one can read in a sitting
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600


def too_long(root: Path = ROOT) -> list[str]:
    """Every function (methods and nested functions too, decorators not counted) over MAX_FUNCTION_LINES lines and
    every module over MAX_FILE_LINES lines under root."""
    bad = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        n = text.count("\n") + 1
        if n > MAX_FILE_LINES:
            bad.append(f"{p.relative_to(root.parent)}: {n} lines (at most {MAX_FILE_LINES}): split it by "
                       f"responsibility")
        for f in ast.walk(ast.parse(text, str(p))):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = f.end_lineno - f.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{p.relative_to(root.parent)}:{f.lineno} {f.name}: {length} lines (at most "
                               f"{MAX_FUNCTION_LINES})")
    return bad


def test_no_function_or_file_is_too_long():
    bad = too_long()
    assert not bad, "too long to live in:\n" + "\n".join(bad)


def test_the_length_check_can_fail(tmp_path):
    pkg = tmp_path / "specscope"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "long.py").write_text("class A:\n    def f(self):\n" + body.replace("    ", "        ") + "\n"
                                 + "def g():\n" + body[:-len("    x59 = 59\n")])
    (pkg / "big.py").write_text("x = 1\n" * MAX_FILE_LINES)
    bad = too_long(pkg)
    assert bad == ["specscope/big.py: 601 lines (at most 600): split it by responsibility",
                   "specscope/long.py:2 f: 61 lines (at most 60)"], bad
