"""exp(logvar) in a VAE's KL term overflows in float16. A VAE trained in half precision (model
.half()) computes KL = -0.5 * sum(1 + logvar - mu**2 - exp(logvar)) in its loss. An unnormalised
outlier sample drives its logvar above 11.1, where exp() exceeds float16's maximum (65504): the KL
is Inf, and the gradients are Inf/NaN. In float32 the same value is finite."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/vanderschaarlab/synthcity/issues/331"
EXPECTED = dict(step=1, phase="loss", module=None, op="exp", samples=[6], cause="overflow")
TAGS = ("loss", "vae", "half", "float16", "overflow")
RECORDER = dict()

LATENT = 4


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.mu = nn.Linear(32, LATENT)
        self.logvar = nn.Linear(32, LATENT)
        self.dec = nn.Sequential(nn.Linear(LATENT, 32), nn.Tanh(), nn.Linear(32, 16))

    def forward(self, x, eps):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * eps
        return self.dec(z), mu, logvar


def make_model():
    torch.manual_seed(0)
    model = VAE()
    with torch.no_grad():
        model.logvar.bias.fill_(-1.0)
    return model.half()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, eps = batch
    recon, mu, logvar = model(x, eps)
    rec = (recon - x).pow(2).sum(1)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
    return (rec + kl).float().mean()


def batches():
    g = torch.Generator().manual_seed(15)
    x_raw = _outlier()
    out = []
    for step in range(3):
        x = torch.randn(8, 16, generator=g) * 0.5
        if step == 1:
            x[6] = x_raw  # an unnormalised record (raw units instead of z-scores)
        eps = torch.randn(8, LATENT, generator=g)
        out.append((x.half(), eps.half()))
    return out


def _outlier():
    """A record in raw units whose logvar lands between 11.1 (exp overflows float16) and 22 (the
    reparameterisation's exp(0.5 * logvar) would overflow too), with |mu| small enough that mu**2
    stays finite: the first overflow is the KL's exp."""
    probe = make_model().float()
    g = torch.Generator().manual_seed(16)
    with torch.no_grad():
        for _ in range(200):
            d = torch.randn(16, generator=g)
            for scale in range(5, 400, 5):
                h = probe.enc(scale * d[None])
                lv, mu = probe.logvar(h), probe.mu(h)
                if 13.0 < lv.max() < 18.0 and mu.abs().max() < 100:
                    return scale * d
    raise RuntimeError("no outlier found")
