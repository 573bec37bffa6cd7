"""A mixture density network's likelihood underflows to 0 before the log. The MDN loss is computed
as -log(sum_k pi_k * N(y | mu_k, sigma_k)) in probability space. For a target ~30 standard
deviations from every component, each Gaussian density is ~exp(-450), which is 0 in float32 (but
~1e-196 in float64): the sum is 0 and log(0) = -inf, so the loss is Inf."""

import math

import torch
import torch.nn as nn

SOURCE = "https://github.com/keras-team/keras/issues/2586"
EXPECTED = dict(step=1, phase="loss", module=None, op="log", samples=[7], cause="underflow")
TAGS = ("loss", "float32", "underflow", "mixture-density")
RECORDER = dict()

K = 3


class MDN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.pi = nn.Linear(32, K)
        self.mu = nn.Linear(32, K)
        self.log_sigma = nn.Linear(32, K)

    def forward(self, x):
        h = self.body(x)
        return torch.softmax(self.pi(h), -1), self.mu(h), self.log_sigma(h).exp()


def make_model():
    torch.manual_seed(0)
    return MDN()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    pi, mu, sigma = model(x)
    z = (y[:, None] - mu) / sigma
    density = torch.exp(-0.5 * z ** 2) / (sigma * math.sqrt(2 * math.pi))
    return -torch.log((pi * density).sum(-1)).mean()


def batches():
    g = torch.Generator().manual_seed(33)
    out = []
    for step in range(3):
        x = torch.randn(8, 4, generator=g)
        y = torch.randn(8, generator=g)
        if step == 1:
            y[7] = 30.0   # a sensor glitch in the target column
        out.append((x, y))
    return out
