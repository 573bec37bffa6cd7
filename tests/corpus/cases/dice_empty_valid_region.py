"""A per-sample Dice loss is 0/0 on a crop with no valid pixel. A segmentation loss computes soft
Dice per image over the pixels that are not labelled 'void' (255), with no smoothing term. A
random crop that falls entirely in a void region (an image border, an unlabelled area) has no
valid pixel: intersection and denominator are both 0, its Dice is NaN and so is the batch mean."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/neuronets/nobrainer/issues/8"
EXPECTED = dict(step=3, phase="loss", module=None, op="div", samples=[2], cause="bad input data")
TAGS = ("loss", "dice", "float32", "segmentation", "empty-mask")
RECORDER = dict()

VOID = 255


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def dice_loss(logits, target):
    valid = (target != VOID).float()
    p = torch.sigmoid(logits.squeeze(1)) * valid
    t = (target == 1).float() * valid
    inter = (p * t).flatten(1).sum(1)
    denom = p.flatten(1).sum(1) + t.flatten(1).sum(1)
    return (1 - 2 * inter / denom).mean()


def loss_fn(model, batch):
    img, target = batch
    return dice_loss(model(img), target)


def batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(5):
        img = torch.randn(4, 3, 12, 12, generator=g)
        target = (torch.rand(4, 12, 12, generator=g) > 0.7).long()
        target[:, :2, :] = VOID
        if step == 3:
            target[2] = VOID  # a crop entirely inside an unlabelled region
        out.append((img, target))
    return out
