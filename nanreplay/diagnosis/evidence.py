"""Interpreting the evidence of a birth: what an op's mathematical domain is (the domain table)
and what the ring buffer's grad norms and learning rates say about the steps before it."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

from ..core.jsonable import fnum
from ..engine.probes import node_forward_op

__all__ = ["domain_explanation", "grad_norm_history"]


_DOMAIN = {
    # forward op -> (forward explanation, backward explanation)
    "log": ("log of zero or of a negative value", "log derivative at 0 (1/x)"),
    "log2": ("log2 of zero or of a negative value", "log2 derivative at 0"),
    "log10": ("log10 of zero or of a negative value", "log10 derivative at 0"),
    "log1p": ("log1p at or below -1", "log1p derivative at -1"),
    "xlogy": ("xlogy with y <= 0", "xlogy derivative at y = 0"),
    "sqrt": ("sqrt of a negative value", "sqrt derivative at 0"),
    "rsqrt": ("rsqrt of zero or of a negative value", "rsqrt derivative at 0"),
    "div": ("division by zero (x/0 is Inf, 0/0 is NaN)", "division by zero in the derivative of a division"),
    "reciprocal": ("reciprocal of zero", "reciprocal derivative at 0"),
    "pow": ("pow of zero to a negative power, or of a negative base to a fractional power", "pow derivative at a zero base"),
    "acos": ("acos outside [-1, 1]", "acos derivative at +-1"),
    "asin": ("asin outside [-1, 1]", "asin derivative at +-1"),
    "atanh": ("atanh at or outside +-1", "atanh derivative at +-1"),
    "acosh": ("acosh below 1", "acosh derivative at 1"),
    "softmax": ("softmax of a row that is entirely -Inf (every position masked)", "softmax derivative of a fully masked row"),
    "_softmax": ("softmax of a row that is entirely -Inf (every position masked)", "softmax derivative of a fully masked row"),
    "log_softmax": ("log_softmax of a row that is entirely -Inf", "log_softmax derivative of a fully masked row"),
    "_log_softmax": ("log_softmax of a row that is entirely -Inf", "log_softmax derivative of a fully masked row"),
    "linalg_vector_norm": ("norm of an infinite vector", "norm derivative at the zero vector (0/0)"),
    "norm": ("norm of an infinite vector", "norm derivative at the zero vector (0/0)"),
    "std": ("std with a non-positive correction count", "std derivative with zero variance"),
    "var": ("var with a non-positive correction count", "var derivative"),
    "mean": ("mean of an empty tensor (0/0)", "mean derivative"),
    "exp": ("exp of a large value", "exp derivative of a large value"),
    "mul": ("0 * Inf", "0 * Inf in a derivative"),
    "sub": ("Inf - Inf", "Inf - Inf in a derivative"),
    "add": ("Inf + (-Inf)", "Inf + (-Inf) in a derivative"),
}


def domain_explanation(op: str, *, backward: bool, node: Optional[str] = None) -> Optional[str]:
    """A short description of the mathematical domain error of ``op`` (an aten op name, or in
    the backward pass the forward op of ``node``); ``None`` when none is known."""
    key = node_forward_op(node) if backward and node else None
    for k in (key, op, op.rstrip("_")):
        if k and k in _DOMAIN:
            return _DOMAIN[k][1 if backward and k == key else 0]
    return None


def grad_norm_history(steps: Sequence[Any], failing_step: int, *, ratio: float = 10.0) -> Optional[dict]:
    """Explosion evidence from the ring buffer: the finite grad norms of the steps before the
    failing one, and whether the latest is at least ``ratio`` times the median of the earlier
    ones, or the learning rate jumped by ``ratio`` within the window.

    Args:
        steps: ring-buffer records with ``step``, ``grad_norm`` (float or None) and ``lrs``.
    """
    prior = [s for s in steps if s.step < failing_step]
    norms = [(s.step, float(s.grad_norm)) for s in prior if s.grad_norm is not None and math.isfinite(float(s.grad_norm))]
    lrs = [(s.step, max(s.lrs)) for s in steps if s.lrs]
    out: dict = {"grad_norms": [[k, v] for k, v in norms], "lrs": [[k, fnum(v)] for k, v in lrs], "exploding": False, "lr_spike": None}
    if len(norms) >= 2:
        base = statistics.median(v for _, v in norms[:-1])
        out["growth"] = norms[-1][1] / base if base > 0 else math.inf
        out["exploding"] = bool(out["growth"] >= ratio)
    if len(lrs) >= 2:
        vals = [v for _, v in lrs]
        lo = min(vals)
        hi_step, hi = max(lrs, key=lambda kv: kv[1] if math.isfinite(kv[1]) else math.inf)
        if lo > 0 and (not math.isfinite(hi) or hi / lo >= ratio):
            out["lr_spike"] = {"step": hi_step, "lr": fnum(hi), "min_lr": lo}
    out["growth"] = fnum(out.get("growth"))
    return out
