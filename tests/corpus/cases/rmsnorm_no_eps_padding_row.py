"""RMSNorm without an epsilon is 0 * Inf = NaN on a zero vector. A custom RMSNorm computes
x * rsqrt(mean(x**2)) with no eps; the token embedding's padding row (padding_idx) is all zeros,
so at padded positions rsqrt(0) = Inf and 0 * Inf = NaN, which masked pooling (NaN * 0) does not
remove. Every padded sequence is affected."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/NVIDIA/apex/pull/1295"
EXPECTED = dict(step=2, phase="forward", module="norm", op="rsqrt", samples=[1, 3], cause="numerics")
TAGS = ("forward", "float32", "nlp", "normalization", "padding")
RECORDER = dict()

VOCAB, PAD, D = 40, 0, 16


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.norm = RMSNorm(D)
        self.ff = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        keep = (ids != PAD).unsqueeze(-1).float()
        h = torch.relu(self.ff(self.norm(self.emb(ids))))
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_model():
    torch.manual_seed(0)
    return Encoder()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    ids, y = batch
    return nn.functional.cross_entropy(model(ids), y)


def batches():
    g = torch.Generator().manual_seed(32)
    out = []
    for step in range(4):
        ids = torch.randint(1, VOCAB, (4, 6), generator=g)   # bucketed by length: no padding needed
        if step == 2:   # a batch of mixed lengths
            ids[1, 4:] = PAD
            ids[3, 3:] = PAD
        y = torch.randint(0, 2, (4,), generator=g)
        out.append((ids, y))
    return out
