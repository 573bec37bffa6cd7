"""A float16 forward overflow that no loss scale can fix makes GradScaler skip every step. T5's
feed-forward output (wo(relu(wi(h)))) exceeds 65504 in float16 for some inputs; under autocast with a
GradScaler the Inf makes the gradients non-finite, the scaler skips the step and halves the scale,
and since the overflow is in the forward pass it recurs on every batch of loud inputs: the run
stalls with a collapsing scale. The loss is then non-finite, which loss scaling cannot cause (the
forward pass is not scaled): the Recorder dumps at the first loud batch, not after the skips."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/huggingface/transformers/issues/5651"
EXPECTED = dict(step=2, phase="forward", module="ff.wo", op=("linear", "addmm", "mm"), samples=[1, 6], cause="overflow")
TAGS = ("forward", "grad-scaler", "float16-autocast", "float16", "overflow", "nlp")

SCALER = None


class DenseReluDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(16, 64, bias=False)
        self.wo = nn.Linear(64, 16, bias=False)

    def forward(self, h):
        return self.wo(torch.relu(self.wi(h)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.ff = DenseReluDense()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.ff(h)).squeeze(-1)


def make_model():
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # pretrained T5 feed-forward weights are large
        model.ff.wi.weight *= 8.0
        model.ff.wo.weight *= 8.0
    return model


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def make_scaler():
    global SCALER
    SCALER = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    return SCALER


def loss_fn(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        pred = model(x)
    return nn.functional.smooth_l1_loss(pred.float(), y)


def train_step(model, optimizer, batch, recorder, step):
    recorder.record(batch)
    loss = loss_fn(model, batch)
    recorder.log_loss(loss)
    optimizer.zero_grad()
    SCALER.scale(loss).backward()
    SCALER.step(optimizer)
    SCALER.update()


def batches():
    g = torch.Generator().manual_seed(19)
    probe = make_model()
    direction = probe.inp.weight.detach().T @ torch.ones(16)     # an input direction that the projection amplifies
    direction = direction / direction.norm()
    out = []
    for step in range(6):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, generator=g)
        if step >= 2:  # from step 2 on, batches come from a shard with unnormalised (loud) records
            x[1] = 12000.0 * direction
            x[6] = -12000.0 * direction
        out.append((x, y))
    return out
