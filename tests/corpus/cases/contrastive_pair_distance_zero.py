"""Hand-written Euclidean distance has a NaN gradient at zero distance. A Siamese network trained
with the contrastive (Hadsell) loss computes d = sqrt(sum((a - b)**2)) itself, as many metric-learning
repositories do (torch.cdist's own zero-distance gradient was fixed, hand-written ones were not). A
pair of identical images (a duplicate in the dataset) gives d = 0: SqrtBackward divides by 0 and
the chain rule multiplies by (a - b) = 0, so the gradient of that pair is NaN."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/37154"
EXPECTED = dict(step=2, phase="backward", module=None, op="sqrt", samples=[5], cause="numerics")
TAGS = ("backward", "cdist-norm", "float32", "metric-learning", "duplicate-data")
RECORDER = dict()

MARGIN = 1.0


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def pair_distance(a, b):
    return ((a - b) ** 2).sum(dim=1).sqrt()


def loss_fn(model, batch):
    x1, x2, same = batch
    d = pair_distance(model(x1), model(x2))
    pos = same * d.pow(2)
    neg = (1 - same) * torch.clamp(MARGIN - d, min=0).pow(2)
    return (pos + neg).mean() / 2


def batches():
    g = torch.Generator().manual_seed(2)
    out = []
    for step in range(4):
        x1 = torch.randn(8, 16, generator=g)
        x2 = x1 + 0.3 * torch.randn(8, 16, generator=g)
        same = (torch.arange(8) % 2 == 0).float()
        if step == 2:
            x2[5] = x1[5]  # the same image twice: a duplicate that survived deduplication
        out.append((x1, x2, same))
    return out
