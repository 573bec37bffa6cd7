"""The counterfactual replay with other random draws (``counterfactuals.persists_with_other_draws``):
a birth whose operand derives from the step's draws is replayed with the recorded RNG states
replaced, and the evidence says whether the draws decide it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import fail_within
from nanreplay import NonFiniteGradientError, Recorder, replay


class DroppedRow(nn.Module):
    """Dropout, then each row divided by its sum: a row whose every unit is dropped is 0 / 0."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(8, 4), nn.Dropout(0.5), nn.Linear(4, 3)

    def forward(self, x):
        h = self.drop(F.softplus(self.fc(x)))
        return self.head(h / h.sum(-1, keepdim=True))


class ZeroRowWithDropout(nn.Module):
    """The divisor is the batch row's sum (0 for an all-zero row) plus 0 times a dropout branch: it
    derives from random draws, yet the data alone decide its zero."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x):
        div = x.abs().sum(-1, keepdim=True) + 0.0 * self.drop(self.fc(x)).sum(-1, keepdim=True)
        return self.head(x / div)


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _fail(cls, out_dir, zero_row: bool):
    torch.manual_seed(0)
    model = cls()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(200)]
    if zero_row:
        batches[3][0][2] = 0.0
    return fail_within(model, torch.optim.SGD(model.parameters(), lr=0.01), batches, _loss, out_dir, diagnose=False)


def test_a_zero_made_by_the_dropout_mask_is_put_down_to_the_steps_draws(tmp_path):
    err = _fail(DroppedRow, tmp_path, zero_row=False)
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly" and diag["origin"]["op"] == "div"
    assert diag["counterfactuals"]["persists_with_other_draws"] is False
    ev = "\n".join(diag["classification"]["evidence"])
    assert "random draws" in ev and "replayed with other random draws (the step's recorded RNG states replaced) the op is finite" in ev
    assert "the step's random draws are its trigger" in ev and "the samples are its trigger" not in ev


def test_a_zero_the_data_makes_persists_with_other_draws(tmp_path):
    err = _fail(ZeroRowWithDropout, tmp_path, zero_row=True)
    assert err.step == 3
    diag = replay(err.bundle_path)
    assert diag["origin"]["op"] == "div" and diag["samples"]["indices"] == [2]
    assert diag["counterfactuals"]["persists_with_other_draws"] is True
    assert "with other random draws the same op still gives a non-finite value" in "\n".join(diag["classification"]["evidence"])


def test_no_draws_no_replay_with_other_draws(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4)
    x[1] = 0.0
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, out_dir=tmp_path, diagnose=False) as rec:
            rec.record((x,))
            out = model(x)
            loss = (out / x.abs().sum(-1, keepdim=True)).mean()  # 0 / 0 in the loss, no random draw anywhere
            rec.log_loss(loss)
            loss.backward()
            opt.step()
    diag = replay(info.value.bundle_path)
    assert diag["counterfactuals"]["persists_with_other_draws"] is None  # not run: nothing derives from random draws
