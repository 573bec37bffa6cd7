"""PPO advantage normalisation is NaN for a minibatch of one sample. PPO normalises advantages per
minibatch with (adv - adv.mean()) / (adv.std() + 1e-8). With a rollout buffer of 9 transitions and
minibatches of 8, the last minibatch holds a single transition; the unbiased std of one value is
0/0 = NaN, the policy loss is NaN and so is every gradient."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/DLR-RM/stable-baselines3/issues/325"
EXPECTED = dict(step=1, phase="loss", module=None, op=("std", "std_mean", "var"), samples=None, cause="bad input data")
TAGS = ("loss", "batch-of-one", "float32", "rl", "std")
RECORDER = dict()

CLIP = 0.2


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.pi = nn.Linear(32, 2)
        self.v = nn.Linear(32, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def make_model():
    torch.manual_seed(0)
    return ActorCritic()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=3e-4)


def loss_fn(model, batch):
    obs, act, old_logp, adv, ret = batch
    logits, value = model(obs)
    logp = torch.log_softmax(logits, -1).gather(1, act[:, None]).squeeze(1)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
    return pg + 0.5 * (ret - value).pow(2).mean()


def batches():
    g = torch.Generator().manual_seed(9)
    n = 9  # rollout length not a multiple of the minibatch size
    obs = torch.randn(n, 4, generator=g)
    act = torch.randint(0, 2, (n,), generator=g)
    old_logp = torch.full((n,), -0.69)
    adv = torch.randn(n, generator=g)
    ret = torch.randn(n, generator=g)
    return [tuple(t[i:i + 8] for t in (obs, act, old_logp, adv, ret)) for i in range(0, n, 8)]
