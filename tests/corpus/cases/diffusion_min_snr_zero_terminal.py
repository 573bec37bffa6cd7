"""Min-SNR loss weighting is 0/0 at the last timestep of a zero-terminal-SNR schedule. A diffusion
denoiser is trained with the noise schedule rescaled to zero terminal SNR (alphas_cumprod[-1] = 0,
"Common Diffusion Noise Schedules and Sample Steps are Flawed") and the min-SNR-gamma weight
min(snr, gamma) / snr of diffusers' training scripts. The data pipeline samples a timestep per
example; when it draws the last one, snr = 0 and the weight is 0/0 = NaN. The timestep is a valid
value (the schedule's own range); the formula has the singular point: the fix is in the weight
(clamp the SNR away from 0, or weight by min(snr, gamma) / (snr + 1)), and the sample with t = T - 1
is only the trigger."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/TiankaiHang/Min-SNR-Diffusion-Training/pull/4"
EXPECTED = dict(step=2, phase="loss", module=None, op="div", samples=[5], cause="numerics")
TAGS = ("loss", "float32", "diffusion", "schedule-lookup", "trigger")
RECORDER = dict()

T_STEPS, GAMMA, DIM = 50, 5.0, 6


def _zero_terminal_snr_alphas_cumprod() -> torch.Tensor:
    """The scaled-linear schedule, rescaled so that the last timestep's SNR is exactly 0."""
    betas = torch.linspace(1e-4 ** 0.5, 0.02 ** 0.5, T_STEPS, dtype=torch.float64) ** 2
    sqrt_ab = torch.cumprod(1 - betas, 0).sqrt()
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab = (sqrt_ab - last) * first / (first - last)  # shift the end to 0, keep the start
    return (sqrt_ab ** 2).float()


ALPHAS_CUMPROD = _zero_terminal_snr_alphas_cumprod()  # a table of the training script, not a model buffer


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(T_STEPS, 16)
        self.net = nn.Sequential(nn.Linear(DIM + 16, 32), nn.SiLU(), nn.Linear(32, DIM))

    def forward(self, x_t, t):
        return self.net(torch.cat([x_t, self.t_emb(t)], dim=-1))


def make_model():
    torch.manual_seed(0)
    return Denoiser()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x0, noise, t = batch["x0"], batch["noise"], batch["t"]
    ab = ALPHAS_CUMPROD[t].unsqueeze(-1)
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    pred = model(x_t, t)
    snr = (ab / (1 - ab)).squeeze(-1)
    weight = torch.stack([snr, GAMMA * torch.ones_like(t, dtype=snr.dtype)], dim=1).min(dim=1)[0] / snr
    per_sample = ((pred - noise) ** 2).mean(-1)
    return (weight * per_sample).mean()


def batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(4):
        t = torch.randint(0, T_STEPS - 1, (8,), generator=g)
        if step == 2:
            t[5] = T_STEPS - 1  # the sampler draws the last timestep for one example
        out.append({"x0": torch.randn(8, DIM, generator=g), "noise": torch.randn(8, DIM, generator=g), "t": t})
    return out
