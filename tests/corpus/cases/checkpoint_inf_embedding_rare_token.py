"""An Inf in a loaded checkpoint surfaces only when a rare token is looked up. A text classifier
resumes from a checkpoint whose embedding row for a rare token holds +Inf (written by an earlier
run that overflowed and was saved anyway). The row is never looked up until step 5, when the
rare token first appears in a batch: its embedding is Inf, the logits and gradients NaN. The
weights were non-finite before the Recorder attached; no recorded update made them so, and what
did is unknown to the recording; the sample whose token looked up the row (3) is named."""

import torch
import torch.nn as nn

SOURCE = "https://discuss.pytorch.org/t/nan-loss-after-loading-checkpoint/131214"
EXPECTED = dict(step=5, phase="weights", module="emb", op=None, samples=[3], cause="unknown")
TAGS = ("weights", "float32", "checkpoint", "embedding")
RECORDER = dict()

VOCAB, RARE = 50, 47


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def make_model():
    torch.manual_seed(0)
    model = BagOfWords()
    with torch.no_grad():  # the resumed checkpoint (load_state_dict) carries the Inf row
        model.emb.weight[RARE] = float("inf")
    return model


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(model, batch):
    tokens, y = batch
    return nn.functional.cross_entropy(model(tokens), y)


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(7):
        tokens = torch.randint(0, 40, (8, 6), generator=g)  # common tokens only
        y = torch.randint(0, 3, (8,), generator=g)
        if step == 5:
            tokens[3, 2] = RARE  # the rare token's first appearance
        out.append((tokens, y))
    return out
