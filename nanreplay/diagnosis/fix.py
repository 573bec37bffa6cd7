"""The fix of a diagnosis, verified by replay (``classification.fix``).

For the cause the classifier gave, the standard fix at the origin op is proposed from two tables:
:data:`FIXES` (a group of op families -> the rewrite of that op and how it reads: an eps inside
``sqrt``/``log``/a division, a clamp into an op's domain, a guard for a fully masked softmax row or
a loss over zero targets, a float16/bfloat16 op computed in float32) and :data:`CAUSE_GROUPS`
(which groups a cause draws from, in order). Where a row holds, the fix is verified by a
counterfactual replay that changes only that op: the call that gave birth (for a birth in a
backward kernel, the forward call whose derivative it is) is rewritten in a plain replay of the step
(:func:`nanreplay.engine.rewrite.replay_rewritten`: its value, and its gradient), and the fix is
verified when the step then produces only finite losses, outputs and gradients. Causes no op
rewrite can fix (an explosion, an optimizer update, non-finite data or weights) get the standard
advice of :data:`ADVICE`, unverified (``verified`` null), with the way to check it.

>>> FIXES["domain"]["sqrt"].text(1e-12)
'sqrt(max(x, 1e-12))'
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..core.results import Fix
from ..engine.deadline import replay_error
from ..engine.rewrite import OpTarget, Rewrite, locate, replay_rewritten
from ..engine.run import StepInputs
from .classify import Features
from .evidence import offending_operand

__all__ = ["FixRow", "FIXES", "CAUSE_GROUPS", "ADVICE", "PHASE_ADVICE", "family", "propose_fix", "eps_for"]


@dataclass(frozen=True)
class FixRow:
    """One fix: ``text(eps)`` says it in the code's terms (``sqrt(max(x, 1e-12))``; ``signed``
    instead where the operand at fault holds negative values); ``rewrite(func, args, kwargs, eps)``
    computes the op that way (same output shapes and dtypes); ``applies(dtype)`` whether it can
    change an op computed in ``dtype`` (the dtype of its first floating operand)."""

    text: Callable[[float], str]
    rewrite: Callable[[Any, tuple, dict, float], Any]
    signed: Optional[Callable[[float], str]] = None
    applies: Callable[[torch.dtype], bool] = lambda dtype: True

    def say(self, eps: float, operand: Optional[dict] = None) -> str:
        return (self.signed if self.signed is not None and (operand or {}).get("negatives") else self.text)(eps)


def eps_for(dtype: torch.dtype) -> float:
    """The eps of a fix in ``dtype``: 1e-12, or 1e-4 in float16 (whose smallest normal value is
    6.1e-5: 1e-12 would round to 0 there)."""
    return 1e-4 if dtype == torch.float16 else 1e-12


# -- rewrites: each computes the op the fixed way on the call's own arguments -----------------

def _with(args: tuple, i: int, value: Any) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


def _clamp_arg(i: int, lo: Optional[Callable[[float], float]] = None, hi: Optional[Callable[[float], float]] = None) -> Callable:
    """The op with its ``i``-th argument clamped into ``[lo(eps), hi(eps)]``."""
    def rewrite(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
        x = args[i]
        return func(*_with(args, i, torch.clamp(x, min=lo(eps) if lo else None, max=hi(eps) if hi else None)), **kwargs)

    return rewrite


def _divisor(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """``x / y`` with every ``|y| < eps`` moved to ``eps`` (its sign kept; 0 becomes +eps)."""
    y = args[1]
    if not isinstance(y, torch.Tensor):
        raise ValueError("the divisor is a Python number")
    sign = torch.where(y < 0, -1.0, 1.0).to(y.dtype)
    safe = torch.where(y.abs() < eps, sign * eps, y)
    return func(*_with(args, 1, safe), **kwargs)


def _softmax_guard(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """softmax / log_softmax with every row that is entirely -Inf given 0 instead of NaN."""
    x, dim = args[0], args[1]
    full = torch.isneginf(x).all(dim=dim, keepdim=True)
    out = func(*_with(args, 0, torch.where(full, torch.zeros_like(x), x)), **kwargs)
    return torch.where(full, torch.zeros_like(out), out)


def _empty_guard(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """A mean over an empty selection (0/0: NaN from finite inputs) taken as 0."""
    out = func(*args, **kwargs)
    return torch.where(torch.isnan(out), torch.zeros_like(out), out)


def _ignored_guard(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """nll_loss whose every target is ignored: 0 (its total weight is 0) instead of 0/0."""
    out, total = func(*args, **kwargs)
    return torch.where(total == 0, torch.zeros_like(out), out), total


def _ctc_zero_infinity(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """ctc_loss with ``zero_infinity=True``: an impossible alignment's Inf loss becomes 0."""
    if len(args) >= 6:  # _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
        nll, alpha = func(*_with(args, 5, True), **kwargs)
    else:
        nll, alpha = func(*args, **dict(kwargs, zero_infinity=True))
    return torch.where(torch.isinf(nll), torch.zeros_like(nll), nll), alpha


def _norm_eps(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """The 2-norm as ``sqrt(sum(x^2) + eps^2)``: its derivative is finite at the zero vector."""
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if ord_ not in (2, 2.0) or x.is_complex():
        raise ValueError(f"a {ord_}-norm")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    sq = (x * x).sum(dim=dim, keepdim=keepdim) if dim is not None else (x * x).sum()
    return torch.sqrt(sq + eps * eps).to(func(*args, **kwargs).dtype)


def _cdist_eps(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """Euclidean distances as ``sqrt(max(squared distance, eps))``: finite derivative at distance 0."""
    x1, x2, p = args[0], args[1], args[2]
    if p != 2:
        raise ValueError(f"a p={p} distance")
    d2 = ((x1.unsqueeze(-2) - x2.unsqueeze(-3)) ** 2).sum(-1)
    return torch.sqrt(torch.clamp(d2, min=eps))


def _var_count(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """std/var with a correction no larger than the elements per output minus one, and std as
    ``sqrt(var + eps)`` (finite derivative where the variance is 0)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = kwargs.get("keepdim", False)
    if dim is None:
        n = x.numel()
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        n = math.prod(x.shape[d] for d in dims) if dims else x.numel()
    corr = kwargs.get("correction", 1)
    corr = 1 if corr is None else corr
    corr = min(float(corr), max(n - 1, 0))
    var = torch.var(x, dim=dim, correction=corr, keepdim=keepdim)
    return torch.sqrt(var + eps) if func.overloadpacket.__name__ == "std" else var


#: the dtypes whose overflow an op computed in float32 fixes (autocast's usual remedy)
_HALF = frozenset({torch.float16, torch.bfloat16})


def _upcast(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """The op computed in float32 (its float16/bfloat16 inputs upcast), the result cast back."""
    dtype = next((t.dtype for t in args if isinstance(t, torch.Tensor) and t.dtype in _HALF), None)
    if dtype is None:
        raise ValueError("no float16/bfloat16 input")
    up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in _HALF else (torch.float32 if x in _HALF else x)  # noqa: E731
    out = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
    return out.to(dtype) if isinstance(out, torch.Tensor) else tuple(o.to(dtype) if isinstance(o, torch.Tensor) else o for o in out)


def _exp_clamp(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """exp of ``min(x, log(max of the dtype))``."""
    x = args[0]
    return func(*_with(args, 0, torch.clamp(x, max=math.log(torch.finfo(x.dtype).max) - 1.0)), **kwargs)


def _complex_zero(func: Any, args: tuple, kwargs: dict, eps: float) -> Any:
    """angle / abs of a complex value with ``|z| < eps`` moved to ``eps``: finite derivative at 0."""
    z = args[0]
    if not z.is_complex():
        raise ValueError("a real input")
    return func(*_with(args, 0, torch.where(z.abs() < eps, torch.full_like(z, eps), z)), **kwargs)


_R = FixRow
_LOG_TEXT = lambda name: (lambda eps: f"{name}(max(x, {eps:g}))")  # noqa: E731

#: the fixes, in groups: ``domain`` (an op's singular point or domain boundary: eps, clamp, guard)
#: and ``range`` (a dtype's range: a clamp before exp, a float16/bfloat16 op computed in float32);
#: op family -> row
FIXES: dict[str, dict[str, FixRow]] = {
    "domain": {
        "sqrt": _R(lambda eps: f"sqrt(max(x, {eps:g}))", _clamp_arg(0, lo=lambda eps: eps)),
        "rsqrt": _R(lambda eps: f"rsqrt(max(x, {eps:g}))", _clamp_arg(0, lo=lambda eps: eps)),
        "log": _R(_LOG_TEXT("log"), _clamp_arg(0, lo=lambda eps: eps)),
        "log2": _R(_LOG_TEXT("log2"), _clamp_arg(0, lo=lambda eps: eps)),
        "log10": _R(_LOG_TEXT("log10"), _clamp_arg(0, lo=lambda eps: eps)),
        "log1p": _R(lambda eps: f"log1p(max(x, -1 + {eps:g}))", _clamp_arg(0, lo=lambda eps: -1 + eps)),
        "xlogy": _R(lambda eps: f"xlogy(x, max(y, {eps:g}))", _clamp_arg(1, lo=lambda eps: eps)),
        "reciprocal": _R(lambda eps: f"1 / max(x, {eps:g})", _clamp_arg(0, lo=lambda eps: eps)),
        "div": _R(lambda eps: f"x / max(y, {eps:g})", _divisor, signed=lambda eps: f"x / where(|y| < {eps:g}, ±{eps:g}, y)"),
        "pow": _R(lambda eps: f"pow(max(x, {eps:g}), p)", _clamp_arg(0, lo=lambda eps: eps)),
        "acos": _R(lambda eps: f"acos(clamp(x, -1 + {eps:g}, 1 - {eps:g}))", _clamp_arg(0, lo=lambda eps: -1 + eps, hi=lambda eps: 1 - eps)),
        "asin": _R(lambda eps: f"asin(clamp(x, -1 + {eps:g}, 1 - {eps:g}))", _clamp_arg(0, lo=lambda eps: -1 + eps, hi=lambda eps: 1 - eps)),
        "atanh": _R(lambda eps: f"atanh(clamp(x, -1 + {eps:g}, 1 - {eps:g}))", _clamp_arg(0, lo=lambda eps: -1 + eps, hi=lambda eps: 1 - eps)),
        "acosh": _R(lambda eps: f"acosh(max(x, 1 + {eps:g}))", _clamp_arg(0, lo=lambda eps: 1 + eps)),
        "angle": _R(lambda eps: f"angle(z) with |z| < {eps:g} moved to {eps:g}", _complex_zero),
        "abs": _R(lambda eps: f"abs(z) with |z| < {eps:g} moved to {eps:g}", _complex_zero),
        "linalg_vector_norm": _R(lambda eps: f"sqrt(sum(x^2) + {eps:g}^2) instead of the 2-norm", _norm_eps),
        "norm": _R(lambda eps: f"sqrt(sum(x^2) + {eps:g}^2) instead of the 2-norm", _norm_eps),
        "cdist": _R(lambda eps: f"sqrt(max(squared distance, {eps:g})) instead of cdist", _cdist_eps),
        "softmax": _R(lambda eps: "a guard for rows with every position masked (softmax gives 0 there, not NaN)", _softmax_guard),
        "log_softmax": _R(lambda eps: "a guard for rows with every position masked (log_softmax gives 0 there, not NaN)", _softmax_guard),
        "mean": _R(lambda eps: "a guard for an empty selection (its mean taken as 0, e.g. sum / max(count, 1))", _empty_guard),
        "nll_loss": _R(lambda eps: "a guard for a batch whose every target is ignore_index (loss 0, e.g. sum / max(count, 1))",
                       _ignored_guard),
        "ctc_loss": _R(lambda eps: "ctc_loss(..., zero_infinity=True) (an impossible alignment contributes 0)", _ctc_zero_infinity),
        "std": _R(lambda eps: f"sqrt(var(x, correction=min(correction, n - 1)) + {eps:g}) (a statistic over too few elements)",
                  _var_count),
        "var": _R(lambda eps: "var(x, correction=min(correction, n - 1)) (a statistic over too few elements)", _var_count),
    },
    "range": {
        "exp": _R(lambda eps: "exp(min(x, log(the dtype's max)))", _exp_clamp),
        "*": _R(lambda eps: "the op computed in float32 (upcast its inputs, cast the result back)", _upcast,
                applies=lambda dtype: dtype in _HALF),
    },
}

#: which groups of :data:`FIXES` a cause draws from, in order (a cause absent here gets :data:`ADVICE`)
CAUSE_GROUPS: dict[str, tuple[str, ...]] = {
    "numerics": ("domain",),
    "underflow": ("domain",),
    "bad input data": ("domain",),
    "overflow": ("range",),
}

#: the standard fix of a cause no op rewrite verifies, with how to check it
ADVICE: dict[str, str] = {
    "explosion": ("lower the learning rate or clip the gradient norm (torch.nn.utils.clip_grad_norm_); values grew over earlier "
                  "steps, so one step's replay cannot verify it: nanreplay bisect --over steps finds where they left the range"),
    "overflow": ("the values pass the range of the op's own dtype ({range}): make them smaller where they "
                 "grow (normalise or clip the op's inputs, or what feeds them); nanreplay bisect --over steps finds the step where "
                 "they left the range"),
    "optimizer update": ("check the optimizer's hyperparameters and state (an eps > 0 in Adam-style optimizers, a finite learning "
                         "rate); nanreplay replay shows the update's replay"),
    "compiler": ("the compiled code rounds differently from eager code where the op named reads its operands: write the formula "
                 "so that rounding cannot reach the op's singular point (clamp the operand into the op's domain, an eps larger than "
                 "the rounding, a two-pass statistic instead of a one-pass one), or keep that code out of the compiled region "
                 "(torch.compiler.disable); report it upstream with the graph (TORCHDYNAMO_REPRO_AFTER=aot writes a minified reproducer)"),
    "nondeterminism": "torch.use_deterministic_algorithms(True) makes the step reproducible; then replay it again",
    "transient": "run the step again on another device and check this one (ECC counters, memory test)",
}

#: the standard fix where the origin is no op but the step's data (a cause :data:`ADVICE` does not name)
PHASE_ADVICE: dict[str, str] = {
    "input": "drop or repair the non-finite samples before the model sees them (filter them in the data pipeline, or fix the code "
             "between record(batch) and the model)",
    "weights": "reload the weights from a finite checkpoint (or reinitialise the non-finite rows) before training on",
}

#: op names (overload packets, without underscores at the ends) that are one family of FIXES
_ALIASES = {"safe_softmax": "softmax", "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss", "nll_loss_nd": "nll_loss",
            "cdist_forward": "cdist", "euclidean_dist": "cdist", "true_divide": "div", "sqrt_": "sqrt"}


def family(op: Optional[str]) -> str:
    """The :data:`FIXES` family of an aten op name: ``_softmax`` -> ``softmax``, ``_cdist_forward`` -> ``cdist``."""
    bare = (op or "").strip("_")
    return _ALIASES.get(bare, bare)


def _row(cause: str, op: Optional[str], dtype: torch.dtype) -> Optional[FixRow]:
    """The row of the cause's groups for ``op``'s family, else the group's ``"*"``, that applies
    to an op computed in ``dtype`` (a float32 op that overflows gets no "computed in float32")."""
    for group in CAUSE_GROUPS.get(cause, ()):
        rows = FIXES[group]
        for row in (rows.get(family(op)), rows.get("*")):
            if row is not None and row.applies(dtype):
                return row
    return None


def _where(birth: dict) -> str:
    src = birth.get("source")
    return f" at {os.path.basename(src['file'])}:{src['line']}" if src and src.get("file") else ""


def _real_dtype(name: Any) -> Optional[torch.dtype]:
    """The floating dtype named ``name`` (``"float16"``; a complex one's real part), else ``None``."""
    dt = getattr(torch, str(name), None)
    if isinstance(dt, torch.dtype) and (dt.is_floating_point or dt.is_complex):
        return dt.to_real() if dt.is_complex else dt
    return None


def _output_dtype(birth: dict) -> Optional[torch.dtype]:
    """The floating dtype of the birth op's output, else ``None``."""
    out = birth.get("output")
    return _real_dtype(out.get("dtype") if isinstance(out, dict) else getattr(out, "dtype", None))


def _known_dtype(birth: dict) -> Optional[torch.dtype]:
    """The dtype of the birth op's first floating operand, else of its output, else ``None``."""
    for o in (birth.get("operands") or {}).get("tensors") or []:
        dt = _real_dtype(o.get("dtype"))
        if dt is not None:
            return dt
    return _output_dtype(birth)


def _dtype(birth: dict) -> torch.dtype:
    """The dtype of the birth op's first floating operand, else of its output (float32 when
    none is known)."""
    return _known_dtype(birth) or torch.float32


def _range_phrase(birth: dict) -> str:
    """``float16's largest is 6.55e+04`` for the dtype the birth op overflowed: its output's (a cast
    to float16 of float32 values overflows float16), else its operands' (:func:`_known_dtype`);
    ``its largest finite value`` when none is recorded."""
    dt = _output_dtype(birth) or _known_dtype(birth)
    return f"{str(dt).replace('torch.', '')}'s largest is {torch.finfo(dt).max:.3g}" if dt is not None else "its largest finite value"


def _to_reproduce(f: Features) -> Optional[str]:
    """For a step the replay did not reproduce: what to record or do so that it does, from the
    verdict ladder's differences (``fidelity``; never the device's advice without its evidence)."""
    records = list(dict.fromkeys(d["record"] for d in (f.fidelity or {}).get("differences") or []))
    return f"to reproduce the step: {'; '.join(records)}" if records else None


def propose_fix(f: Features, cause: str, model: torch.nn.Module, inp: StepInputs, *, device: Optional[torch.device] = None,
                verify: bool = True, restore: Optional[Callable[[], None]] = None,
                progress: Optional[Callable[[str], None]] = None) -> Optional[Fix]:
    """The fix of the cause at the origin, and whether a replay that changes only that op is
    finite (``docs/report.md``, ``classification.fix``).

    Args:
        f: the facts the cause rule read (the origin's birth); ``cause`` its verdict.
        model: holds the step-start weights; ``restore()`` puts back what a replay moved (buffers).
        progress: told what the verification replays.
        verify: replay the step with the call rewritten (a backward birth's forward call located
            by one plain replay first); ``False`` (the
            in-process diagnosis answered from the bundle alone) proposes without verifying.

    Returns:
        ``{"description", "verified", "loss", "op", "detail"}``, or ``None`` for a cause with no
        standard fix.
    """
    b = f.birth or {}
    dtype = _dtype(b)
    row = _row(cause, b.get("forward_op") or b.get("op"), dtype) if b else None
    if row is None:
        advice = ADVICE.get(cause) or PHASE_ADVICE.get(f.phase) or _to_reproduce(f)
        if advice is None:
            return None
        return {"description": advice.replace("{range}", _range_phrase(b)), "verified": None, "loss": None, "op": None,
                "detail": "no op rewrite verifies this cause"}
    eps = eps_for(dtype)
    text = row.say(eps, offending_operand(b))
    fix: Fix = {"description": text + _where(b), "verified": None, "loss": None, "op": None, "detail": None}
    if not verify:
        fix["detail"] = "not verified: the step was not replayed (nanreplay replay verifies it)"
        return fix
    if progress is not None:
        progress(f"replaying the step with the fix ({text})")
    return _verify(fix, row, cause, b, model, inp, eps, device=device, restore=restore)


def _stale_cotangent(res: Any) -> bool:
    """Whether the replay ``res`` drove the backward pass with a recorded output gradient (a
    cotangent: no loss function) that holds non-finite values. Such a gradient was made by the
    failing step's loss from the outputs a fix of the forward pass changes: non-finite gradients
    downstream of it do not refute the fix (a fix whose own backward pass stops the non-finite
    entries still shows finite gradients, and is verified), and only the forward pass judges it."""
    return res.mode == "cotangent" and any(h is not None and not h.finite for h in res.cotangents)


def _verify(fix: Fix, row: Any, cause: str, b: dict, model: torch.nn.Module, inp: StepInputs, eps: float, *,
            device: Optional[torch.device], restore: Optional[Callable[[], None]]) -> Fix:
    """``fix`` with its verdict: the step replayed with the birth's call (and its twins from the
    same source line) rewritten by ``row``. A forward or loss birth's call is found in that replay
    itself (:func:`~nanreplay.engine.rewrite.replay_rewritten` with ``find``); a backward birth's
    forward call is located by one plain replay first."""
    backward = b.get("phase") == "backward"
    src = b.get("source") or {}
    line = (src["file"], src["line"]) if src.get("file") and src.get("line") is not None else None
    rewrite: Rewrite = lambda func, args, kwargs: row.rewrite(func, args, kwargs, eps)  # noqa: E731
    try:
        call, how = None, None
        if backward:  # the forward call whose node gives birth in its backward: located by one plain replay first
            call = locate(model, inp, OpTarget(b.get("op"), backward, b.get("node")), device=device)
            if restore:
                restore()
            if call is not None:
                row = _row(cause, call.name, _dtype(b)) or row  # the located call's own family (``_log_softmax`` for LogSoftmaxBackward0)
                res, how = replay_rewritten(model, inp, call, rewrite, device=device, line=line)
        else:  # a forward or loss birth: its call is found in the rewriting replay itself (one replay)
            res, how = replay_rewritten(model, inp, None, rewrite, device=device, line=line, find=OpTarget(b.get("op")))
        if how is None or how["call"] is None:
            fix["detail"] = "not verified: a plain replay of the step did not make the call that gave birth"
            return fix
        fix["op"] = how["call"].overload
    except Exception as e:  # noqa: BLE001 - a verification that cannot run leaves the fix unverified, the error said
        fix["detail"] = f"not verified: the replay with the fix raised {replay_error(e)}"
        return fix
    finally:
        if restore:
            restore()
    if not how["applied"]:
        fix["detail"] = f"not verified: {how['error'] or 'the replay did not make the call'}"
        return fix
    bad = res.products_nonfinite()
    if bad and _stale_cotangent(res) and not any(h is not None and not h.finite for h in res.outputs):
        # non-finite gradients from a backward pass run on the recorded output gradient, non-finite because the step's
        # loss was: the fix changes the outputs that gradient came from, so they do not refute it; its forward pass is finite
        fix["detail"] = ("the forward pass replays finite with it (every model output finite); its backward pass cannot "
                         "judge it: the replay drives it with the recorded gradient of the model's output, which holds non-finite "
                         "values made by the failing step's loss from the outputs the fix changes; give the loss function "
                         "(Recorder(loss_fn=...), or `nanreplay replay --loss-fn`) to verify the whole step")
    else:
        fix["verified"] = not bad
        losses = [v for v in res.loss_values if math.isfinite(v)]
        fix["loss"] = (losses[0] if len(losses) == 1 else sum(losses) / len(losses)) if losses and not bad else None
        fix["detail"] = ("the step replayed with it produces finite losses, outputs and gradients" if not bad else
                         "the step replayed with it is still non-finite: the non-finite value does not come from this op alone")
    if how["others"]:
        fix["detail"] += f" (the op rewritten at {how['others'] + 1} calls from that source line)"
    fix["detail"] += "".join(f"; {n}" for n in how["notes"])
    return fix
