"""nanreplay diff: two runs' settings side by side, the numerics-relevant differences first; --here,
--json against the shipped schema, --html, exit codes, bundle strings made inert."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import with_meta

import scenarios
from nanreplay import open_bundle
from nanreplay.cli import EXIT_BAD_BUNDLE, EXIT_OK, EXIT_USAGE, main
from nanreplay.core import schema
from nanreplay.core.settings import diff_settings


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_setting_that_differs_comes_first(autocast_runs):
    a, b = autocast_runs
    r = _run("diff", a, b)
    assert r.exit_code == EXIT_OK, r.output
    lines = r.output.splitlines()
    head = next(i for i, line in enumerate(lines) if "can change numerics" in line)
    assert lines[head].startswith("1 difference(s)")
    first = lines[head + 2].split()
    assert first[:4] == ["1", "autocast", "float16", "bfloat16"] and "[bisect --over config can toggle it]" in lines[head + 2]
    assert f"next: nanreplay bisect {a} --over config --against {b}" in r.output


def test_json_follows_the_shipped_schema(autocast_runs):
    jsonschema = pytest.importorskip("jsonschema")
    a, b = autocast_runs
    r = _run("diff", a, b, "--json")
    out = json.loads(r.stdout)
    jsonschema.Draft202012Validator(schema.shipped_schema("diff")).validate(out)
    assert out["schema_version"] == schema.results.SCHEMA_VERSION
    assert [d["key"] for d in out["differences"] if d["numerics"]] == ["autocast"]
    assert out["a"] == {"bundle": str(a), "step": 22, "here": False} and out["unknown"] == [] and out["same"] > 30


def test_numerics_first_then_by_rank_whatever_else_differs(autocast_runs, tmp_path):
    """B also runs another torch, TF32 matmuls, another learning rate and NCCL_ALGO, another
    platform and a logging variable: the precision settings come first, then the optimizer, then
    versions and variables; the platform and the logging variable are not numerics."""
    a, b = autocast_runs

    def other(meta):
        env = meta["environment"]
        env["determinism"]["tf32_matmul"] = True
        env["torch"], env["platform"] = "2.99.0", "Plan9"
        env["variables"].update({"NCCL_ALGO": "Tree", "TORCH_LOGS": "+dynamo"})
        meta["config"]["optimizer"]["param_groups"][0]["lr"] = 0.01
    b2 = with_meta(b, tmp_path / "b2.h5", other)
    with open_bundle(a) as A, open_bundle(b2) as B:
        d = diff_settings(A.meta, B.meta)
    keys = [r["key"] for r in d["differences"]]
    assert keys[:2] == ["autocast", "numerics.tf32_matmul"]
    assert keys.index("optimizer.lr") < keys.index("version.torch") and keys.index("optimizer.lr") < keys.index("env.NCCL_ALGO")
    ranks = [r["rank"] for r in d["differences"]]
    assert ranks == sorted(ranks)
    other_rows = {r["key"] for r in d["differences"] if not r["numerics"]}
    assert other_rows == {"version.platform", "env.TORCH_LOGS"}


def test_different_data_at_a_step_is_one_row(tmp_path):
    """Two float16 runs whose step 22 batches differ (scaled 3e3 and 4e3): the data row names the
    step; the steps before it read the same data."""
    (a,) = scenarios.autocast_run(tmp_path / "a", "float16")
    (b,) = scenarios.autocast_run(tmp_path / "b", "float16", scale=4e3)
    with open_bundle(a) as A, open_bundle(b) as B:
        d = diff_settings(A.meta, B.meta)
    (row,) = [r for r in d["differences"] if r["category"] == "data"]
    assert row["key"] == "data.batches" and "1 of the 4 step(s)" in row["why"] and "steps 22" in row["why"]
    assert all(r["category"] == "data" for r in d["differences"] if r["numerics"])


def test_here_compares_the_process(autocast_runs):
    a, _ = autocast_runs
    r = _run("diff", a, "--here", "--json")
    out = json.loads(r.stdout)
    assert r.exit_code == EXIT_OK and out["b"] == {"bundle": "this process", "step": None, "here": True}
    assert not any(d["key"].startswith(("autocast", "optimizer.", "data.")) for d in out["differences"])  # the run's side is not compared
    assert "version.torch" not in {d["key"] for d in out["differences"]}  # the same torch as this test
    assert out["notes"] and "this process" in out["notes"][0]


@pytest.mark.parametrize("args, code, says", [
    (["A"], EXIT_USAGE, "give a second bundle B, or --here"),
    (["A", "A", "--here"], EXIT_USAGE, "give a second bundle B, or --here"),
    (["A", "missing.h5"], EXIT_BAD_BUNDLE, "missing.h5"),
])
def test_usage_and_bad_bundles(autocast_runs, tmp_path, args, code, says):
    a, _ = autocast_runs
    r = CliRunner().invoke(main, ["diff", *[str(a) if x == "A" else str(tmp_path / x) if x.endswith(".h5") else x for x in args]])
    assert r.exit_code == code and says in r.output


def test_html_page_and_inert_strings(autocast_runs, tmp_path):
    """A variable whose value carries terminal escapes (a hostile bundle) shows escaped in the
    text and in the page; the page holds the diff section and the JSON."""
    a, b = autocast_runs
    b2 = with_meta(b, tmp_path / "b2.h5", lambda m: m["environment"]["variables"].update({"NCCL_PROTO": "Simple\x1b[2J<script>"}))
    page = tmp_path / "diff.html"
    r = _run("diff", a, b2, "--html", page)
    assert r.exit_code == EXIT_OK and "\x1b" not in r.output and "Simple\\x1b[2J<script>" in r.output
    html = page.read_text()
    assert '<section id="config-diff">' in html and 'id="nanreplay-diff"' in html
    assert "<script>" not in html.split('id="nanreplay-diff"')[0] and "Simple\\x1b[2J&lt;script&gt;" in html


def test_the_worked_example_of_docs_bisect(autocast_runs, monkeypatch):
    """examples/amp_config.py run twice (the fixture), then the diff and the two searches of
    docs/bisect.md ("A worked example") from the directory holding runs/: their output is the one
    the page shows."""
    import re
    from pathlib import Path

    a, _ = autocast_runs
    monkeypatch.chdir(Path(a).parents[2])
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bisect.md").read_text()
    block = doc.split("### A worked example", 1)[1].split("```", 2)[1]
    commands = re.findall(r"^\$ nanreplay (.+)$", block, flags=re.M)
    assert [c.split()[0] for c in commands] == ["diff", "bisect", "bisect"]
    same = re.compile(r"^\d+ setting\(s\) the same", re.M)  # how many variables the process has set varies
    for cmd in commands:
        r = _run(*cmd.split())
        assert r.exit_code == EXIT_OK, r.output
        shown = block.split(f"$ nanreplay {cmd}\n", 1)[1].split("\n$ ", 1)[0].strip()
        assert same.sub("N", r.output.strip()) == same.sub("N", shown), cmd
