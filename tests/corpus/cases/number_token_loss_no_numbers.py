"""A token loss averaged over an empty selection is NaN when a batch has no selected tokens. The
number-token loss of a language model is the mean, over the label positions that hold a number
token, of a regression term; it selects them with a boolean mask built from the labels. A batch
whose labels hold no number token selects nothing, and the mean over 0 elements is 0/0 = NaN.
The selection comes from the batch alone (its labels): this batch gives the loss nothing to
average, the data the code assumed is not there (skip or guard the empty selection)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/tum-ai/number-token-loss/issues/73"
EXPECTED = dict(step=2, phase="loss", module=None, op="mean", samples=None, cause="bad input data")
TAGS = ("loss", "float32", "nlp", "empty-selection")
RECORDER = dict()

VOCAB, NUMBERS = 40, range(30, 40)  # the last ten ids are the digits 0-9
DIGITS = torch.arange(10, dtype=torch.float32)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    ids, labels = batch["ids"], batch["labels"]
    logits = model(ids)
    ce = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    is_number = (labels >= NUMBERS.start) & (labels < NUMBERS.stop)
    probs = logits[..., NUMBERS.start:NUMBERS.stop].softmax(-1)[is_number]  # [k, 10] at the number positions
    expected = (probs * DIGITS).sum(-1)
    target = (labels[is_number] - NUMBERS.start).float()
    return ce + ((expected - target) ** 2).mean()  # the mean over k = 0 number tokens is NaN


def batches():
    g = torch.Generator().manual_seed(2)
    out = []
    for step in range(4):
        ids = torch.randint(0, VOCAB, (4, 7), generator=g)
        labels = torch.randint(0, VOCAB, (4, 7), generator=g)
        if step == 2:
            labels = torch.randint(0, NUMBERS.start, (4, 7), generator=g)  # no number token in this batch
        out.append({"ids": ids, "labels": labels})
    return out
