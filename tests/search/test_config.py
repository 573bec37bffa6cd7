"""bisect --over config: the recorded setting whose change makes the failing step finite, within
the replay bound of binary splitting; --against B; what cannot be toggled; the search's algorithm
on its own (every culprit position, two culprits together, none)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from helpers import with_meta

from nanreplay import open_bundle
from nanreplay.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main
from nanreplay.search.api import bisect
from nanreplay.search.config import Candidate, _find


@pytest.fixture
def runs(autocast_runs):
    return autocast_runs


def _bound(n: int) -> int:
    """The replays binary splitting needs for one culprit among ``n`` candidates: the replay as
    recorded, ceil(log2 n) halvings, the culprit alone when the last halving said no."""
    return math.ceil(math.log2(n)) + 2


def test_the_autocast_dtype_is_named_within_the_bound(runs):
    a, _ = runs
    with open_bundle(a) as b:
        assert b.step(b.failing_step).autocast == {"device_type": "cpu", "dtype": "float16"}
    res = bisect(a, over="config")
    assert res["status"] == "found"
    (c,) = res["culprits"]
    assert (c["setting"], c["recorded"], c["changed_to"]) == ("autocast", "float16", "off")
    n = len(res["details"]["candidates"])
    assert n >= 2 and res["replays"] <= _bound(n)
    first, *rest = res["trials"]
    assert first["varied"] == "the recorded configuration" and first["nonfinite"] is True
    assert any(t["varied"] == "autocast float16 -> off (float32)" and t["nonfinite"] is False for t in rest)
    assert res["answer"].startswith("Step 22 becomes finite when autocast changes from float16 to off (float32)")
    # on a CPU the TF32 and cuDNN flags change nothing: left out, and said so
    left = {r["setting"] for r in res["details"]["left_out"]}
    assert "numerics.cudnn_tf32" in left and all("cudnn" not in c["setting"] for c in res["details"]["candidates"])
    assert any("change nothing" in w and "--device cuda" in w for w in res["warnings"])


def test_against_the_healthy_run_moves_to_its_value(runs):
    a, b = runs
    res = bisect(a, over="config", against=b)
    assert res["status"] == "found"
    (c,) = res["culprits"]
    assert (c["setting"], c["recorded"], c["changed_to"]) == ("autocast", "float16", "bfloat16")
    assert [x["setting"] for x in res["details"]["candidates"]] == ["autocast"]  # the one setting the runs differ in
    assert res["replays"] == 2 == _bound(1)
    assert "(the value in nanreplay-spike-step22" in res["answer"]
    assert res["details"]["diff"]["differences"][0]["key"] == "autocast"


def test_one_culprit_among_many_differences_within_the_bound(runs, tmp_path):
    """B differs from A in four settings a CPU replay can change; only the autocast dtype
    matters: it is named within ceil(log2 4) + 2 replays, and the differences no replay can make
    (the torch version, the world size, the reduce dtype) are reported, not searched."""
    a, b = runs

    def other_run(meta):
        env = meta["environment"]
        env["numerics"].update({"float32_matmul_precision": "high", "sdpa_flash": False, "mkldnn_enabled": False})
        env["torch"] = "2.99.0"
        meta["config"]["distributed"] = {"reduce_dtype": "bfloat16"}
        meta["world_size"] = 2
    b2 = with_meta(b, tmp_path / "b2.h5", other_run)
    res = bisect(a, over="config", against=b2)
    cands = [c["setting"] for c in res["details"]["candidates"]]
    assert cands[0] == "autocast" and len(cands) == 4, cands
    assert res["status"] == "found" and [c["setting"] for c in res["culprits"]] == ["autocast"]
    assert res["replays"] <= _bound(len(cands))
    cannot = {r["setting"] for r in res["details"]["cannot_toggle"]}
    assert {"version.torch", "distributed.world_size", "distributed.reduce_dtype"} <= cannot
    assert "no replay can change" in res["answer"] and "version.torch" in res["answer"]


def test_a_compiled_recording_replays_compiled(runs, tmp_path):
    """A bundle that says its model ran under torch.compile (aot_eager: Dynamo and AOTAutograd,
    cheap on a CPU) is replayed compiled, and eager is a candidate."""
    a, _ = runs
    a2 = with_meta(a, tmp_path / "compiled.h5", lambda m: m.update(compile={
        "compiled": True, "backend": "aot_eager", "mode": None, "modules": [], "options": None, "dynamic": False, "fullgraph": False}))
    res = bisect(a2, over="config")
    cands = [c["setting"] for c in res["details"]["candidates"]]
    assert cands[:2] == ["autocast", "compile.compiled"] and "compile.mode" not in cands  # no mode recorded: nothing to change
    assert res["details"]["recorded"]["compile.backend"] == "aot_eager"
    assert res["trials"][0]["nonfinite"] is True and res["culprits"][0]["setting"] == "autocast"
    assert res["replays"] <= _bound(len(cands))


def test_a_failure_no_setting_explains_is_not_in_the_search_space(sqrt_bundle):
    res = bisect(sqrt_bundle, over="config")
    assert res["status"] == "not in search space"
    assert res["culprits"] == [] and res["replays"] == 1 + len(res["details"]["candidates"]) >= 2
    assert "is not the cause" in res["answer"]


def test_a_failed_update_replays_the_update_with_the_optimizer_kernels(tmp_path):
    """check_update found step 2's update non-finite (a NaN learning rate, finite gradients): the
    search replays the update after each backward pass, and the foreach kernel (recorded on) is a
    candidate; switching it off does not help, so no setting is named."""
    import models
    from nanreplay import Recorder

    torch.manual_seed(0)
    model = models.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=tmp_path, check_update=True, action="warn",
                  diagnose=False, embed_program=False) as rec:
        for step in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            if step == 2:
                opt.param_groups[0]["lr"] = float("nan")
            opt.step()
    (path,) = rec.bundles
    res = bisect(path, over="config")
    assert res["details"]["replays_update"] is True
    assert [c["setting"] for c in res["details"]["candidates"]] == ["optimizer.foreach", "numerics.sdpa_flash"]
    assert res["trials"][0]["nonfinite"] is True and res["trials"][0]["update_nonfinite"] is True  # the backward pass is finite
    # as recorded; the first half (foreach off); the second half alone; every candidate together
    assert res["status"] == "not in search space" and res["replays"] == 4


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_binary_splitting_names_any_single_culprit_within_the_bound(n):
    """The search alone, on a predicate: for every position of one culprit among ``n``, the
    halvings and the final check stay within ceil(log2 n) + 1 tests (the replay as recorded is
    the bound's other one), and never test a set twice."""
    cands = [Candidate(f"s{i}", True, False) for i in range(n)]
    for culprit in range(n):
        tried: list[frozenset] = []

        class Trials:
            def fixes(self, changed):
                key = frozenset(c.key for c in changed)
                assert key not in tried
                tried.append(key)
                return f"s{culprit}" in key

        found, how = _find(Trials(), cands)
        assert [c.key for c in found] == [f"s{culprit}"] and how == "binary splitting"
        assert len(tried) <= _bound(n) - 1


def test_two_settings_that_only_fail_together_fall_back_to_delta_debugging():
    cands = [Candidate(f"s{i}", True, False) for i in range(6)]

    class Trials:  # the step is finite only when s1 and s4 both change
        def fixes(self, changed):
            return {"s1", "s4"} <= {c.key for c in changed}

    found, how = _find(Trials(), cands)
    assert sorted(c.key for c in found) == ["s1", "s4"] and how == "delta debugging"

    class Never:
        def fixes(self, changed):
            return False

    assert _find(Never(), cands) == (None, "binary splitting")


def test_cli_bisect_over_config_against(runs, tmp_path):
    pytest.importorskip("matplotlib")
    a, b = runs
    page = tmp_path / "bisect.html"
    r = CliRunner().invoke(main, ["bisect", str(a), "--against", str(b), "--over", "config", "--json", f"--html={page}"], catch_exceptions=False)
    assert r.exit_code == EXIT_OK, r.output
    out = json.loads(r.stdout)
    assert out["over"] == "config" and out["culprits"][0]["setting"] == "autocast"
    html = page.read_text()
    assert '<section id="config-diff">' in html and "<code>autocast</code>" in html
    for args in (["--over", "layers", "--against", str(b)], ["--against", str(b)]):
        r = CliRunner().invoke(main, ["bisect", str(a), *args])
        assert r.exit_code == EXIT_USAGE and "--against goes with --over config" in r.output


def test_cli_bisect_over_config_names_no_culprit_with_exit_6(sqrt_bundle):
    r = CliRunner().invoke(main, ["bisect", str(sqrt_bundle), "--over", "config"], catch_exceptions=False)
    assert r.exit_code == EXIT_NOT_FOUND and "not in search space" in r.output


def test_process_flags_are_put_back():
    """The flags a replay sets are the process's own again after it, even when the block raises."""
    from nanreplay.engine.settings import process_flags

    before = (torch.get_float32_matmul_precision(), torch.backends.cuda.flash_sdp_enabled(), torch.backends.mkldnn.enabled,
              torch.backends.mkldnn.matmul.fp32_precision)
    with pytest.raises(RuntimeError, match="inside"):
        with process_flags({"numerics.float32_matmul_precision": "medium", "numerics.sdpa_flash": False, "numerics.mkldnn_enabled": False}):
            assert torch.get_float32_matmul_precision() == "medium" and not torch.backends.cuda.flash_sdp_enabled()
            assert not torch.backends.mkldnn.enabled
            raise RuntimeError("inside")
    assert (torch.get_float32_matmul_precision(), torch.backends.cuda.flash_sdp_enabled(), torch.backends.mkldnn.enabled,
            torch.backends.mkldnn.matmul.fp32_precision) == before


def test_the_settings_a_replay_can_change_are_the_toggles():
    """core.settings.SETTINGS marks ``replay`` exactly the rows engine.settings.TOGGLES sets, and
    every toggle's conservative value is one it accepts."""
    import fnmatch

    from nanreplay.core.settings import SETTINGS, rule_for
    from nanreplay.engine.settings import NO_REFERENCE, TOGGLES

    assert all(rule_for(t.pattern.replace("*", "x")).replay for t in TOGGLES)
    assert all(any(fnmatch.fnmatchcase(t.pattern, r.pattern) for t in TOGGLES) for r in SETTINGS if r.replay)
    assert all(t.reference is NO_REFERENCE or t.accepts(t.reference) for t in TOGGLES)
