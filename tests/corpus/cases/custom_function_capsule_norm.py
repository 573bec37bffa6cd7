"""A custom autograd.Function for a vector norm divides by zero in backward. A capsule network's
squash uses a hand-written `VecNorm` autograd.Function (forward: ||s||, backward:
grad * s / ||s||) to save memory. A blank input image produces all-zero capsule vectors (the
primary capsules have no bias), and the Function's backward computes 0 / 0 = NaN for them."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/2721"
EXPECTED = dict(step=1, phase="backward", module="caps", op=("div", "VecNorm", "vec_norm"), samples=[3], cause="numerics")
TAGS = ("backward", "custom-function", "float32", "capsules", "norm")
RECORDER = dict()


class VecNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s):
        n = s.pow(2).sum(-1, keepdim=True).sqrt()
        ctx.save_for_backward(s, n)
        return n

    @staticmethod
    def backward(ctx, grad):
        s, n = ctx.saved_tensors
        return grad * s / n


class PrimaryCaps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 6 * 4, bias=False)

    def forward(self, x):
        s = self.proj(x).view(x.shape[0], 6, 4)
        n = VecNorm.apply(s)
        return (n ** 2 / (1 + n ** 2)) * s / (n + 1e-8)   # squash


class CapsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.caps = PrimaryCaps()
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(self.caps(x).flatten(1))


def make_model():
    torch.manual_seed(0)
    return CapsNet()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def batches():
    g = torch.Generator().manual_seed(22)
    out = []
    for step in range(3):
        x = torch.rand(6, 16, generator=g)
        y = torch.randint(0, 3, (6,), generator=g)
        if step == 1:
            x[3] = 0.0   # a blank (all-black) image
        out.append((x, y))
    return out
