"""AcceleratorWatch on a real accelerate.Accelerator (CPU): a plain loop with gradient
accumulation whose loss is NaN in one micro-batch while every gradient stays finite."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import models  # noqa: E402
from nanreplay import NonFiniteGradientError, Recorder, open_bundle  # noqa: E402
from nanreplay.integrations.accelerate import AcceleratorWatch  # noqa: E402


def labelled_mean(model, batch):
    """Summed cross-entropy over the count of labelled rows: 0/0 for a batch with no label."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / (y != -100).sum()


def test_the_loss_each_micro_batch_backpropagates_and_the_norm_before_clipping_reach_the_recorder(tmp_path):
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 8, generator=g) * 10, torch.randint(0, 4, (4,), generator=g)) for _ in range(8)]
    batches[4][1].fill_(-100)  # step 2's first micro-batch: no label
    with torch.no_grad():  # step 0's loss as accelerate backpropagates it: each micro-batch's divided by 2
        step0 = sum(float(labelled_mean(model, batches[i])) / 2 for i in (0, 1))
    own = type(acc).backward, type(acc).clip_grad_norm_
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=labelled_mean, out_dir=tmp_path, diagnose=False) as rec, AcceleratorWatch(acc, rec):
            for batch in batches:
                with acc.accumulate(model):
                    rec.record(batch)
                    acc.backward(labelled_mean(model, batch))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 0.01)
                    opt.step()
                    opt.zero_grad()
    assert "non-finite loss (first in micro-batch 0 of 2) at step 2" in str(info.value)
    assert "backward" not in vars(acc) and "clip_grad_norm_" not in vars(acc)  # the accelerator's own methods are back
    assert (type(acc).backward, type(acc).clip_grad_norm_) == own
    with open_bundle(info.value.bundle_path) as b:
        reason = b.meta["reason"]
        assert reason["nonfinite_loss"] and not reason["nonfinite_grad"] and reason["nonfinite_loss_micro_batch"] == 0
        finite = {k: b.step(k) for k in b.steps if b.step(k).finite}
    # the recorded grad norm is the one before clipping (0.01 clips every step), and the step's loss
    # the sum of its micro-batches' losses
    assert sorted(finite) == [0, 1] and all(r.grad_norm_pre_clip > 0.1 >= r.grad_norm for r in finite.values())
    assert finite[0].loss == pytest.approx(step0, rel=1e-6)
