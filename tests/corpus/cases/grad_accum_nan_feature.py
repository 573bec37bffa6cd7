"""A missing value read as NaN poisons a gradient-accumulation step. A tabular regressor is trained
from a CSV whose empty cells become NaN when converted to a tensor; one row of the second
micro-batch of step 2 has a missing feature, so that micro-batch's loss and the accumulated
gradients are NaN. The NaN is in the data before any code runs."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/timeseriesAI/tsai/issues/506"
EXPECTED = dict(step=2, phase="input", module=None, op=None, samples=[5], cause="bad input data")
TAGS = ("input", "grad-accumulation", "float32", "tabular", "missing-values")
RECORDER = dict()

ACCUM = 2


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(1), y)


def train_step(model, optimizer, batch, recorder, step):
    for micro in batch:
        recorder.record(micro)
        loss = loss_fn(model, micro) / ACCUM
        recorder.log_loss(loss)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def batches():
    g = torch.Generator().manual_seed(8)
    out = []
    for step in range(4):
        micro_batches = []
        for m in range(ACCUM):
            x = torch.randn(8, 6, generator=g)
            y = x[:, 0] - 0.5 * x[:, 3] + 0.1 * torch.randn(8, generator=g)
            if step == 2 and m == 1:
                x[5, 4] = float("nan")  # an empty cell in the CSV
            micro_batches.append((x, y))
        out.append(micro_batches)
    return out
