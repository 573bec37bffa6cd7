"""The per-step check on the host (``check_every=1``): one fused norm, one host read.

:func:`read_check` reads the grad norm and the loss (and, under ``torch.distributed``, every
rank's flags, all-reduced on the device first) with one ``tolist()``; :func:`overflowed_norm`
tells an exploding step (finite gradients whose float32 2-norm overflows) from a non-finite one,
on that rare path only. The sync-free variant is :mod:`nanreplay.capture.lagged`.
"""

from __future__ import annotations

import logging
import math
from itertools import repeat
from operator import is_not
from typing import Any, Optional, Sequence

import torch

from ..core.numerics import combined_norm, fused_norm, total_norm
from ..format.records import StepRecord

logger = logging.getLogger(__name__)

__all__ = ["CPU_READS_EACH", "HOST_NORMS", "read_check", "read_norms", "nonfinite_micro_batch", "overflowed_norm", "warn_explosion", "explosion", "lr_value"]


_NONE = repeat(None)
#: on the CPU, read each per-tensor norm as a float instead of stacking them first (there is no
#: device to wait on: about 1 µs instead of 2.6 for a small model); off, the CPU takes the device's
#: path (one stacked ``tolist()``), which is how a test counts the device path's host reads
CPU_READS_EACH = True

#: most per-tensor norms read to the host and summed there (:func:`read_check`); more are reduced
#: on the device first, so the host read stays one small copy
HOST_NORMS = 512


def read_check(norms: Sequence[torch.Tensor], loss: Optional[torch.Tensor], dist: Any = None,
               extra: Sequence[Optional[torch.Tensor]] = ()) -> tuple[Optional[float], Optional[float], Optional[bool], list]:
    """(grad norm, loss, agreed finiteness, extra values) as host values from one host read.
    ``norms``: the gradients' per-tensor 2-norms (:func:`~nanreplay.core.numerics.tensor_norms`,
    0-dim float32 on one device; ``[]`` without gradients). On one process with up to
    :data:`HOST_NORMS` of them, they are read with the loss in one ``tolist()`` and their total is
    taken on the host (:func:`~nanreplay.core.numerics.total_norm`: two fewer device ops than a
    total on the device); else the total is taken on the device first. The agreed finiteness is
    ``None`` outside torch.distributed (``dist`` is ``None``); inside, the
    ranks' flags are all-reduced on the device first (:meth:`nanreplay.capture.ddp.RankContext.agree`).
    ``extra``: more device scalars read in the same host read (the GradScaler's scale, the grad
    norm before clipping), their host floats returned in order (``None`` for a ``None``); they
    take no part in the ranks' agreement."""
    if dist is None and norms and len(norms) <= HOST_NORMS and not any(map(is_not, extra, _NONE)) and \
            (loss is None or (loss.dtype is torch.float32 and loss.dim() == 0)):
        read = read_norms(norms, loss)  # the usual step
        if read is not None:
            return (*read, None, [None] * len(extra))
    norm = combined_norm(norms)
    present = [t for t in (norm, loss) if t is not None]
    more = [t for t in extra if t is not None]
    if dist is None and not present and not more:
        return None, None, None, [None] * len(extra)
    device = present[0].device if present else (more[0].device if more else dist.device())
    # 0-dim float32 on one device (the norm already is, the loss from log_loss usually): no copy, no view
    parts = [t if t.dtype == torch.float32 and t.dim() == 0 and t.device == device else t.to(device, torch.float32).reshape(())
             for t in present]
    flat = torch.stack(parts) if parts else torch.zeros(0, device=device)
    n = len(parts)
    if dist is not None:
        flat = torch.cat([flat, dist.agree(flat, loss_bad=parts[-1] if loss is not None else None)])
    if more:
        flat = torch.cat([flat] + [t.detach().to(device, torch.float32).reshape(1) for t in more])
    vals = flat.tolist()  # the one host read
    it = iter(vals[:n])
    g = next(it) if norm is not None else None
    lo = next(it) if loss is not None else None
    tail = iter(vals[len(vals) - len(more):])
    agreed = dist.decide(vals[n:len(vals) - len(more)]) if dist is not None else None
    return g, lo, agreed, [None if t is None else next(tail) for t in extra]


def read_norms(norms: Sequence[torch.Tensor], loss: Optional[torch.Tensor]) -> Optional[tuple[float, Optional[float]]]:
    """(total grad norm, loss) from the per-tensor norms and a 0-dim float32 loss, in one host
    read (on the CPU, where nothing waits on a device, each read as it is: cheaper than stacking
    them first); ``None`` when the loss is on another device than the norms (:func:`read_check`
    then moves it)."""
    if norms[0].is_cpu:
        if loss is not None and not loss.is_cpu:
            return None
        if CPU_READS_EACH:
            return total_norm(list(map(float, norms))), (float(loss) if loss is not None else None)
    elif loss is not None and loss.device != norms[0].device:
        return None
    vals = torch.stack([*norms, loss] if loss is not None else norms).tolist()
    lo = vals.pop() if loss is not None else None
    return total_norm(vals), lo


def nonfinite_micro_batch(losses: list[torch.Tensor]) -> Optional[dict]:
    """``{"nonfinite_loss_micro_batch": i, "micro_batches": n}`` for a step whose loss is
    non-finite, ``i`` the first of its ``n`` micro-batch losses (``Recorder.log_loss`` calls)
    that is; ``None`` with fewer than two. Failure path only: one more host read."""
    if len(losses) < 2:
        return None
    bad = [int(i) for i in (~torch.isfinite(torch.stack([t.to(losses[0].device) for t in losses]))).nonzero().flatten().tolist()]
    return {"nonfinite_loss_micro_batch": bad[0], "micro_batches": len(losses)} if bad else None


def overflowed_norm(grads: list[torch.Tensor]) -> Optional[float]:
    """The float64 2-norm of ``grads`` when every gradient is finite (the float32 norm overflowed),
    else ``None``. Rare path: one ``_foreach_norm(inf)`` and one float64 pass."""
    if not grads:
        return None
    maxes = fused_norm(grads, ord=math.inf)
    if maxes is None or not math.isfinite(float(maxes)):
        return None
    return math.sqrt(sum(float(torch.linalg.vector_norm(g.detach().double(), 2)) ** 2 for g in grads))


def warn_explosion(rec: StepRecord, grads: list, steps: list[StepRecord], *, dumping: bool) -> None:
    """Log an exploding step (finite gradients whose float32 2-norm overflows): its float64
    norm, its largest gradient, and the grad norms of the ``steps`` held."""
    history = [(r.step, r.grad_norm) for r in steps if r.grad_norm is not None]
    largest = max(grads, key=lambda kv: float(kv[1].detach().abs().max()) if kv[1].numel() else 0.0)
    logger.warning(
        "nanreplay: step %d: exploding gradients: every gradient is finite, but the float32 2-norm overflows (the sum of "
        "squares passes float32's range; in float64 the norm is %.4g; largest |gradient| %.4g in %s); grad norms of the "
        "steps held: %s. Training goes on; the bundle is written at the first non-finite gradient%s",
        rec.step, rec.grad_norm, float(largest[1].detach().abs().max()), largest[0],
        ", ".join(f"{k}: {v:.3g}" for k, v in history), "" if not dumping else " (and now: dump_on_explosion)")


def explosion(rec: StepRecord, grads: list, agreed: Optional[bool], *, ring: Any, dump: Any, live: Any, dumping: bool) -> bool:
    """Whether the step ``rec``, whose grad norm read ``inf`` on this rank alone (``agreed`` is
    ``None``), is an exploding step: every gradient finite, the float32 2-norm overflowed. Then
    its true norm (float64) replaces ``rec.grad_norm``, it is logged with the grad-norm history
    of ``ring`` and, with ``dumping`` (``dump_on_explosion``), dumped through ``dump`` (``live``:
    the live state for the bundle)."""
    if rec.grad_norm is None or not math.isinf(rec.grad_norm) or agreed is not None:
        return False
    wide = overflowed_norm([g for _, g in grads])
    if wide is None:
        return False
    rec.grad_norm = wide
    warn_explosion(rec, grads, ring.upto(rec.step), dumping=dumping)
    if dumping and dump.allowed:
        dump(rec, grads, live, cause={"explosion": True, "message": "exploding gradients (finite, float32 2-norm overflows)"})
    return True


def lr_value(lr: Any) -> Any:
    """A param group's learning rate as kept in the ring buffer: a float as is; a tensor (fused
    or capturable optimizers, some schedulers) as a detached copy on its device, because
    ``float()`` of a CUDA tensor would be a host sync every step. Converted at dump time."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)
