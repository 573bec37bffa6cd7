"""A transient hardware fault corrupts one gradient value. Silent data corruption (a flipped bit in
an accelerator's memory or an unstable link) can turn a single gradient element into NaN in one
step only; re-running the same step on the same inputs is finite. The loop below simulates it by
writing NaN into one element of one gradient after backward in step 3. A replay of the step is
finite, so the honest verdict is a transient fault, with no op or module to blame."""

import torch
import torch.nn as nn

SOURCE = "https://arxiv.org/abs/2102.11245"
EXPECTED = dict(step=3, phase="none", module=None, op=None, samples=None, cause="transient")
TAGS = ("transient", "float32", "hardware-fault")
RECORDER = dict()

FAULT_STEP = 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.GELU(), nn.Linear(8, 1))


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def train_step(model, optimizer, batch, recorder, step):
    recorder.record(batch)
    loss = loss_fn(model, batch)
    recorder.log_loss(loss)
    optimizer.zero_grad()
    loss.backward()
    if step == FAULT_STEP:  # the simulated fault: one element of one gradient is corrupted
        with torch.no_grad():
            model[2].weight.grad[3, 17] = float("nan")
    optimizer.step()


def batches():
    g = torch.Generator().manual_seed(27)
    out = []
    for _ in range(6):
        x = torch.randn(16, 8, generator=g)
        out.append((x, x[:, 0] * x[:, 1] + 0.1 * torch.randn(16, generator=g)))
    return out
