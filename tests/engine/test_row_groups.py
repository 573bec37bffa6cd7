"""A birth whose output merges the batch with the dimensions after it (``[B * T, d]``: ``F.linear``
of a 3-d input runs ``addmm`` on a reshape) names its samples from its rows, as a birth whose
output keeps the batch dimension does, instead of replaying samples one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import fail_once
from nanreplay import replay
from nanreplay.engine.monitors import Fact, row_groups


def _fact(groups=None) -> Fact:
    return Fact(False, False, 0.0, frozenset(), "const", row_groups=groups)


@pytest.mark.parametrize("shape, new, groups", [
    ((4, 3, 5), (12, 5), (4, 3)),           # F.linear of [B, T, d]
    ((4, 2, 3, 5), (8, 3, 5), (4, 2)),      # attention heads: [B, H, T, D] -> [B * H, T, D]
    ((4, 2, 3, 5), (24, 5), (4, 6)),
    ((4, 3, 5), (4, 15), None),             # dimension 0 kept: nothing merged into it
    ((4, 3, 5), (2, 30), None),             # dimension 0 split: its rows hold two samples each
    ((6, 5), (5, 6), None),                 # not a multiple
])
def test_a_reshape_that_merges_leading_dimensions_groups_its_rows(shape, new, groups):
    x = torch.randn(shape)
    assert row_groups("view", [x], [_fact()], x.reshape(new)) == groups
    assert row_groups("add", [x], [_fact()], x + 1) is None  # only reshapes group rows


def test_chained_reshapes_keep_the_rows_of_the_first_tensor():
    x = torch.randn(4, 2, 3, 5)
    y = x.reshape(8, 3, 5)
    g = row_groups("_unsafe_view", [x], [_fact()], y)
    assert row_groups("view", [y], [_fact(g)], y.reshape(24, 5)) == (4, 6)  # row r of [24, 5] is in row r // 6 of x
    assert row_groups("view", [y], [_fact(g)], y.reshape(8, 15)) == (4, 2)  # dimension 0 unchanged: the grouping carries on


class SeqLinear(nn.Module):
    """A Linear over a [B, T, d] sequence whose weights are all 1: a token of 3e38s overflows
    float32 in every output of that token, the other tokens stay finite."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)

    def forward(self, x):
        return self.fc(x)


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def test_a_birth_in_merged_rows_names_the_sample_without_per_sample_replays(out_dir):
    x = torch.randn(4, 3, 4)
    x[2, 1] = 3e38  # sample 2, token 1: row 2 * 3 + 1 of addmm's [12, 4] output
    model = SeqLinear()
    err = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, torch.randn(4, 3, 4)), _mse, out_dir, model_factory=SeqLinear)
    diag = replay(err.bundle_path)
    assert (diag["phase"], diag["origin"]["op"], diag["origin"]["module"]) == ("forward", "addmm", "fc")
    birth = diag["births"][0]
    assert birth["rows"] == {"size": 4, "dim": 0, "count": 1, "indices": [2], "rows_per_sample": 3}
    assert diag["samples"]["method"] == "non-finite rows of the producer op's output" and diag["samples"]["indices"] == [2]
    assert "runs" not in diag["samples"]  # no sample was replayed alone
    assert diag["origin"]["samples"] == [2]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, x):
        return self.head(self.emb(x))


def _lm_loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_a_loss_over_merged_rows_with_no_target_is_a_batch_statistic_without_per_sample_replays(out_dir):
    from nanreplay import NonFiniteGradientError, Recorder

    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randint(0, 11, (3, 5)), torch.full((3, 5), -100))  # every target is padding: the mean over 0 targets is NaN
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=_lm_loss, model_factory=TinyLM, out_dir=out_dir, diagnose=False) as rec:
            rec.record(batch)
            loss = _lm_loss(model, batch)
            rec.log_loss(loss)
            loss.backward()
            opt.step()
    diag = replay(ei.value.bundle_path)
    assert (diag["phase"], diag["origin"]["op"]) == ("loss", "nll_loss_forward")
    smp = diag["samples"]
    assert smp["method"] == "batch-level" and smp["batch_level"] is True and "runs" not in smp
    assert "3 samples x 5 rows" in smp["reason"] and "a statistic of the 3 samples together" in smp["reason"]
    assert diag["classification"]["fix"]["verified"] is True
