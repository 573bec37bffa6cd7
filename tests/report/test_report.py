"""The visual report: the diagnosis keys it draws from, ``nanreplay report`` and ``bisect --html``
through the CLI (exit codes, files written, the extra missing), the terminal's colour and
progress, that matplotlib stays out of ``import nanreplay`` and the other commands, and the HTML
page itself in a real browser (headless Chromium, skipped where it is not installed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import failure_models as fm
import models
from browser import load_page, missing_reason
from helpers import fail_once
from nanreplay import replay
from nanreplay.cli import EXIT_BAD_BUNDLE, EXIT_NOT_REPRODUCED, EXIT_OK, EXIT_REPLAY, EXIT_USAGE, _Status, main
from nanreplay.core.results import SCHEMA_VERSION
from nanreplay.report.text import render_report

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kw)


# ---------------------------------------------------------------------------------------------
# the diagnosis keys the report draws from
# ---------------------------------------------------------------------------------------------
def test_forward_modules_list_every_module_call_with_roles_and_health(nested_div_bundle):
    diag = replay(nested_div_bundle)
    mods = diag["forward_modules"]
    # every module call in completion order (a parent after its children; the ModuleDict is never called)
    assert [m["module"] for m in mods] == ["encoder.block.proj", "encoder.block.norm", "encoder.block.out", "encoder.block", "head", ""]
    assert [m["index"] for m in mods] == list(range(len(mods)))
    # the same roles as the health table, for every row the table holds
    for row in diag["health"]:
        assert mods[row["index"]]["module"] == row["module"] and mods[row["index"]]["role"] == row["role"]
    by = {m["module"]: m for m in mods}
    norm = by["encoder.block.norm"]
    assert norm["role"] == "producer" and norm["class"] == "SafeDiv" and norm["depth"] == 3
    assert norm["output"]["nan"] == 8 and norm["output"]["numel"] == 48  # row 2 of a (6, 8) output
    assert isinstance(norm["output"]["absmax"], float) and norm["output"]["absmax"] > 0
    assert by[""]["role"] == "contains producer"
    assert by["encoder.block.proj"]["role"] == "" and by["encoder.block.proj"]["output"]["nan"] == 0
    # the gradient at each output, from the backward pass (a mean loss sends back finite 1/N everywhere)
    assert norm["grad"]["numel"] == 48 and norm["grad"]["nan"] == 0
    json.dumps(diag, allow_nan=False)  # strict JSON


def test_timeline_holds_the_ring_buffer_losses_grad_norms_and_lrs(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    from nanreplay import NonFiniteGradientError, Recorder

    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir, capacity=8) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for step in range(6):
                x, y = torch.randn(4, 8), torch.randn(4, 4)
                if step == 4:
                    x[1, 0] = float("nan")
                rec.record((x, y))
                loss = models.mse_loss(model, (x, y))
                rec.log_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    diag = replay(info.value.bundle_path)
    tl = diag["timeline"]
    assert [r["step"] for r in tl] == [0, 1, 2, 3, 4]
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) and r["lrs"] == [0.05] for r in tl[:4])
    assert tl[-1]["failing"] and tl[-1]["loss"] == "nan" and tl[-1]["finite"] is False
    assert not any(r["failing"] for r in tl[:4])
    # the NaN row flows back: the MSE gradient at the model's output is NaN for that row
    out = next(m for m in diag["forward_modules"] if m["module"] == "")
    assert out["output"]["nan"] == 4 and out["grad"]["nan"] == 4 and out["grad"]["numel"] == 16
    # the batch leaves: row 1 of the images holds the NaN, the targets are finite
    leaves = {lf["leaf"]: lf for lf in diag["batch_leaves"]}
    assert leaves["batch[0]"]["rows"] == [1] and leaves["batch[0]"]["nan"] == 1 and leaves["batch[0]"]["shape"] == [4, 8]
    assert leaves["batch[1]"]["rows"] == [] and leaves["batch[1]"]["floating"]
    # the in-process diagnosis stored in the bundle has the same keys
    assert info.value.diagnosis["timeline"] == tl


@pytest.mark.slow
def test_allowlisted_masks_are_attached_to_their_modules(out_dir):
    model = fm.make_attn()
    x = torch.randn(6, 5, 6)
    pad = torch.zeros(6, 5, dtype=torch.bool)
    pad[:, 4] = True
    pad[4] = True  # sample 4 masks every key: NaN
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, pad, torch.randint(0, 2, (6,))), fm.attn_loss, out_dir, model_factory=fm.make_attn)
    diag = replay(err.bundle_path)
    allowed = {m["module"]: m["allowed"] for m in diag["forward_modules"] if m["allowed"]}
    assert sum(sum(v.values()) for v in allowed.values()) <= diag["allowed_births"]
    assert any(op.startswith("masked_fill") for ops in allowed.values() for op in ops)
    leaves = {lf["leaf"]: lf for lf in diag["batch_leaves"]}
    assert leaves["batch[1]"]["dtype"] == "bool" and not leaves["batch[1]"]["floating"]


# ---------------------------------------------------------------------------------------------
# nanreplay report / bisect --html through the CLI
# ---------------------------------------------------------------------------------------------
def _html_checks(page: str, summary: str) -> None:
    """Self-contained: no external resource, the sentence, three plots, unique ids."""
    from html import escape

    assert escape(summary) in page
    assert len(re.findall(r'<svg class="plot"', page)) == 3
    assert not re.search(r'<(link|img|iframe|script)[^>]*\b(src|href)=', page)  # nothing loaded from anywhere
    assert not re.search(r'(src|href)="(https?:)?//', page)
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    data = re.search(r'<script type="application/json" id="nanreplay-diagnosis">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data)["summary"] == summary


def test_report_writes_one_self_contained_page(nested_div_bundle, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    r = _run("report", nested_div_bundle)
    assert r.exit_code == EXIT_OK, r.output
    out = nested_div_bundle.with_suffix(".html")  # default: beside the bundle
    diag = replay(nested_div_bundle)
    assert r.output.splitlines()[0] == diag["summary"]
    assert f"report written to {out}" in r.output
    _html_checks(out.read_text(encoding="utf-8"), diag["summary"])
    # -o names the file; parent directories are created; --open hands it to the default browser
    opened = []
    monkeypatch.setattr(click, "launch", lambda url, **kw: opened.append(url) or 0)
    target = tmp_path / "sub" / "r.html"
    r = _run("report", nested_div_bundle, "-o", target, "--no-samples", "--open")
    assert r.exit_code == EXIT_OK and target.exists() and not target.with_name("r.html.tmp").exists()
    assert opened == [str(target)]


def test_report_no_replay_uses_the_stored_diagnosis(nested_div_bundle, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import nanreplay.diagnosis.api as api

    def no_replay(*a, **k):
        raise AssertionError("--no-replay must not replay")

    monkeypatch.setattr(api, "replay", no_replay)
    out = tmp_path / "stored.html"
    r = _run("report", "--no-replay", nested_div_bundle, "-o", out)
    assert r.exit_code == EXIT_OK, r.output
    assert "from the stored diagnosis" in r.output
    from nanreplay import open_bundle

    with open_bundle(nested_div_bundle) as b:
        stored = b.diagnosis
    assert "forward_modules" in stored and "timeline" in stored  # the Recorder's in-process diagnosis has the new keys
    _html_checks(out.read_text(encoding="utf-8"), stored["summary"])


def test_report_without_matplotlib_names_the_extra(nested_div_bundle, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "r.html"
    r = _run("report", nested_div_bundle, "-o", out)
    assert r.exit_code == EXIT_USAGE
    assert "pip install 'nanreplay[report]'" in r.output and "Traceback" not in r.output
    assert not out.exists()
    r = _run("bisect", nested_div_bundle, "--over", "samples", "--html", out)
    assert r.exit_code == EXIT_USAGE and "nanreplay[report]" in r.output


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_report_on_a_bad_bundle_exits_4(tmp_path, damage):
    bad = tmp_path / "bad.h5"
    if damage == "garbage":
        bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"x" * 200)
    for extra in ([], ["--no-replay"]):
        r = _run("report", bad, *extra, "-o", tmp_path / "r.html")
        if r.exit_code == EXIT_USAGE:
            pytest.skip("matplotlib is not installed")
        assert r.exit_code == EXIT_BAD_BUNDLE, r.output
        assert r.output.startswith("Error: ") and not (tmp_path / "r.html").exists()


def test_report_no_replay_without_a_stored_diagnosis_exits_5(out_dir, tmp_path):
    pytest.importorskip("matplotlib")
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    err = fail_once(model, opt, (x, torch.randn(4, 4)), models.mse_loss, out_dir, model_factory=models.make_mlp, diagnose=False)
    r = _run("report", "--no-replay", err.bundle_path, "-o", tmp_path / "r.html")
    assert r.exit_code == EXIT_REPLAY and "without --no-replay" in r.output


def test_report_of_a_failure_that_does_not_reproduce_exits_3(unreproducible_bundle, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.html"
    r = _run("report", unreproducible_bundle, "-o", out)
    assert r.exit_code == EXIT_NOT_REPRODUCED and out.exists()
    assert "not reproduced" in out.read_text(encoding="utf-8")


def test_bisect_html_shows_the_replays_tried(nested_div_bundle, tmp_path):
    pytest.importorskip("matplotlib")
    r = _run("bisect", nested_div_bundle, "--over", "samples", "--json", "--html")
    assert r.exit_code == EXIT_OK, r.output
    res = json.loads(r.stdout)
    out = nested_div_bundle.with_name(f"{nested_div_bundle.stem}-bisect-samples.html")
    assert f"bisect page written to {out}" in r.stderr
    # every replay is in `trials`, in order, with what it varied
    assert [t["replay"] for t in res["trials"]] == list(range(1, res["replays"] + 1))
    assert res["trials"][0]["varied"] == "6 of 6 samples: 0, 1, 2, 3, 4, 5" and res["trials"][0]["nonfinite"]
    assert any(t["varied"] == "1 of 6 samples: 2" and t["nonfinite"] for t in res["trials"])
    page = out.read_text(encoding="utf-8")
    assert 'data-plot="trials"' in page and "1 of 6 samples: 2" in page and res["answer"].split(";")[0] in page
    named = tmp_path / "b.html"
    assert _run("bisect", nested_div_bundle, "--over", "samples", f"--html={named}").exit_code == EXIT_OK and named.exists()


def test_page_from_a_diagnosis_without_the_new_keys(nested_div_bundle):
    """A diagnosis stored by an older nanreplay lacks timeline/forward_modules/batch_leaves: the
    page rebuilds the timeline from the bundle's steps and draws the health rows it has."""
    pytest.importorskip("matplotlib")
    from nanreplay import open_bundle
    from nanreplay.report.html import render_html

    with open_bundle(nested_div_bundle) as b:
        meta = dict(b.meta)
    old = {k: v for k, v in meta["diagnosis"].items() if k not in ("timeline", "forward_modules", "batch_leaves")}
    page = render_html(old, meta=meta, bundle_name=nested_div_bundle.name)
    assert 'data-plot="timeline"' in page and 'data-plot="modules"' in page
    assert f"holds only the {len(old['health'])} rows of the health table" in page
    assert "encoder.block.norm" in page and "torch" in page


# ---------------------------------------------------------------------------------------------
# the terminal: plain when piped, colour on request, progress only on a terminal
# ---------------------------------------------------------------------------------------------
def test_replay_output_is_plain_and_unchanged_when_piped(nested_div_bundle):
    diag = replay(nested_div_bundle)
    r = _run("replay", nested_div_bundle)  # CliRunner's stdout is not a terminal
    assert r.exit_code == 0
    assert r.stdout == render_report(diag) + "\n"
    assert "\x1b[" not in r.stdout and r.stderr == ""  # no colour, no progress line
    j = _run("replay", "--json", nested_div_bundle)
    assert json.loads(j.stdout) == {"schema_version": SCHEMA_VERSION, **json.loads(json.dumps(diag, default=str))}  # the one field --json adds
    assert j.stdout == json.dumps(json.loads(j.stdout), indent=2) + "\n" and "\x1b[" not in j.stdout
    assert _run("replay", "--json", "--color", nested_div_bundle).stdout == j.stdout  # --json stays plain


def test_color_flag_styles_the_same_text(nested_div_bundle):
    plain = _run("replay", nested_div_bundle).stdout
    colored = _run("replay", "--color", nested_div_bundle).stdout
    assert "\x1b[" in colored and click.unstyle(colored) == plain
    assert _run("replay", "--no-color", nested_div_bundle).stdout == plain
    for args in (["inspect"], ["bisect", "--over", "samples"]):
        p, c = _run(*args, nested_div_bundle).stdout, _run(*args, "--color", nested_div_bundle).stdout
        assert "\x1b[" not in p and "\x1b[" in c and click.unstyle(c) == p


def test_status_line_only_after_the_delay_and_erased(capsys):
    with _Status(enabled=True, delay=0.05, interval=0.01) as status:
        status("replaying step 3")
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "replaying step 3" in err and err.endswith("\r\x1b[K")
    with _Status(enabled=True, delay=5.0) as status:  # work shorter than the delay: nothing drawn
        status("quick")
    with _Status(enabled=False, delay=0.0) as status:  # stderr not a terminal: nothing drawn
        status("piped")
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# matplotlib stays out of everything but the report
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_matplotlib_is_imported_only_by_the_report(nested_div_bundle):
    pytest.importorskip("matplotlib")
    code = f"""
import sys
from click.testing import CliRunner
import nanreplay
from nanreplay.cli import main
bundle = {str(nested_div_bundle)!r}
assert "matplotlib" not in sys.modules, "import nanreplay"
diag = nanreplay.replay(bundle)
for args in (["replay", bundle], ["replay", "--json", bundle], ["inspect", bundle], ["bisect", bundle, "--over", "samples"]):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "matplotlib" not in sys.modules, args
r = CliRunner().invoke(main, ["report", bundle, "-o", bundle + ".html", "--no-samples"])
assert r.exit_code == 0, r.output
print("matplotlib" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests", timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # the report does import it


# ---------------------------------------------------------------------------------------------
# the page in a real browser
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_digits_report_in_headless_chromium(digits_bundle, tmp_path):
    why = missing_reason()
    if why:
        pytest.skip(why)
    pytest.importorskip("matplotlib")
    from PIL import Image

    out = tmp_path / "report.html"
    r = _run("report", digits_bundle, "-o", out)
    assert r.exit_code == EXIT_OK, r.output
    summary = r.output.splitlines()[0]
    shot = tmp_path / "report.png"
    t0 = time.perf_counter()
    page = load_page(out, screenshot=shot)
    print(f"\nscreenshot of the digits report: {shot} (browser: {time.perf_counter() - t0:.1f} s)")
    assert [m for m in page.console] == []  # no console message at all, errors included
    uri = out.resolve().as_uri()
    mine = [r["url"] for r in page.requests if r["document"] == uri]
    assert mine[0] == uri and all(u.startswith("data:") for u in mine[1:]), mine  # the page itself, then its inline images only
    assert not [r for r in page.requests if r["url"].split(":")[0] not in ("file", "data", "chrome")]  # no network at all
    assert page.summary == summary and summary.startswith("NaN born in the loss")
    assert [s["plot"] for s in page.svgs] == ["timeline", "modules", "samples"]
    img = Image.open(shot).convert("L")
    for s in page.svgs:
        w_pt, h_pt = float(s["width"].removesuffix("pt")), float(s["height"].removesuffix("pt"))
        x, y, w, h = s["box"]
        assert abs(w - w_pt * 4 / 3) < 1 and abs(h - h_pt * 4 / 3) < 1, s  # drawn at its own size (1 pt = 4/3 px)
        assert s["paths"] > 10
        region = img.crop((int(x), int(y), int(x + w), int(y + h)))
        inked = sum(region.histogram()[:200]) / (region.width * region.height)  # share of pixels darker than light grey
        assert inked > 0.01, (s["plot"], inked)  # the plot is drawn, not blank
    for section in ("Loss, grad norm and learning rate", "The forward pass, module by module", "Causal chain", "Samples", "Environment of the recording"):
        assert section in page.text
    assert "return (per_class / counts).mean()" in page.text and "torch" in page.text


def test_a_births_rows_read_as_samples_where_dimension_0_merges_the_batch():
    from nanreplay.report.html import _birth_extra

    merged = {"rows": {"size": 4, "dim": 0, "count": 1, "indices": [2], "rows_per_sample": 128}}
    assert _birth_extra(merged) == ["non-finite samples [2] of 4 (128 rows each)"]
    assert _birth_extra({"rows": {"size": 4, "dim": 0, "count": 2, "indices": [0, 3]}}) == ["non-finite rows [0, 3] of 4"]


def test_the_verdict_says_its_numbers_in_four_digits_and_the_origin_labels_keep_their_space():
    """The sentence printed a norm difference with its full repr (1.1473960115360171e-08), and the
    origin's first non-finite gradient label ran into its value."""
    from nanreplay.report.summary import verdict_phrase

    assert verdict_phrase({"verdict": "reproduced", "norm_diff": 1.1473960115360171e-08}) == (
        "reproduced (same non-finite positions; finite gradient 2-norms differ by up to 1.147e-08)")
    assert verdict_phrase({"verdict": "reproduced", "max_abs_diff": 0.000123456}) == "reproduced (max abs difference 0.0001235)"
    assert verdict_phrase({"verdict": "reproduced", "grad_factor": 0.125}) == (
        "reproduced up to one gradient factor 0.125 that the loop applied after backward")
    report = render_report({"step": 3, "phase": "backward", "summary": "s", "reproduction": {"verdict": "reproduced exactly"},
                            "origin": {"module": "net", "op": "div", "first_nonfinite_gradient": "cotangent at net.2", "samples": [1]}})
    assert "  first non-finite gradient: cotangent at net.2" in report and "  samples:       [1]" in report
