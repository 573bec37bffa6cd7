"""Hostile embedded programs (tests/attacks/program_attacks.py), replayed as a stranger's bundle:
empty trust store, no code of the user's, so the program is the only way to replay. Each is refused
with its exit code and message, in bounded time, and nothing it names runs or is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from attacks.program_attacks import ATTACKS, PROBE, build_all
from nanreplay.cli import main

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = {a.name: a for a in ATTACKS}
IN_SUBPROCESS = {"power_tower", "power_tower_srepr", "sympify_eval", "float_precision_hang"}  # a hang must fail the test, not pytest


@pytest.fixture(scope="module")
def program_attacks(tmp_path_factory):
    out = tmp_path_factory.mktemp("program-attacks")
    files = build_all(out)
    sys.path.insert(0, str(out))  # an import of the probe the attacks name would succeed
    yield out, files
    sys.path.remove(str(out))
    assert PROBE not in sys.modules, "a module named by a bundle was imported"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_a_hostile_program_is_refused_and_runs_nothing(program_attacks, name):
    out, files = program_attacks
    attack, path = BY_NAME[name], files[name]
    if name in IN_SUBPROCESS:
        r = subprocess.run([sys.executable, "-m", "nanreplay.cli", "replay", str(path)], capture_output=True, text=True,
                           timeout=90, env=_env(), cwd=out)
        code, output = r.returncode, r.stdout + r.stderr
    else:
        r = CliRunner().invoke(main, ["replay", str(path)], catch_exceptions=False)
        code, output = r.exit_code, r.output
    assert code == attack.exit, output
    assert attack.says in output, output
    assert "Traceback" not in output
    if code == 5:
        assert "--model-factory" in output and "model_factory=" not in output
    assert not list(out.glob("PWNED-*")) or [p.name for p in out.glob("PWNED-*")] == ["PWNED-from_file_write"]
    assert (out / "PWNED-from_file_write").read_bytes() == b"original", "the program wrote into a file"
    assert PROBE not in sys.modules


@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_inspect_gives_the_expected_exit_code(program_attacks, name):
    out, files = program_attacks
    r = CliRunner().invoke(main, ["inspect", "--json", str(files[name])], catch_exceptions=False)
    assert r.exit_code == BY_NAME[name].inspect, r.output
    assert "Traceback" not in r.output


def test_the_base_bundle_replays_from_its_program_alone(program_attacks):
    out, _ = program_attacks
    (base,) = (out / "program-base").glob("nanreplay-step*")
    r = CliRunner().invoke(main, ["replay", "--json", str(base)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model_source"].startswith("the program embedded in the bundle") and d["reproduction"]["verdict"] == "reproduced exactly"


_IMPORT_HOOK = textwrap.dedent("""
    import sys, glob
    from pathlib import Path
    import nanreplay
    out = Path(sys.argv[1])
    base = glob.glob(str(out / "program-base" / "nanreplay-step*"))[0]
    nanreplay.replay(base)  # warm: every module a replay of a program needs is imported now
    before = set(sys.modules)

    class Watch:
        seen = []
        def find_spec(self, name, path=None, target=None):
            if name not in before:
                Watch.seen.append(name)
            return None

    sys.meta_path.insert(0, Watch())
    sys.path.insert(0, str(out))  # the probe beside the bundles would be importable
    nanreplay.replay(base)
    for name in sys.argv[2:]:
        try:
            nanreplay.replay(out / name)
        except nanreplay.NanReplayError:
            pass
    new = sorted(set(Watch.seen) | (set(sys.modules) - before))
    print("NEW IMPORTS:", new)
    sys.exit(1 if new else 0)
""")


def test_an_untrusted_replay_imports_no_module_it_had_not_imported_before(program_attacks):
    """Under an import hook: a second replay of a program, and replays of the bundles whose specs
    name a module (refused at open), import nothing that the first replay had not imported."""
    out, files = program_attacks
    names = [files[n].name for n in ("signature_spec_import", "output_spec_import", "hop_operator_system", "from_file_write")]
    r = subprocess.run([sys.executable, "-c", _IMPORT_HOOK, str(out), *names], capture_output=True, text=True, timeout=300,
                       env=_env(), cwd=out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not (out / "PWNED-probe").exists()


def test_the_attack_index_matches_what_the_script_writes(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "attacks" / "program_attacks.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "index.json").exists()


def test_hostile_arguments_to_allowlisted_ops_are_refused_or_contained(tmp_path):
    """bench/fuzz.py's argument mutator, a few dozen mutants: each calls one allowlisted op (a
    different one each, in turn) with valid arguments, then with hostile sizes, indices, dtypes or
    empty tensors; replayed as a stranger's bundle (the sandbox), each ends ok / exit 4 / 5 / 7,
    never another exit, a traceback or a signal of the process around it, within the time and
    memory bounds of the fuzzer's child."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz.py"), "--args", "--mutants", "30", "--workers", "1", "--seed", "7",
                        "--timeout", "60", "--json", str(tmp_path / "r.jsonl")], capture_output=True, text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "30 argument mutants over 30 allowlisted ops" in r.stdout
    assert "other outcomes (not ok / exit 4 / exit 5 / exit 7, a signal or a timeout of the outer process): 0" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert all(row["seconds"] < 60 for row in rows)
    assert all(row["stages"]["replay"] in ("ok", "exit 4", "exit 5", "exit 7") for row in rows)
