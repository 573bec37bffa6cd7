"""The batch dimension, defined once: how big a recorded batch is, how to cut rows out of it, and
which layers make a sample's result depend on the rest of its batch."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

import torch

from .tree import map_tensors, tensor_leaves

__all__ = ["batch_size", "take_rows", "batch_coupled"]


def batch_size(tree: Any) -> Optional[int]:
    """The batch size of a batch (any nesting, dataclass fields included): the most common dim-0
    size among its tensors of rank >= 1 (the first seen on a tie), or ``None`` without such a tensor.

    >>> batch_size({"x": torch.zeros(8, 3), "y": torch.zeros(8), "mask": torch.zeros(1, 3)})
    8
    """
    sizes = Counter(int(t.shape[0]) for t in tensor_leaves(tree) if t.dim() >= 1)
    if not sizes:
        return None
    best = max(sizes.values())
    return next(s for s in sizes if sizes[s] == best)


def take_rows(tree: Any, idx: Any, size: int) -> Any:
    """Slice every tensor leaf of ``tree`` whose dim 0 equals ``size`` (the batch dimension) to
    the rows ``idx`` (a list or a long tensor); other leaves and non-tensors pass unchanged."""
    idx = torch.as_tensor(idx, dtype=torch.long)

    def cut(x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 1 and x.shape[0] == size:
            return x.index_select(0, idx.to(x.device))
        return x

    return map_tensors(cut, tree)


def batch_coupled(model: torch.nn.Module, training: Iterable[str]) -> list[str]:
    """FQNs of the layers whose output for one sample depends on the rest of the batch: BatchNorm
    in training mode (``training``: the FQNs of modules in training mode). Per-sample results
    differ from the whole batch's there."""
    on = set(training)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and n in on]
