"""The shape of src/ the team keeps (docs/architecture.md): files of at most 500 lines, functions
of at most 60, no import circles among shardlab's modules (function-local imports included), and
engine names only inside engines/ (outside it, the config's default alone: every list of engines
comes from STRATEGIES and what the engines answer)."""

from __future__ import annotations

import ast
import collections
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
MAX_FILE_LINES = 500       # a file longer than this is split along a seam it already has (issue 48)
MAX_FUNCTION_LINES = 60    # def line to last line, inclusive
BUILT_IN_ENGINES = ("single", "ddp", "zero3", "fsdp", "ddp-minimal", "zero3-minimal", "fsdp-minimal", "torch-ddp",
                    "torch-fsdp")


def _files() -> list[pathlib.Path]:
    return sorted(SRC.rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_files_and_functions_stay_small():
    too_big = []
    for p in _files():
        text = p.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{p.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                too_big.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big


def import_graph() -> dict[str, set[str]]:
    """module -> the shardlab modules it imports, anywhere in it (a package's parent is not counted)."""
    modules = {_module(p): p for p in _files()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("shardlab") else None
                if target is not None and target != m:
                    graph[m].add(target)
    return graph


def test_no_import_circles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def _full_engine_modules() -> set[str]:
    """The full engines and the helpers only they need: ddp, zero3*, fsdp, fsdp_layout and _hooks."""
    engines = SRC / "shardlab" / "engines"
    names = {p.stem for p in engines.glob("zero3*.py")} | {"ddp", "fsdp", "fsdp_layout", "_hooks"}
    return {f"shardlab.engines.{n}" for n in names if not n.endswith("_minimal")}


def test_minimal_engines_stand_alone():
    """A minimal engine is read alone, before the full one (issue 48): nothing it imports, directly
    or through another shardlab module, function-local imports included, is a full engine or one of
    their helpers. The contract (api, planning, measuring), the counted collectives and pieces below
    every engine (state_keys) are what it may use."""
    graph, full = import_graph(), _full_engine_modules()
    leaning = []
    for m in sorted(m for m in graph if m.startswith("shardlab.engines.") and m.endswith("_minimal")):
        via: dict[str, str] = {m: m}  # module reached -> the chain that reached it
        todo = [m]
        while todo:
            v = todo.pop()
            for w in sorted(graph[v] - via.keys()):
                via[w] = f"{via[v]} -> {w}"
                todo.append(w)
        leaning += [via[w] for w in sorted(full & via.keys())]
    assert not leaning, leaning


# The engine names allowed outside engines/, by file: the config's default strategy and the public
# API docstring's example.
ENGINE_NAMES_OUTSIDE = {("shardlab/config_sections.py", "fsdp"), ("shardlab/__init__.py", "fsdp")}


def test_engine_names_only_inside_engines():
    names = "|".join(re.escape(n) for n in BUILT_IN_ENGINES)
    literal = re.compile(rf"""["']({names})["']""")
    found = [(str(p.relative_to(SRC)), m.group(1), f"{p.relative_to(SRC)}:{i}: {line.strip()}")
             for p in _files() if "engines" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in literal.finditer(line)]
    assert not [where for file, name, where in found if (file, name) not in ENGINE_NAMES_OUTSIDE], found
    assert len(found) == len(ENGINE_NAMES_OUTSIDE), found  # once each


def test_engine_classes_have_no_method_only_tests_call():
    """A public method of a class in engines/ is named in src/ besides its definition: what only the
    tests read of an engine is a helper in tests/ that takes the engine (tests/engine_internals.py)."""
    text = "\n".join(p.read_text() for p in _files())
    names = collections.Counter(re.findall(r"\w+", text))
    defined = collections.Counter(re.findall(r"\bdef (\w+)", text))
    only_defined = []
    for p in sorted((SRC / "shardlab" / "engines").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                only_defined += [f"{p.relative_to(SRC)}:{f.lineno} {node.name}.{f.name}" for f in node.body
                                 if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
                                 and names[f.name] == defined[f.name]]
    assert not only_defined, only_defined
