"""The backward of logsumexp over a row of -Inf is NaN in a log-space forward algorithm. A
left-to-right HMM aligner (the same recursion as a hand-written CTC) keeps log-probabilities with
-Inf as log(0): an utterance whose first frame may only be the first state leaves the later states
unreachable for a few frames. The forward pass is finite: logsumexp over an all -Inf row is -Inf,
which adds nothing to the total. Its derivative is not: exp(-Inf - (-Inf)) is NaN, multiplied by a
zero gradient it stays NaN and reaches the emissions. The -Inf row is a valid state of the
recursion and the utterance is valid data: the fix is a safe logsumexp (or finfo.min for log 0),
and the utterance is the trigger."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/31829"
EXPECTED = dict(step=1, phase="backward", module=None, op="logsumexp", samples=[2], cause="numerics")
TAGS = ("backward", "float32", "log-space", "logsumexp", "speech", "trigger")
RECORDER = dict()

STATES, FRAMES, FEAT = 4, 6, 5


class Emitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, 16), nn.Tanh(), nn.Linear(16, STATES))

    def forward(self, x):
        return self.net(x).log_softmax(-1)


def make_model():
    torch.manual_seed(0)
    return Emitter()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def loss_fn(model, batch):
    emis = model(batch["x"])  # [B, FRAMES, STATES] log-emissions
    start = batch["start"]    # [B, STATES] bool: states the first frame may be in
    alpha = emis[:, 0].masked_fill(~start, float("-inf"))
    for t in range(1, FRAMES):
        stay = alpha
        move = torch.cat([torch.full_like(alpha[:, :1], float("-inf")), alpha[:, :-1]], dim=1)
        alpha = torch.logsumexp(torch.stack([stay, move], dim=-1), dim=-1) + emis[:, t]
    return -torch.logsumexp(alpha, dim=-1).mean()


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(3):
        start = torch.ones(4, STATES, dtype=torch.bool)
        if step == 1:
            start[2] = torch.tensor([True, False, False, False])  # this utterance starts in the first state only
        out.append({"x": torch.randn(4, FRAMES, FEAT, generator=g), "start": start})
    return out
