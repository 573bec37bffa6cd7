"""Copying recorded state into live tensors, defined once: buffers into a module, and many
tensors at once with one multi-tensor ``torch._foreach_copy_``."""

from __future__ import annotations

import torch

__all__ = ["load_buffers", "copy_all"]


def load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy recorded buffers (FQN -> tensor, e.g. a step's step-start BatchNorm running stats)
    into ``model``'s buffers in place. Names the model lacks, shapes that differ and tensors
    that already are the live buffer's storage are left alone."""
    live = dict(model.named_buffers())
    with torch.no_grad():
        for n, t in buffers.items():
            b = live.get(n)
            if b is not None and b.shape == t.shape and b.data_ptr() != t.data_ptr():
                b.copy_(t)


def copy_all(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for all i, with one multi-tensor ``_foreach_copy_``."""
    if not dst:
        return
    try:
        torch._foreach_copy_(dst, src)
    except (AttributeError, RuntimeError):  # older torch without _foreach_copy_
        for d, s in zip(dst, src):
            d.copy_(s)
