"""The CLI as a user meets it: the digits example end to end, bad inputs, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import models
from nanreplay import NonFiniteGradientError, Recorder
from nanreplay.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def nested_bundle(out_dir) -> Path:
    model = models.make_nested()
    with torch.no_grad():
        model.encoder["block"].proj.bias.fill_(-1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8) * 3
    x[2] = 0.0
    with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_nested, out_dir=out_dir) as rec:
        rec.record({"x": x})
        models.mean_loss(model, {"x": x}).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return Path(info.value.bundle_path)


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


def test_replay_json_and_text(nested_bundle):
    r = _run("replay", "--json", nested_bundle)
    assert r.exit_code == 0
    diag = json.loads(r.output)
    assert diag["origin"]["module"] == "encoder.block.norm"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    text = _run("replay", nested_bundle).output
    assert "encoder.block.norm (SafeDiv)" in text and "producer" in text


def test_inspect_lists_steps_keys_and_diagnosis(nested_bundle):
    r = _run("inspect", nested_bundle)
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
def test_corrupted_bundle_is_a_clean_error(nested_bundle, tmp_path, damage, command):
    data = bytearray(nested_bundle.read_bytes())
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


def test_not_reproduced_has_its_own_exit_code(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        model(torch.randn(4, 8)).sum().backward()
        model.fc1.bias.grad[0] = float("nan")  # corrupted after the fact: no replay can produce it
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    r = _run("replay", info.value.bundle_path)
    assert r.exit_code == 3
    assert "not reproduced" in r.output.splitlines()[0]


def test_model_that_does_not_match_exits_5(nested_bundle):
    r = _run("replay", "--model-factory", "models:make_mlp", nested_bundle)
    assert r.exit_code == 5
    assert "the model does not match the bundle" in r.output


@pytest.mark.parametrize("command", [[], ["replay"], ["inspect"]])
def test_help(command):
    r = _run(*command, "--help")
    assert r.exit_code == 0 and "Usage:" in r.output


def test_cli_help_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, nanreplay.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_digits_failure_is_batch_level_not_blamed_on_samples(digits_bundle):
    diag = json.loads(_run("replay", "--json", digits_bundle).output)
    assert diag["samples"]["batch_level"] is True
    assert diag["samples"]["indices"] == []
    assert "samples [" not in diag["summary"]
    assert not any("no sample alone" in w for w in diag["samples"]["warnings"])  # the two verdicts exclude each other
