"""acos of a cosine similarity that rounds past 1 is NaN. A surface-normal refiner is trained with
the angular error acos(cos_sim(pred, target)). The refiner is residual with a zero-initialised last
layer, so at the start pred equals the input normal; for a sample whose target equals the input (no
correction needed) cosine_similarity(x, x) evaluates to 1.0000001 in float32 for some vectors, and
acos of it is NaN."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/78064"
EXPECTED = dict(step=0, phase="loss", module=None, op="acos", samples=[3], cause="numerics")
TAGS = ("loss", "acos", "float32", "geometry", "rounding")
RECORDER = dict()


class NormalRefiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 3))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, n):
        return n + self.mlp(n)


def make_model():
    torch.manual_seed(0)
    return NormalRefiner()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    n_in, n_gt = batch
    cos = nn.functional.cosine_similarity(model(n_in), n_gt, dim=-1)
    return torch.acos(cos).mean()


def batches():
    g = torch.Generator().manual_seed(13)
    torch.randn(8, 6, generator=g)  # (skip a draw: the vectors below are ones that round past 1)
    out = []
    for step in range(3):
        n_in = torch.randn(8, 3, generator=g)
        n_gt = n_in + 0.2 * torch.randn(8, 3, generator=g)
        n_gt[3] = n_in[3]   # a surface where the input normal is already right
        out.append((n_in, n_gt))
    return out
