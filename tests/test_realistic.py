"""The Recorder on realistic training code: CNNs with BatchNorm and in-place ReLUs, Transformer
encoders with padding masks, tied-weight RNN language models, frozen parameters, param groups,
schedulers, gradient accumulation, multi-output models, validation passes, skip/close.

Each test checks that the recorder leaves training alone, raises on the first non-finite step,
writes a bundle, and that the in-process diagnosis and the replay from the file name the right
phase, module and op and say the failure was reproduced exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import realistic_models as rm
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay


def _state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _images(step: int, n: int = 8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


# -- 1. ResNet-style CNN: BatchNorm running stats, ReLU(inplace=True), in-place residual add ----------
def _train_resnet(out_dir, *, poison=None, recorder=True, steps=5, seen=None):
    model = rm.make_resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rec = Recorder(model, opt, loss_fn=rm.ce_loss, model_factory=rm.make_resnet, out_dir=out_dir) if recorder else None
    seen = {} if seen is None else seen
    try:
        for step in range(steps):
            x, y = _images(step)
            if step == 3 and poison == "input":
                x[2, 1, 4, 4] = float("nan")  # one corrupt pixel in sample 2
            if step == 3 and poison == "dead channel":
                with torch.no_grad():  # channel 4 dies after head_bn's ReLU: its energy is 0, log(0) = -Inf
                    model.head_bn.weight[4] = 0.0
                    model.head_bn.bias[4] = -1.0
            if step == 3:
                seen["running_mean"] = model.stem[1].running_mean.clone()
            if rec is not None:
                rec.record((x, y))
            loss = rm.ce_loss(model, (x, y))
            if rec is not None:
                rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return model


def test_resnet_recorder_leaves_training_bit_identical(out_dir):
    with_rec = _train_resnet(out_dir)
    without = _train_resnet(out_dir, recorder=False)
    _assert_same_state(_state(with_rec), _state(without))  # weights and BatchNorm running stats
    assert not out_dir.exists()  # no false alarm


def test_resnet_nan_pixel_is_bad_input_and_bundle_keeps_step_start_running_stats(out_dir):
    with pytest.raises(NonFiniteGradientError) as info:
        _train_resnet(out_dir, poison="input")
    err = info.value
    assert err.step == 3 and Path(err.bundle_path).is_file()
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "input"
        assert diag["origin"]["leaf"] == "batch[0]" and diag["origin"]["samples"] == [2]
        assert diag["reproduction"]["verdict"] == "reproduced exactly"
    with open_bundle(err.bundle_path) as b:
        stats = b.state().buffers["stem.1.running_mean"]
    # the forward of step 3 wrote NaN into the running mean; the bundle holds its step-start value
    assert torch.isfinite(stats).all()


def test_resnet_log_of_dead_channel_is_born_in_the_custom_block(out_dir):
    seen = {}
    with pytest.raises(NonFiniteGradientError) as info:
        _train_resnet(out_dir, poison="dead channel", seen=seen)
    err = info.value
    with open_bundle(err.bundle_path) as b:  # step-start running stats, not the ones step 3's forward wrote
        assert torch.equal(b.state().buffers["stem.1.running_mean"], seen["running_mean"])
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "forward"
        o = diag["origin"]
        assert (o["module"], o["class"], o["op"], o["nonfinite"]) == ("pool", "LogEnergyPool", "log", "-Inf")
        assert o["source"]["code"] == "return torch.log(x.pow(2).mean(dim=(2, 3)))"
        assert diag["reproduction"]["verdict"] == "reproduced exactly"
