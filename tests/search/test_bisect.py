"""bisect: the first bad layer, the first bad step, the layer that must run in float32, the
smallest bad set of samples; replay counts, missing snapshots and the CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import math

import pytest
import torch
from click.testing import CliRunner

import models
from nanreplay import NonFiniteGradientError, Recorder, open_bundle
from nanreplay.search.api import bisect, ddmin
from nanreplay.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_REPLAY, main
from nanreplay.errors import ReplayError

SPIKE_STEP, SPIKE_LAYER = 5, 2


def _lr_spike_bundle(out_dir) -> str:
    """Six Linear+ReLU layers and a head, SGD with one param group per layer and gradient clipping.
    At step 5 a scheduler bug sets layers.2's learning rate to 1e19: its weights jump to ~1e17
    while clipping keeps every other layer where it was. Step 6 is still finite; step 7 brings a
    batch of unnormalised inputs (x 1e5) and the blown-up layer overflows float32: the NaN
    appears at step 7 = 5 + 2."""
    model = models.make_deep()
    opt = torch.optim.SGD([{"params": m.parameters()} for m in [*model.layers, model.head]], lr=0.01)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=out_dir, snapshot_every=1, capacity=8, diagnose=False) as rec:
        for step in range(12):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == SPIKE_STEP + 2:
                x = x * 1e5
            for group in opt.param_groups:
                group["lr"] = 0.01
            if step == SPIKE_STEP:
                opt.param_groups[SPIKE_LAYER]["lr"] = 1e19
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            try:
                opt.step()
            except NonFiniteGradientError as e:
                assert e.step == SPIKE_STEP + 2
                return e.bundle_path
    raise AssertionError("the run never became non-finite")


@pytest.fixture(scope="module")
def spike_bundle(tmp_path_factory):
    torch.manual_seed(0)
    return _lr_spike_bundle(tmp_path_factory.mktemp("spike"))


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_ddmin_single_culprit_and_interaction():
    calls = []

    def fails(s):
        calls.append(s)
        return 19 in s

    assert ddmin(list(range(32)), fails) == [19]
    assert len(calls) <= 2 * math.log2(32)
    assert ddmin(list(range(32)), lambda s: {3, 20} <= set(s)) == [3, 20]


def test_steps_names_the_spike_step(spike_bundle):
    before = _sha(spike_bundle)
    res = bisect(spike_bundle, over="steps")
    assert res["status"] == "found"
    first = res["culprits"][0]
    assert first["step"] == SPIKE_STEP
    assert first["largest_relative_update"]["layer"] == f"layers.{SPIKE_LAYER}"
    assert f"Step {SPIKE_STEP} is the first" in res["answer"]
    # the trajectory was verified against the recording up to the spike (clipping was rescaled)
    rows = {r["step"]: r for r in res["details"]["timeline"]}
    assert all(rows[s]["matches_recording"] for s in range(0, SPIKE_STEP + 1))
    assert "clipped_to" in rows[SPIKE_STEP]
    assert res["replays"] == len(res["details"]["timeline"])
    assert _sha(spike_bundle) == before  # bisect never modifies the bundle


def test_layers_names_the_blown_up_layer(spike_bundle):
    before = _sha(spike_bundle)
    res = bisect(spike_bundle, over="layers")
    assert res["status"] == "found"
    assert [c["layer"] for c in res["culprits"]] == [f"layers.{SPIKE_LAYER}"]
    c = res["culprits"][0]
    assert c["class"] == "Linear" and c["relative_change"] > 1e10 and c["max_abs_diff"] > 1e10
    # the newest snapshot (step 6) already holds the blown-up weights: the baseline is step 5,
    # the last healthy state before the first abnormal step (the spiked update) found by the walk
    assert res["details"]["good_step"] == SPIKE_STEP
    assert res["details"]["largest_moves"][0]["layer"] == f"layers.{SPIKE_LAYER}"
    w = res["window"]
    assert (w["first_abnormal_step"], w["good_step"], w["bad_step"], w["failing_step"]) == (SPIKE_STEP, SPIKE_STEP, SPIKE_STEP + 1, SPIKE_STEP + 2)
    # clipping kept every other layer where it was: nothing spread
    assert w["corrupted"] == [f"layers.{SPIKE_LAYER}"] and w["spread_to"] == []
    assert "no other layer's weights had left their healthy range" in res["answer"]
    assert _sha(spike_bundle) == before


@pytest.mark.parametrize("culprit", [0, 19, 31])
def test_layers_replay_count_for_one_culprit_among_32(tmp_path, culprit):
    model = models.make_deep32()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(names) == 32
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep32, out_dir=tmp_path, snapshot_every=1, diagnose=False) as rec:
        for step in range(2):
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            if step == 0:
                opt.step()
                with torch.no_grad():  # a corrupted update of one layer
                    model.get_submodule(names[culprit]).weight.mul_(1e38)  # finite, but the loss overflows
            else:
                with pytest.raises(NonFiniteGradientError) as info:
                    opt.step()
    res = bisect(info.value.bundle_path, over="layers")
    assert [c["layer"] for c in res["culprits"]] == [names[culprit]]
    assert res["replays"] <= 2 * math.log2(32) + 2


def test_layers_says_when_the_cause_is_not_in_the_weights(tmp_path):
    model = models.make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=tmp_path, snapshot_every=1, diagnose=False) as rec:
        for step in range(3):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            if step == 2:
                x[4, 1] = 3e38  # finite but huge: overflows in the first layer
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            if step < 2:
                opt.step()
            else:
                with pytest.raises(NonFiniteGradientError) as info:
                    opt.step()
    res = bisect(info.value.bundle_path, over="layers")
    assert res["status"] == "not in search space"
    assert "the cause is not in the weights" in res["answer"]
    assert [t["step"] for t in res["details"]["snapshots_tried"]] == [1, 0]
    # the same bundle, over samples: the poisoned sample is the culprit
    res = bisect(info.value.bundle_path, over="samples")
    assert res["status"] == "found"
    assert res["details"]["minimal_failing_subset"] == [4]
    assert res["details"]["removal_makes_finite"] == [4]


def test_samples_names_the_poisoned_sample(tmp_path):
    model = models.make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    x[21] = 3e38  # finite, but float32 overflows in the first layer
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=tmp_path, diagnose=False) as rec:
        rec.record((x, y))
        loss = models.mse_loss(model, (x, y))
        loss.backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    assert torch.isfinite(x).all()
    res = bisect(info.value.bundle_path, over="samples")
    assert res["status"] == "found"
    assert [c["sample"] for c in res["culprits"]] == [21]
    assert res["culprits"][0]["removal_makes_finite"] is True
    assert "removing sample 21 alone makes it finite" in res["answer"]
    assert res["replays"] <= 2 * math.log2(32) + 2 + 1  # whole batch, ddmin, one removal check
    assert res["warnings"] == []


def test_samples_cotangent_mode_and_batchnorm_warning(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    x[5, 0] = float("nan")  # BatchNorm spreads it over the whole batch
    with Recorder(model, opt, out_dir=tmp_path, diagnose=False) as rec:
        model(x).pow(2).mean().backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    with caplog.at_level(logging.INFO, logger="nanreplay"):
        res = bisect(info.value.bundle_path, over="samples", model=torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)))
    # the warnings are the result's, printed once by the CLI: the library logs them below WARNING
    assert not [r for r in caplog.records if r.name.startswith("nanreplay.search") and r.levelno >= logging.WARNING]
    assert res["details"]["mode"] == "cotangent"
    assert any("batch-coupled" in w and "(1)" in w for w in res["warnings"])
    # BatchNorm spread the NaN over the batch, so the recorded cotangent is NaN for every row
    assert any("recorded cotangent, which is already non-finite for samples [0, 1, 2, 3, 4, 5, 6, 7]" in w for w in res["warnings"])


def _half_bundle(out_dir) -> str:
    model = models.make_half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8).half(), torch.randn(16, 1)
    with Recorder(model, opt, loss_fn=models.mse_loss_fp32, model_factory=models.make_half, out_dir=out_dir, diagnose=False) as rec:
        rec.record((x, y))
        loss = models.mse_loss_fp32(model, (x, y))
        loss.backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return info.value.bundle_path


def test_precision_names_the_overflowing_layer(tmp_path):
    res = bisect(_half_bundle(tmp_path), over="precision")
    assert res["status"] == "found"
    c = res["culprits"][0]
    assert c["layer"] == "gate2" and c["class"] == "NaiveSoftmaxGate"
    assert c["dtype"] == "float16" and c["dtype_max"] == torch.finfo(torch.float16).max
    assert c["overflow"] is True and c["absmax_fp32"] > 65504 and c["first_op_over_range"] == "exp"
    assert res["details"]["execution_order"] == ["fc1", "gate1", "fc2", "gate2", "head"]
    assert res["replays"] <= 2 + math.ceil(math.log2(5)) + 1


def test_precision_on_a_float32_failure_is_not_a_precision_problem(spike_bundle):
    res = bisect(spike_bundle, over="precision")
    assert res["status"] == "not in search space"
    assert "not a precision problem" in res["answer"]


def test_missing_snapshot_message(tmp_path):
    model = models.make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    x[0, 0] = float("nan")
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=tmp_path, diagnose=False) as rec:
        rec.record((x, y))
        models.mse_loss(model, (x, y)).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    for over in ("layers", "steps"):
        with pytest.raises(ReplayError) as e:
            bisect(info.value.bundle_path, over=over)
        msg = str(e.value)
        assert f"bisect --over {over} needs the weights" in msg
        assert "holds snapshots at steps none" in msg
        assert "Recorder(..., snapshot_every=1)" in msg
        assert "--over samples and --over precision" in msg
    r = CliRunner().invoke(main, ["bisect", info.value.bundle_path, "--over", "layers"])
    assert r.exit_code == EXIT_REPLAY
    assert "snapshot_every=1" in r.output and "Traceback" not in r.output


def test_max_replays_bounds_the_search(spike_bundle):
    res = bisect(spike_bundle, over="layers", max_replays=3)
    assert res["replays"] == 3
    assert res["status"] == "incomplete"
    assert "--max-replays" in res["answer"]
    with pytest.raises(ValueError, match="over must be one of"):
        bisect(spike_bundle, over="weights")


def test_layers_budget_spent_on_snapshots_is_incomplete(spike_bundle):
    """The newest snapshot (step 6) already holds the blown-up weights: with the budget spent before
    the finite one (step 5) is tried, the search is incomplete, not "the cause is not in the weights"
    (and too small to walk the steps for the first abnormal one, which it says)."""
    for max_replays in (1, 2):
        res = bisect(spike_bundle, over="layers", max_replays=max_replays)
        assert res["status"] == "incomplete" and res["replays"] == max_replays
        assert "before finding a snapshot" in res["answer"] and res["culprits"] == []
        assert any("leaves too few replays to walk the steps before step 7" in w for w in res["warnings"])


def test_upcast_gives_back_autocast_hooks_and_dtypes_when_a_forward_raises():
    from nanreplay.search.precision import Upcast

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4).half(), Boom())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            with Upcast(model, ["0", "1"], 2, "cpu", [torch.float16]):  # Boom raises inside its float32 forward
                assert model[0].weight.dtype == torch.float32
                model(torch.randn(2, 4).half())
        assert torch.is_autocast_enabled("cpu")  # no autocast(enabled=False) left open
    assert not torch.is_autocast_enabled("cpu")
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_cli_bisect(spike_bundle):
    runner = CliRunner()
    r = runner.invoke(main, ["bisect", "--help"])
    assert r.exit_code == EXIT_OK
    for opt in ("--over", "--max-replays", "--threshold", "--model-factory", "--loss-fn", "--json"):
        assert opt in r.output
    r = runner.invoke(main, ["bisect", spike_bundle, "--over", "layers"])
    assert r.exit_code == EXIT_OK, r.output
    first = r.output.splitlines()[0]
    assert first.startswith(f"Step 7 becomes non-finite 2 step(s) after layer layers.2 (Linear) was corrupted at step {SPIKE_STEP}")
    assert f"window:   last healthy step {SPIKE_STEP}, first abnormal step {SPIKE_STEP}, failing step 7" in r.output
    assert "replays:" in r.output
    r = runner.invoke(main, ["bisect", spike_bundle, "--over", "steps", "--json"])
    assert r.exit_code == EXIT_OK, r.output
    data = json.loads(r.output)
    assert data["culprits"][0]["step"] == SPIKE_STEP
    r = runner.invoke(main, ["bisect", spike_bundle, "--over", "precision"])
    assert r.exit_code == EXIT_NOT_FOUND
    r = runner.invoke(main, ["bisect", spike_bundle, "--over", "nope"])
    assert r.exit_code == 2
    r = runner.invoke(main, ["bisect", spike_bundle, "--threshold", "0.5"])
    assert r.exit_code == 2


def test_samples_search_does_not_blame_one_sample_for_a_batch_level_failure(out_dir):
    """Every sample alone fails (the loss divides by a count that is zero for any subset):
    bisect must not name 'sample 0' as the culprit."""
    import models as m
    from nanreplay import NonFiniteGradientError, Recorder
    from nanreplay.search.api import bisect

    def loss(model, batch):
        return model(batch).sum() / torch.zeros(())

    model = m.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8)
    with Recorder(model, opt, loss_fn=loss, out_dir=out_dir, diagnose=False) as rec:
        rec.record(x)
        loss(model, x).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    res = bisect(info.value.bundle_path, over="samples", model=m.make_mlp(), loss_fn=loss)
    assert res["status"] == "not in search space"
    assert res["culprits"] == []
    assert "any single sample" in res["answer"]


def test_precision_uses_the_recorded_autocast(tmp_path):
    """float32 weights, float16 autocast: the bundle records the autocast of the step, so the
    search knows the reduced dtype instead of assuming it."""
    model = models.make_half_fp32()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with Recorder(model, opt, loss_fn=models.autocast_fp16_mse, model_factory=models.make_half_fp32, out_dir=tmp_path, diagnose=False) as rec:
        rec.record((x, y))
        models.autocast_fp16_mse(model, (x, y)).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    res = bisect(info.value.bundle_path, over="precision")
    assert res["status"] == "found"
    c = res["culprits"][0]
    assert c["layer"] == "gate2" and c["dtype"] == "float16" and c["first_op_over_range"] == "exp"
    assert not any("assumes" in w for w in res["warnings"])


@pytest.mark.parametrize("failing_step", [8, 9, 11])
def test_snapshot_every_n_with_a_ring_of_n_plus_1_always_holds_an_earlier_snapshot(tmp_path, failing_step):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=tmp_path,
                  diagnose=False, snapshot_every=4, capacity=5) as rec:
        for step in range(failing_step + 1):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            if step == failing_step:
                x[1, 2] = float("nan")  # bad data: the cause is not in the weights
            rec.record((x, y))
            models.mse_loss(model, (x, y)).backward()
            if step == failing_step:
                with pytest.raises(NonFiniteGradientError) as info:
                    opt.step()
            else:
                opt.step()
                opt.zero_grad()
    with open_bundle(info.value.bundle_path) as b:
        held = [k for k in b.steps if b.step(k).snapshot is not None and k < failing_step]
    assert len(held) == 1 and held[0] % 4 == 0
    res = bisect(info.value.bundle_path, over="layers")  # runs: no missing-snapshot error
    assert res["status"] == "not in search space" and "not in the weights" in res["answer"]
