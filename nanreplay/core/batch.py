"""The batch dimension, defined once: how big a recorded batch is, which dimension of each tensor
holds its samples, how to cut rows out of it, and which layers make a sample's result depend on
the rest of its batch.

The batch size is the size that every tensor of the batch has in some dimension (``x [B, F]`` and
``y [B]``; a time-major ``x [T, B, F]`` with ``y [B]`` too), preferring dimension 0; a tensor's
batch dimension is its first dimension of that size. Tensors without it (a shared mask, a
constant) are left whole.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

import torch

from .tree import map_tensors, tensor_leaves

__all__ = ["batch_size", "batch_dim", "take_rows", "rows_of", "batch_coupled"]


def batch_size(tree: Any) -> Optional[int]:
    """The batch size of a batch (any nesting, dataclass fields included): among the sizes that
    every tensor of rank >= 1 has in some dimension, the one found most often in dimension 0
    (then the first tensor's earliest); without a common size, the most common dim-0 size.
    ``None`` without a tensor of rank >= 1.

    >>> batch_size({"x": torch.zeros(8, 3), "y": torch.zeros(8), "mask": torch.zeros(1, 3)})
    8
    >>> batch_size((torch.zeros(6, 8, 10), torch.zeros(8)))  # time-major inputs, batch of 8
    8
    """
    shaped = [t for t in tensor_leaves(tree) if t.dim() >= 1]
    if not shaped:
        return None
    common = set(shaped[0].shape)
    for t in shaped[1:]:
        common &= set(t.shape)
    first_dim0 = Counter(int(t.shape[0]) for t in shaped)
    if common:
        order = [int(s) for s in shaped[0].shape]
        return max(sorted(common, key=order.index), key=lambda s: first_dim0.get(s, 0))
    best = max(first_dim0.values())
    return next(s for s in first_dim0 if first_dim0[s] == best)


def batch_dim(t: torch.Tensor, size: int) -> Optional[int]:
    """The first dimension of ``t`` of length ``size``, or ``None``."""
    return next((d for d, n in enumerate(t.shape) if n == size), None)


def take_rows(tree: Any, idx: Any, size: int) -> Any:
    """Slice every tensor leaf of ``tree`` along its batch dimension (its first dimension of
    length ``size``) to the rows ``idx`` (a list or a long tensor); other leaves pass unchanged."""
    idx = torch.as_tensor(idx, dtype=torch.long)

    def cut(x: torch.Tensor) -> torch.Tensor:
        d = batch_dim(x, size) if x.dim() else None
        return x.index_select(d, idx.to(x.device)) if d is not None else x

    return map_tensors(cut, tree)


def rows_of(mask: torch.Tensor, size: int) -> Optional[list[int]]:
    """The batch rows where boolean ``mask`` is true anywhere (along its first dimension of length
    ``size``), or ``None`` when it has no such dimension."""
    d = batch_dim(mask, size) if mask.dim() else None
    if d is None:
        return None
    per_row = mask.movedim(d, 0).reshape(size, -1).any(dim=1)
    return [int(i) for i in per_row.nonzero().flatten().tolist()]


def batch_coupled(model: torch.nn.Module, training: Iterable[str]) -> list[str]:
    """FQNs of the layers whose output for one sample depends on the rest of the batch: BatchNorm
    in training mode (``training``: the FQNs of modules in training mode), by type or, in a model
    rebuilt from an embedded program, by class name. Per-sample results differ from the whole
    batch's there."""
    on = set(training)
    return [n for n, m in model.named_modules() if n in on and (isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or type(m).__name__ in _BATCH_NORMS)]


#: class names of the batch-coupled layers: a model rebuilt from an embedded program keeps only the names
_BATCH_NORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"})
