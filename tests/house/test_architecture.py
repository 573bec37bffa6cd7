"""The package's layering, checked on the source: the design's allowed edges, no import cycle, no
import of the package facade from inside the package.

The layers, from the bottom (see docs/architecture.md): each package imports only from itself and
the packages before it. Within that order, :data:`ALLOWED` says which packages each one may import
(siblings such as ``capture`` and ``search`` do not import each other, ``search`` replays without
``diagnosis``), and :data:`EXCEPTIONS` names each edge outside the table with its reason. Imports
inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nanreplay"

#: bottom first; a module may import from its own layer and the layers before it
LAYERS = ["errors", "core", "report", "format", "engine", "diagnosis", "capture", "search", "testing", "integrations", "cli"]

_BASE = {"errors", "core"}

#: package -> the other packages its modules may import (each below it in LAYERS)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "core": {"errors"},
    "report": _BASE,  # the diagnosis dict in words and pictures: no torch, nothing that reads or replays
    "format": _BASE,
    "engine": _BASE | {"format"},
    "diagnosis": _BASE | {"format", "engine", "report"},
    "capture": _BASE | {"format", "engine"},  # the diagnosis only through EXCEPTIONS
    "search": _BASE | {"format", "engine"},  # replays with one thing changed; no diagnosis, no recorder
    "testing": _BASE | {"format", "engine"},  # a regression test from a bundle: one bare replay, no diagnosis
    "integrations": _BASE | {"capture"},  # callbacks that drive a Recorder
    "cli": _BASE | {"report", "format", "engine", "diagnosis", "capture", "search", "testing"},
}

#: (importing package or module, imported module) -> why the edge is allowed outside ALLOWED;
#: an edge here must be a lazy import (inside a function)
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("nanreplay.capture", "nanreplay.diagnosis.api"): "the in-process diagnosis: one lazy call, diagnose_live, after the bundle is written",
    ("nanreplay.capture", "nanreplay.report.html"): "log_to: the HTML report as a tracker artifact, rendered lazily from the diagnosis, only when a tracker is configured",
}

#: the package facade (nanreplay/__init__.py): it re-exports lazily from every layer, and no module
#: inside the package imports from it
FACADE = "nanreplay"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def _edges(name: str, path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """Every nanreplay module ``name`` imports, at any depth of its code -> whether every import
    of it is lazy (inside a function). ``from PKG import sub`` imports the submodule ``PKG.sub``
    (and ``PKG`` only when some name is not a submodule: ``from .. import replay`` imports the
    facade)."""
    is_pkg = path.name == "__init__.py"
    found: dict[str, bool] = {}
    tree = ast.parse(path.read_text(), str(path))
    lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in modules] + ([base] if any(t not in modules for t in subs) else [])
        for t in targets:
            # a submodule import also imports its package: keep the most specific module that exists
            while t and t not in modules:
                t = t.rpartition(".")[0]
            own_package = name.startswith(t + ".") and modules[t].name == "__init__.py" and t != FACADE
            if t and t != name and not own_package:
                found[t] = found.get(t, True) and id(node) in lazy_nodes
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every nanreplay module ``name`` imports, at any depth of its code."""
    return set(_edges(name, path, modules))


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


def _exception(module: str, dep: str) -> str | None:
    return next((why for (src, dst), why in EXCEPTIONS.items() if dep == dst and (module == src or module.startswith(src + "."))), None)


def test_every_import_is_an_allowed_edge_or_a_named_exception():
    mods = _modules()
    bad = []
    for m, p in mods.items():
        if m == FACADE:
            continue
        pkg = m.split(".")[1]
        for d, lazy in _edges(m, p, mods).items():
            dpkg = d.split(".")[1] if d != FACADE else None
            if dpkg is None or dpkg == pkg or dpkg in ALLOWED[pkg]:
                continue
            why = _exception(m, d)
            if why is None:
                bad.append(f"{m} ({pkg}) imports {d} ({dpkg}): not in ALLOWED[{pkg!r}] nor EXCEPTIONS")
            elif not lazy:
                bad.append(f"{m} imports {d} at module level; the exception ({why}) is for a lazy import")
    assert not bad, "imports outside the design:\n" + "\n".join(sorted(bad))


def test_no_module_imports_the_package_facade():
    mods = _modules()
    bad = sorted(m for m, p in mods.items() if m != FACADE and FACADE in _edges(m, p, mods))
    assert not bad, f"modules importing the package facade nanreplay/__init__.py (import from the defining module): {bad}"


def test_the_allowed_edges_follow_the_layers_and_the_exceptions_are_used():
    assert set(ALLOWED) == set(LAYERS)
    upward = [(p, d) for p, ds in ALLOWED.items() for d in ds if LAYERS.index(d) >= LAYERS.index(p)]
    assert not upward, f"ALLOWED edges that do not go down the layers: {upward}"
    mods = _modules()
    graph = _graph()
    for (src, dst), why in EXCEPTIONS.items():
        assert dst in mods, f"EXCEPTIONS names {dst}, which does not exist"
        assert any(dst in deps for m, deps in graph.items() if m == src or m.startswith(src + ".")), f"unused exception {src} -> {dst} ({why})"


@pytest.mark.parametrize("line", ["from .. import replay", "from nanreplay import Recorder", "import nanreplay"])
def test_the_facade_check_sees_a_facade_import(tmp_path, line):
    """The hole the old test had: an added ``from .. import replay`` inside core/ kept it green."""
    f = tmp_path / "x.py"
    f.write_text(line + "\n")
    assert FACADE in _edges("nanreplay.core.x", f, {**_modules(), "nanreplay.core.x": f})


def test_a_submodule_import_is_not_a_facade_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from .. import errors\nfrom . import numerics\n")
    assert set(_edges("nanreplay.core.x", f, {**_modules(), "nanreplay.core.x": f})) == {"nanreplay.errors", "nanreplay.core.numerics"}


def test_a_capture_module_may_import_diagnose_live_only_lazily(tmp_path):
    eager, lazy = tmp_path / "eager.py", tmp_path / "lazy.py"
    eager.write_text("from ..diagnosis.api import diagnose_live\n")
    lazy.write_text("def f():\n    from ..diagnosis.api import diagnose_live\n")
    mods = _modules()
    assert _edges("nanreplay.capture.eager", eager, mods) == {"nanreplay.diagnosis.api": False}
    assert _edges("nanreplay.capture.lazy", lazy, mods) == {"nanreplay.diagnosis.api": True}
    assert _exception("nanreplay.capture.lazy", "nanreplay.diagnosis.api") is not None
    assert _exception("nanreplay.search.lazy", "nanreplay.diagnosis.api") is None


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
