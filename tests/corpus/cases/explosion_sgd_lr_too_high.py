"""Too high a learning rate makes the weights grow step over step until the loss overflows. A
linear regressor on 2048 features is overfitted on a small fixed set with SGD at a learning rate
above 2 / (largest curvature): each step multiplies the error by ~3.6. For a few steps before the
end, the gradients are still finite but their 2-norm already overflows float32 (sum of squares >
3.4e38): the run goes on. Then the MSE itself overflows to Inf: a non-finite value born from
operands that grew over many steps (the grad-norm history shows it)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/keras-team/keras/issues/5127"
EXPECTED = dict(step=34, phase="loss", module=None, op=("mse_loss", "pow", "mean", "sum"), samples=None, cause="explosion")
TAGS = ("loss", "explosion", "float32", "regression", "norm-overflow")
RECORDER = dict(capacity=8)

D = 2048


def make_model():
    torch.manual_seed(0)
    return nn.Linear(D, 1)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(1), y)


def batches():
    g = torch.Generator().manual_seed(28)
    x = torch.randn(16, D, generator=g) * 4.0
    return [(x, x[:, 0])] * 40   # the same small set every step
