"""Adam's default eps=1e-8 underflows to 0 in float16 parameters, so an update on a zero gradient
is 0/0 = NaN. A text classifier trained with model.half() and torch.optim.Adam adds eps=1e-8 to a
float16 denominator, where it rounds to 0; the padding row of the embedding (padding_idx) always
gets an exactly zero gradient, so the first update writes NaN into it. The gradients were finite;
the next step starts with NaN weights (check_update is off)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/google-deepmind/optax/pull/1769"
EXPECTED = dict(step=1, phase="weights", module="emb", op=None, samples=None, cause="optimizer update")
TAGS = ("weights", "half", "float16", "adam-eps", "nlp", "padding")
RECORDER = dict()

VOCAB, PAD = 30, 0


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.fc = nn.Linear(16, 2)

    def forward(self, ids):
        mask = (ids != PAD).unsqueeze(-1).to(self.emb.weight.dtype)
        h = (self.emb(ids) * mask).sum(1) / mask.sum(1)
        return self.fc(h)


def make_model():
    torch.manual_seed(0)
    return Classifier().half()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    ids, y = batch
    return nn.functional.cross_entropy(model(ids).float(), y)


def batches():
    g = torch.Generator().manual_seed(25)
    out = []
    for step in range(3):
        ids = torch.randint(1, VOCAB, (6, 8), generator=g)
        ids[:, 6:] = PAD
        y = torch.randint(0, 2, (6,), generator=g)
        out.append((ids, y))
    return out
