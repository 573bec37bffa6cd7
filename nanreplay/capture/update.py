"""``check_update``: whether the optimizer's update made the weights or its state non-finite.

:class:`UpdateCheck` owns the mode's state: the copy of the pre-step weights, buffers and
optimizer state taken in the step pre-hook (into the recycled snapshot slot, counted in the ring
buffer as ``"check_update"`` while the step runs), and whether the mode is still on. After
``optimizer.step()``, :meth:`UpdateCheck.finite` is one fused ``_foreach_norm`` over the updated
parameters and floating optimizer state and one host read; :func:`check_update` acts on a
non-finite one (restore, dump, action).

Memory: the copy counts against ``memory_budget``. A copy that cannot fit beside the step in
progress (the optimizer creates its state at its first step, after the check at construction)
turns the mode off, once, with a warning naming the budget it needs.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.numerics import fused_norm, is_float
from ..format.records import Snapshot
from .ring import MiB, tensor_bytes
from .sharded import local

logger = logging.getLogger(__name__)

__all__ = ["UpdateCheck", "check_update"]


class UpdateCheck:
    """The update check's copy and switch.

    Args:
        ring: the ring buffer (counts the copy; its snapshot pool recycles it).

    Attributes:
        on: the check runs (``False`` once its copy outgrew ``memory_budget``).
    """

    def __init__(self, ring: Any) -> None:
        self.ring = ring
        self.on = True

    def keep(self, live: Snapshot) -> None:
        """Copy ``live`` (references to the pre-step state) into the recycled slot when it fits in
        the budget beside the step in progress; else turn the check off, with a warning."""
        need = _copy_bytes(live)
        if self.ring.reserve("check_update", need, from_pool=True):
            self.ring.keep("check_update", self.ring.pool.take(live))
            return
        self.on = False
        budget, required = self.ring.budget, self.ring.required
        logger.warning(
            "nanreplay: check_update=True keeps a copy of the weights, buffers and optimizer state (%d bytes, %.2f MiB), which "
            "memory_budget=%d bytes (%.2f MiB) cannot hold beside the step in progress; the update check is off from now on "
            "(the gradients and the loss are still checked). Raise memory_budget to at least %d bytes (%.2f MiB) to keep it",
            need, need / MiB, budget, budget / MiB, required, required / MiB)

    def take(self) -> Optional[Snapshot]:
        """The copy of the step that just ran (no longer counted), or ``None``."""
        return self.ring.release("check_update")

    def recycle(self, copy: Snapshot) -> None:
        """Give a finite step's copy back to the pool (a restored one may be aliased: never that)."""
        self.ring.pool.release(copy)

    @staticmethod
    def finite(optimizer: torch.optim.Optimizer, buffers: Iterable[torch.Tensor] = ()) -> bool:
        """Whether the parameters, the floating optimizer state (and ``buffers``) are finite: one
        fused norm of their largest magnitude (which, unlike a 2-norm, cannot overflow for finite
        values), one host read. Used after the update, and by ``Recorder.note_checkpoint``."""
        state = [local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and is_float(v) and v.numel() > 1]
        params = [local(p).detach() for g in optimizer.param_groups for p in g["params"]]  # DTensor: this rank's shard
        more = [local(b).detach() for b in buffers if is_float(b)]
        norm = fused_norm([t for t in params + state + more if t.numel()], ord=math.inf)
        return norm is None or math.isfinite(norm.item())


def check_update(rec: Any, pre: Snapshot, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, actions: Any, dump: Any,
                 live_copy: Callable[[], Snapshot], grads: Callable[[], list], nonfinite_steps: list,
                 on_nonfinite: Optional[Callable[[int], None]] = None) -> bool:
    """After ``optimizer.step()`` of the step ``rec``: :meth:`UpdateCheck.finite`; on a
    non-finite update, put back ``pre`` (the copy taken in the pre-hook), dump and diagnose
    (``dump``, a :class:`~nanreplay.capture.dump.Dump`), put the update back again when the
    action keeps the step (``live_copy``: a copy of the live state), then act (``actions``).
    ``on_nonfinite(step)``: told of the non-finite update before the dump (the episode).
    Returns ``True`` when the update was finite."""
    from .actions import Incident
    from .snapshots import restore_into

    if UpdateCheck.finite(optimizer):
        return True
    post = None if actions.restores else live_copy()
    restore_into(model, optimizer, pre)
    found = grads()
    nonfinite_steps.append(rec.step)
    if on_nonfinite is not None:
        on_nonfinite(rec.step)
    path = dump(rec, found, pre, update=True) if dump.allowed else None
    msg = (f"non-finite weights or optimizer state after the update of step {rec.step} (the gradients were finite, grad "
           f"norm {rec.grad_norm})" + dump.outcome(path))
    if post is not None:
        restore_into(model, optimizer, post)  # the action keeps the update
    actions(Incident(rec.step, msg, path, dump.last_diagnosis, update=True))
    return False


def _copy_bytes(live: Snapshot) -> int:
    """Bytes a copy of ``live`` takes (what ``live.nbytes()`` says), without flattening the
    optimizer's ``state_dict`` with pytree every step: ``state`` is ``{index: {key: value}}``."""
    opt_state = (live.optimizer or {}).get("state", {})
    tensors = [*live.params.values(), *live.buffers.values(), *(v for st in opt_state.values() for v in st.values()),
               *pytree.tree_leaves(live.extra)]
    return tensor_bytes(tensors)
