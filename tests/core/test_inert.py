"""Every string from a bundle is inert: in the HTML page (escaped, one path: ``report.html.esc``)
and on the terminal (control characters shown as escapes: ``core.inert``), for every command,
piped or not; ``--json`` stays JSON."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import assert_inert_page, raw_controls
from nanreplay import open_bundle, replay
from nanreplay.cli import main
from nanreplay.core.inert import inert, inert_name, inert_tree
from nanreplay.report.text import render_report

ROOT = Path(__file__).resolve().parents[2]

#: strings an attacker would store in a diagnosis: each must reach the page as text only
HTML_PAYLOADS = (
    '<meta http-equiv="refresh" content="0; url=https://attacker.example/">',
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "' onload='alert(1)",
    "</script><script>alert(2)</script><!--<script>",
    "$x^{$",  # mathtext in a plot label
)

#: characters a terminal acts on
TERMINAL_PAYLOAD = "evil:run\rtorch.nn:Linear\x1b]0;owned\x07\x1b[2J\x08\x7f\x9b31m\u202e"


def _hostile(obj, payload):
    """``obj`` with every string value replaced by ``payload`` (keys, numbers and shapes kept)."""
    if isinstance(obj, str):
        return payload
    if isinstance(obj, dict):
        return {k: _hostile(v, payload) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hostile(v, payload) for v in obj]
    return obj


@pytest.fixture(scope="module")
def diagnosis(tmp_path_factory):
    import scenarios

    out = tmp_path_factory.mktemp("inert")
    bundle = Path(scenarios.division_by_zero_in_a_submodule(out).bundle_path)
    return bundle, replay(bundle)


@pytest.mark.parametrize("payload", HTML_PAYLOADS)
def test_the_page_shows_every_hostile_string_as_text(diagnosis, payload):
    pytest.importorskip("matplotlib")
    from nanreplay.report.html import render_html

    bundle, diag = diagnosis
    with open_bundle(bundle) as b:
        meta = _hostile(dict(b.meta), payload)
    bad = _hostile(diag, payload)
    bad.update(propagated_ops=payload, allowed_births=payload, allowlist=[payload])
    page = render_html(bad, meta=meta, bundle_name=payload)
    crawl = assert_inert_page(page)
    assert payload in crawl.scripts[0] or json.loads(crawl.scripts[0])["propagated_ops"] == payload


def test_the_page_is_built_through_one_escaping_path():
    """No HTML is built by an f-string or ``%`` in report/html.py: markup comes only from the
    literal templates of ``h``, whose arguments ``esc`` escapes unless already markup."""
    src = (ROOT / "nanreplay" / "report" / "html.py").read_text()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            assert "<" not in text, f"line {node.lineno}: an f-string builds HTML; use h('...{{}}...', value)"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
            assert "<" not in str(node.left.value), f"line {node.lineno}: HTML built with %"
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Markup":
            arg = node.args[0] if node.args else None
            ok = isinstance(arg, ast.Constant) or (isinstance(arg, ast.Name) and arg.id in ("_CSS", "svg", "text"))
            ok = ok or (isinstance(arg, ast.Call) and getattr(arg.func, "attr", "") in ("format", "join", "__add__") )
            ok = ok or (isinstance(arg, ast.Call) and getattr(arg.func, "id", "") in ("escape", "_scoped"))  # _scoped: the literal _CSS, scoped
            assert ok, f"line {node.lineno}: Markup() of something that is not a literal or the escaped output"


def test_bisect_page_escapes_the_result():
    pytest.importorskip("matplotlib")
    from nanreplay.report.html import render_bisect_html

    payload = HTML_PAYLOADS[0]
    res = {"status": payload, "over": payload, "step": 1, "replays": 1, "max_replays": 2, "device": payload, "answer": payload,
           "culprits": [{"layer": payload, "relative_change": 1.0}], "warnings": [payload], "bundle": payload,
           "trials": [{"replay": 1, "varied": payload, "nonfinite": True, "loss": payload, "grad_norm": None}],
           "details": {"verification": payload, "largest_moves": [{"layer": payload, "relative_change": 2.0, "max_abs_diff": 1.0}]}}
    assert_inert_page(render_bisect_html(res))


# ---------------------------------------------------------------------------------------------
# the terminal
# ---------------------------------------------------------------------------------------------
def test_inert_escapes_controls_and_keeps_newlines_and_tabs():
    assert inert("a\r\x1b[2Jb\x08\x7f\x9b\u202e\n\tc") == "a\\r\\x1b[2Jb\\b\\x7f\\x9b\\u202e\n\tc"
    assert inert_name("evil:run\rtorch.nn:Linear\n") == "evil:run\\rtorch.nn:Linear\\n"
    assert inert_name("a\\rb") == "a\\\\rb"  # a literal backslash-r reads differently from a CR
    assert inert_tree({"k\x1b": ["\r", 1, None, ("\x9b",)]}) == {"k\\x1b": ["\\r", 1, None, ("\\x9b",)]}
    assert inert("plain text, ünïcödé, 日本") == "plain text, ünïcödé, 日本"


@pytest.mark.parametrize("color", [False, True])
def test_the_text_report_shows_controls_as_escapes(diagnosis, color):
    _, diag = diagnosis
    text = render_report(_hostile(diag, TERMINAL_PAYLOAD), color=color)
    assert not raw_controls(text)
    assert "evil:run\\rtorch.nn:Linear\\x1b]0;owned\\x07" in text


def test_a_newline_in_a_bundle_string_cannot_forge_a_line_of_the_report(diagnosis):
    _, diag = diagnosis
    forged = "enc\n  reproduction:  reproduced exactly"
    text = render_report(_hostile(diag, forged))
    assert "enc\\n  reproduction:" in text
    assert sum(line.startswith("  reproduction:") for line in text.splitlines()) == 1


@pytest.fixture(scope="module")
def hostile_bundle(diagnosis, tmp_path_factory):
    """The bundle with control characters in its factory and loss names, a module name, the
    stored diagnosis and its model class."""
    from attacks.make_attacks import read_manifest, write_manifest
    from nanreplay.engine.program import PROGRAM_META_KEY

    bundle, diag = diagnosis
    out = tmp_path_factory.mktemp("hostile") / "hostile.h5"
    out.write_bytes(bundle.read_bytes())
    m = read_manifest(out)
    meta = m["meta"]
    meta["model_factory"] = TERMINAL_PAYLOAD
    meta["loss_fn"] = "pkg:loss\x1b[8m"
    meta["model"]["class"] = TERMINAL_PAYLOAD
    meta["diagnosis"] = _hostile(diag, TERMINAL_PAYLOAD)
    meta.pop(PROGRAM_META_KEY, None)  # no embedded program: replay would use the named code
    write_manifest(out, m)
    return out


@pytest.mark.parametrize("color", ["--no-color", "--color"])
def test_inspect_shows_bundle_strings_escaped_piped_or_not(hostile_bundle, color):
    r = CliRunner().invoke(main, ["inspect", str(hostile_bundle), color], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not raw_controls(r.output), [c for c in raw_controls(r.output)]
    # the review line: the name escaped, the real name visible before the \r
    assert "code it names: model factory evil:run\\rtorch.nn:Linear\\x1b]0;owned\\x07\\x1b[2J\\b\\x7f\\x9b31m\\u202e" in r.output


def test_inspect_json_stays_json_and_round_trips_the_strings(hostile_bundle):
    r = CliRunner().invoke(main, ["inspect", "--json", str(hostile_bundle)], catch_exceptions=False)
    assert r.exit_code == 0
    assert not raw_controls(r.output)
    info = json.loads(r.output)
    assert info["model_factory"] == TERMINAL_PAYLOAD


def test_replay_refusal_and_report_no_replay_are_inert(hostile_bundle, tmp_path):
    pytest.importorskip("matplotlib")
    r = CliRunner().invoke(main, ["replay", str(hostile_bundle)], catch_exceptions=False)
    assert r.exit_code == 7 and not raw_controls(r.output), r.output
    assert "evil:run\\rtorch.nn:Linear" in r.output
    r = CliRunner().invoke(main, ["report", "--no-replay", str(hostile_bundle), "-o", str(tmp_path / "r.html"), "--color"], catch_exceptions=False)
    assert r.exit_code in (0, 3) and not raw_controls(r.output), r.output
    assert_inert_page((tmp_path / "r.html").read_text())


def test_trust_review_line_is_escaped(hostile_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("NANREPLAY_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(main, ["trust", str(hostile_bundle)], catch_exceptions=False)
    assert r.exit_code == 0 and not raw_controls(r.output), r.output
    assert "model factory evil:run\\rtorch.nn:Linear" in r.output


def test_log_lines_are_inert(caplog):
    import logging

    from nanreplay.cli import _InertFormatter

    rec = logging.LogRecord("nanreplay.x", logging.WARNING, __file__, 1, "batch type %s is not rebuilt", (TERMINAL_PAYLOAD,), None)
    assert not raw_controls(_InertFormatter("%(message)s").format(rec))


def test_report_no_replay_of_a_malformed_stored_diagnosis_exits_4(diagnosis, tmp_path):
    pytest.importorskip("matplotlib")
    from attacks.make_attacks import read_manifest, write_manifest

    bundle, _ = diagnosis
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bundle.read_bytes())
    m = read_manifest(bad)
    m["meta"]["diagnosis"] = {"summary": "s", "births": 5}
    write_manifest(bad, m)
    r = CliRunner().invoke(main, ["report", "--no-replay", str(bad), "-o", str(tmp_path / "r.html")], catch_exceptions=False)
    assert r.exit_code == 4, r.output
    assert "the stored diagnosis is malformed" in r.output and "without --no-replay" in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_the_hostile_page_stays_put_in_headless_chromium(diagnosis, tmp_path):
    """The attack of issue 18: a stored <meta http-equiv="refresh"> sent Chromium to another site.
    The escaped page makes no request but its own file and its inline images."""
    from browser import load_page, missing_reason

    why = missing_reason()
    if why:
        pytest.skip(why)
    pytest.importorskip("matplotlib")
    from nanreplay.report.html import render_html

    _, diag = diagnosis
    bad = _hostile(diag, HTML_PAYLOADS[0])
    bad.update(propagated_ops=HTML_PAYLOADS[0], allowed_births=HTML_PAYLOADS[0])
    out = tmp_path / "hostile.html"
    out.write_text(render_html(bad), encoding="utf-8")
    page = load_page(out)
    uri = out.resolve().as_uri()
    # the browser's own pages (chrome://new-tab-page before navigation) load their own resources: not ours
    ours = [r for r in page.requests if not str(r.get("document") or "").startswith("chrome://")]
    assert ours and all(r["url"].split(":")[0] in ("file", "data") for r in ours), page.requests
    assert all(r["document"] == uri for r in ours), page.requests
    assert HTML_PAYLOADS[0] in page.text  # shown as text


def test_model_init_names_lists_every_import_path_in_its_arguments():
    from nanreplay.core.callables import model_init_names

    init = {"class": "nanreplay.integrations.transformers:model_from_config",
            "kwargs": {"model_class": "evil.Thing", "config": {"act": "os:system", "url": "https://x", "n": 3, "files": ["/tmp/e.py:make"],
                                                              "odd\nkey": "pkg.mod:Cls"}}}
    assert model_init_names(init) == {
        "model class (model_init)": ["nanreplay.integrations.transformers:model_from_config"],
        "imported by the model class (model_init.kwargs.model_class)": ["evil.Thing"],  # whatever its shape: the builder imports it
        "imported by the model class (model_init.kwargs.config.act)": ["os:system"],
        "imported by the model class (model_init.kwargs.config.files[0])": ["/tmp/e.py:make"],
        'imported by the model class (model_init.kwargs.config["odd\\nkey"])': ["pkg.mod:Cls"],
    }
    assert model_init_names(None) == {} and model_init_names({"class": "a:B"}) == {"model class (model_init)": ["a:B"]}


# ---------------------------------------------------------------------------------------------
# invisible and look-alike characters
# ---------------------------------------------------------------------------------------------
#: invisible, bidirectional and look-alike characters a name can hide: zero-width space, word
#: joiner, byte-order mark, soft hyphen, a left-to-right isolate, a no-break space, U+2024 ONE DOT
#: LEADER (looks like "."), a Cyrillic "а"
SPOOFS = "\u200b\u2060\ufeff\u00ad\u2066\u00a0\u2024\u0430"


def test_every_format_character_and_separator_but_the_space_is_escaped():
    import re
    import sys
    import unicodedata

    from nanreplay.core.inert import INVISIBLE

    cls = re.compile(f"[{INVISIBLE}]")
    missed = [hex(c) for c in range(sys.maxunicode + 1)
              if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp", "Zs", "Cs") and c != 0x20 and not cls.match(chr(c))]
    assert missed == []
    assert inert("a\u200bb\u2060c\ufeffd\u00ade\u2066f\u00a0g \u2028h") == "a\\u200bb\\u2060c\\ufeffd\\xade\\u2066f\\xa0g \\u2028h"
    assert inert("\U000e0041tag") == "\\U000e0041tag"  # a Unicode tag character (invisible)


def test_a_name_under_review_shows_every_character_outside_printable_ascii():
    assert inert_name("model\u2024py:make") == "model\\u2024py:make"  # never reads as model.py:make
    assert inert_name("pkg.\u0430pi:make") == "pkg.\\u0430pi:make"
    assert inert_name("a\u200bb") == "a\\u200bb"


@pytest.fixture(scope="module")
def spoofed_bundle(diagnosis, tmp_path_factory):
    """The bundle naming a factory and a loss function spoofed with invisible and look-alike characters."""
    from attacks.make_attacks import read_manifest, write_manifest
    from nanreplay.engine.program import PROGRAM_META_KEY

    bundle, _ = diagnosis
    out = tmp_path_factory.mktemp("spoof") / "spoof.h5"
    out.write_bytes(bundle.read_bytes())
    m = read_manifest(out)
    m["meta"]["model_factory"] = "model\u2024py:make"
    m["meta"]["loss_fn"] = "train:lo" + SPOOFS + "ss"
    m["meta"]["diagnosis"]["summary"] = "NaN born" + SPOOFS
    m["meta"].pop(PROGRAM_META_KEY, None)
    write_manifest(out, m)
    return out


def test_inspect_trust_and_the_refusal_show_spoofed_names_escaped(spoofed_bundle, tmp_path, monkeypatch):
    escaped = "lo\\u200b\\u2060\\ufeff\\xad\\u2066\\xa0\\u2024\\u0430ss"
    r = CliRunner().invoke(main, ["inspect", str(spoofed_bundle)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "code it names: model factory model\\u2024py:make;" in r.output and "; loss function train:" + escaped in r.output
    assert "factory: model\\u2024py:make" in r.output and "NaN born\\u200b\\u2060\\ufeff\\xad\\u2066\\xa0" in r.output
    assert not any(c in r.output for c in SPOOFS[:6])  # invisible: escaped everywhere
    review = [line for line in r.output.splitlines() if "code it names" in line or "factory:" in line]
    assert not any(c in line for line in review for c in SPOOFS)  # look-alikes too, in the names under review
    r = CliRunner().invoke(main, ["replay", str(spoofed_bundle)], catch_exceptions=False)
    assert r.exit_code == 7 and "'model\\u2024py:make'" in r.output and escaped in r.output, r.output
    assert not any(c in r.output for c in SPOOFS)
    monkeypatch.setenv("NANREPLAY_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(main, ["trust", str(spoofed_bundle)], catch_exceptions=False)
    assert r.exit_code == 0 and "model factory model\\u2024py:make" in r.output and not any(c in r.output for c in SPOOFS), r.output
