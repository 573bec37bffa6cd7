"""The corpus of real NaN/Inf bugs (tests/corpus/cases/, one reproduction per file).

Each case is recorded under a Recorder (which diagnoses it in process and stores that diagnosis
in the bundle) and its bundle replayed afresh with ``nanreplay.replay`` (what ``nanreplay replay
BUNDLE --json`` prints):

* ``test_report_invariants`` checks what must hold whatever the diagnosis says (the report is
  coherent with itself and with the model, and follows the shipped JSON Schema);
* ``test_diagnosis_fields`` (marker ``corpus``, select with ``-m corpus``) checks the six EXPECTED
  fields of each case (step, phase, module, op, samples, cause) with ``runner.field_matches``;
  the diagnosis is being fixed to pass it, so it fails on many cases today;
* ``test_one_answer_per_bundle`` checks that the in-process diagnosis stored in the bundle and the
  fresh replay give the same answer: cause, origin (phase, module FQN, op, micro-batch) and samples;
* ``test_corpus_protocol`` checks the corpus itself: size, SOURCE, EXPECTED, TAGS coverage.

Each case is recorded and replayed once per session (both tests share the result).
"""

from __future__ import annotations

import json
import re

import pytest

from corpus import runner

CASES = {runner.case_name(c): c for c in runner.load_cases()}

#: one tag per category the corpus must cover (see tests/corpus/README.md)
REQUIRED_TAGS = {
    # where the value is born, and the cause families
    "input", "weights", "forward", "loss", "backward", "optimizer", "explosion", "transient",
    # dtypes
    "float32", "bfloat16-autocast", "float16-autocast", "half", "complex64", "angle", "stft", "complex-mul",
    # loop and code shapes
    "custom-function", "criterion-submodule", "grad-accumulation", "clip-grad-norm", "grad-scaler",
    "lr-scheduler", "adam-eps",
    # bug patterns
    "ignore-index", "masked-attention", "batch-of-one", "dice", "masked-mean", "where-log", "cdist-norm",
    "acos", "focal", "vae", "attention-overflow", "log-softmax-underflow", "preprocessing-after-record", "torch-compile",
}

# what a report says when the loss was not replayed: never with mode == "loss_fn"
_NOT_REPLAYED = re.compile(r"not replayed|no loss function|without (a|the) loss|did not run|--loss-fn", re.I)

_RESULTS: dict[str, tuple] = {}


def _register_marker(config) -> None:
    if not any(str(line).startswith("corpus:") for line in config.getini("markers")):
        from corpus.conftest import pytest_configure

        pytest_configure(config)


def pytest_generate_tests(metafunc):
    if "case_name" not in metafunc.fixturenames:
        return
    _register_marker(metafunc.config)  # tests/corpus/conftest.py is not loaded when only this file is collected
    marks = [pytest.mark.corpus] if metafunc.function.__name__ == "test_diagnosis_fields" else []
    metafunc.parametrize("case_name", [pytest.param(n, id=n, marks=marks) for n in sorted(CASES)])


def _cxx_compiler() -> bool:
    """Whether inductor can build a CPU kernel here: a C++ compiler on PATH (``CXX``, else the
    ones inductor looks for)."""
    import os
    import shutil

    return any(shutil.which(c) for c in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")))


def _recorded_and_replayed(name: str, tmp_path_factory) -> tuple[dict, dict]:
    """(record_case result, in-process diagnosis), computed once per case and session."""
    if "torch-compile" in CASES[name].TAGS and not _cxx_compiler():
        pytest.skip("inductor needs a C++ compiler (none on PATH: install gcc or set CXX)")
    if name not in _RESULTS:
        from nanreplay import replay

        try:
            rec = runner.record_case(CASES[name], tmp_path_factory.mktemp(name))  # diagnosed in process too
            # a case file only defines names (its EXPECTED = dict(...) is the one top-level call the
            # script check flags); a case whose program cannot be embedded replays from its factory
            _RESULTS[name] = (rec, replay(rec["bundle"], import_script=True))
        except Exception as e:  # remembered, so the second test reports the same failure without rerunning
            _RESULTS[name] = e
    res = _RESULTS[name]
    if isinstance(res, Exception):
        raise res
    return res


def _texts(diag: dict) -> list[str]:
    cls = diag.get("classification") or {}
    out = [diag.get("cause"), diag.get("summary"), cls.get("detail")] + list(cls.get("evidence") or [])
    return [t for t in out if isinstance(t, str)]


def _validates_against_the_shipped_schema(diag: dict) -> None:
    """The diagnosis follows nanreplay/schema/diagnosis.schema.json (generated from core.results)."""
    jsonschema = pytest.importorskip("jsonschema")
    from nanreplay.core.schema import shipped_schema

    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}"
              for e in jsonschema.Draft202012Validator(shipped_schema("diagnosis")).iter_errors(diag)]
    assert not errors, "the diagnosis does not follow the shipped JSON Schema:\n" + "\n".join(errors)


@pytest.mark.slow
def test_report_invariants(case_name, tmp_path_factory):
    case = CASES[case_name]
    _, diag = _recorded_and_replayed(case_name, tmp_path_factory)

    json.dumps(diag, allow_nan=False)  # non-finite floats are written as strings
    _validates_against_the_shipped_schema(json.loads(json.dumps(diag, default=str)))

    origin = diag.get("origin") or {}
    op = origin.get("op")
    if op:
        birth_ops = {b.get("op") for b in diag.get("births") or []}
        assert op in birth_ops or runner.norm_op(op) in {runner.norm_op(b) for b in birth_ops}, (
            f"origin op {op!r} is not among the births {sorted(map(str, birth_ops))}"
        )

    if diag.get("mode") == "loss_fn":
        said = [t for t in _texts(diag) if _NOT_REPLAYED.search(t)]
        assert not said, f"mode is loss_fn (the loss was replayed) but the report says otherwise: {said}"

    module = origin.get("module")
    if module is not None:
        modules = dict(case.make_model().named_modules())
        assert module in modules, f"origin module {module!r} is not a module of the model ({sorted(modules)[:12]}...)"

    # a device fault only where the case injects one (issue 34: never a hardware verdict for want of a finding)
    if (diag.get("classification") or {}).get("cause") == "transient":
        assert "hardware-fault" in case.TAGS, f"a device verdict for a software bug: {diag.get('summary')!r}"
        assert (diag.get("fidelity") or {}).get("verdict") == "device fault" and diag["fidelity"]["first_difference"]

    summary = diag.get("summary") or ""
    if op:
        names = [n for n in (op, origin.get("forward_op"), origin.get("node")) if n]
        assert any(n in summary for n in names), f"summary does not name the origin op {names}: {summary!r}"
    if module:
        named = re.search(rf"(?<![\w.]){re.escape(module)}(?!\w)", summary)
        assert named, f"summary does not name the origin module {module!r}: {summary!r}"
    elif module == "":
        assert "root module" in summary, f"summary does not name the root module: {summary!r}"


@pytest.mark.slow
def test_diagnosis_fields(case_name, tmp_path_factory):
    case = CASES[case_name]
    _, diag = _recorded_and_replayed(case_name, tmp_path_factory)
    matches = runner.field_matches(case.EXPECTED, diag)
    got = runner.got_fields(diag)
    wrong = {f: {"expected": case.EXPECTED[f], "got": got[f]} for f, ok in matches.items() if not ok}
    assert not wrong, f"{case_name}: {wrong}\nsummary: {diag.get('summary')}"


@pytest.mark.slow
def test_one_answer_per_bundle(case_name, tmp_path_factory):
    """The Recorder's in-process diagnosis (stored in the bundle) and a fresh replay of the bundle
    name the same cause, origin and samples."""
    from nanreplay.diagnosis.api import load_diagnosis

    rec, diag = _recorded_and_replayed(case_name, tmp_path_factory)
    live = load_diagnosis(rec["bundle"])
    assert runner.answer(live) == runner.answer(diag), f"in process: {live['summary']}\nreplayed:   {diag['summary']}"


def test_corpus_protocol():
    assert len(CASES) >= 32, f"the corpus has {len(CASES)} cases, expected at least 32"
    problems = [p for c in CASES.values() for p in runner.validate_expected(c)]
    assert not problems, "\n".join(problems)
    tags = set().union(*(set(c.TAGS) for c in CASES.values()))
    missing = REQUIRED_TAGS - tags
    assert not missing, f"no case covers: {sorted(missing)}"
    sources = [c.SOURCE for c in CASES.values()]
    assert len(set(sources)) >= len(sources) - 3, "most cases should cite their own source"
