"""Focal loss with gamma < 1 has a NaN gradient on a saturated prediction. The binary focal loss
multiplies BCE by (1 - p_t) ** gamma; with gamma = 0.5 the derivative 0.5 * (1 - p_t) ** -0.5 is
infinite when p_t == 1. A very confident, correct prediction (logit ~ 60: sigmoid is exactly 1.0
even in float64) gives PowBackward = Inf, and the sigmoid's zero derivative turns it into NaN. The
zero 1 - p_t is the batch's doing: the very bright sample keeps it 0 whatever the exact weights
(it stays 0 with every weight perturbed), so the cause is the batch meeting a formula with no
margin at 0."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/kornia/kornia/issues/918"
EXPECTED = dict(step=2, phase="backward", module=None, op="pow", samples=[4], cause="numerics")
TAGS = ("backward", "focal", "float32", "detection", "saturation")
RECORDER = dict()

GAMMA, ALPHA = 0.5, 0.25


def make_model():
    torch.manual_seed(0)
    return nn.Linear(8, 1)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)


def focal_loss(logits, target):
    p = torch.sigmoid(logits)
    bce = nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    alpha_t = ALPHA * target + (1 - ALPHA) * (1 - target)
    return (alpha_t * torch.pow(1 - p_t, GAMMA) * bce).mean()


def loss_fn(model, batch):
    x, y = batch
    return focal_loss(model(x).squeeze(1), y)


def batches():
    g = torch.Generator().manual_seed(14)
    sign = torch.sign(make_model().weight.detach()[0])
    out = []
    for step in range(4):
        x = torch.randn(8, 8, generator=g)
        y = (torch.rand(8, generator=g) > 0.5).float()
        if step == 2:
            x[4] = 40.0 * sign  # an easy, very bright positive: the detector is certain
            y[4] = 1.0
        out.append((x, y))
    return out
