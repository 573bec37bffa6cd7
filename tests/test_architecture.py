"""The package's layering, checked on the source: no import cycle, no import that goes up the layers.

The layers, from the bottom (see docs/architecture.md): each package imports only from itself and
the packages before it. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanreplay"

#: bottom first; a module may import from its own layer and the layers before it
LAYERS = ["errors", "core", "report", "format", "engine", "diagnosis", "capture", "search", "integrations", "cli"]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every nanreplay module ``name`` imports, at any depth of its code."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            # a submodule import also imports its package: keep the most specific module that exists
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not (name.startswith(t + ".") and modules[t].name == "__init__.py"):
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package facade nanreplay/__init__.py: it re-exports lazily from every layer
    return LAYERS.index(parts[1])


def test_every_module_belongs_to_a_layer():
    unknown = [m for m in _modules() if m != "nanreplay" and m.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}; add the package to LAYERS in its place"


def test_no_import_goes_up_the_layers():
    upward = []
    for m, deps in _graph().items():
        lm = _layer(m)
        if lm is None:
            continue
        for d in deps:
            ld = _layer(d)
            if ld is not None and ld > lm:
                upward.append(f"{m} ({LAYERS[lm]}) imports {d} ({LAYERS[ld]})")
    assert not upward, "imports that go up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["nanreplay", "nanreplay.cli"])
def test_importing_the_facade_or_the_cli_imports_no_torch(module):
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"
