"""Left padding plus a causal mask leaves attention rows with no key at all. A decoder-only LM fine-
tuned with left-padded batches builds its mask as causal AND not-padding and fills masked scores
with -inf before the softmax. A padding query position can only see earlier positions, which are
all padding too, so its row is entirely -inf and the softmax returns 0/0 = NaN for every
left-padded sequence; the NaN then spreads through the residual stream to the loss."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/unslothai/unsloth/pull/9848"
EXPECTED = dict(step=1, phase="forward", module="blocks.0.attn", op="softmax", samples=[0, 3], cause="bad input data")
TAGS = ("forward", "masked-attention", "float32", "nlp", "padding", "causal-lm")
RECORDER = dict()

VOCAB, PAD, D = 48, 0, 16


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / D ** 0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal[None] & keep[:, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        return self.proj(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, keep):
        x = x + self.attn(self.ln(x), keep)
        return x + self.mlp(x)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(16, D)
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        keep = ids != PAD
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x, keep)
        return self.head(x)


def make_model():
    torch.manual_seed(0)
    return LM()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-4)


def loss_fn(model, batch):
    ids, labels = batch
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def batches():
    g = torch.Generator().manual_seed(29)
    out = []
    for step in range(3):
        ids = torch.randint(1, VOCAB, (4, 8), generator=g)
        if step == 1:   # the collator switched to left padding (for generation) in the training loop
            ids[0, :3] = PAD
            ids[3, :2] = PAD
        labels = ids.masked_fill(ids == PAD, -100)
        out.append((ids, labels))
    return out
