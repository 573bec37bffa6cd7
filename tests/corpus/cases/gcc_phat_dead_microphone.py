"""GCC-PHAT normalisation divides a zero cross-spectrum by its zero magnitude. A sound-source
localiser computes the PHAT-weighted cross-power spectrum R = X1 * conj(X2) / |X1 * conj(X2)| of
two learned complex filterbank outputs (complex64). When one microphone channel is dead (all
zeros), X2 = 0, the cross-spectrum is 0 and 0 / 0 = NaN in every bin of that sample."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/eembc/audiomark/pull/92"
EXPECTED = dict(step=1, phase="forward", module="phat", op="div", samples=[2], cause="numerics")
TAGS = ("forward", "complex64", "complex-mul", "conj", "abs", "audio")
RECORDER = dict()

BINS = 16


class Phat(nn.Module):
    def forward(self, x1, x2):
        cross = x1 * x2.conj()
        return cross / cross.abs()


class Localiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.filt = nn.Parameter(torch.randn(BINS, dtype=torch.complex64) * 0.5 + 1.0)
        self.phat = Phat()
        self.head = nn.Linear(2 * BINS, 8)

    def forward(self, spec1, spec2):
        r = self.phat(spec1 * self.filt, spec2 * self.filt)
        return self.head(torch.cat([r.real, r.imag], -1))


def make_model():
    torch.manual_seed(0)
    return Localiser()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    spec1, spec2, doa = batch
    return nn.functional.cross_entropy(model(spec1, spec2), doa)


def batches():
    g = torch.Generator().manual_seed(34)
    out = []
    for step in range(3):
        spec1 = torch.complex(torch.randn(4, BINS, generator=g), torch.randn(4, BINS, generator=g))
        spec2 = spec1 * torch.exp(1j * torch.rand(4, 1, generator=g) * torch.arange(BINS))
        if step == 1:
            spec2[2] = 0   # the second microphone of this recording was dead
        doa = torch.randint(0, 8, (4,), generator=g)
        out.append((spec1, spec2.to(torch.complex64), doa))
    return out
