"""T5-style attention scores overflow float16 under autocast. T5 does not scale q @ k^T by
1/sqrt(d) (the scale is folded into the initialisation), so with large activations the raw scores
exceed float16's maximum of 65504 when the matmul runs in float16 under autocast: the scores are
Inf, and the softmax over a row holding Inf is NaN. In float32 the same scores are finite."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/huggingface/transformers/issues/11461"
EXPECTED = dict(step=1, phase="forward", module="block.attn", op=("matmul", "bmm", "mm"), samples=[1], cause="overflow")
TAGS = ("forward", "attention-overflow", "float16-autocast", "float16", "nlp", "overflow")
RECORDER = dict()

D, H = 32, 2


class T5Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(-1, -2))          # no 1/sqrt(d): T5's convention
        attn = torch.softmax(scores.float(), dim=-1).type_as(scores)
        return self.o(torch.matmul(attn, v).transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = T5Attention()
        self.ff = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, D)
        self.block = Block()
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)).mean(1))


def make_model():
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():
        model.embed.weight[0] *= 200.0   # a sentinel token whose embedding grew large
    return model


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def loss_fn(model, batch):
    ids, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(ids)
    return nn.functional.cross_entropy(logits.float(), y)


def batches():
    g = torch.Generator().manual_seed(17)
    out = []
    for step in range(3):
        ids = torch.randint(10, 100, (4, 6), generator=g)
        if step == 1:
            ids[1, 2] = 0
            ids[1, 4] = 0
        y = torch.randint(0, 2, (4,), generator=g)
        out.append((ids, y))
    return out
