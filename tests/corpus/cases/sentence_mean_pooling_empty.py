"""Masked mean pooling divides by zero for an all-padding sequence. A sentence encoder pools token
states with sum(h * mask) / sum(mask) (the sentence-transformers formula without its clamp). A
sequence whose tokens were all removed by preprocessing (an empty string padded to the batch
length) has mask sum 0: the pooled vector is 0/0 = NaN inside the model's pooler."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/alibaba/TorchEasyRec/pull/104"
EXPECTED = dict(step=2, phase="forward", module="pooler", op="div", samples=[3], cause="bad input data")
TAGS = ("forward", "masked-mean", "float32", "nlp", "padding")
RECORDER = dict()

VOCAB, PAD = 60, 0


class MeanPooler(nn.Module):
    def forward(self, h, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1)


class SentenceEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24, padding_idx=PAD)
        self.ff = nn.Sequential(nn.Linear(24, 24), nn.GELU())
        self.pooler = MeanPooler()

    def forward(self, ids):
        return self.pooler(self.ff(self.emb(ids)), ids != PAD)


def make_model():
    torch.manual_seed(0)
    return SentenceEncoder()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=2e-4)


def loss_fn(model, batch):
    a, b = batch                     # in-batch-negatives contrastive loss (MultipleNegativesRanking)
    ea = nn.functional.normalize(model(a), dim=-1)
    eb = nn.functional.normalize(model(b), dim=-1)
    scores = ea @ eb.T * 20.0
    return nn.functional.cross_entropy(scores, torch.arange(len(a)))


def batches():
    g = torch.Generator().manual_seed(12)
    out = []
    for step in range(4):
        a = torch.randint(1, VOCAB, (5, 9), generator=g)
        b = torch.randint(1, VOCAB, (5, 9), generator=g)
        a[:, 6:] = PAD
        b[:, 7:] = PAD
        if step == 2:
            a[3] = PAD  # an empty sentence after cleaning
        out.append((a, b))
    return out
