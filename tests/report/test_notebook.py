"""``nanreplay.replay()`` and ``nanreplay.load_diagnosis()`` return a ``Diagnosis``: the same mapping
as before, whose ``repr`` is the summary sentence and whose ``_repr_html_`` is the report inline."""

from __future__ import annotations

import json
import pickle

import pytest

import scenarios
from nanreplay import Diagnosis, ReplayError, load_diagnosis, open_bundle, replay
from nanreplay.errors import MissingExtraError


def test_replay_returns_the_mapping_it_always_did_with_the_sentence_as_repr(sqrt_bundle):
    diag = replay(sqrt_bundle)
    assert type(diag) is Diagnosis and isinstance(diag, dict)
    assert repr(diag) == diag["summary"]
    assert diag["summary"].startswith("+Inf born in backward of sqrt (SqrtBackward0)")
    plain = json.loads(json.dumps(diag))
    assert plain == dict(diag) and type(plain) is dict
    again = pickle.loads(pickle.dumps(diag))
    assert again == diag and type(again) is Diagnosis and again.meta == diag.meta


def test_load_diagnosis_reads_the_stored_one_without_replaying(sqrt_bundle, monkeypatch):
    import nanreplay.diagnosis.api as api

    monkeypatch.setattr(api, "replay_step", lambda *a, **k: pytest.fail("load_diagnosis must not replay"))
    diag = load_diagnosis(sqrt_bundle)
    with open_bundle(sqrt_bundle) as b:
        assert diag == b.diagnosis
        assert load_diagnosis(b) == diag
    assert type(diag) is Diagnosis and repr(diag) == diag["summary"]
    assert diag.meta["failing_step"] == 0


def test_load_diagnosis_of_a_bundle_without_one_says_to_replay(out_dir):
    bundle = scenarios.sqrt_at_zero(out_dir, diagnose=False).bundle_path
    with pytest.raises(ReplayError, match=r"expected a stored diagnosis, found none .*; replay the step instead: nanreplay.replay\(bundle\)"):
        load_diagnosis(bundle)


def test_repr_html_is_the_report_inline_without_the_page_chrome(sqrt_bundle):
    pytest.importorskip("matplotlib")
    diag = replay(sqrt_bundle)
    html = diag._repr_html_()
    assert html.startswith('<div class="nanreplay-report"><style>') and html.endswith("</div>")
    for chrome in ("<!DOCTYPE", "<html", "<head>", "<title", "<body", "<main", "<footer", "nanreplay-diagnosis", "<script"):
        assert chrome not in html, chrome
    for section in ('id="summary"', 'id="origin"', 'id="timeline"', 'id="modules"', 'id="chain"', 'id="samples"', "<svg"):
        assert section in html, section
    style = html.split("<style>", 1)[1].split("</style>", 1)[0]
    rules = [line.split("{", 1)[0].strip() for line in style.splitlines() if "{" in line and not line.startswith("@media")]
    assert rules and all(r.startswith(".nanreplay-report") for r in rules), [r for r in rules if not r.startswith(".nanreplay-report")]


def test_repr_and_html_escape_what_the_bundle_says():
    hostile = {"phase": "none", "step": 1, "summary": 'step 1: <img src=x onerror="alert(1)">\x1b[2J\nforged line',
               "reproduction": {"verdict": "not reproduced"}, "warnings": ["<b>w</b>"]}
    d = Diagnosis(hostile)
    assert repr(d) == 'step 1: <img src=x onerror="alert(1)">\\x1b[2J\\nforged line'
    pytest.importorskip("matplotlib")
    html = d._repr_html_()
    assert "<img" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html and "&lt;b&gt;w&lt;/b&gt;" in html


def test_repr_html_without_matplotlib_is_the_text_report(monkeypatch):
    import nanreplay.report.html as html

    def missing() -> None:
        raise MissingExtraError("nanreplay report needs matplotlib: pip install 'nanreplay[report]'", extra="report")

    monkeypatch.setattr(html, "require_matplotlib", missing)
    d = Diagnosis({"phase": "none", "step": 2, "summary": "step 2: <x>", "reproduction": {"verdict": "not reproduced"}})
    out = d._repr_html_()
    assert out.startswith('<div class="nanreplay-report"><pre>step 2: &lt;x&gt;') and "pip install &#x27;nanreplay[report]&#x27;" in out


def test_a_diagnosis_without_summary_says_its_sentence():
    d = Diagnosis({"phase": "none", "step": 3, "reproduction": {"verdict": "not reproduced"}})
    assert repr(d) == "step 3: the replay produced no non-finite value; not reproduced."


@pytest.mark.slow
def test_the_example_notebook_records_replays_and_shows_the_report_inline(tmp_path):
    """examples/notebook.ipynb, executed in a real kernel: the replay cell's output is the report
    inline (text/html) with the sentence as its text/plain, and the mapping's fields follow."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "the notebook is stored without outputs"
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    results = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "execute_result"]
    shown, fields = results[0]["data"], results[1]["data"]["text/plain"]
    assert shown["text/plain"].startswith("NaN born in the loss, outside the model, in op div")
    assert shown["text/plain"].endswith("cause: bad input data (the divisor is 0 at 1 of its 3 entries and derives only from batch[1]: "
                                        "this batch makes it 0); reproduced exactly.")
    html = shown["text/html"]
    assert html.startswith('<div class="nanreplay-report"><style>') and "<!DOCTYPE" not in html
    assert 'id="origin"' in html and 'id="timeline"' in html and "<svg" in html
    assert fields == "(5, 'loss', 'bad input data', 'reproduced exactly')"
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream" and o.name == "stdout")
    assert printed.strip() == shown["text/plain"]  # the stored diagnosis says what the replay said
