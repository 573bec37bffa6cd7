"""Finiteness checks: the fused one-sync check the recorder runs every step, and the detailed
per-tensor health statistics the replay engine reports.

The fused check follows torch's own gradient clipping (``torch.nn.utils.clip_grad_norm_``):
one multi-tensor ``torch._foreach_norm`` per (device, dtype) group, accumulated in float32, then
the 2-norm of the per-tensor norms. A NaN or Inf anywhere makes the total non-finite, so one host
read of one scalar answers "is any gradient non-finite" and yields the grad norm for free.
The total can also be non-finite when every value is finite but the norm overflows float32
(|g| around 1e19 and up); :func:`count_nonfinite` tells the two apart on the slow path.

One definition each: :func:`any_nonfinite` is the yes/no check of replay and diagnosis,
:func:`kinds` names the kinds of non-finite values a health holds. Torch is imported by the
functions that need it, so ``report`` (no torch) can use :func:`kinds` and :class:`Health`.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

__all__ = ["Health", "tensor_health", "tensor_norms", "fused_norm", "combined_norm", "total_norm", "count_nonfinite", "is_float", "all_finite_flag", "any_nonfinite", "kinds",
           "as_real"]


def is_float(t: torch.Tensor) -> bool:
    """True for floating and complex tensors, the dtypes that can hold NaN or Inf."""
    return t.is_floating_point() or t.is_complex()


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as a real one with a trailing dimension of 2 (real, imaginary), its
    conjugate or negative view resolved first; any other tensor unchanged. NaN/Inf counts and
    comparisons of complex tensors go through it."""
    import torch

    if t.is_complex():
        return torch.view_as_real(t.resolve_conj().resolve_neg())
    return t


def tensor_norms(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """The ``ord``-norm (2 or ``math.inf``) of each of ``tensors``, as 0-dim float32 tensors on the
    first tensor's device, in order: one ``_foreach_norm`` (one per (device, dtype) group when the
    tensors are on several devices, or of a dtype the float32 norm does not take as is), no host
    sync. ``[]`` for an empty sequence."""
    import torch

    if not tensors:
        return []
    if tensors[0].get_device() == tensors[-1].get_device():  # the usual case (an int compare, no device objects): one call
        try:
            return list(torch._foreach_norm(tensors, ord, torch.float32))  # dtype given by position: no keyword parsing
        except (TypeError, RuntimeError):  # several devices after all, float64, an older torch: by group
            pass
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    device = tensors[0].device
    out: list[Any] = [None] * len(tensors)
    for (dev, _), idx in groups.items():
        ts = [tensors[i] for i in idx]
        try:
            per = torch._foreach_norm(ts, ord, dtype=torch.float32)
        except (TypeError, RuntimeError):  # older torch without the dtype argument
            per = torch._foreach_norm([t.float() for t in ts], ord)
        if dev != device:
            per = torch.stack(per).to(device, non_blocking=True).unbind(0)
        for i, n in zip(idx, per):
            out[i] = n
    return out


def fused_norm(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> Optional[torch.Tensor]:
    """The ``ord``-norm (2 or ``math.inf``) over all ``tensors`` as a 0-dim float32 tensor on the
    first tensor's device: :func:`tensor_norms`, then the norm of those norms, with no host sync.
    Returns ``None`` for an empty sequence.
    """
    return combined_norm(tensor_norms(tensors, ord), ord)


def combined_norm(norms: Sequence[torch.Tensor], ord: float = 2.0) -> Optional[torch.Tensor]:
    """The ``ord``-norm of per-tensor ``ord``-norms (:func:`tensor_norms`) on their device: the norm
    over all the tensors, as a 0-dim float32 tensor (no host sync); ``None`` for none."""
    import torch

    return torch.linalg.vector_norm(torch.stack(list(norms)), ord) if norms else None


#: the largest finite float32, the bound of a 2-norm accumulated in float32
FLOAT32_MAX = 3.4028234663852886e38


def total_norm(norms: Sequence[float]) -> float:
    """The 2-norm of per-tensor 2-norms read to the host (:func:`tensor_norms`), as the float32
    total :func:`fused_norm` computes it: NaN when any norm is NaN, else ``inf`` when any is
    infinite or the total overflows float32 (as a float32 accumulation would: an exploding step
    is then told from a non-finite one as on the device, :func:`nanreplay.capture.check.explosion`);
    summed in float64, so it can differ from the device's float32 total in the last bits."""
    s = math.sqrt(math.fsum(map(operator.mul, norms, norms)))  # no Python call per tensor
    return math.inf if s > FLOAT32_MAX else s


def all_finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``t``'s device: whether every element of the floating or complex
    tensor ``t`` is finite (no host read). For float16/bfloat16/float32/float64 one ``aminmax``
    (NaN propagates through min and max, and an Inf is one of them): no temporary, about 7x faster
    on CPU than ``isfinite(t).all()``, which writes a boolean tensor the size of ``t`` first;
    other dtypes (float8) take ``isfinite``."""
    import torch

    x = as_real(t)
    if x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) and x.numel():
        lo, hi = torch.aminmax(x)
        return torch.isfinite(lo) & torch.isfinite(hi)
    return torch.isfinite(x).all()


def any_nonfinite(ts: Union["torch.Tensor", Iterable[Any]]) -> bool:
    """Whether any floating tensor in ``ts`` (one tensor, or an iterable whose non-tensor and
    integer items are skipped; anything else, e.g. an optimizer state's ``int`` step, is not a
    tensor: ``False``) holds a NaN or Inf; one host read (:func:`all_finite_flag` per tensor).
    The one non-finite check of replay and diagnosis (the recorder's hot path uses
    :func:`fused_norm`).

    >>> any_nonfinite([torch.ones(2), torch.tensor([1.0, float("nan")])]), any_nonfinite(torch.arange(3))
    (True, False)
    """
    import torch

    ts = ts if isinstance(ts, Iterable) and not isinstance(ts, torch.Tensor) else [ts]
    fl = [t for t in ts if isinstance(t, torch.Tensor) and is_float(t) and t.numel()]
    if not fl:
        return False
    if len(fl) == 1:
        return not bool(all_finite_flag(fl[0]))
    dev = fl[0].device
    return not bool(torch.stack([all_finite_flag(t).to(dev) for t in fl]).all())


def kinds(h: Any) -> str:
    """The kinds of non-finite values a :class:`Health` (or its JSON dict) counts: ``'NaN'``,
    ``'+Inf'``, ``'-Inf'`` or a combination such as ``'NaN and -Inf'``; ``'finite'`` when it
    counts none; ``'non-finite value'`` when unknown (``None``).

    >>> kinds({"nan": 2, "posinf": 0, "neginf": 1}), kinds({"nan": 0}), kinds(None)
    ('NaN and -Inf', 'finite', 'non-finite value')
    """
    if h is None:
        return "non-finite value"
    h = h.to_json() if hasattr(h, "to_json") else h
    parts = [n for n, k in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf")) if h.get(k)]
    return " and ".join(parts) if parts else "finite"


def count_nonfinite(t: torch.Tensor) -> tuple[int, int, int]:
    """(NaN count, +Inf count, -Inf count) of one tensor; syncs. Zero for non-float dtypes."""
    import torch

    if not is_float(t) or t.numel() == 0:
        return 0, 0, 0
    t = as_real(t)
    counts = torch.stack([torch.count_nonzero(torch.isnan(t)), torch.count_nonzero(torch.isposinf(t)),
                          torch.count_nonzero(torch.isneginf(t))]).tolist()
    return counts[0], counts[1], counts[2]


@dataclass
class Health:
    """Health of one tensor (or of several flattened together).

    Attributes:
        nan, posinf, neginf: counts of NaN, +Inf and -Inf elements.
        numel: element count.
        min, max, mean, absmax: over the finite elements only (``None`` when there are none).
        dtype: torch dtype name, e.g. ``"float32"``; shape: list of ints (first tensor's when several).
    """

    nan: int
    posinf: int
    neginf: int
    numel: int
    min: Optional[float]
    max: Optional[float]
    mean: Optional[float]
    absmax: Optional[float]
    dtype: str
    shape: list[int]

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0

    def kinds(self) -> str:
        """'NaN', '+Inf', '-Inf' or a combination such as 'NaN and -Inf' (:func:`kinds`)."""
        return kinds(self)

    def to_json(self) -> dict:
        return asdict(self)


def tensor_health(tensors: Iterable[torch.Tensor]) -> Optional[Health]:
    """Health over the floating tensors in ``tensors`` (others are skipped); ``None`` if there
    are none. Syncs the device: for replay and reports, never for the training hot path. A finite
    tensor costs two ``aminmax`` (:func:`all_finite_flag`, then its range) and one float64 ``sum``; only
    non-finite ones pay for the NaN/Inf counts and the masked copy of the finite values."""
    import torch

    ts = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and is_float(t)]
    if not ts:
        return None
    nan = pos = neg = numel = 0
    lo, hi, total, absmax, nfin = math.inf, -math.inf, 0.0, 0.0, 0
    for t in ts:
        t = as_real(t)
        numel += t.numel()
        if t.numel() and bool(all_finite_flag(t)):  # the common case: no counts, no masked copy
            lo_t, hi_t = torch.aminmax(t)
            a_lo, a_hi = float(lo_t), float(hi_t)
            lo, hi = min(lo, a_lo), max(hi, a_hi)
            total += float(t.sum(dtype=torch.float64))
            absmax = max(absmax, abs(a_lo), abs(a_hi))
            nfin += t.numel()
            continue
        a, b, c = count_nonfinite(t)
        nan, pos, neg = nan + a, pos + b, neg + c
        fin = t[torch.isfinite(t)].double()
        if fin.numel():
            lo = min(lo, float(fin.min()))
            hi = max(hi, float(fin.max()))
            total += float(fin.sum())
            absmax = max(absmax, float(fin.abs().max()))
            nfin += fin.numel()
    return Health(
        nan=nan,
        posinf=pos,
        neginf=neg,
        numel=numel,
        min=lo if nfin else None,
        max=hi if nfin else None,
        mean=total / nfin if nfin else None,
        absmax=absmax if nfin else None,
        dtype=str(ts[0].dtype).replace("torch.", ""),
        shape=list(ts[0].shape),
    )
