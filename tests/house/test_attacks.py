"""The attack folder (tests/attacks/make_attacks.py): every hostile or damaged bundle gives its exact
outcome, and no code named by a bundle ever runs (the payloads would create marker files)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from click.testing import CliRunner

from attacks.make_attacks import ATTACKS, PROBE, USER_CODE, build_all
from helpers import assert_inert_page, raw_controls
from nanreplay import BundleFormatError, open_bundle
from nanreplay.cli import main

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = {a.name: a for a in ATTACKS}
IN_SUBPROCESS = {"h5_v1_corrupt_vlen_attribute", "st_sparse_huge_tensor", "fifo"}  # a crash or a hang must fail the test, not pytest


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    out = tmp_path_factory.mktemp("attacks")
    files = build_all(out)
    sys.path.insert(0, str(out))  # so that an import of the probe module the attacks name would succeed
    yield out, files
    sys.path.remove(str(out))
    assert not list(out.glob("PWNED-*")), "a payload ran"
    assert PROBE not in sys.modules


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.output


def _cli_subprocess(*args: str, timeout: float = 600, env: Optional[dict] = None) -> tuple[int, str, int]:
    """Run the CLI in a child process; returns (exit code, output, peak RSS in KiB of the child)."""
    code = ("import resource, sys, runpy; sys.argv = ['nanreplay'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('nanreplay.cli', run_name='__main__')\n"
            "finally:\n    sys.stderr.write(f'\\nmaxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n')\n")
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    rss = int(re.findall(r"maxrss=(\d+)", r.stderr)[-1]) if "maxrss=" in r.stderr else 0
    return r.returncode, r.stdout + r.stderr, rss


def _read_everything(path: Path) -> None:
    with open_bundle(path) as b:
        for k in b.steps:
            b.step(k)
        b.state()
        b.grads()


@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_reading_gives_the_expected_outcome_and_runs_nothing(attacks, name):
    out, files = attacks
    attack, path = BY_NAME[name], files[name]
    if name in IN_SUBPROCESS:
        code = "import sys\nfrom tests.house.test_attacks import _read_everything\n_read_everything(sys.argv[1])"
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}, cwd=ROOT)
        if attack.read is None:
            assert r.returncode == 0, r.stderr
        else:
            assert r.returncode == 1 and f"BundleFormatError: {path}: {attack.read}" in r.stderr, r.stderr
    elif attack.read is None:
        _read_everything(path)
    else:
        with pytest.raises(BundleFormatError) as e:
            _read_everything(path)
        assert str(e.value).startswith(f"{path}: {attack.read}"), str(e.value)
    assert not list(out.glob("PWNED-*"))


@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_inspect_gives_the_expected_exit_code(attacks, name):
    out, files = attacks
    attack, path = BY_NAME[name], files[name]
    if name in IN_SUBPROCESS:
        code, output, rss = _cli_subprocess("inspect", "--json", path)
    else:
        code, output = _cli("inspect", "--json", path)
    assert code == attack.inspect, output
    assert "Traceback" not in output
    if code == 4:
        assert f"Error: {path}: " in output
    assert not list(out.glob("PWNED-*"))


@pytest.mark.parametrize("name, run", [(a.name, i) for a in ATTACKS for i in range(len(a.replays))])
def test_replay_gives_the_expected_exit_code(attacks, name, run):
    out, files = attacks
    args, want, says = BY_NAME[name].replays[run]
    if name in IN_SUBPROCESS:
        code, output, _ = _cli_subprocess("replay", files[name], *args)
    else:
        code, output = _cli("replay", files[name], *args)
    assert code == want, output
    assert says in output
    assert "Traceback" not in output
    assert not list(out.glob("PWNED-*"))


@pytest.mark.parametrize("name, run", [(a.name, i) for a in ATTACKS for i in range(len(a.commands))])
def test_other_commands_give_the_expected_exit_code_and_keep_bundle_strings_inert(attacks, name, run, tmp_path):
    """inspect, trust and report --no-replay in a child process writing to a pipe, under a time
    limit, with a trust store of their own (a trust here must not reach the other tests)."""
    out, files = attacks
    command, args, want, says = BY_NAME[name].commands[run]
    extra: tuple = ()
    if command == "report":
        pytest.importorskip("matplotlib")
        extra = ("-o", tmp_path / "page.html")
    code, output, _ = _cli_subprocess(command, files[name], *args, *extra, timeout=120, env={"NANREPLAY_HOME": str(tmp_path / "home")})
    assert code == want, output
    assert says in output, output
    assert "Traceback" not in output
    assert not raw_controls(output), raw_controls(output)
    if command == "report":
        assert_inert_page((tmp_path / "page.html").read_text(encoding="utf-8"))
    assert not list(out.glob("PWNED-*"))


def test_refusals_name_cli_flags_not_python_keywords(attacks):
    _, files = attacks
    code, output = _cli("replay", files["model_init_popen"], "--loss-fn", USER_CODE[3])
    assert code == 7
    assert "nanreplay trust" in output and "--trust" in output and "--model-factory" in output
    assert "trust=True" not in output and "model_factory=" not in output


def test_an_untrusted_optimizer_class_is_never_imported_and_bisect_over_steps_refuses_it(attacks):
    _, files = attacks
    code, output = _cli("bisect", files["optimizer_class_probe"], "--over", "steps", *USER_CODE)
    assert code == 7, output
    assert f"optimizer class '{PROBE}:Opt'" in output


@pytest.mark.slow
def test_inspect_bounds_memory_on_a_sparse_huge_tensor(attacks):
    """1 GiB declared in a few KiB on disk: inspect verifies it in 8 MiB chunks (the old reader
    held two copies: 8.6 GB for a 4 GiB tensor)."""
    out, files = attacks
    path = files["st_sparse_huge_tensor"]
    assert path.stat().st_size > 1 << 30 and path.stat().st_blocks * 512 < 1 << 20
    (small,) = (out / "base-safetensors").glob("*.safetensors")
    code, _, baseline_kib = _cli_subprocess("inspect", small, timeout=600)
    assert code == 0
    code, output, rss_kib = _cli_subprocess("inspect", path, timeout=600)
    assert code == 4 and "checksum mismatch for tensor 'huge'" in output
    assert rss_kib - baseline_kib < 64 * 1024, f"peak RSS {rss_kib / 1024:.0f} MiB, {baseline_kib / 1024:.0f} MiB for a small bundle"


@pytest.mark.slow
def test_the_attack_index_matches_what_the_script_writes(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "attacks" / "make_attacks.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(index) == set(BY_NAME)
    assert all((tmp_path / entry["file"]).exists() or entry["file"].startswith("fifo") for entry in index.values())
