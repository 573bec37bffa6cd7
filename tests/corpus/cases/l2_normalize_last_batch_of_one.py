"""The last, one-sample batch of an epoch is a blank input, and L2 normalisation divides it by 0.
A retrieval encoder L2-normalises its input features by hand, `x / x.norm(dim=1, keepdim=True)`,
without an eps. The dataset size leaves a final batch of one sample, and that sample is an
all-zero feature vector (a blank image's pooled features), so the division is 0/0 = NaN. The
data are valid, the formula is not guarded (numerics); with one sample in the batch no sample can
be told from its batch, so the failure is batch-level."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/49289"
EXPECTED = dict(step=2, phase="forward", module="norm", op="div", samples=None, cause="numerics")
TAGS = ("forward", "float32", "batch-of-one", "l2-normalize")
RECORDER = dict()


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=1, keepdim=True)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = L2Normalize()
        self.proj = nn.Linear(6, 4)

    def forward(self, x):
        return self.proj(self.norm(x))


def make_model():
    torch.manual_seed(0)
    return Encoder()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batches():
    g = torch.Generator().manual_seed(2)
    out = [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]
    out.append((torch.zeros(1, 6), torch.randn(1, 4, generator=g)))  # the epoch's last batch: one blank sample
    return out
