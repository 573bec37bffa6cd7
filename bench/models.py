"""The benchmark models and their batches: a small MLP (a step of about 1 ms on 2 CPU threads,
where the Recorder's fixed host cost per step shows), an MLP, a small CNN and GPT-style
transformers (``gpt``: 3.7M parameters; ``gpt42m``: issue 23's 42M-parameter model, as
``bench/scale.py``'s ``42M``). Sizes are arguments so ``overhead.py`` can scale them; the defaults
give a step of roughly 20-150 ms on 2 CPU threads (``gpt42m``: about 1 s)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 512, width: int = 1024, depth: int = 4, n_out: int = 10) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, channels: int = 32, n_out: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.BatchNorm2d(4 * c), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * c, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def spec(name: str, scale: float = 1.0) -> tuple[Callable[[], nn.Module], Callable[[torch.Generator, torch.device], tuple], Callable]:
    """(model factory, batch maker ``(gen, device) -> (inputs, targets)``, loss ``(out, target)``)
    for ``name`` in :data:`MODELS`; ``scale`` multiplies the width."""
    if name == "small":
        w = int(256 * scale)
        return (lambda: MLP(d_in=64, width=w, depth=2)), (lambda g, dev: (torch.randn(128, 64, generator=g).to(dev), torch.randint(0, 10, (128,), generator=g).to(dev))), F.cross_entropy
    if name == "mlp":
        w = int(1024 * scale)
        return (lambda: MLP(width=w)), (lambda g, dev: (torch.randn(64, 512, generator=g).to(dev), torch.randint(0, 10, (64,), generator=g).to(dev))), F.cross_entropy
    if name == "cnn":
        c = max(4, int(32 * scale))
        return (lambda: CNN(channels=c)), (lambda g, dev: (torch.randn(32, 3, 32, 32, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g).to(dev))), F.cross_entropy
    if name in ("gpt", "gpt42m"):
        big = name == "gpt42m"  # 8 layers of width 512, vocabulary 16,384, untied head, 4 x 128 tokens
        d = int((512 if big else 256) * scale) // 8 * 8
        vocab, ctx, bs = (16384, 128, 4) if big else (2048, 64, 8)

        def batch(g: torch.Generator, dev: torch.device) -> tuple:
            t = torch.randint(0, vocab, (bs, ctx + 1), generator=g)
            return t[:, :-1].contiguous().to(dev), t[:, 1:].contiguous().to(dev)

        def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        def make() -> nn.Module:
            if not big:
                return GPT(vocab=vocab, d=d, ctx=ctx)
            m = GPT(vocab=vocab, d=d, layers=8, heads=8, ctx=ctx)
            m.head.weight = nn.Parameter(m.tok.weight.detach().clone())
            return m

        return make, batch, loss
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


#: the names :func:`spec` takes
MODELS = ("small", "mlp", "cnn", "gpt", "gpt42m")


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
