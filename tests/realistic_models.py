"""Small but realistic training models for tests/diagnosis/test_realistic.py: a ResNet-style CNN with
BatchNorm and in-place ReLUs, a Transformer encoder classifier with key padding masks, a tied-
weight LSTM language model, a model with a frozen backbone, and a multi-output model. Importable
by replay as ``realistic_models:<factory>`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- 1. ResNet-style CNN ------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # the in-place residual add of torchvision's BasicBlock
        return self.relu(out)


class LogEnergyPool(nn.Module):
    """Pools each channel to the log of its mean energy: log(0) = -Inf for a channel that is
    entirely zero after the ReLU (a dead channel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.pow(2).mean(dim=(2, 3)))


class ResNetish(nn.Module):
    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.head_bn = nn.BatchNorm2d(c)
        self.head_relu = nn.ReLU(inplace=True)
        self.pool = LogEnergyPool()
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head_relu(self.head_bn(self.layer1(self.stem(x))))
        return self.fc(self.pool(h))


def make_resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNetish()


def ce_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- 2. Transformer encoder classifier ------------------------------------------------------------
class TransformerClassifier(nn.Module):
    """Token embedding, a 2-layer batch_first TransformerEncoder with dropout, attention pooling
    with a learned query (``nn.MultiheadAttention`` called with its default ``need_weights=True``,
    the math path: a sequence whose key padding mask is all True softmaxes a row of -Inf, NaN;
    the encoder's own attention returns zeros there), a linear head."""

    def __init__(self, vocab: int = 50, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.query = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pool = nn.MultiheadAttention(d, num_heads=2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=pad_mask)
        pooled, _ = self.pool(self.query.expand(h.shape[0], -1, -1), h, h, key_padding_mask=pad_mask)
        return self.head(pooled.squeeze(1))


def make_transformer() -> nn.Module:
    torch.manual_seed(0)
    return TransformerClassifier()


def transformer_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"], batch["pad_mask"]), batch["label"])


# -- 3. tied-weight LSTM language model ------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, cell: str = "lstm") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(d, d, batch_first=True)
        self.decoder = nn.Linear(d, vocab)
        self.decoder.weight = self.embed.weight  # tied input/output embedding: one shared parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.decoder(h)


def make_lstm_lm() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM()


def make_gru_lm() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM(cell="gru")


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token loss averaged over the real (non-pad) target tokens: sum / count, which is
    0 / 0 = NaN for a batch whose targets are all padding."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1).to(nll.dtype)
    return (nll * m).sum() / m.sum()


# -- 4. frozen backbone, two param groups ---------------------------------------------------------
class FrozenBackbone(nn.Module):
    """log1p of count features, a frozen backbone (requires_grad=False), a trainable adapter and head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12))
        self.adapter = nn.Linear(12, 12)
        self.head = nn.Linear(12, 2)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(torch.log1p(x))  # count features; a -9 "missing" sentinel makes log1p NaN
        h = torch.relu(self.adapter(h))
        return self.head(h)


def make_frozen() -> nn.Module:
    torch.manual_seed(0)
    return FrozenBackbone()


def frozen_loss(model: nn.Module, batch) -> torch.Tensor:
    """The micro-batch loss of a 3-step gradient accumulation: already divided by 3."""
    x, y = batch
    return F.cross_entropy(model(x), y) / 3


# -- 5. multi-output model (dict and tuple) ---------------------------------------------------------
class MultiOut(nn.Module):
    """Returns ``{"logits": ..., "aux": (recon, score)}``: a dict holding a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 10)
        self.cls = nn.Linear(10, 3)
        self.dec = nn.Linear(10, 6)
        self.score = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.relu(self.enc(x))
        return {"logits": self.cls(h), "aux": (self.dec(h), self.score(h))}


def make_multi() -> nn.Module:
    torch.manual_seed(0)
    return MultiOut()


def multi_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy on the logits, a reconstruction term and a hand-written binary cross-entropy
    of the score against the negative class: 1 - sigmoid(score) rounds to 0 for a score above
    about 17, and log(0) = -Inf."""
    x, y = batch
    out = model(x)
    recon, score = out["aux"]
    return F.cross_entropy(out["logits"], y) + F.mse_loss(recon, x) - torch.log(1 - torch.sigmoid(score)).mean()


def lm_loss_bias_penalty(model: nn.Module, batch) -> torch.Tensor:
    """The LM loss plus an L2 penalty on the output bias written as a hand-made norm: sqrt'(0) is
    Inf, so a zero-initialised bias gets a NaN gradient while every other gradient is finite."""
    return lm_loss(model, batch) + 1e-3 * torch.sqrt((model.decoder.bias**2).sum())
