"""log(softmax(x)) underflows to log(0) = -inf in half precision. A classifier run in float16
(model.half()) computes its loss as -log(softmax(logits))[target] instead of log_softmax. When
the target class's logit is ~25 below the largest one, its softmax probability (~1e-11) rounds to
0 in float16 and log(0) = -inf: the loss is Inf and the gradients NaN. log_softmax, or float32,
keeps it finite."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/1620"
EXPECTED = dict(step=2, phase="loss", module=None, op="log", samples=[5], cause="underflow")
TAGS = ("loss", "log-softmax-underflow", "half", "float16", "underflow")
RECORDER = dict()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 6)).half()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=1e-2)


def loss_fn(model, batch):
    x, y = batch
    prob = torch.softmax(model(x), dim=-1)
    return -torch.log(prob.gather(1, y[:, None])).float().mean()


def batches():
    g = torch.Generator().manual_seed(18)
    probe = make_model().float()
    out = []
    for step in range(4):
        x = torch.randn(8, 10, generator=g)
        y = torch.randint(0, 6, (8,), generator=g)
        if step == 2:
            x[5] = 80.0 * torch.randn(10, generator=g)  # a mislabelled, out-of-range sample
            with torch.no_grad():
                y[5] = probe(x[5:6]).argmin(1)          # its label is the class the model finds least likely
        out.append((x.half(), y))
    return out
