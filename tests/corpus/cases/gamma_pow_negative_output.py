"""A fractional power of a negative value is NaN. An image-enhancement network applies gamma
correction out ** (1/2.2) to its output, which is a residual prediction that is not clamped to
[0, 1]; on dark images the residual pushes some pixels below 0, and a negative base to a
fractional power is NaN."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/TorchIO-project/torchio/issues/306"
EXPECTED = dict(step=1, phase="forward", module="gamma", op="pow", samples=[0, 2], cause="numerics")
TAGS = ("forward", "float32", "vision", "pow")
RECORDER = dict()


class Gamma(nn.Module):
    def forward(self, x):
        return x.pow(1 / 2.2)


class Enhancer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.res = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1))
        self.gamma = Gamma()

    def forward(self, img):
        return self.gamma(img + 0.05 * self.res(img))


def make_model():
    torch.manual_seed(0)
    model = Enhancer()
    with torch.no_grad():
        model.res[2].bias.fill_(-0.2)   # the residual darkens slightly: fine on normal images
    return model


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    img, ref = batch
    return nn.functional.l1_loss(model(img), ref)


def batches():
    g = torch.Generator().manual_seed(35)
    out = []
    for step in range(3):
        img = 0.3 + 0.7 * torch.rand(4, 3, 8, 8, generator=g)
        if step == 1:
            img[0] = 0.0          # a black frame
            img[2, :, :4] = 0.0   # a frame whose top half is black
        ref = img.clamp(min=1e-3) ** (1 / 2.2)
        out.append((img, ref))
    return out
