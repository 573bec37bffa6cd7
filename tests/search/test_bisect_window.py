"""bisect --over layers when the NaN comes steps after the corruption (issue 21 item 4): the search
runs between the last healthy state and the first abnormal step the steps search's walk finds,
names the layer corrupted there, and says which layers the corruption spread to by the failing
step; with no healthy snapshot left in the ring buffer it says so."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import models
from nanreplay import NonFiniteGradientError, Recorder
from nanreplay.cli import EXIT_NOT_FOUND, EXIT_OK, main
from nanreplay.search.api import bisect

CORRUPT_STEP, CORRUPT_LAYER = 6, "layers.3"
OTHERS = ["layers.0", "layers.1", "layers.2", "layers.4", "layers.5", "head"]


def _train(out_dir, how: str, *, capacity: int = 16, snapshot_every: int = 1) -> tuple[str, int]:
    """A six-layer MLP trained with SGD + momentum (one param group per layer) on fresh batches.

    ``how="reload"``: after step 6's update, a bad partial checkpoint reload leaves layers.3's weight
    scaled by 1e4 (finite; made outside ``optimizer.step()``, so only the recorded weights show it).
    ``how="lr"``: a scheduler bug gives layers.3's param group lr 1e4 for step 6 only.
    Either way the loss stays finite for a few steps while the huge gradients blow up every other
    layer through their updates; the bundle is written at the first non-finite gradient.
    Returns the bundle path and the failing step."""
    torch.manual_seed(0)
    model = models.make_deep()
    opt = torch.optim.SGD([{"params": m.parameters()} for m in [*model.layers, model.head]], lr=0.01, momentum=0.9)
    target = dict(model.named_modules())[CORRUPT_LAYER]
    group = [*model.layers, model.head].index(target)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=out_dir, snapshot_every=snapshot_every,
                  capacity=capacity, diagnose=False, on_spike=None) as rec:
        for step in range(40):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            for pg in opt.param_groups:
                pg["lr"] = 0.01
            if how == "lr" and step == CORRUPT_STEP:
                opt.param_groups[group]["lr"] = 1e4
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                return e.bundle_path, e.step
            if how == "reload" and step == CORRUPT_STEP:
                with torch.no_grad():
                    target.weight.mul_(1e4)
    raise AssertionError("the run never became non-finite")


@pytest.fixture(scope="module")
def reload_bundle(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("reload"), "reload")


def _check_window(res: dict, failing: int) -> None:
    assert res["status"] == "found", res["answer"]
    assert [c["layer"] for c in res["culprits"]] == [CORRUPT_LAYER]
    w = res["window"]
    assert failing >= CORRUPT_STEP + 3  # the NaN comes several steps after the corruption
    assert w["first_abnormal_step"] == CORRUPT_STEP and w["failing_step"] == failing
    assert (w["good_step"], w["bad_step"], w["probe_step"]) == (CORRUPT_STEP, CORRUPT_STEP + 1, CORRUPT_STEP + 1)
    assert w["corrupted"] == [CORRUPT_LAYER]
    assert sorted(w["spread_to"]) == sorted(OTHERS)
    assert f"after layer {CORRUPT_LAYER} (Linear) was corrupted at step {CORRUPT_STEP}" in res["answer"]
    assert f"By step {failing} the corruption had spread to {len(OTHERS)} other layer(s)" in res["answer"]
    # the spread is measured: every other layer moved far beyond its bound by the failing step, not at step 7
    first = {r["layer"]: r for r in res["details"]["at_first_abnormal"]}
    last = {r["layer"]: r for r in res["details"]["at_failing"]}
    for L in OTHERS:
        assert not first[L]["abnormal"] and last[L]["abnormal"]
        assert last[L]["nonfinite_values"] or last[L]["relative_change"] > last[L]["bound"]
    assert first[CORRUPT_LAYER]["relative_change"] > 1e3
    # the walk replayed the steps from the oldest snapshot up to the corrupted one, and no further
    assert [r["step"] for r in res["details"]["walk"]] == list(range(0, CORRUPT_STEP + 1))


def test_layers_finds_a_corruption_made_outside_the_optimizer(reload_bundle):
    path, failing = reload_bundle
    res = bisect(path, over="layers")
    _check_window(res, failing)
    # the update of step 6 is the recorded one (the snapshots), not a replayed optimizer step
    assert res["window"]["anomalies"][0].startswith(f"the recorded update (step {CORRUPT_STEP}'s weights to step {CORRUPT_STEP + 1}'s) norm")


def test_layers_finds_an_lr_spike_bridged_by_the_optimizer(tmp_path):
    """Snapshots every 2 steps: the weights after step 6 are not recorded, so the walk rebuilds the
    optimizer from step 6's snapshot and takes the recorded (spiked) learning rates."""
    path, failing = _train(tmp_path, "lr", snapshot_every=2)
    res = bisect(path, over="layers")
    _check_window(res, failing)
    assert res["window"]["anomalies"][0].startswith("the optimizer update norm")


def test_layers_says_when_no_healthy_snapshot_is_held(tmp_path):
    """A ring buffer of 3: every snapshot held comes after the corruption. The search says so (and
    where the scalar history saw the grad norm leave its range) instead of naming a layer."""
    path, failing = _train(tmp_path, "reload", capacity=3)
    res = bisect(path, over="layers")
    assert res["status"] == "not in search space" and res["culprits"] == []
    w = res["window"]
    oldest = failing - 2
    assert w["good_step"] is None and w["first_abnormal_step"] == oldest
    assert res["answer"].startswith(f"No healthy snapshot: step {oldest}, the oldest step whose weights the ring buffer holds, is already out")
    assert w["history_onset"] == CORRUPT_STEP + 1  # the first step whose grad norm left the band: the one after the reload
    assert f"the scalar history shows the grad norm leaving the healthy range at step {CORRUPT_STEP + 1}" in res["answer"]
    assert "larger capacity" in res["answer"]
    r = CliRunner().invoke(main, ["bisect", path, "--over", "layers"])
    assert r.exit_code == EXIT_NOT_FOUND, r.output
    assert "window:   last healthy none held" in r.output


def test_cli_bisect_layers_window_text_and_json(reload_bundle):
    jsonschema = pytest.importorskip("jsonschema")
    from nanreplay.core.schema import shipped_schema

    path, failing = reload_bundle
    runner = CliRunner()
    r = runner.invoke(main, ["bisect", path, "--over", "layers"])
    assert r.exit_code == EXIT_OK, r.output
    assert r.output.startswith(f"Step {failing} becomes non-finite {failing - CORRUPT_STEP} step(s) after layer {CORRUPT_LAYER}")
    assert f"window:   last healthy step {CORRUPT_STEP}, first abnormal step {CORRUPT_STEP}, failing step {failing}" in r.output
    assert f"spread:   abnormal at step {CORRUPT_STEP + 1}: {CORRUPT_LAYER}; spread to by step {failing}: " in r.output
    r = runner.invoke(main, ["bisect", path, "--over", "layers", "--json"])
    assert r.exit_code == EXIT_OK, r.output
    data = json.loads(r.output)
    _check_window(data, failing)
    errors = [e.message for e in jsonschema.Draft202012Validator(shipped_schema("bisect")).iter_errors(data)]
    assert not errors, errors


def test_bisect_html_draws_the_walk(reload_bundle, tmp_path):
    pytest.importorskip("matplotlib")
    path, failing = reload_bundle
    out = tmp_path / "page.html"
    r = CliRunner().invoke(main, ["bisect", path, "--over", "layers", f"--html={out}"])
    assert r.exit_code == EXIT_OK, r.output
    page = out.read_text()
    assert '<section id="steps"><h2>Replayed steps</h2>' in page and "bisect-steps" in page
    assert "had spread to 6 other layer(s)" in page


def test_layers_says_when_the_trouble_began_with_a_batch(tmp_path):
    """Step 6's targets are off by 1e6 (a unit bug in one shard): its gradients blow every layer up
    and the loss is non-finite two steps later. No layer was corrupted first: step 6 is abnormal on
    the last healthy weights too, and the search says the data began it, not "layers.0"."""
    torch.manual_seed(0)
    model = models.make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_deep, out_dir=tmp_path, snapshot_every=1,
                  capacity=16, diagnose=False, on_spike=None) as rec:
        for step in range(40):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == CORRUPT_STEP:
                y = y * 1e6
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                path, failing = e.bundle_path, e.step
                break
    res = bisect(path, over="layers")
    assert res["status"] == "not in search space" and res["culprits"] == []
    w = res["window"]
    assert (w["first_abnormal_step"], w["good_step"], w["bad_step"], w["probe_step"]) == (CORRUPT_STEP, CORRUPT_STEP - 1, CORRUPT_STEP, CORRUPT_STEP)
    assert w["anomalies"][0].startswith("grad norm") and w["corrupted"] == []
    assert sorted(w["spread_to"]) == sorted([CORRUPT_LAYER, *OTHERS])
    assert f"the trouble began with the data of step {CORRUPT_STEP}, not with a layer's weights" in res["answer"]
    assert f"By step {failing} the corruption had spread to 7 layer(s)" in res["answer"]


def test_a_small_budget_walks_from_a_later_snapshot(reload_bundle):
    """--max-replays 16: walking all 10 steps before the failing one would leave too few replays for
    the layers, so the walk starts at a later snapshot (still before the corruption) and says so."""
    path, failing = reload_bundle
    res = bisect(path, over="layers", max_replays=16)
    walked = [r["step"] for r in res["details"]["walk"]]
    assert walked[0] > 0 and walked[-1] == CORRUPT_STEP
    assert any(w.startswith(f"walked steps {walked[0]}..{failing - 1} for the first abnormal one") for w in res["warnings"])
    assert [c["layer"] for c in res["culprits"]] == [CORRUPT_LAYER] and res["replays"] <= 16
