"""Mixed precision: GradScaler skips are counted, real failures are dumped, and replay restores
the scaler and the autocast of the step. fp16 and bf16 autocast on the CPU."""

from __future__ import annotations

import pytest
import torch

import models
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay


def _amp_step(model, opt, scaler, rec, batch, *, dtype=torch.float16, bypass=False):
    rec.record(batch)
    with torch.autocast("cpu", dtype=dtype):
        loss = models.mse_loss(model, batch)
    opt.zero_grad()
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    if bypass:  # a loop that unscales and then steps the optimizer itself, skipping the scaler's check
        scaler.unscale_(opt)
        opt.step()
    else:
        scaler.step(opt)
    scaler.update()


def _batch(g, scale=1.0):
    return torch.randn(16, 8, generator=g) * scale, torch.randn(16, 4, generator=g)


def test_scaler_skips_are_counted_not_dumped(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # too large: the first steps overflow fp16
    g = torch.Generator().manual_seed(0)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir, capacity=16) as rec:
        for _ in range(12):
            _amp_step(model, opt, scaler, rec, _batch(g))
        skipped = [r.step for r in rec.ring if r.scaler_skipped]
        assert rec.scaler_skips >= 4
        assert rec.step == 12  # skipped steps are steps too
        assert rec.bundles == [] and rec.nonfinite_steps == []
        assert scaler.get_scale() < 2.0**24
        assert rec.ring[-1].autocast == {"device_type": "cpu", "dtype": "float16"}
        assert len(skipped) == rec.scaler_skips and skipped[:4] == [0, 1, 2, 3]
        assert all(r.finite is (not r.scaler_skipped) for r in rec.ring)
    assert "update" not in vars(scaler)  # close() gave the scaler its own update back


def _overflowing_mlp():
    model = models.make_mlp()
    with torch.no_grad():
        model.fc1.weight.fill_(0.25)  # 8 inputs of 5e4: 1e5 per output, beyond fp16's 65504
    return model


def test_scale_collapse_is_dumped_and_replays_with_the_scaler(out_dir):
    model = _overflowing_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.full((16, 8), 5e4), torch.randn(16, 4)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir, min_scale=16.0) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for _ in range(10):
                _amp_step(model, opt, scaler, rec, (x.clone(), y))
    err = info.value
    # scales 256, 128, 64, 32, 16 are skipped; the fifth skip leaves 8 < 16
    assert err.step == 4 and rec.scaler_skips == 5
    assert "the GradScaler's scale collapsed to 8, below min_scale=16" in str(err)
    with open_bundle(err.bundle_path) as b:
        assert b.state().extra["scaler"]["scale"] == 16.0  # the scale the failing step ran with
        assert b.meta["reason"]["scaler_failure"] == "scale collapsed"
        assert b.meta["reason"]["scaler"]["skipped"] is True
        assert b.meta["reason"]["scaler"]["grads_unscaled"] is True
        assert b.step(4).autocast == {"device_type": "cpu", "dtype": "float16"}
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "fc1"  # the fp16 overflow


def test_consecutive_skips_are_dumped(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")  # 2**16
    g = torch.Generator().manual_seed(1)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir, max_scaler_skips=3, min_scale=0.0) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for _ in range(10):
                x, y = _batch(g)
                x[5, 2] = float("nan")  # a corrupt sample in every batch: no scale helps
                _amp_step(model, opt, scaler, rec, (x, y))
    err = info.value
    assert err.step == 3 and rec.scaler_skips == 4
    assert "skipped 4 consecutive steps, more than max_scaler_skips=3" in str(err)
    with open_bundle(err.bundle_path) as b:
        assert b.state().extra["scaler"]["scale"] == 2.0**13
    diag = replay(err.bundle_path)
    assert diag["phase"] == "input" and diag["origin"]["samples"] == [5]
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_nonfinite_after_unscale_without_skip_is_dumped(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    g = torch.Generator().manual_seed(2)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        for _ in range(2):
            _amp_step(model, opt, scaler, rec, _batch(g), bypass=True)
        x, y = _batch(g)
        x[1, 0] = float("inf")
        with pytest.raises(NonFiniteGradientError) as info:
            _amp_step(model, opt, scaler, rec, (x, y), bypass=True)
    err = info.value
    assert err.step == 2 and rec.scaler_skips == 0
    assert str(err).startswith("non-finite gradients after unscaling, and the GradScaler did not skip the step at step 2")
    with open_bundle(err.bundle_path) as b:
        assert b.meta["reason"]["scaler"] == {**b.meta["reason"]["scaler"], "skipped": False, "grads_unscaled": True}
        assert b.state().extra["scaler"]["scale"] == 2.0**4
    diag = replay(err.bundle_path)  # scales the replayed loss by 16, unscales the gradients
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_bf16_nonfinite_is_a_real_failure_and_replays_under_autocast(out_dir):
    model = models.make_ratio()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_ratio, out_dir=out_dir) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for step in range(4):
                x = torch.randn(6, 8, generator=g)
                if step == 2:
                    x[0] = 0.0
                rec.record({"x": x})
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = models.mean_loss(model, {"x": x})
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert err.step == 2
    with open_bundle(err.bundle_path) as b:
        assert b.step(2).autocast == {"device_type": "cpu", "dtype": "bfloat16"}
        assert "scaler" not in b.meta["reason"]
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "norm"


def test_scaler_must_be_a_gradscaler(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match=r"scaler must be a torch.amp.GradScaler \(expected a method update\(\)\), got object"):
        Recorder(model, opt, scaler=object(), out_dir=out_dir)
