"""The CLI as a user meets it: the digits example end to end, bad inputs, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanreplay.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_digits_example_end_to_end(digits_bundle):
    r = _run("replay", digits_bundle)
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("NaN born in the loss, outside the model, in op div at digits_nan.py:")
    assert "born in the loss, outside the model" in first
    assert "reproduced exactly" in first
    assert "phase:         loss" in r.output
    # the stored in-process diagnosis agrees with the offline replay
    info = json.loads(_run("inspect", "--json", digits_bundle).output)
    assert info["diagnosis"]["phase"] == "loss"
    assert info["failing_step"] == json.loads(_run("replay", "--json", digits_bundle).output)["step"]


def test_replay_json_and_text(nested_div_bundle):
    r = _run("replay", "--json", nested_div_bundle)
    assert r.exit_code == 0
    diag = json.loads(r.output)
    assert diag["origin"]["module"] == "encoder.block.norm"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    text = _run("replay", nested_div_bundle).output
    assert "encoder.block.norm (SafeDiv)" in text and "producer" in text


def test_inspect_lists_steps_keys_and_diagnosis(nested_div_bundle):
    r = _run("inspect", nested_div_bundle)
    assert r.exit_code == 0
    assert "failing step: 0" in r.output
    assert "state/params/encoder.block.proj.weight" in r.output
    assert "stored diagnosis: NaN born in the forward pass in op div" in r.output


def test_missing_path_is_a_clean_error():
    r = _run("replay", "/no/such/bundle.h5")
    assert r.exit_code == 4
    assert r.output.startswith("Error: ") and "Traceback" not in r.output
    assert "/no/such/bundle.h5" in r.output


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_corrupted_bundle_is_a_clean_error(nested_div_bundle, tmp_path, damage, command):
    data = bytearray(nested_div_bundle.read_bytes())
    bad = tmp_path / "bad.h5"
    if damage == "truncate":
        bad.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        # flip bytes in the middle of the file (tensor data): the CRC-32 or HDF5 parsing catches it
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        bad.write_bytes(bytes(data))
    else:
        bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"x" * 200)
    r = _run(command, bad)
    assert r.exit_code == 4, r.output
    assert r.output.startswith("Error: ") and "Traceback" not in r.output


def test_not_reproduced_has_its_own_exit_code(unreproducible_bundle):
    r = _run("replay", unreproducible_bundle)
    assert r.exit_code == 3
    assert "not reproduced" in r.output.splitlines()[0]


def test_model_that_does_not_match_exits_5(nested_div_bundle):
    r = _run("replay", "--model-factory", "models:make_mlp", nested_div_bundle)
    assert r.exit_code == 5
    assert "the model does not match the bundle" in r.output


@pytest.mark.parametrize("command", [[], ["replay"], ["inspect"]])
def test_help(command):
    r = _run(*command, "--help")
    assert r.exit_code == 0 and "Usage:" in r.output


def test_cli_help_does_not_import_torch():
    """``nanreplay --help`` and every subcommand's ``--help``, run as the console script runs
    them, in a fresh process: each prints its usage, exits 0, and torch is never imported."""
    import subprocess
    import sys

    commands = [[]] + [[name] for name in sorted(main.commands)]
    code = (
        "import sys\n"
        "from nanreplay.cli import main\n"
        "for args in %r:\n"
        "    try:\n"
        "        main(args + ['--help'], prog_name='nanreplay')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (args, e.code)\n"
        "    print('@@', ' '.join(args), 'torch' in sys.modules, flush=True)\n"
    ) % (commands,)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    marks = [line.split() for line in r.stdout.splitlines() if line.startswith("@@")]
    assert len(marks) == len(commands) >= 6
    assert all(m[-1] == "False" for m in marks), marks
    for args in commands:
        assert f"Usage: nanreplay {' '.join(args)}".strip() in r.stdout, args


def test_digits_failure_is_batch_level_not_blamed_on_samples(digits_bundle):
    diag = json.loads(_run("replay", "--json", digits_bundle).output)
    assert diag["samples"]["batch_level"] is True
    assert diag["samples"]["indices"] == []
    assert "samples [" not in diag["summary"]
    assert not any("no sample alone" in w for w in diag["samples"]["warnings"])  # the two verdicts exclude each other


def test_the_exit_code_table_of_the_docstring_is_the_code_table():
    """The module docstring's table lists exactly the codes of EXIT_CODES, and every code the
    exception table maps to is one of them."""
    import re

    from nanreplay import cli

    documented = [int(m) for m in re.findall(r"^(\d+)\s{2,}\S", cli.__doc__, flags=re.M)]
    assert documented == sorted(cli.EXIT_CODES)
    assert {code for _, code, _ in cli.ERROR_EXITS} <= set(cli.EXIT_CODES)


@pytest.mark.parametrize("make, code", [
    (lambda: FileNotFoundError("x.h5: no such bundle file"), 4),
    (lambda: IsADirectoryError("bundles/"), 4),
    (lambda: PermissionError("x.h5"), 4),
    (lambda: SystemExit(3), 5),
    (lambda: RuntimeError("boom"), 1),
])
def test_guard_maps_each_exception_by_the_table(make, code):
    import click

    from nanreplay import cli

    def fail():
        raise make()

    with pytest.raises(click.ClickException) as info:
        cli._guard(fail)
    assert info.value.exit_code == code


def test_guard_maps_the_library_errors_by_the_table():
    import click

    from nanreplay import cli
    from nanreplay.errors import BundleFormatError, MissingExtraError, ModelMismatchError, ReplayError, UntrustedBundleError

    cases = {BundleFormatError("bad"): 4, UntrustedBundleError("x.h5", {"model factory": ["m:f"]}): 7, ModelMismatchError("mismatch"): 5,
             ReplayError("cannot"): 5, MissingExtraError("pip install 'nanreplay[report]'", extra="report"): 2}
    for err, code in cases.items():
        with pytest.raises(click.ClickException) as info:
            cli._guard(lambda err=err: (_ for _ in ()).throw(err))
        assert info.value.exit_code == code, err
