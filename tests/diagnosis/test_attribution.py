"""Exact attribution: one small model per failure family; each test asserts the phase, op,
module FQN, samples and cause that replay reports, from the bundle (a fresh model) and, where
cheap, from the in-process diagnosis too."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.module_tracker import ModuleTracker

import failure_models as fm
import models
import scenarios
from helpers import fail_once
from nanreplay import NonFiniteGradientError, Recorder, replay
from nanreplay.core.allowlist import AllowRule, Allowlist
from nanreplay.engine.monitors import OpMonitor


def _strict_json(diag: dict) -> dict:
    return json.loads(json.dumps(diag, allow_nan=False, default=str))


def test_forward_division_by_zero_in_a_submodule(out_dir):
    err = scenarios.division_by_zero_in_a_submodule(out_dir)  # only row 2: relu(0 - 1) = 0 everywhere, then 0 / 0
    diag = _strict_json(replay(err.bundle_path))
    o = diag["origin"]
    assert (diag["phase"], o["op"], o["module"], o["samples"]) == ("forward", "div", "encoder.block.norm", [2])
    assert o["aten"] == "aten.div.Tensor" and o["nonfinite"] == "NaN" and o["dtype"] == "float32" and o["shape"] == [6, 8]
    assert o["source"]["file"].endswith("models.py") and "x.abs().sum(-1, keepdim=True)" in o["source"]["code"]
    assert o["inputs"]["nan"] == 0 and o["output"]["nan"] == 8
    # the zero divisor comes from the all-zero sample 2, carried through the model: with every weight
    # perturbed it is still 0, so the sample triggers it; but an all-zero row of continuous values is
    # valid data at the division's singular point: the cause (what to fix) is numerics, the sample its trigger
    c = diag["classification"]
    assert c["cause"] == "numerics" and diag["counterfactuals"]["persists_with_perturbed_weights"] is True
    assert c["trigger"]["samples"] == [2] and c["trigger"]["batch_level"] is False
    assert "the divisor is 0 at 1 of its 6 entries and derives from batch['x'] and the weights and stays 0 with the weights perturbed" in c["trigger"]["property"]
    assert any("the batch triggers the singular point" in e for e in c["evidence"])
    assert diag["samples"]["method"] == "non-finite rows of the producer op's output"
    assert diag["summary"].startswith("NaN born in the forward pass in op div at models.py:")
    assert "in module encoder.block.norm (SafeDiv), step 0, samples [2]" in diag["summary"]
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert err.diagnosis["summary"] == diag["summary"]  # the in-process diagnosis says the same


def test_log_of_zero_inside_where_reports_the_causal_chain(out_dir):
    model = fm.make_logwhere()
    with torch.no_grad():
        model.fc.bias.zero_()
    x = torch.randn(6, 4)
    x[3] = 0.0  # c = 0 for row 3: log(0) = -Inf masked by where, then 0/0 in LogBackward
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, torch.randn(6, 1)), fm.mse_loss, out_dir, model_factory=fm.make_logwhere)
    diag = _strict_json(replay(err.bundle_path))
    o = diag["origin"]
    assert (diag["phase"], o["op"], o["node"], o["forward_op"], o["module"], o["samples"]) == ("backward", "div", "LogBackward0", "log", "", [3])
    assert "torch.log(c)" in o["source"]["code"]
    chain = diag["chain"]
    assert [(c["phase"], c["op"], c["kinds"]) for c in chain] == [("forward", "log", "-Inf"), ("backward", "div", "NaN")]
    assert diag["classification"]["cause"] == "numerics" and "log derivative at 0" in diag["classification"]["detail"]
    assert "forward had -Inf born in log at failure_models.py:" in diag["summary"]
    assert diag["samples"]["method"] == "non-finite rows of the producer op's output"  # LogBackward's output has the batch rows


def test_sqrt_at_zero_in_backward(sqrt_bundle):
    diag = replay(sqrt_bundle)
    o = diag["origin"]
    assert (diag["phase"], o["node"], o["module"], o["samples"]) == ("backward", "SqrtBackward0", "root", [1])
    assert diag["classification"] == {**diag["classification"], "cause": "numerics", "detail": "sqrt derivative at 0"}
    # sqrt'(0) = 1/(2*0) = +Inf is born first; the NaN comes later (Inf * 0)
    assert o["nonfinite"] == "+Inf"
    assert diag["summary"].startswith("+Inf born in backward of sqrt (SqrtBackward0) at models.py:")
    assert "in module root (SqrtLayer), step 0, samples [1]; forward was finite; cause: numerics (sqrt derivative at 0)" in diag["summary"]
    assert all(row["output"]["nan"] == 0 for row in diag["health"])  # the forward was finite
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def _attn_batch(n: int = 6, L: int = 5):
    x = torch.randn(n, L, 6)
    pad = torch.zeros(n, L, dtype=torch.bool)
    pad[:, L - 1] = True          # the usual padding: some keys masked
    pad[0, 2:] = True
    y = torch.randint(0, 2, (n,))
    return x, pad, y


def test_masked_attention_trains_without_false_alarms(out_dir):
    model = fm.make_attn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Recorder(model, opt, loss_fn=fm.attn_loss, out_dir=out_dir, model_factory=fm.make_attn) as rec:
        for _ in range(8):
            batch = _attn_batch()
            rec.record(batch)
            loss = fm.attn_loss(model, batch)
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert rec.nonfinite_steps == [] and rec.bundles == []
    # the op monitor sees the -Inf masks, and the allowlist keeps them from being births
    tracker = ModuleTracker()
    mon = OpMonitor(tracker, model)
    with tracker, mon:
        fm.attn_loss(model, _attn_batch()).backward()
    assert mon.births == []
    assert {a["op"] for a in mon.allowed} >= {"masked_fill"} and all(a["output"].neginf and not a["output"].nan for a in mon.allowed)
    # without the default rules the same masks would be called births: the allowlist is what stops them
    strict = OpMonitor(tracker, model, allow=Allowlist(defaults=False))
    with tracker, strict:
        fm.attn_loss(model, _attn_batch()).backward()
    assert strict.births and all(b["output"].neginf and not b["output"].nan for b in strict.births)


def test_fully_masked_attention_row_is_caught(out_dir):
    model = fm.make_attn()
    x, pad, y = _attn_batch()
    pad[4] = True  # sample 4 masks every key: its softmax row is all -Inf -> NaN
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, pad, y), fm.attn_loss, out_dir, model_factory=fm.make_attn)
    diag = replay(err.bundle_path)
    o = diag["origin"]
    assert (diag["phase"], o["op"], o["module"], o["samples"]) == ("forward", "_softmax", "attn", [4])
    # the row is fully masked because of the batch's padding mask: bad input data, not numerics
    c = diag["classification"]
    assert c["cause"] == "bad input data" and "every position masked (-Inf)" in c["detail"] and "batch[1]" in c["detail"], c
    assert diag["allowed_births"] >= 1  # the -Inf masks were seen and allowed, not blamed


def test_custom_allow_rule_hides_a_birth(out_dir):
    model = fm.make_attn()
    x, pad, y = _attn_batch()
    pad[4] = True
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, pad, y), fm.attn_loss, out_dir,
                     model_factory=fm.make_attn, allow_nonfinite=("attn:_softmax",))
    diag = replay(err.bundle_path)
    assert "attn:_softmax" in diag["allowlist"]
    assert all(c["op"] != "_softmax" for c in diag["chain"])
    with pytest.raises(ValueError, match="an allowlist rule is 'MODULE:OP'"):
        AllowRule.parse("softmax")


def test_fp16_overflow_in_a_linear_layer_under_cpu_autocast(out_dir):
    model = fm.make_wide()
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.zeros(1, 8))
    except RuntimeError as e:  # pragma: no cover - older torch without CPU float16 autocast
        pytest.skip(f"CPU autocast to float16 unsupported here: {e}")
    with torch.no_grad():
        model.fc2.weight.fill_(300.0)
    x = torch.rand(4, 8)
    x[2] = 400.0  # fc2 of sample 2 exceeds 65504 in float16
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, torch.zeros(4, 1)), fm.fp16_autocast_loss, out_dir, model_factory=fm.make_wide)
    diag = replay(err.bundle_path)
    o = diag["origin"]
    assert (diag["phase"], o["module"], o["samples"], o["dtype"]) == ("forward", "fc2", [2], "float16")
    assert o["op"] == "addmm"
    c = diag["classification"]
    assert c["cause"] == "overflow" and any("finite in float32" in e for e in c["evidence"])


def test_one_bad_sample_in_the_input(out_dir):
    model = models.make_mlp()
    x = torch.randn(8, 8)
    x[5, 3] = float("nan")
    batch = {"image": x, "label": torch.randn(8, 4)}
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, input_mse, out_dir, model_factory=models.make_mlp)
    diag = replay(err.bundle_path)
    assert (diag["phase"], diag["origin"]["leaf"], diag["origin"]["samples"]) == ("input", "batch['image']", [5])
    assert diag["classification"]["cause"] == "bad input data"
    assert diag["summary"].startswith("non-finite value in the input data at batch['image'], step 0, samples [5]")


def input_mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["image"]), batch["label"])


def _train(model, opt, rec, steps, batch, loss_fn, lr_at=None):
    for s in range(steps):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
        rec.record(batch)
        loss = loss_fn(model, batch)
        rec.log_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_nan_learning_rate_is_an_optimizer_update(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    before = None
    with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=out_dir, model_factory=models.make_mlp, check_update=True) as rec:
        _train(model, opt, rec, 2, batch, models.mse_loss)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.param_groups[0]["lr"] = float("nan")
        with pytest.raises(NonFiniteGradientError, match="after the update of step 2") as info:
            _train(model, opt, rec, 1, batch, models.mse_loss)
    # raise restored the pre-step weights
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    for diag in (info.value.diagnosis, replay(info.value.bundle_path)):
        o = diag["origin"]
        assert (diag["phase"], o["param"], o["module"], diag["classification"]["cause"]) == ("optimizer", "fc1.weight", "fc1", "optimizer update")
        assert diag["optimizer"]["detail"].startswith("lr=nan in param group 0")
        assert diag.get("samples") is None


def test_an_optimizer_replay_that_raises_is_an_error_not_a_finite_update(out_dir, monkeypatch):
    """The NaN-learning-rate bundle, but the optimizer replay raises: the diagnosis says which
    replay failed and why, and never that the replay produced no non-finite value."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=out_dir, model_factory=models.make_mlp, check_update=True) as rec:
        _train(model, opt, rec, 2, batch, models.mse_loss)
        opt.param_groups[0]["lr"] = float("nan")
        with pytest.raises(NonFiniteGradientError) as info:
            _train(model, opt, rec, 1, batch, models.mse_loss)

    def broken(*args, **kwargs):
        raise RuntimeError("the optimizer cannot be rebuilt here")

    monkeypatch.setattr("nanreplay.diagnosis.optimizer.optimizer_from_info", broken)
    diag = replay(info.value.bundle_path)
    assert diag["phase"] == "none"
    assert diag["errors"] == [{"replay": "optimizer update", "error": "RuntimeError: the optimizer cannot be rebuilt here"}]
    assert diag["optimizer"] is None and diag["classification"]["cause"] == "unknown"
    assert diag["classification"]["detail"] == "RuntimeError: the optimizer cannot be rebuilt here"
    assert "the optimizer update replay failed: RuntimeError: the optimizer cannot be rebuilt here" in diag["warnings"]
    assert diag["summary"].startswith(f"step {diag['step']}: the optimizer update replay failed, so the origin is unknown; cause: unknown (RuntimeError")
    assert "no non-finite value" not in diag["summary"] + diag["cause"]
    _strict_json(diag)


def test_adam_eps_zero_names_the_second_moment(out_dir):
    """Resuming with eps=0: a weight whose gradient has always been 0 has a zero second moment,
    and its update is 0 / (sqrt(0) + 0) = NaN."""
    model = models.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 8)
    x[:, 0] = 0.0  # fc1.weight[:, 0] always gets a zero gradient: zero first and second moments
    batch = (x, torch.randn(8, 4))
    with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=out_dir, model_factory=models.make_mlp, check_update=True) as rec:
        _train(model, opt, rec, 2, batch, models.mse_loss)
        opt.param_groups[0]["eps"] = 0.0
        with pytest.raises(NonFiniteGradientError) as info:
            _train(model, opt, rec, 1, batch, models.mse_loss)
    diag = replay(info.value.bundle_path)
    o = diag["origin"]
    assert (diag["phase"], o["param"], o["module"], o["state_key"]) == ("optimizer", "fc1.weight", "fc1", "exp_avg_sq")
    assert diag["classification"]["cause"] == "optimizer update"
    assert any("eps=0" in e for e in diag["classification"]["evidence"])
    assert "state exp_avg_sq" in diag["summary"]


def test_exploding_gradients_from_a_learning_rate_spike(out_dir, caplog):
    torch.manual_seed(1)
    model = fm.make_wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(16, 8), torch.randn(16, 1))
    with Recorder(model, opt, loss_fn=fm.mse_loss, out_dir=out_dir, model_factory=fm.make_wide, capacity=6) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            _train(model, opt, rec, 200, batch, fm.mse_loss, lr_at=lambda s: 0.01 if s < 5 else 5.0)
    # step 8's gradients are all finite but their 2-norm overflows float32: a warning, not a dump
    warned = [r.getMessage() for r in caplog.records if "exploding gradients" in r.getMessage()]
    assert warned and "step 8" in warned[0]
    assert info.value.step == 9, "the bundle is written at the first truly non-finite gradient"
    diag = _strict_json(replay(info.value.bundle_path))
    c = diag["classification"]
    assert c["cause"] == "explosion", c
    assert diag["history"]["lr_spike"] == {"step": 5, "lr": 5.0, "min_lr": 0.01}
    # the history shows the explosion, with step 8's true norm (float64: its float32 sum of squares overflowed)
    norms = dict(diag["history"]["grad_norms"])
    assert norms[8] ** 2 > torch.finfo(torch.float32).max and norms[8] / norms[7] > 1e10
    assert diag["history"]["exploding"] and any("grad norm rose to" in e for e in c["evidence"])


def test_cli_json_and_allow_option(sqrt_bundle):
    from click.testing import CliRunner

    from nanreplay.cli import main

    bundle = str(sqrt_bundle)
    r = CliRunner().invoke(main, ["replay", bundle, "--json", "--allow", "root:mul"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["origin"]["node"] == "SqrtBackward0" and d["classification"]["cause"] == "numerics" and "root:mul:-inf" not in d["allowlist"]
    assert "root:mul" in d["allowlist"]
    r = CliRunner().invoke(main, ["replay", bundle])
    assert r.exit_code == 0 and r.output.startswith("+Inf born in backward of sqrt (SqrtBackward0)")
    assert "autograd node: SqrtBackward0" in r.output
    r = CliRunner().invoke(main, ["replay", bundle, "--allow", "nocolon"])
    assert r.exit_code == 2 and "an allowlist rule is 'MODULE:OP'" in r.output
