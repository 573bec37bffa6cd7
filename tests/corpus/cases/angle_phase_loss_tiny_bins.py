"""torch.angle has a NaN gradient at tiny complex magnitudes. A mask-based speech enhancer multiplies
the noisy complex spectrum by a sigmoid mask and trains with a phase-aware loss on
torch.angle(pred). Where the mask logit is very negative the predicted bin's magnitude is ~1e-20:
AngleBackward divides by |z|**2, which underflows in complex64 (finite in complex128), and returns
NaN for that utterance."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/98276"
EXPECTED = dict(step=1, phase="backward", module=None, op="angle", samples=[3], cause="underflow")
TAGS = ("backward", "complex64", "angle", "audio", "underflow")
RECORDER = dict()

BINS = 12


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(BINS, 32), nn.Tanh(), nn.Linear(32, BINS))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    feats, noisy, clean = batch
    mask = torch.sigmoid(model(feats))
    pred = mask * noisy                      # complex64 spectrum
    phase = 1 - torch.cos(torch.angle(pred) - torch.angle(clean))
    mag = (pred.abs() - clean.abs()).pow(2)
    return phase.mean() + mag.mean()


def batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(3):
        feats = torch.randn(6, BINS, generator=g)
        noisy = torch.complex(torch.randn(6, BINS, generator=g), torch.randn(6, BINS, generator=g))
        clean = 0.7 * noisy + 0.1 * torch.complex(torch.randn(6, BINS, generator=g), torch.randn(6, BINS, generator=g))
        if step == 1:
            feats[3] = 0.0
            noisy[3] = noisy[3] * 1e-20  # a near-silent utterance (gain of a broken channel)
            clean[3] = clean[3] * 1e-20
        out.append((feats, noisy, clean))
    return out
