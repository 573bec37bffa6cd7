"""Non-finite rows of a lookup table name the samples that looked them up (issue 19, item 2):
the weights were non-finite before the Recorder attached (a loaded checkpoint), so the cause is
unknown to the recording, but the samples (and micro-batch) whose indices reach the bad rows are
the trigger, found by one replay that watches every lookup reading the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NonFiniteGradientError, Recorder, replay

VOCAB, RARE, ACCUM = 40, 37, 2


class Bag(nn.Module):
    """A functional lookup (``F.embedding`` on a raw parameter, no ``nn.Embedding`` module)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, 8) * 0.1)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(tokens, self.table).mean(1))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = Bag()
    state = model.state_dict()
    state["table"][RARE] = float("inf")  # the checkpoint the run resumes from
    model.load_state_dict(state)
    return model


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    tokens, y = batch
    return F.cross_entropy(model(tokens), y)


def _batches():
    g = torch.Generator().manual_seed(3)
    steps = []
    for step in range(7):
        micro = []
        for m in range(ACCUM):
            tokens = torch.randint(0, 30, (4, 5), generator=g)  # common tokens only
            if step == 5 and m == 1:
                tokens[2, 4] = RARE  # the rare token's first appearance: micro-batch 1, sample 2
            micro.append((tokens, torch.randint(0, 3, (4,), generator=g)))
        steps.append(micro)
    return steps


def _record(out_dir, **opts) -> NonFiniteGradientError:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Recorder(model, opt, loss_fn=loss_fn, model_factory=make_model, out_dir=out_dir, **opts) as rec:
        for micro in _batches():
            for mb in micro:
                rec.record(mb)
                loss = loss_fn(model, mb) / ACCUM
                rec.log_loss(loss)
                loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                return e
            opt.zero_grad()
    raise AssertionError("no step failed")


@pytest.mark.parametrize("snapshot_every", [0, 1])
def test_the_samples_that_looked_up_a_nonfinite_embedding_row_are_named(out_dir, snapshot_every):
    err = _record(out_dir, snapshot_every=snapshot_every, embed_program=False)
    assert err.step == 5
    for diag in (err.diagnosis, replay(err.bundle_path, samples=False)):
        assert diag["phase"] == "weights" and diag["origin"]["tensor"] == "table"
        assert diag["history"]["weights_nonfinite_since"] == "before recording"
        assert diag["classification"]["cause"] == "unknown"  # no recorded update made it non-finite
        smp = diag["samples"]
        assert (smp["indices"], smp["micro_batch"], smp["rows"], smp["batch_size"]) == ([2], 1, [RARE], 4)
        assert smp["method"] == "samples whose indices look up non-finite embedding rows"
        assert f"rows [{RARE}] of table are non-finite; the embedding lookups of step 5 read them for samples [2] of micro-batch 1" \
            in diag["classification"]["evidence"]
        assert diag["classification"]["trigger"]["samples"] == [2]
        assert "samples [2]" in diag["summary"]


def test_a_nonfinite_weight_that_is_not_a_lookup_table_names_no_sample(out_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 2] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, embed_program=False) as rec:
        with pytest.raises(NonFiniteGradientError):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
    assert rec.last_diagnosis["phase"] == "weights" and rec.last_diagnosis["samples"] is None
