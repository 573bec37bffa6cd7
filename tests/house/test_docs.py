"""Every Python snippet in README.md and docs/*.md runs.

The rule, per Markdown file:

* Every fenced block opened with ```` ```python ```` (or ```` ```py ````) is a snippet. Other fences
  (shell commands, output, JSON) are not run.
* A file's snippets run **in order, in one namespace per file** (so a later snippet may use a name
  an earlier one in the same file defined, as a reader following the page would), in a fresh
  temporary working directory per file. No file sees another file's names.
* The namespace starts with the objects the prose says are the reader's own, here those of the
  built-in example (``examples/digits_nan.py``): ``make_model``, ``step_loss``, ``model``,
  ``optimizer`` (``opt``), a finite ``loader`` of three batches, one batch ``x, y``, and the
  example's bundle at ``nanreplay_bundles/nanreplay-step28.h5`` in the working directory (the
  path the Quick start writes to). Everything else a snippet uses it must import or define.
* A snippet is skipped only when the line just before its fence is ``<!-- no-test: REASON -->``
  with a non-empty reason; use it for what a test cannot run here (CUDA, several processes, the
  network, objects only the reader has). The skipped snippets are listed by
  :func:`test_skipped_snippets_say_why`.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NO_TEST = re.compile(r"^<!--\s*no-test:\s*(.*?)\s*-->\s*$")


@dataclass
class Snippet:
    file: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason of a no-test marker, else None

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """The Python snippets of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if lang in ("python", "py"):
            marker = NO_TEST.match(lines[start - 1]) if start else None
            out.append(Snippet(path, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return out


def _reader_objects(bundle: Path) -> dict:
    """The names the docs leave to the reader: the digits example's model, loss and data."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_nan_docs", ROOT / "examples" / "digits_nan.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    xs, ys = ex.load_digits()
    loader = [(xs[i : i + 100], ys[i : i + 100]) for i in (0, 100, 200)]
    assert all(len(set(yb.tolist())) == 10 for _, yb in loader), "each batch must hold every class (finite loss)"
    model = ex.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = loader[0]
    Path("nanreplay_bundles").mkdir()
    shutil.copy(bundle, "nanreplay_bundles/nanreplay-step28.h5")
    return {"make_model": ex.make_model, "step_loss": ex.step_loss, "model": model, "optimizer": opt, "opt": opt,
            "loader": loader, "x": x, "y": y, "__name__": "__docs__"}


def test_the_snippets_are_found():
    found = {p.name: len(snippets(p)) for p in DOC_FILES}
    assert found["README.md"] >= 6 and found["program.md"] >= 1, found


def test_skipped_snippets_say_why():
    skipped = [(s.where, s.skip) for p in DOC_FILES for s in snippets(p) if s.skip is not None]
    assert all(reason for _, reason in skipped), f"a no-test marker without a reason: {skipped}"
    # few, on purpose: everything that can run here runs
    assert len(skipped) <= 3, skipped


@pytest.mark.parametrize("doc", [p for p in DOC_FILES if any(s.skip is None for s in snippets(p))], ids=lambda p: p.name)
def test_doc_snippets_run(doc, digits_bundle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = _reader_objects(digits_bundle)
    for s in snippets(doc):
        if s.skip is not None:
            continue
        try:
            exec(compile(s.code, s.where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the snippet at {s.where} fails: {type(e).__name__}: {e}\n{s.code}") from e


def test_the_rule_reads_markers_and_fences(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n```python\na = 1\n```\n<!-- no-test: needs CUDA -->\n```python\nb = a\n```\n```bash\nls\n```\n")
    got = snippets(md)
    assert [(s.line, s.code, s.skip) for s in got] == [(2, "a = 1\n", None), (6, "b = a\n", "needs CUDA")]
    assert os.path.basename(got[0].file) == "x.md"


# -- docs/architecture.md against the code ------------------------------------------------------

ARCH = ROOT / "docs" / "architecture.md"


def _arch_rows() -> dict[str, list[str]]:
    """The package table: package -> the modules its row lists."""
    rows = {}
    for line in ARCH.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = [m.removesuffix(".py") for m in re.findall(r"`([\w.]+)`", cells[1])]
    return rows


def test_architecture_layers_are_those_the_import_test_enforces():
    from test_architecture import LAYERS

    text = ARCH.read_text()
    m = re.search(r"<!-- layers:.*?-->\n```\n(.*?)\n```", text, re.S)
    assert m, "docs/architecture.md lost its layer line"
    assert [p.strip() for p in m.group(1).split("<")] == LAYERS
    assert list(_arch_rows()) == LAYERS, "the package table must list every layer, in the same order"


def test_architecture_lists_every_package_and_module():
    pkg = ROOT / "nanreplay"
    rows = _arch_rows()
    actual = {p.name: sorted(q.stem for q in p.glob("*.py") if q.stem != "__init__") for p in pkg.iterdir() if (p / "__init__.py").exists()}
    actual.update({p.stem: [p.stem] for p in pkg.glob("*.py") if p.stem != "__init__"})
    assert set(rows) == set(actual), f"packages: the doc lists {sorted(rows)}, the code has {sorted(actual)}"
    for name, modules in actual.items():
        assert sorted(rows[name]) == modules, f"{name}: the doc lists {sorted(rows[name])}, the code has {modules}"


def test_architecture_names_exist():
    """Every dotted name the page cites (`nanreplay.diagnosis.origin.STAGES`, `engine.run.run_step`)
    is importable: the module exists and has the attribute."""
    import importlib

    from test_architecture import LAYERS

    cited = set(re.findall(r"`((?:nanreplay\.)?(?:%s)\.[\w.]+)`" % "|".join(LAYERS), ARCH.read_text()))
    cited = {c for c in cited if not c.endswith(".py")}  # file names, checked by the package table
    assert len(cited) > 30, cited
    missing = []
    for name in sorted(cited):
        parts = name.removeprefix("nanreplay.").split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module, the rest attributes
            try:
                obj = importlib.import_module("nanreplay." + ".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"docs/architecture.md cites names the code lacks: {missing}"


# -- docs/bundle-format.md against the writer ---------------------------------------------------

def test_bundle_format_documents_every_meta_field_the_recorder_writes(sqrt_bundle):
    from nanreplay import open_bundle

    text = (ROOT / "docs" / "bundle-format.md").read_text()
    rows = {}
    for line in text.split("### `meta` fields", 1)[1].splitlines():
        if line.startswith("| `"):
            first, rest = line[2:].split(" | ", 1)
            for name in re.findall(r"`(\w+)`", first):
                rows[name] = rest
    with open_bundle(sqrt_bundle) as b:
        meta = b.meta
    assert {"replay_options", "program", "callables", "extra_tensors"} <= set(rows)
    assert sorted(set(meta) - set(rows)) == [], "meta fields the spec does not list"
    assert sorted(k for k in meta["reason"] if f"`{k}`" not in rows["reason"]) == [], "reason fields the spec does not list"
    # the typed node's context, as the spec states it: the three-element list [type path, kind, field names]
    import collections
    import json

    from torch.utils._pytree import treespec_dumps

    from nanreplay.core.tree import flatten_typed

    pair = collections.namedtuple("Pair", "a b")
    node = json.loads(treespec_dumps(flatten_typed(pair(torch.ones(1), 2))[1]))[1]
    assert node["type"] == "nanreplay.tree.TypedNode" and node["context"] == [f"{__name__}:Pair", "namedtuple", ["a", "b"]]
    assert "whose context is the three-element list\n`[<\"module:QualName\">, <\"namedtuple\"|\"dataclass\">, [<field name>, ...]]`" in text


# -- docs/guide.md against the CLI --------------------------------------------------------------

def test_the_guide_lists_every_exit_code_and_is_linked_from_the_readme():
    from nanreplay.cli import EXIT_CODES

    text = (ROOT / "docs" / "guide.md").read_text()
    rows = [int(m) for m in re.findall(r"^\| (\d+) \|", text, re.M)]
    assert rows == sorted(EXIT_CODES), f"docs/guide.md's exit-code table lists {rows}, nanreplay.cli.EXIT_CODES has {sorted(EXIT_CODES)}"
    assert "(docs/guide.md)" in (ROOT / "README.md").read_text(), "README.md must link docs/guide.md"
