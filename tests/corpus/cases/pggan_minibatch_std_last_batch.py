"""A minibatch-stddev layer is NaN on a last batch of one image. The PGGAN/StyleGAN discriminator
appends the standard deviation of features across the batch; with a dataset of 17 images, batches
of 8 and drop_last=False, the third batch holds one image and torch.std over a batch of one is
0/0 = NaN, inside the discriminator's forward pass."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/ziwei-jiang/PGGAN-PyTorch/issues/1"
EXPECTED = dict(step=2, phase="forward", module="mbstd", op=("std", "std_mean", "var"), samples=None, cause="bad input data")
TAGS = ("forward", "batch-of-one", "float32", "gan", "std")
RECORDER = dict()


class MinibatchStd(nn.Module):
    def forward(self, x):
        std = torch.std(x, dim=0).mean()                     # one statistic for the whole batch
        return torch.cat([x, std.expand(x.shape[0], 1, *x.shape[2:])], dim=1)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.LeakyReLU(0.2))
        self.mbstd = MinibatchStd()
        self.out = nn.Sequential(nn.Conv2d(9, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 8 * 8, 1))

    def forward(self, x):
        return self.out(self.mbstd(self.conv(x)))


def make_model():
    torch.manual_seed(0)
    return Discriminator()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.0, 0.99))


def loss_fn(model, batch):
    real, fake = batch
    return nn.functional.softplus(-model(real)).mean() + nn.functional.softplus(model(fake)).mean()


def batches():
    g = torch.Generator().manual_seed(10)
    images = torch.rand(17, 1, 8, 8, generator=g) * 2 - 1
    out = []
    for i in range(0, 17, 8):
        real = images[i:i + 8]
        fake = torch.randn(real.shape, generator=g).clamp(-1, 1)  # the generator's samples, fixed here
        out.append((real, fake))
    return out
