"""bench/gpu.py, the one script of GPU measurements, runs end to end on the CPU (``--dry-run``:
tiny sizes, the same code paths), so that it is known to work before a GPU is available. Its JSON
holds every section, each with numbers or the error it recorded, and it writes its table into a
copy of bench/README.md, never into the real one. No figure is checked: timing lives in bench/."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "bench" / "README.md"
SECTIONS = ("gpu_tests", "overhead:124M", "dump_replay:124M", "overhead:3.7M")
VARIANTS = ("plain", "recorder", "recorder_lagged", "recorder_snapshot_ring", "anomaly", "hook_detector")


@pytest.mark.slow
def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(README, readme)
    before = hashlib.sha256(README.read_bytes()).hexdigest()
    out = tmp_path / "results_gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(out), "--readme", str(readme)],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hashlib.sha256(README.read_bytes()).hexdigest() == before  # the real README is not touched
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["finished"] is True
    assert res["machine"]["device"] == "cpu" and res["machine"]["torch"]
    secs = res["sections"]
    assert set(secs) == set(SECTIONS)
    errors = {k: v["error"] for k, v in secs.items() if "error" in v or "skipped" in v}
    assert not errors, errors  # every section measured something on the CPU
    # the GPU tests ran (skipped without CUDA) and were read back from their JUnit XML
    tests = secs["gpu_tests"]
    assert tests["rc"] == 0 and tests["counts"]["skipped"] >= 5 and tests["counts"]["failed"] == 0
    assert {"tests/capture/test_cuda_syncs.py", "tests/engine/test_cuda_replay.py"} <= set(tests["files"])
    assert (tmp_path / "gpu_tests.xml").exists()
    for key in ("overhead:124M", "overhead:3.7M"):
        sec = secs[key]
        assert set(sec["variants"]) == set(VARIANTS) and sec["rounds"] >= 2
        for name, v in sec["variants"].items():
            assert v["ratio_median"] > 0 and v["step_ms_median"] > 0, (key, name)
        syncs = sec["syncs"]
        assert set(syncs) == set(VARIANTS)
        # host reads beyond the plain loop's (counted in Python; CUDA's count needs CUDA): one per step by default, one per 8 sync-free
        assert syncs["recorder"]["python_net_per_step"] == 1.0 and syncs["recorder"]["cuda_per_step"] is None
        assert syncs["recorder_lagged"]["python_net_per_step"] == 1 / 8
        mode = sec["sync_free_error_mode"]
        assert mode["check_every"] == 8 and mode["steps_under_error_mode"] == 7 and mode["raised"] == []
        prof = sec["profile"]  # the dry run always profiles, to run that path
        assert prof["recorder"]["top_self_cpu"] and "Self CPU" in prof["recorder"]["table"]
    assert set(secs["overhead:124M"]["targets"]) == {"recorder", "recorder_lagged"}
    dump = secs["dump_replay:124M"]
    assert dump["in_process_s"] > 0 and dump["bundle_bytes"] > 0 and dump["save_file"]["seconds"] > 0
    assert dump["verdict"] == "reproduced exactly" and dump["origin"] == "blocks.1.mlp.0"
    cli = dump["replay_cli"]
    assert cli["rc"] == 0 and cli["verdict"] == "reproduced exactly" and cli["origin"] == "blocks.1.mlp.0"
    # the table, between the markers of the README copy, says it is a dry run and holds every part
    text = readme.read_text()
    table = text.split("<!-- gpu -->", 1)[1].split("<!-- /gpu -->", 1)[0]
    assert "DRY RUN" in table and "`python bench/gpu.py --dry-run" in table
    assert "| Recorder, default options |" in table and "Targets on the 124M model" in table
    assert "GPU tests (" in table and "Failing step of the" in table and "nanreplay replay --json" in table
    assert _outside(text) == _outside(README.read_text())  # the rest of the copy is as it was


def _outside(text: str) -> str:
    head, rest = text.split("<!-- gpu -->", 1)
    return head + rest.split("<!-- /gpu -->", 1)[1]
