"""Adam with eps=0 divides 0 by 0 for a parameter whose gradient is exactly zero. A multi-task
model ramps its auxiliary loss in from weight 0, so during the first step the auxiliary head's
gradients are exactly zero; with eps=0 (set to "disable" the epsilon) Adam's update is
exp_avg / sqrt(exp_avg_sq) = 0/0 = NaN, and the head's weights become NaN. The gradients were
finite: the NaN is born in optimizer.step() (caught with check_update=True)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/google-deepmind/optax/pull/1553"
EXPECTED = dict(step=0, phase="optimizer", module="aux_head", op=("addcdiv", "div"), samples=None, cause="optimizer update")
TAGS = ("optimizer", "adam-eps", "float32", "multi-task")
RECORDER = dict(check_update=True)


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.main_head = nn.Linear(32, 3)
        self.aux_head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.main_head(h), self.aux_head(h).squeeze(-1)


def make_model():
    torch.manual_seed(0)
    return MultiTask()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)


def loss_fn(model, batch):
    x, y, aux_target, aux_weight = batch
    logits, aux = model(x)
    return nn.functional.cross_entropy(logits, y) + aux_weight * nn.functional.mse_loss(aux, aux_target)


def batches():
    g = torch.Generator().manual_seed(24)
    out = []
    for step in range(3):
        x = torch.randn(8, 10, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        aux_target = torch.randn(8, generator=g)
        aux_weight = torch.tensor(min(1.0, step / 4))  # linear ramp-in of the auxiliary task
        out.append((x, y, aux_target, aux_weight))
    return out
