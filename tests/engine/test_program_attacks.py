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
BOUNDED = [a.name for a in ATTACKS if a.bounded]
#: the address space of the child that replays the memory attacks: a replay needs about 1 GiB of it
#: (torch's libraries), so an attack that got past the checks fails to allocate its gigabytes
#: instead of taking them from the machine
ADDRESS_SPACE = 3 << 30
HEAP_MARKER = "NANREPLAY-HEAP-MARKER"


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


@pytest.mark.parametrize("name", [a.name for a in ATTACKS if not a.bounded])
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


# -- memory attacks (issue 32), replayed in a child with an address-space limit and a heap marker --

_BOUNDED_RUNNER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    heap = [("%s-%06d" % (sys.argv[2], i)).encode() * 4 for i in range(50000)]  # bytes a heap read would find
    from click.testing import CliRunner
    from nanreplay.cli import main
    from nanreplay.engine import opset
    out = Path(sys.argv[1])
    results = {}

    def run(key, args):
        t0 = time.perf_counter()
        r = CliRunner().invoke(main, args, catch_exceptions=True)
        crash = None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)[:300]
        results[key] = {"exit": r.exit_code, "output": r.output, "seconds": time.perf_counter() - t0, "crash": crash}

    for name in sys.argv[3:]:
        path = str(next(out.glob("program-" + name + ".*")))
        run(name, ["replay", path])
        if name.startswith("reshape_alias"):
            repro = out / ("repro-" + name)
            run(name + "/export", ["export", path, "--repro", str(repro)])
            results[name + "/export"]["files"] = sorted(p.name for p in repro.glob("*")) if repro.exists() else []
            results[name + "/export"]["heap_in_files"] = any(sys.argv[2].encode() in p.read_bytes() for p in repro.glob("*"))
    opset.OPS = opset.OPS | {"_reshape_alias.default"}  # were the allowlist to let it through: the verifier alone refuses
    for name in ("reshape_alias_read", "reshape_alias_write"):
        run(name + "/allowed", ["replay", str(next(out.glob("program-" + name + ".*")))])
    print("RESULTS" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def bounded_results(program_attacks):
    """Replay every memory attack in one child process under RLIMIT_AS, with marker bytes all over
    its heap; results by attack name (and ``name/export``, ``name/allowed``)."""
    import resource

    out, _ = program_attacks

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**_env(), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _BOUNDED_RUNNER, str(out), HEAP_MARKER, *BOUNDED], capture_output=True, text=True,
                       timeout=600, env=env, cwd=out, preexec_fn=limit)
    assert r.returncode == 0 and "RESULTS" in r.stdout, f"the child died (exit {r.returncode}): {r.stderr[-3000:]}"
    results = json.loads(r.stdout.split("RESULTS", 1)[1])
    results["_stderr"] = r.stderr
    return results


@pytest.mark.parametrize("name", BOUNDED)
def test_a_memory_attack_is_refused_within_bounds_and_leaks_nothing(bounded_results, name):
    """Exit code and sentence, no crash, no marker byte in any output, seconds not minutes (the
    child's address space is capped: an attack that got through would fail or die there)."""
    attack, res = BY_NAME[name], bounded_results[name]
    assert res["crash"] is None, res
    assert res["exit"] == attack.exit, res["output"]
    assert attack.says in res["output"], res["output"]
    assert "Traceback" not in res["output"] and HEAP_MARKER not in res["output"]
    assert res["seconds"] < 30, res
    if res["exit"] == 5:
        assert "--model-factory" in res["output"]


def test_the_memory_attacks_write_nothing_to_stderr_and_no_heap_byte(bounded_results):
    assert HEAP_MARKER not in bounded_results["_stderr"]
    assert "Traceback" not in bounded_results["_stderr"]


@pytest.mark.parametrize("name", ["reshape_alias_read", "reshape_alias_write"])
def test_a_view_outside_its_storage_is_refused_by_the_verifier_alone(bounded_results, name):
    """With ``_reshape_alias`` put back on the allowlist, the verifier runs its own kernel on meta
    tensors and refuses the view it makes (strides of 4,096 and 16,384 over storages of 12 and 4
    floats), though torch's fake kernel for it makes an honest view."""
    res = bounded_results[name + "/allowed"]
    assert res["crash"] is None and res["exit"] == 5, res["output"]
    assert "makes a view (in its own kernel) with sizes [" in res["output"] and "of a storage of" in res["output"], res["output"]
    assert HEAP_MARKER not in res["output"]


@pytest.mark.parametrize("name", ["reshape_alias_read", "reshape_alias_write"])
def test_export_repro_of_a_view_attack_writes_no_heap_byte(bounded_results, name):
    """``nanreplay export --repro`` (whose op_inputs.safetensors is meant for upstream bug reports)
    is refused too, and whatever it left holds no byte of the heap."""
    res = bounded_results[name + "/export"]
    assert res["exit"] == 5 and res["crash"] is None, res["output"]
    assert "op_inputs.safetensors" not in res["files"] and not res["heap_in_files"], res
    assert HEAP_MARKER not in res["output"]


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
