"""torch.where guarding log(0) still gives a NaN gradient. An RL policy head with invalid-action
masking multiplies the softmax by the action mask and takes the log-probabilities "safely" as
torch.where(p > 0, log(p), 0) (for the policy-gradient term and the entropy bonus). The forward pass
is finite, but for a masked action log(0) = -inf sits in the unselected branch; LogBackward computes
0 / 0 = NaN there, and the multiplication by the mask (NaN * 0 = NaN) carries it into the logits and
the weights."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/52248"
EXPECTED = dict(step=1, phase="backward", module="head", op="log", samples=[2, 6], cause="numerics")
TAGS = ("backward", "where-log", "float32", "rl", "mask")
RECORDER = dict()

N_ACT = 5


class MaskedPolicyHead(nn.Module):
    """Logits -> log-probabilities of the legal actions (0 for illegal ones) and the entropy."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.logits = nn.Linear(dim, N_ACT)

    def forward(self, h, mask):
        p = torch.softmax(self.logits(h), dim=-1) * mask
        p = p / p.sum(-1, keepdim=True)
        logp = torch.where(p > 0, torch.log(p), torch.zeros_like(p))
        return logp, -(p * logp).sum(-1)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = MaskedPolicyHead(32)

    def forward(self, obs, mask):
        return self.head(self.body(obs), mask)


def make_model():
    torch.manual_seed(0)
    return Policy()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    obs, mask, action, adv = batch
    logp, entropy = model(obs, mask)
    chosen = logp.gather(1, action[:, None]).squeeze(1)
    return -(chosen * adv).mean() - 0.01 * entropy.mean()


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(3):
        obs = torch.randn(8, 8, generator=g)
        mask = torch.ones(8, N_ACT)
        if step >= 1:  # states where some actions are illegal
            mask[2, 3:] = 0.0
            mask[6, 0] = 0.0
        action = torch.zeros(8, dtype=torch.long)
        action[6] = 1
        adv = torch.randn(8, generator=g)
        out.append((obs, mask, action, adv))
    return out
