"""Replays of steps recorded on a GPU: bit-exact on CUDA (the recorded CUDA generator states, the
deterministic cuBLAS setting a fresh replay process sets), and honest on the CPU (the CUDA
generator states left out, the verdict with its max abs difference, not "exactly").

The ``gpu`` tests need CUDA and are skipped without it; ``bench/gpu.py`` runs them first and
reads the verdicts they record (``record_property``) into its table. The others run anywhere:
a CUDA recording is stood in for by CPU steps whose RNG record also holds a CUDA generator state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scenarios
from nanreplay import replay
from nanreplay.core.rng import RNGReader, sole_thread
from nanreplay.engine.state import DETERMINISTIC_CUBLAS, deterministic_cublas

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _with_cuda_state(last):
    """The CUDA part of the RNG record of a step taken on a machine with one GPU: a CUDA generator
    state (16 bytes, Philox seed and offset) beside the CPU ones."""
    return last.torch_cuda if last is not None and last.torch_cuda else [torch.zeros(16, dtype=torch.uint8)]


def test_a_recording_with_cuda_generator_states_replays_on_the_cpu(out_dir, monkeypatch):
    monkeypatch.setattr(RNGReader, "_cuda", staticmethod(_with_cuda_state))
    err = scenarios.masked_root_under_dropout(out_dir)
    monkeypatch.undo()
    # restoring the recorded states as they are needs the GPU the recording had
    if not torch.cuda.is_available():
        from nanreplay import open_bundle

        with open_bundle(err.bundle_path) as b:
            with pytest.raises(ValueError, match="holds 1 CUDA generator"):
                b.step(b.failing_step).rng.restore()
    # the in-process diagnosis and a replay from the bundle, both on the CPU, leave them out
    assert err.diagnosis["reproduction"]["verdict"] == "reproduced exactly"
    diag = replay(err.bundle_path, device="cpu")
    assert diag["device"] == "cpu"
    assert diag["origin"]["op"] == "sqrt"
    # the recording's dropout drew from the CPU generator, which the replay restores: bit-equal
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert any("recorded with CUDA generator states" in w for w in diag["warnings"])


@pytest.mark.parametrize("capability, initialised, preset, expected", [
    ((9, 0), False, None, DETERMINISTIC_CUBLAS),  # Hopper, fresh process: :4096:8 is torch's own 32 MiB workspace there
    ((10, 0), False, None, DETERMINISTIC_CUBLAS),
    ((8, 0), False, None, None),                  # Ampere: torch's default workspace is neither deterministic setting
    ((9, 0), True, None, None),                   # CUDA already in use: torch and cuBLAS have read the variable
    ((9, 0), False, ":16:8", None),               # the user's own setting stays
])
def test_the_replay_sets_cublas_workspace_config_only_where_it_keeps_the_recorded_kernels(monkeypatch, capability, initialised, preset,
                                                                                          expected):
    if preset is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", preset)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert deterministic_cublas(torch.device("cpu")) is None
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == preset
    assert deterministic_cublas(torch.device("cuda")) == expected
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (expected or preset)


# -- on a GPU ----------------------------------------------------------------------------------------

def _fresh_process(code: str, *, env_drop: tuple = ("CUBLAS_WORKSPACE_CONFIG",)) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter, nanreplay and tests/ importable, the variables
    ``env_drop`` unset (as in a user's shell)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)


def _cli_replay(bundle: Path, *args: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    r = subprocess.run([sys.executable, "-m", "nanreplay.cli", "replay", str(bundle), "--json", *args], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr


@pytest.mark.gpu
def test_a_dropout_step_on_cuda_replays_bit_exactly(out_dir, record_property):
    err = scenarios.masked_root_under_dropout(out_dir, device="cuda")
    live = err.diagnosis["reproduction"]["verdict"]
    record_property("verdict_in_process", live)
    if sole_thread():  # alone in the process, the replay sets the process-wide CUDA generator: the fused dropout kernel's own masks
        assert live == "reproduced exactly", err.diagnosis["reproduction"]
    diag = replay(err.bundle_path)  # in this process, on the recorded device
    record_property("verdict_replay", diag["reproduction"]["verdict"])
    assert diag["device"].startswith("cuda")
    assert diag["reproduction"]["verdict"] == "reproduced exactly", diag["reproduction"]
    assert diag["origin"]["op"] == "sqrt"
    # a fresh process, as `nanreplay replay` runs: CUBLAS_WORKSPACE_CONFIG unset in its environment
    r = _fresh_process(
        "import json, os, nanreplay\n"
        f"d = nanreplay.replay({str(err.bundle_path)!r})\n"
        "print(json.dumps({'verdict': d['reproduction']['verdict'], 'device': d['device'],\n"
        "                  'cublas': os.environ.get('CUBLAS_WORKSPACE_CONFIG')}))\n")
    assert r.returncode == 0, r.stderr[-3000:]
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    record_property("verdict_fresh_process", fresh["verdict"])
    record_property("cublas_workspace_config_set", str(fresh["cublas"]))
    major = torch.cuda.get_device_capability()[0]
    assert fresh["cublas"] == (DETERMINISTIC_CUBLAS if major >= 9 else None)
    assert fresh["verdict"] == "reproduced exactly", fresh
    assert "CuBLAS" not in r.stderr  # torch's determinism alert is not the user's business


@pytest.mark.gpu
def test_a_cuda_bundle_replayed_on_the_cpu_says_how_far_it_is(out_dir, record_property):
    err = scenarios.masked_root_under_dropout(out_dir, device="cuda")
    on_gpu, stderr = _cli_replay(err.bundle_path)
    record_property("verdict_cli_cuda", on_gpu["reproduction"]["verdict"])
    assert on_gpu["reproduction"]["verdict"] == "reproduced exactly"
    assert "CuBLAS" not in stderr
    on_cpu, _ = _cli_replay(err.bundle_path, "--device", "cpu")
    repro = on_cpu["reproduction"]
    record_property("verdict_cli_cpu", repro["verdict"])
    record_property("max_abs_diff_cli_cpu", str(repro.get("max_abs_diff")))
    record_property("summary_cli_cpu", on_cpu["summary"])
    assert on_cpu["device"] == "cpu"
    # the same non-finite gradient (floor's), other dropout masks: reproduced, with how far the finite values are
    assert repro["verdict"] == "reproduced", repro
    assert repro["max_abs_diff"] is not None and float(repro["max_abs_diff"]) > 0
    assert f"reproduced (max abs difference {repro['max_abs_diff']:.4g})" in on_cpu["summary"]
    assert "reproduced exactly" not in on_cpu["summary"]
    assert any("recorded with CUDA generator states" in w for w in on_cpu["warnings"])
