"""The one sentence a diagnosis leads with, built from the diagnosis dict alone (no torch)."""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["summary_sentence", "verdict_phrase", "kinds_of"]


def kinds_of(h: Any) -> str:
    """'NaN', '+Inf', '-Inf' or a combination, of a health dict (or an object with ``to_json``)."""
    if h is None:
        return "non-finite value"
    h = h.to_json() if hasattr(h, "to_json") else h
    parts = [n for n, k in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf")) if h.get(k)]
    return " and ".join(parts) or "non-finite value"


def _where_src(src: Optional[dict]) -> Optional[str]:
    return f"{os.path.basename(src['file'])}:{src['line']}" if src else None


def verdict_phrase(repro: dict) -> str:
    """The reproduction verdict as the summary says it: ``reproduced exactly``, ``reproduced (max
    abs difference X)``, ``reproduced up to one gradient factor C that the loop applied after
    backward`` (see :func:`nanreplay.engine.compare.common_factor`), ``not reproduced``."""
    v = repro.get("verdict", "")
    if v == "reproduced" and repro.get("grad_factor") == "nan":
        return "reproduced (the loop then made every gradient NaN, as clip_grad_norm_ does with a non-finite total norm)"
    if v == "reproduced" and repro.get("grad_factor") is not None:
        return f"reproduced up to one gradient factor {repro['grad_factor']} that the loop applied after backward"
    if v == "reproduced" and repro.get("max_abs_diff") is not None:
        return f"reproduced (max abs difference {repro['max_abs_diff']})"
    return v


def summary_sentence(diag: dict) -> str:
    """The one actionable sentence, e.g. ``NaN born in backward of sqrt (SqrtBackward0) at
    model.py:41 in module encoder.norm, step 4711, samples [17]; forward was finite; cause:
    numerics (sqrt derivative at 0); reproduced exactly.``"""
    phase, step, o = diag["phase"], diag["step"], diag.get("origin") or {}
    v = verdict_phrase(diag.get("reproduction") or {})
    if phase == "none":
        return f"step {step}: the replay produced no non-finite value; {v}."
    cls = diag.get("classification") or {}
    kinds = o.get("nonfinite") or "non-finite value"
    src = _where_src(o.get("source"))
    mod = o.get("module")
    in_mod = f" in module {mod or '(root module)'}" + (f" ({o['class']})" if o.get("class") else "") if mod is not None else ""
    smp = o.get("samples")
    parts = []
    if phase == "input":
        parts.append(f"non-finite value in the input data at {o.get('leaf')}")
    elif phase == "weights":
        parts.append(f"non-finite weights before the step ({o.get('tensor')})")
    elif phase == "optimizer":
        parts.append(f"{kinds if o.get('nonfinite') else 'non-finite value'} born in the optimizer update ({o.get('optimizer')}) of parameter {o.get('param')}"
                     + (f", state {o['state_key']}" if o.get("state_key") else ""))
    elif phase == "backward" and o.get("kind") == "explosion":
        parts.append(f"gradients exploded in backward: every gradient is finite but their 2-norm overflows float32; the largest "
                     f"({o['largest_gradient']:.4g}) is in {o['param']}" + in_mod)
    elif phase == "backward":
        fop = o.get("forward_op") or o.get("op")
        parts.append(f"{kinds} born in backward of {fop}" + (f" ({o['node']})" if o.get("node") else f" (op {o['op']})" if o.get("op") else "")
                     + (f" at {src}" if src else "") + in_mod)
    elif phase == "loss":
        parts.append(f"{kinds} born in the loss, outside the model" + (f", in op {o['op']}" if o.get("op") else "") + (f" at {src}" if src else ""))
    else:
        parts.append(f"{kinds} born in the {phase} pass" + (f" in op {o['op']}" if o.get("op") else "") + (f" at {src}" if src else "") + in_mod)
    mb = o.get("micro_batch")
    head = parts[0] + f", step {step}" + (f", micro-batch {mb}" if mb is not None else "") + (f", samples {smp}" if smp else "")
    tail = []
    if phase == "backward" and o.get("kind") != "explosion":
        fwd = [c for c in diag.get("chain", []) if c["phase"] in ("forward", "loss")]
        if fwd:
            c = fwd[0]
            tail.append(f"forward had {c['kinds']} born in {c['op']}" + (f" at {_where_src(c['source'])}" if c.get("source") else "")
                        + " that was masked before the output")
        else:
            tail.append("forward was finite")
    elif phase == "loss":
        tail.append("the model's forward pass was finite")
    if cls:
        tail.append(f"cause: {cls['cause']} ({cls['detail']})")
    return "; ".join([head] + tail) + f"; {v}."
