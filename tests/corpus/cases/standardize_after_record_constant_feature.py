"""Per-batch standardisation after `record` divides a constant feature by a zero std. A tabular
classifier's loop calls `rec.record((x, y))` and only then standardises `x` per batch,
`(x - x.mean(0)) / x.std(0)`, before the cross-entropy loss. In step 2 one feature is constant
across the batch (a sensor stuck at its default value), its std is 0 and the whole column becomes
0/0 = NaN. The replay feeds the recorded (raw, finite) batch to the loss function, so the step
replays finite; the model's recorded forward inputs hold the NaN: the fault is in the code
between `record` and the model, and the inputs the model saw are invalid."""

import torch
import torch.nn as nn

SOURCE = "https://discuss.pytorch.org/t/nan-when-normalizing-data-with-zero-standard-deviation/69624"
EXPECTED = dict(step=2, phase="input", module=None, op=None, samples=None, cause="bad input data")
TAGS = ("input", "float32", "tabular", "preprocessing-after-record")
RECORDER = dict()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train_step(model, optimizer, batch, recorder, step):
    x, y = batch
    recorder.record((x, y))
    x = (x - x.mean(0)) / x.std(0)  # the user's preprocessing, after record
    loss = loss_fn(model, (x, y))
    recorder.log_loss(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(4):
        x = torch.randn(8, 5, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        if step == 2:
            x[:, 2] = 1.0  # a stuck sensor: the feature is constant in this batch
        out.append((x, y))
    return out
