"""A hand-written BCE under bfloat16 autocast takes log(0). A multi-label tagger computes
-(y*log(p) + (1-y)*log(1-p)) from p = sigmoid(logits) itself instead of
binary_cross_entropy_with_logits. Under bfloat16 autocast the linear layer's output, and so p, is
bfloat16, whose 8-bit mantissa rounds sigmoid(6) = 0.9975 to exactly 1.0: 1 - p = 0 and
log(0) = -inf (in float32, 1 - p would be 2.5e-3)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/huggingface/candle/issues/2561"
EXPECTED = dict(step=1, phase="loss", module=None, op="log", samples=[4], cause="underflow")
TAGS = ("loss", "bfloat16-autocast", "bfloat16", "underflow", "multilabel")
RECORDER = dict()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = torch.sigmoid(model(x))
        bce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
    return bce.float().mean()


def batches():
    g = torch.Generator().manual_seed(20)
    probe = make_model()
    out = []
    for step in range(3):
        x = torch.randn(8, 12, generator=g) * 0.5
        y = (torch.rand(8, 5, generator=g) > 0.5).float()
        if step == 1:
            # a strongly activated record: its logits reach ~6-8 where bfloat16 sigmoid rounds to 1
            x[4] = _scaled_to_logit(probe, g, 7.0)
        out.append((x, y))
    return out


def _scaled_to_logit(probe, g, target):
    """A record whose largest logit is just above ``target`` and whose others stay below 12."""
    with torch.no_grad():
        for _ in range(100):
            d = torch.randn(12, generator=g)
            for s in torch.linspace(0.1, 20.0, 200):
                logits = probe(s * d[None])[0]
                if logits.max() >= target:
                    if logits.max() < 12.0:
                        return s * d
                    break
    raise RuntimeError("no record reaches the target logit")
