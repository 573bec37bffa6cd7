"""One small model per failure family, for tests/diagnosis/test_attribution.py. Importable by replay as
``failure_models:<factory>`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LogWhere(nn.Module):
    """Safe-looking log: ``where(c > 0, log(c), 0)``. Forward is finite; log(0) = -Inf is born and
    masked in forward, and LogBackward gives 0/0 = NaN in backward for a row with c = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        c = (h * h).sum(-1, keepdim=True)
        return self.head(torch.where(c > 0, torch.log(c), torch.zeros_like(c)))


def make_logwhere() -> nn.Module:
    return LogWhere()


class AttnNet(nn.Module):
    """Token embedding -> nn.MultiheadAttention with a key padding mask -> mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        L = x.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(L)
        a, _ = self.attn(h, h, h, key_padding_mask=pad.float().masked_fill(pad, float("-inf")), attn_mask=causal)
        return self.head(a.mean(1))


def make_attn() -> nn.Module:
    return AttnNet()


def attn_loss(model: nn.Module, batch) -> torch.Tensor:
    x, pad, y = batch
    return F.cross_entropy(model(x, pad), y)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_wide() -> nn.Module:
    return Wide()


def fp16_autocast_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mixed precision on the CPU: the linear layers run in float16."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
