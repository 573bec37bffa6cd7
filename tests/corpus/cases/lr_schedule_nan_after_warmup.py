"""A warmup + cosine schedule returns a NaN learning rate when decay_steps == warmup_steps. The
schedule computes progress = (step - warmup) / (decay_steps - warmup) in numpy floats; with the
two settings equal (a short fine-tuning config) the first step after warmup is 0/0 = NaN (plain
Python floats would raise ZeroDivisionError, numpy and torch scalars give NaN). SGD then writes
NaN into every weight from finite gradients; check_update=True catches it in that step."""

import math

import numpy as np
import torch
import torch.nn as nn

SOURCE = "https://github.com/mlcommons/hpc/pull/27"
EXPECTED = dict(step=3, phase="optimizer", module="", op=("add", "mul", "addcmul", "add_", "foreach_add"), samples=None,
                cause="optimizer update")
TAGS = ("optimizer", "lr-scheduler", "float32", "linear-probe")
RECORDER = dict(check_update=True)

WARMUP, DECAY_STEPS, BASE_LR = 3, 3, 0.1
SCHEDULER = None


def lr_lambda(step):
    if step < WARMUP:
        return float(np.float64(step + 1) / np.float64(WARMUP))
    progress = np.float64(step - WARMUP) / np.float64(DECAY_STEPS - WARMUP)
    return float(0.5 * (1.0 + np.cos(math.pi * min(progress, 1.0)))) if np.isfinite(progress) else float(progress)


def make_model():
    torch.manual_seed(0)
    return nn.Linear(12, 4)   # a linear probe on frozen features


def make_optimizer(model):
    global SCHEDULER
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.0, foreach=False)
    SCHEDULER = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return opt


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train_step(model, optimizer, batch, recorder, step):
    recorder.record(batch)
    loss = loss_fn(model, batch)
    recorder.log_loss(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    SCHEDULER.step()


def batches():
    g = torch.Generator().manual_seed(26)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
