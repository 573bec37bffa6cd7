"""Interpreting what was observed at a birth: the op's mathematical domain (a table), which of its
operands put it outside that domain and where that operand came from, and what the ring buffer's
grad norms, losses and learning rates say about the steps before it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..core.jsonable import fnum
from ..engine.probes import node_forward_op

__all__ = ["Domain", "DOMAIN", "domain_of", "offending_operand", "sources", "describe_sources", "grad_norm_history", "POSITIVE_OPS"]


@dataclass(frozen=True)
class Domain:
    """What puts one op outside its domain.

    Attributes:
        forward, backward: the explanation in the forward pass, and for the op's derivative.
        kind: ``zero`` (undefined at 0: log, division, rsqrt, pow of 0 to a negative power...),
            ``negative`` (sqrt of x < 0), ``bound`` (acos outside [-1, 1]), ``empty`` (a mean over
            0 elements), ``masked`` (a softmax row with every position -Inf), ``count`` (var/std
            over too few elements), ``ignored`` (a loss whose every target is ignored), ``large``
            (exp of a large value), ``inf`` (Inf - Inf, 0 * Inf).
        operand: the schema name of the operand at fault (``other`` is the divisor of ``div``);
            ``None`` when any operand may be.
        backward_kind: the kind of the derivative's domain (most derivatives blow up at 0: sqrt,
            log, rsqrt, pow; acos/asin at +-1); in the backward pass any operand may be at fault.
    """

    forward: str
    backward: str
    kind: str
    operand: Optional[str] = "self"
    backward_kind: str = "zero"


_D = Domain
#: op name (aten overload packet, without underscores at the ends) -> its domain
DOMAIN: dict[str, Domain] = {
    "log": _D("log of zero or of a negative value", "log derivative at 0 (1/x)", "zero"),
    "log2": _D("log2 of zero or of a negative value", "log2 derivative at 0", "zero"),
    "log10": _D("log10 of zero or of a negative value", "log10 derivative at 0", "zero"),
    "log1p": _D("log1p at or below -1", "log1p derivative at -1", "bound"),
    "xlogy": _D("xlogy with y <= 0", "xlogy derivative at y = 0", "zero", "other"),
    "sqrt": _D("sqrt of a negative value", "sqrt derivative at 0", "negative"),
    "rsqrt": _D("rsqrt of zero or of a negative value", "rsqrt derivative at 0", "zero"),
    "div": _D("division by zero (x/0 is Inf, 0/0 is NaN)", "division by zero in the derivative of a division", "zero", "other"),
    "reciprocal": _D("reciprocal of zero", "reciprocal derivative at 0", "zero"),
    "pow": _D("pow of zero to a negative power, or of a negative base to a fractional power", "pow derivative at a zero base", "zero"),
    "acos": _D("acos outside [-1, 1]", "acos derivative at +-1", "bound", backward_kind="bound"),
    "asin": _D("asin outside [-1, 1]", "asin derivative at +-1", "bound", backward_kind="bound"),
    "atanh": _D("atanh at or outside +-1", "atanh derivative at +-1", "bound", backward_kind="bound"),
    "acosh": _D("acosh below 1", "acosh derivative at 1", "bound", backward_kind="bound"),
    "angle": _D("angle of a complex value", "angle derivative at 0 (1/|z|^2)", "zero"),
    "abs": _D("abs", "abs derivative of a complex 0 (z/|z|)", "zero"),
    "softmax": _D("softmax of a row that is entirely -Inf (every position masked)", "softmax derivative of a fully masked row", "masked"),
    "safe_softmax": _D("softmax of a row that is entirely -Inf (every position masked)", "softmax derivative of a fully masked row", "masked"),
    "log_softmax": _D("log_softmax of a row that is entirely -Inf", "log_softmax derivative of a fully masked row", "masked"),
    "linalg_vector_norm": _D("norm of an infinite vector", "norm derivative at the zero vector (0/0)", "zero"),
    "norm": _D("norm of an infinite vector", "norm derivative at the zero vector (0/0)", "zero"),
    "cdist": _D("cdist", "cdist derivative at zero distance", "zero"),
    "std": _D("std with no more elements than its correction", "std derivative with zero variance", "count"),
    "var": _D("var with no more elements than its correction", "var derivative", "count"),
    "std_mean": _D("std with no more elements than its correction", "std derivative with zero variance", "count"),
    "var_mean": _D("var with no more elements than its correction", "var derivative", "count"),
    "mean": _D("mean of an empty tensor (0/0)", "mean derivative of an empty tensor", "empty"),
    "nll_loss": _D("a mean over zero targets (every target is ignore_index)", "nll_loss derivative with no target", "ignored", "target"),
    "nll_loss_forward": _D("a mean over zero targets (every target is ignore_index)", "nll_loss derivative with no target", "ignored", "target"),
    "nll_loss2d_forward": _D("a mean over zero targets (every target is ignore_index)", "nll_loss derivative with no target", "ignored", "target"),
    "ctc_loss": _D("a CTC target that no alignment of the input can produce (target longer than the input)", "CTC derivative of an impossible alignment", "count", None),
    "exp": _D("exp of a large value", "exp derivative of a large value", "large", backward_kind="large"),
    "mul": _D("0 * Inf", "0 * Inf in a derivative", "inf", None, backward_kind="inf"),
    "sub": _D("Inf - Inf", "Inf - Inf in a derivative", "inf", None, backward_kind="inf"),
    "add": _D("Inf + (-Inf)", "Inf + (-Inf) in a derivative", "inf", None, backward_kind="inf"),
}

#: ops whose output is mathematically positive for finite inputs: an exact 0 there is an underflow
POSITIVE_OPS = frozenset({"exp", "exp2", "softmax", "sigmoid", "softplus", "cosh"})


def _bare(op: Optional[str]) -> str:
    return (op or "").strip("_")


def domain_of(birth: dict) -> Optional[tuple[str, Domain]]:
    """(op name, :class:`Domain`) of a birth: in the backward pass, the forward op of its autograd
    node when the table knows it (``SqrtBackward0`` -> ``sqrt``, with the derivative's domain:
    its kind is ``backward_kind`` and any operand may be at fault), else the op itself."""
    if birth.get("phase") == "backward":
        k = _bare(birth.get("forward_op") or node_forward_op(birth.get("node")))
        if k in DOMAIN:
            d = DOMAIN[k]
            return k, Domain(d.forward, d.backward, d.backward_kind, None, d.backward_kind)
    k = _bare(birth.get("op"))
    return (k, DOMAIN[k]) if k in DOMAIN else None


def explanation(birth: dict) -> Optional[str]:
    """The domain error in words, for the pass the birth happened in."""
    d = domain_of(birth)
    if d is None:
        return None
    name, dom = d
    return dom.backward if birth.get("phase") == "backward" and name == _bare(birth.get("forward_op")) else dom.forward


def offending_operand(birth: dict) -> Optional[dict]:
    """The operand that put the op outside its domain: by the domain table's operand name where
    it holds the tell-tale values (zeros for a ``zero`` domain, an empty tensor for ``empty``,
    negatives for ``negative``...), else the first operand that does; ``None`` when no operand shows it.
    In the backward pass, where the derivative's domain names no operand, the kernel op's own
    table entry does when its kind is the derivative's: log's derivative runs ``grad / x``, whose
    divisor ``x`` holds the zeros, while the incoming gradient holds zeros of its own. Where the
    monitor counted them at the output's non-finite positions (``zeros_where_born``), an operand
    with its tell-tale values there comes first."""
    ops = ((birth.get("operands") or {}).get("tensors") or [])
    if not ops:
        return None
    d = domain_of(birth)
    kind = d[1].kind if d else None

    def telling(o: dict) -> bool:
        if kind in ("zero",):
            return bool(o.get("zeros"))
        if kind == "negative":
            return bool(o.get("negatives")) or bool(o.get("zeros"))
        if kind == "empty":
            return o.get("numel") == 0
        if kind == "masked":
            return bool(o.get("neginf"))
        if kind == "inf":
            return bool(o.get("posinf") or o.get("neginf"))
        return True

    def there(o: dict) -> bool:  # its tell-tale values where the output is non-finite (when the monitor counted them)
        if kind == "zero":
            return bool(o.get("zeros_where_born"))
        if kind == "negative":
            return bool(o.get("negatives_where_born")) or bool(o.get("zeros_where_born"))
        return False

    name = d[1].operand if d is not None else None
    if name is None and birth.get("phase") == "backward":  # the kernel's own operand at fault: the divisor of log's grad / x
        kernel = DOMAIN.get(_bare(birth.get("op")))
        name = kernel.operand if kernel is not None and kernel.kind == kind else None
    named = [o for o in ops if name is not None and o.get("name") == name]
    ordered = named + [o for o in ops if o not in named]
    for o in [o for o in ordered if there(o)] + ordered:
        if telling(o):
            return o
    return named[0] if named else None


def sources(operand: Optional[dict]) -> dict:
    """Where an operand's values come from, from its provenance: ``batch`` (leaf paths),
    ``weights`` (bool), ``buffers`` (FQNs), ``const``, ``rng``, ``lookup`` (bools; ``lookup``: the
    batch chose entries of a table of the code, :func:`nanreplay.engine.monitors._provenance`)."""
    prov = (operand or {}).get("prov") or []
    return {
        "batch": sorted(p[len("batch:"):] for p in prov if p.startswith("batch:")),
        "weights": "weights" in prov,
        "buffers": sorted(p[len("buffer:"):] for p in prov if p.startswith("buffer:")),
        "const": "const" in prov,
        "rng": "rng" in prov,
        "lookup": "lookup" in prov,
    }


def describe_sources(src: dict) -> str:
    """``derives from batch['y'] and the weights``, in words."""
    parts = [", ".join(src["batch"])] if src["batch"] else []
    if src.get("lookup") and parts:
        parts[0] += " (as positions in a table of the code)"
    if src["weights"]:
        parts.append("the weights")
    if src["buffers"]:
        parts.append("buffer" + ("s " if len(src["buffers"]) > 1 else " ") + ", ".join(src["buffers"]))
    if src["rng"]:
        parts.append("random draws")
    if not parts and src["const"]:
        parts.append("constants of the code")
    return " and ".join(parts) if parts else "unknown sources"


#: the most recent steps in which a learning-rate jump counts as a spike (a warm-up over the
#: whole scalar history is not one)
LR_WINDOW = 16


def _norm(s: Any) -> Optional[float]:
    """A step's grad norm as the evidence reads it: the norm before clipping when the loop gave it
    (``Recorder.log_grad_norm``: under clipping the norm the optimizer sees stays at the clip
    value), else the check's norm."""
    v = getattr(s, "grad_norm_pre_clip", None)
    v = s.grad_norm if v is None else v
    return None if v is None else float(v)


def grad_norm_history(steps: Sequence[Any], failing_step: int, *, ratio: float = 10.0) -> Optional[dict]:
    """Explosion evidence from the scalar history and the ring buffer (``steps``: the merged
    records, :meth:`~nanreplay.engine.run.StepInputs.long_history`): the grad norms of the steps before the failing one
    (finite ones; a step whose float32 2-norm overflowed keeps its float64 norm; the norm before
    clipping where the loop gave it), whether the latest is at least ``ratio`` times the median of
    the earlier ones (a median of 0 gives no growth: nothing is exploding), the losses, and whether the
    learning rate jumped by ``ratio`` within the last ``LR_WINDOW`` steps or was non-finite.

    Args:
        steps: ring-buffer records with ``step``, ``grad_norm`` and ``loss`` (float or None) and ``lrs``.

    Returns:
        ``{"grad_norms": [[step, norm]], "losses": [[step, loss]], "lrs": [[step, max lr]],
        "growth", "exploding", "lr_spike", "nonfinite_lr"}``.
    """
    prior = [(s.step, _norm(s)) for s in steps if s.step < failing_step]
    norms = [(k, v) for k, v in prior if v is not None and math.isfinite(v)]
    losses = [[s.step, fnum(s.loss)] for s in steps if s.loss is not None]
    lrs = [(s.step, max(s.lrs, key=lambda v: v if math.isfinite(v) else math.inf)) for s in steps if s.lrs]
    bad_lr = next(([k, fnum(v)] for k, v in lrs if not math.isfinite(v)), None)
    out: dict = {"grad_norms": [[k, v] for k, v in norms], "losses": losses, "lrs": [[k, fnum(v)] for k, v in lrs], "exploding": False,
                 "lr_spike": None, "nonfinite_lr": bad_lr}
    if len(norms) >= 2:
        base = statistics.median(v for _, v in norms[:-1])
        if base > 0:  # growth needs a scale to grow from: a zero norm (or zeros before it) is not exploding
            out["growth"] = norms[-1][1] / base
            out["exploding"] = bool(out["growth"] >= ratio)
    recent = lrs[-LR_WINDOW:]
    if len(recent) >= 2:
        finite = [v for _, v in recent if math.isfinite(v)]
        lo = min(finite) if finite else math.nan
        hi_step, hi = max(recent, key=lambda kv: kv[1] if math.isfinite(kv[1]) else math.inf)
        if lo > 0 and (not math.isfinite(hi) or hi / lo >= ratio):
            out["lr_spike"] = {"step": hi_step, "lr": fnum(hi), "min_lr": lo}
    out["growth"] = fnum(out.get("growth"))
    return out
