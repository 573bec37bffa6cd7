"""CrossEntropyLoss(reduction='mean') is NaN when every target is ignore_index. A token-tagging
model labels only the first sub-word of each word and sets the others (and padding) to -100. A
batch of continuation-only chunks has no labelled token: the mean over zero elements is 0/0 = NaN
(PyTorch returns NaN by design since 1.10), and the NaN reaches every gradient."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/70348"
EXPECTED = dict(step=2, phase="loss", module=None, op=("cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss_nd"),
                samples=None, cause="bad input data")
TAGS = ("loss", "ignore-index", "float32", "nlp", "empty-reduction")
RECORDER = dict()

VOCAB, TAGS_N = 40, 5
CRITERION = nn.CrossEntropyLoss(ignore_index=-100)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, TAGS_N)

    def forward(self, tokens):
        h, _ = self.rnn(self.emb(tokens))
        return self.out(h)


def make_model():
    torch.manual_seed(0)
    return Tagger()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    tokens, labels = batch
    logits = model(tokens)
    return CRITERION(logits.reshape(-1, TAGS_N), labels.reshape(-1))


def batches():
    g = torch.Generator().manual_seed(6)
    out = []
    for step in range(4):
        tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
        labels = torch.randint(0, TAGS_N, (4, 6), generator=g)
        labels[:, 1::2] = -100   # continuation sub-words
        if step == 2:
            labels[:] = -100     # a batch of chunks that hold only continuation sub-words
        out.append((tokens, labels))
    return out
