"""sqrt at 0 in a hand-written L2 normalisation gives NaN gradients, and clip_grad_norm_ spreads
them to every parameter. An embedding head applies dropout to a 4-d projection and normalises with
x / (sqrt(sum(x**2)) + 1e-8): the epsilon keeps the forward pass finite, but when dropout zeroes
all four units of a sample (x = 0), SqrtBackward divides by 0 and the chain rule multiplies by x = 0:
NaN. The loop clips gradients with clip_grad_norm_, whose total norm is then NaN and which
multiplies every gradient by NaN. Which sample and step depend on the dropout RNG stream."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/keras-team/keras/issues/23075"
EXPECTED = dict(step=0, phase="backward", module="l2norm", op="sqrt", samples=[5], cause="numerics")
TAGS = ("backward", "clip-grad-norm", "float32", "metric-learning", "norm", "dropout-rng")
RECORDER = dict()


class L2Norm(nn.Module):
    def forward(self, x):
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-8)


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 4)
        self.drop = nn.Dropout(0.5)
        self.l2norm = L2Norm()
        self.cls = nn.Linear(4, 3)

    def forward(self, x):
        return self.cls(self.l2norm(self.drop(self.fc(x))) * 8.0)


def make_model():
    torch.manual_seed(0)
    return Embedder()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train_step(model, optimizer, batch, recorder, step):
    recorder.record(batch)
    loss = loss_fn(model, batch)
    recorder.log_loss(loss)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()


def batches():
    g = torch.Generator().manual_seed(23)
    return [(torch.randn(6, 10, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(8)]
