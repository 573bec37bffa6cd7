"""The sync-free check (``check_every=N > 1``): the verdict stays on the device, like
GradScaler's ``found_inf``, and the host reads it once every N steps.

A device-side latch keeps the first non-finite step's pre-step weights, optimizer state and
gradients until the host reads the verdicts, so its bundle holds the same content as with a
per-step check. :func:`nonfinite_flag` is the device-side verdict of one step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..format.records import Snapshot, StepRecord

__all__ = ["Latch", "nonfinite_flag"]


def nonfinite_flag(norm: Optional[torch.Tensor], loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 0-dim bool device tensor: True when the grad norm or the loss is non-finite. No sync."""
    flags = [torch.logical_not(torch.isfinite(t.detach().reshape(()))) for t in (norm, loss) if t is not None]
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = out | f.to(out.device)
    return out


def _layout(spec: object, tensors: list) -> tuple:
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))


class Latch:
    """The sync-free mode's device-side evidence: the pre-step params, optimizer state tensors
    and gradients of the first non-finite step since the last host check.

    Every step, before its update: ``slot = where(latched, slot, live)`` for each tensor, then
    ``latched |= bad``. So the slot follows the live state until a non-finite step, holds that
    step's values from then on, and the host never has to look in between. The layout of the
    live state (params with and without gradients, optimizer state tensors created lazily on the
    first step) may change while the latch is open; the slot is then reallocated, which is only
    right while nothing has latched, so a layout change also reads the latch (the one case that
    syncs between checks: the first step of a fresh optimizer, and the first after a param starts
    receiving gradients).
    """

    def __init__(self) -> None:
        self.latched: Optional[torch.Tensor] = None  # 0-dim bool, device
        self.key: Optional[tuple] = None
        self.names: list[str] = []
        self.live_spec: Any = None
        self.params: list[torch.Tensor] = []
        self.opt: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []

    def update(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list, bad: torch.Tensor) -> None:
        """Move the latch for one step: ``grads`` are its ``(fqn, gradient)`` pairs, ``bad`` its
        0-dim bool device flag (non-finite grad norm or loss). No host sync, but on a layout change."""
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        opt_leaves, opt_spec = pytree.tree_flatten(optimizer.state_dict()["state"])
        opt_t = [t for t in opt_leaves if isinstance(t, torch.Tensor)]
        g = [t for _, t in grads]
        key = (tuple(n for n, _ in params), _layout(opt_spec, opt_t), tuple(n for n, _ in grads), _layout(None, g))
        dev = bad.device
        if key != self.key:
            if self.latched is not None and bool(self.latched):  # layout change after a latch: keep it frozen
                self.latched = self.latched | bad
                return
            self.key, self.names, self.live_spec = key, [n for n, _ in grads], opt_spec
            self.params = [p.clone() for _, p in params]
            self.opt = [t.clone() for t in opt_t]
            self.grads = [t.detach().clone() for t in g]
            self.latched = torch.zeros((), dtype=torch.bool, device=dev)
        else:
            keep = self.latched
            for dst, src in zip(self.params + self.opt + self.grads, [p for _, p in params] + opt_t + g):
                torch.where(keep.to(dst.device), dst, src.detach(), out=dst)
        self.latched = self.latched | bad

    def reset(self) -> None:
        """Open the latch again after a host check; the slot's tensors are kept for reuse."""
        if self.latched is not None:
            self.latched = torch.zeros_like(self.latched)

    def snapshot(self, live_sd: dict, rec: StepRecord) -> Snapshot:
        """The latched step's pre-step state as a Snapshot (params, buffers from the ring record,
        optimizer state with the slot's tensors and the live non-tensor entries, lrs of ``rec``)."""
        names = self.key[0] if self.key else ()
        leaves, spec = pytree.tree_flatten(live_sd["state"])
        it = iter(self.opt)
        state = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        groups = [dict(gr) for gr in live_sd["param_groups"]]
        for gr, lr in zip(groups, rec.lrs):
            gr["lr"] = lr
        return Snapshot(
            params=dict(zip(names, self.params)),
            buffers=dict(rec.buffers or {}),
            optimizer={"state": state, "param_groups": groups},
            extra={},
        )

    def grad_list(self) -> list:
        return list(zip(self.names, self.grads))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params + self.opt + self.grads)
