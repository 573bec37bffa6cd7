"""Small models with known failure modes, shared by the tests. Importable by replay as
``models:<factory>`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_mlp() -> nn.Module:
    return MLP()


def make_dropout_mlp() -> nn.Module:
    return MLP(dropout=0.5)


class SafeDiv(nn.Module):
    """x / s where s is a learned scale; becomes 0/0 = NaN when an input row is all zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = SafeDiv()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.proj(x))))


class Nested(nn.Module):
    """encoder.block.norm divides by a row sum: a ReLU that zeroes a whole row makes it 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"block": Block()})
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder["block"](x))


def make_nested() -> nn.Module:
    return Nested()


class SqrtNet(nn.Module):
    """The norm of a linear layer's output: finite forward, NaN gradient when a row is all zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.root = SqrtLayer()
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.root(self.fc(x)))


class SqrtLayer(nn.Module):
    """Row-wise L2 norm written by hand: sqrt(0) = 0 forward, sqrt'(0) = inf backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1, keepdim=True))


def make_sqrt() -> nn.Module:
    return SqrtNet()


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def mean_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch["x"]).mean()


class RatioNet(nn.Module):
    """A bias-free projection, a row normalisation, a head: a zero input row (padding) makes
    0 / 0 = NaN born in ``norm``; any other row is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.norm = SafeDiv()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def make_ratio() -> nn.Module:
    torch.manual_seed(1234)  # the same weights on every rank and in replay
    return RatioNet()


class DeepMLP(nn.Module):
    """``depth`` Linear+ReLU layers then a Linear head; with ``depth=31`` it has 32 layers."""

    def __init__(self, d: int = 8, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(depth)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def make_deep() -> nn.Module:
    return DeepMLP()


def make_deep32() -> nn.Module:
    return DeepMLP(depth=31)


def mse_loss_fp32(model: nn.Module, batch) -> torch.Tensor:
    """MSE computed in float32 whatever the model's dtype (for half-precision models)."""
    x, y = batch
    return F.mse_loss(model(x).float(), y.float())


class NaiveSoftmaxGate(nn.Module):
    """A gating layer with a hand-written softmax: ``exp(logits)`` overflows float16 once a logit
    exceeds about 11, and inf / inf is NaN."""

    def __init__(self, d: int, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) * scale / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x @ self.weight)
        return x * (e / e.sum(-1, keepdim=True))


class HalfNet(nn.Module):
    """fc1 -> gate1 -> fc2 -> gate2 -> head, for float16: gate2's weights are large enough that
    its logits overflow ``exp`` in float16 (finite in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.gate1 = NaiveSoftmaxGate(16)
        self.fc2 = nn.Linear(16, 16)
        self.gate2 = NaiveSoftmaxGate(16, scale=40.0)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate2(self.fc2(self.gate1(self.fc1(x)))))


def make_half() -> nn.Module:
    torch.manual_seed(0)
    return HalfNet().half()


@dataclasses.dataclass
class Output:
    """A model output the way Hugging Face returns one: a dataclass of tensors."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: Optional[torch.Tensor] = None


class DataclassOut(nn.Module):
    """Returns :class:`Output`; ``scale`` divides the hidden state by its row sum (0/0 on a zero row)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 6)
        self.scale = SafeDiv()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.scale(torch.relu(self.enc(x)))
        return Output(logits=self.head(h), hidden=h)


def make_dataclass_out() -> nn.Module:
    return DataclassOut()


def make_half_fp32() -> nn.Module:
    """:class:`HalfNet` with float32 weights, for training under float16 autocast."""
    torch.manual_seed(0)
    return HalfNet()


def autocast_fp16_mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return F.mse_loss(out.float(), y)


class Branchy(nn.Module):
    """A BatchNorm inside a branch taken only when ``use_aux`` is set: its running stats first
    change at a later step, not at step 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux = nn.BatchNorm1d(4)
        self.use_aux = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.aux(h) if self.use_aux else h


class RootHead(nn.Module):
    """``sqrt(x)``: NaN where ``x < 0``, in the output and in the gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class RootMLP(nn.Module):
    """A tiny MLP ending in ``sqrt``: finite for inputs of magnitude about 1 (the last layer's
    bias 2.0 outweighs ``-0.05 * sum(relu(h))``), NaN born in ``head`` (op ``sqrt``) for inputs
    scaled by 100. Inputs ``[B, 4]``, output ``[B, 1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc2.weight.fill_(-0.05)
            self.fc2.bias.fill_(2.0)
        self.head = RootHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(x))))


def make_root_mlp() -> nn.Module:
    torch.manual_seed(0)
    return RootMLP()


def root_mean_loss(model: nn.Module, batch) -> torch.Tensor:
    (x,) = batch
    return model(x).mean()


class CompiledOnlyNaN(nn.Module):
    """Finite in eager mode; under ``torch.compile`` (``torch.compiler.is_compiling()``) its
    forward takes ``sqrt(h - 100)``, NaN (output and gradients): a stand-in for a NaN that only
    compiled code produces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if torch.compiler.is_compiling():
            h = torch.sqrt(h - 100.0)
        return h


def make_compiled_only_nan() -> nn.Module:
    torch.manual_seed(0)
    return CompiledOnlyNaN()


class OnePassNorm(nn.Module):
    """Normalises each row by a one-pass variance, E[x^2] - E[x]^2: on rows with a large offset
    and a small spread the two terms cancel, and the float32 result is rounding noise of either
    sign. Inductor's kernel sums the reductions in another order than eager code, so for some
    rows only the compiled model takes ``rsqrt`` of a negative value (NaN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) * torch.rsqrt(var + 1e-6)


class OnePassNet(nn.Module):
    """:class:`OnePassNorm` at ``norm``, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = OnePassNorm()
        self.fc = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def make_one_pass_norm() -> nn.Module:
    torch.manual_seed(0)
    return OnePassNet()


class BatchStdNet(nn.Module):
    """Normalises by the batch's standard deviation (``std`` over dim 0), then takes ``sqrt`` of
    a batch mean: NaN born in an op whose output has no batch dimension, so the samples are found
    by per-sample replay, where ``std`` of one sample warns "degrees of freedom is <= 0"."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h / (h.std(dim=0, keepdim=True) + 1.0)
        return torch.sqrt(h.mean(dim=0) - 5.0)


def make_batch_std() -> nn.Module:
    torch.manual_seed(0)
    return BatchStdNet()


class Cache:
    """A non-tensor, non-JSON object in a model's output, like transformers' ``DynamicCache``."""


class WithCache(nn.Module):
    """Returns ``{"y": sqrt(fc(x)), "cache": Cache()}``: NaN where ``fc(x) < 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": torch.sqrt(self.fc(x)), "cache": Cache()}


def make_with_cache() -> nn.Module:
    torch.manual_seed(0)
    return WithCache()


class SqrtHead(nn.Module):
    """A bias-free projection, a row norm by hand, a head: a zero input row gives sqrt(0) = 0 in
    the forward (finite) and 0 * inf = NaN in ``root``'s backward, so the gradients of ``proj``
    are NaN while the loss stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.root = SqrtLayer()
        self.head = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.root(self.proj(x)))


def make_sqrt_head() -> nn.Module:
    torch.manual_seed(4321)  # the same weights on every rank and in replay
    return SqrtHead()
