"""nn.MultiheadAttention returns NaN for a sequence that is all padding. A text encoder passes
key_padding_mask to nn.MultiheadAttention; an empty document (every token is padding after
cleaning) masks every key of its row, the softmax over an all -inf row is 0/0 = NaN, and the
NaN reaches the loss and every weight."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/40932"
EXPECTED = dict(step=1, phase="forward", module="attn", op="softmax", samples=[2], cause="bad input data")
TAGS = ("forward", "masked-attention", "float32", "nlp", "padding")
RECORDER = dict()

VOCAB, PAD = 50, 0


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        pad = tokens == PAD
        h = self.emb(tokens)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((a * keep).sum(1) / keep.sum(1).clamp(min=1.0))


def make_model():
    torch.manual_seed(0)
    return Encoder()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    tokens, y = batch
    return nn.functional.cross_entropy(model(tokens), y)


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(3):
        tokens = torch.randint(1, VOCAB, (4, 7), generator=g)
        tokens[:, 5:] = PAD
        if step == 1:
            tokens[2] = PAD  # an empty document
        y = torch.randint(0, 3, (4,), generator=g)
        out.append((tokens, y))
    return out
