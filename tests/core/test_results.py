"""The typed diagnosis (``nanreplay.core.results``) against its documentation and its JSON Schema.

* ``docs/report.md`` names exactly the keys of the types: every field a section documents is a key
  of the section's type, and every key of the type is documented there. A renamed key fails here.
* The JSON Schemas shipped in the package and in ``docs/schema/`` are the ones the types generate.
* Real diagnoses (a few scenarios of ``tests/scenarios.py``, in process and through
  ``nanreplay replay --json``) validate against the shipped schema; a renamed key does not.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanreplay.core import results as R
from nanreplay.core import schema

ROOT = Path(__file__).resolve().parents[2]
REPORT_MD = ROOT / "docs" / "report.md"

#: a section of docs/report.md (its heading, or the label of a bullet) -> the type it documents
TABLES = {
    "Top level": R.DiagnosisDict, "`classification`": R.Classification, "`reproduction`": R.Reproduction, "`samples`": R.Samples,
    "`history`": R.History, "`origin`": R.Origin, "`compile`": R.CompileCheck, "`classification.fix`": R.Fix,
    "`rollback`": R.RollbackPlan, "`loss_scale`": R.LossScale,
}
PROSE = {"A birth (`births[i]`)": R.Birth, "`optimizer`": R.OptimizerReplay}
BULLETS = {
    "`chain[i]`": R.ChainLink, "`health[i]`": R.HealthRow, "`nonfinite_inputs[i]`, `nonfinite_weights[i]`": R.NonfiniteLeaf,
    "`errors[i]`": R.ReplayFailure, "`counterfactuals`": R.Counterfactuals, "a health object": R.Health, "`source`": R.Source,
    "`timeline[i]`": R.TimelineStep, "`forward_modules[i]`": R.ForwardModule, "`batch_leaves[i]`": R.BatchLeaf,
    "`backends[i]`": R.CompiledReplay, "`culprit`": R.CompiledCulprit, "`culprit.operands[i]`": R.CompiledOperand,
    "`culprit.samples`": R.CompiledRows,
    "`rollback.episode`": R.Episode, "`rollback.episode.runs[i]`": R.EpisodeRun, "`rollback.rejected[i]`": R.RejectedState,
    "`rollback.lr_jump`": R.LrJump,
}

#: keys declared for work merged in parallel; documented when the code that writes them lands
PENDING: dict[str, set[str]] = {}

_NAME = re.compile(r"`([a-z_][a-z0-9_]*)`")


def _sections(text: str) -> dict[str, str]:
    out, head = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            head = line[3:].strip()
            out[head] = ""
        elif head is not None:
            out[head] += line + "\n"
    return out


def _unparenthesized(text: str) -> str:
    """``text`` without what stands in parentheses (explanations name values, not fields)."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def _table_fields(body: str) -> set[str]:
    rows = [line.strip().strip("|").split("|") for line in body.splitlines() if line.startswith("| `")]
    return {n for cells in rows for n in _NAME.findall(cells[0])}


def _bullets(text: str) -> dict[str, str]:
    out, label = {}, None
    for line in text.splitlines():
        if line.startswith("* "):
            label, _, rest = line[2:].partition(":")
            out[label.strip()] = rest
        elif label is not None and line.startswith("  "):
            out[label.strip()] += " " + line.strip()
        else:
            label = None
    return out


def documented(page: Path = REPORT_MD) -> dict[str, tuple[type, set[str]]]:
    """Each documented part of the diagnosis: its type and the fields docs/report.md names."""
    secs = _sections(page.read_text())
    got = {}
    for head, tp in TABLES.items():
        assert head in secs, f"docs/report.md lost its section '## {head}' (documents {tp.__name__})"
        got[head] = (tp, _table_fields(secs[head]))
    for head, tp in PROSE.items():
        assert head in secs, f"docs/report.md lost its section '## {head}' (documents {tp.__name__})"
        first = secs[head].strip().split("\n\n")[0]
        got[head] = (tp, set(_NAME.findall(_unparenthesized(first))))
    bullets = {k: v for body in secs.values() for k, v in _bullets(body).items()}
    for label, tp in BULLETS.items():
        assert label in bullets, f"docs/report.md lost its bullet '* {label}: ...' (documents {tp.__name__})"
        got[label] = (tp, set(_NAME.findall(_unparenthesized(bullets[label]))))
    return got


def _check_page(part: str, page: Path = REPORT_MD) -> None:
    tp, fields = documented(page)[part]
    keys = set(typing.get_type_hints(tp)) - PENDING.get(tp.__name__, set())
    fields -= PENDING.get(tp.__name__, set())
    assert not fields - keys, (f"docs/report.md ({part}) documents {sorted(fields - keys)}, which {tp.__name__} "
                               f"(nanreplay/core/results.py) lacks: add the key there, or fix the name on the page")
    assert not keys - fields, (f"{tp.__name__} (nanreplay/core/results.py) has {sorted(keys - fields)}, which docs/report.md "
                               f"({part}) does not document: add it to the page")


@pytest.mark.parametrize("part", [*TABLES, *PROSE, *BULLETS])
def test_report_md_names_exactly_the_keys_of_the_types(part):
    _check_page(part)


def _object_types(tp, seen: dict) -> dict:
    """Every TypedDict ``tp`` holds, at any depth, by name (``tp`` included)."""
    if isinstance(tp, type) and hasattr(tp, "__required_keys__"):
        if tp.__name__ in seen:
            return seen
        seen[tp.__name__] = tp
        for v in typing.get_type_hints(tp).values():
            _object_types(v, seen)
    for a in typing.get_args(tp):
        _object_types(a, seen)
    return seen


def test_every_object_type_of_the_diagnosis_is_documented():
    defs = set(_object_types(R.DiagnosisDict, {}))
    covered = {tp.__name__ for tp in [*TABLES.values(), *PROSE.values(), *BULLETS.values()]}
    assert defs == covered, f"types without a section of docs/report.md: {sorted(defs - covered)}; sections without a type: {sorted(covered - defs)}"


def test_a_renamed_field_on_the_page_fails(tmp_path):
    page = tmp_path / "report.md"
    page.write_text(REPORT_MD.read_text().replace("| `forward_finite` |", "| `forward_ok` |"))
    with pytest.raises(AssertionError, match=r"documents \['forward_ok'\], which DiagnosisDict \(nanreplay/core/results.py\) lacks"):
        _check_page("Top level", page)


# -- the shipped JSON Schemas --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(schema.SCHEMAS))
def test_shipped_schema_is_the_generated_one(name):
    want = schema.schema_text(name)
    regenerate = "regenerate both with: python -m nanreplay.core.schema"
    assert schema.schema_path(name).read_text() == want, f"nanreplay/schema/{name}.schema.json is stale; {regenerate}"
    assert (ROOT / "docs" / "schema" / f"{name}.schema.json").read_text() == want, f"docs/schema/{name}.schema.json is stale; {regenerate}"


def test_the_schema_is_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'\[tool\.setuptools\.package-data\]\s*\nnanreplay = \[[^\]]*"schema/\*\.json"', text), "pyproject.toml must ship nanreplay/schema/*.json"


def test_the_generator_refuses_what_it_cannot_say():
    with pytest.raises(TypeError, match="no JSON Schema for the annotation"):
        schema._schema(set[int], {})


def _validator(name: str):
    jsonschema = pytest.importorskip("jsonschema")
    s = schema.shipped_schema(name)
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


def _errors(v, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}" for e in v.iter_errors(doc)]


@pytest.fixture(scope="module")
def diagnoses(tmp_path_factory) -> dict[str, dict]:
    """Real diagnoses: three scenarios replayed, and the in-process diagnoses the Recorder stored."""
    import scenarios

    from nanreplay import replay

    out = {}
    for name, build in [("div", scenarios.division_by_zero_in_a_submodule), ("sqrt", scenarios.sqrt_at_zero), ("unreproducible", scenarios.unreproducible)]:
        err = build(tmp_path_factory.mktemp(name))
        out[f"{name} live"] = json.loads(json.dumps(err.diagnosis, default=str))
        out[f"{name} replay"] = json.loads(json.dumps(replay(err.bundle_path), default=str))
        out[f"{name} bundle"] = err.bundle_path
    return out


@pytest.mark.parametrize("case", ["div live", "div replay", "sqrt live", "sqrt replay", "unreproducible live", "unreproducible replay"])
def test_real_diagnoses_validate_against_the_shipped_schema(diagnoses, case):
    assert _errors(_validator("diagnosis"), diagnoses[case]) == []


def test_a_renamed_key_does_not_validate(diagnoses):
    v = _validator("diagnosis")
    d = dict(diagnoses["sqrt replay"])
    d["verdict"] = d.pop("classification")
    assert _errors(v, d) == ["(top): 'classification' is a required property", "(top): Additional properties are not allowed ('verdict' was unexpected)"]


def test_replay_json_carries_the_schema_version_and_validates(diagnoses):
    from nanreplay.cli import main

    res = CliRunner().invoke(main, ["replay", str(diagnoses["sqrt bundle"]), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["schema_version"] == R.SCHEMA_VERSION == schema.shipped_schema("diagnosis")["x-schema-version"]
    assert _errors(_validator("diagnosis"), out) == []


def test_bisect_json_carries_the_schema_version_and_validates(diagnoses):
    from nanreplay.cli import main

    res = CliRunner().invoke(main, ["bisect", str(diagnoses["sqrt bundle"]), "--over", "samples", "--json"])
    assert res.exit_code in (0, 6), res.output
    out = json.loads(res.output)
    assert out["schema_version"] == R.SCHEMA_VERSION
    assert _errors(_validator("bisect"), out) == []
