"""The cause verdict of a diagnosis, with its evidence."""

from __future__ import annotations

from typing import Optional

import torch

from ..core.numerics import Health
from ..engine.probes import node_forward_op
from .evidence import domain_explanation

__all__ = ["CAUSES", "classify"]

#: the cause verdicts, in the order they are tested
CAUSES = ("bad input data", "optimizer update", "explosion", "overflow", "numerics", "unknown")


def classify(phase: str, origin_birth: Optional[dict], history: Optional[dict], *, optimizer: Optional[dict] = None,
             input_leaf: Optional[str] = None) -> dict:
    """One cause verdict from :data:`CAUSES`, with the evidence for it.

    Args:
        phase: the diagnosis phase (``input``, ``weights``, ``forward``, ``loss``, ``backward``,
            ``optimizer``, ``none``).
        origin_birth: the op-level birth taken as the origin (a dict from the op monitor), if any.
        history: :func:`grad_norm_history` of the ring buffer.
        optimizer: the optimizer-update replay's result, for ``phase == "optimizer"``.

    Returns:
        ``{"cause": str, "detail": str, "evidence": [str, ...]}``.
    """
    ev: list[str] = []
    if phase == "input":
        return {"cause": "bad input data", "detail": f"non-finite value in the recorded batch at {input_leaf}", "evidence": [f"the batch leaf {input_leaf} is non-finite before any op runs"]}
    if phase in ("optimizer", "weights"):
        if optimizer:
            ev.extend(optimizer.get("evidence", []))
        detail = (optimizer or {}).get("detail") or ("the step-start weights are already non-finite" if phase == "weights" else "the update")
        return {"cause": "optimizer update", "detail": detail, "evidence": ev or ["the gradients are finite, the updated weights or optimizer state are not"]}
    if phase == "none":
        return {"cause": "unknown", "detail": "no non-finite value in the replay", "evidence": []}
    explode = bool(history and (history.get("exploding") or history.get("lr_spike")))
    if history and history.get("exploding"):
        ev.append(f"grad norm rose to {history['grad_norms'][-1][1]:.4g} at step {history['grad_norms'][-1][0]}, "
                  f"{float(history['growth']):.3g}x the median of the earlier steps in the ring buffer")
    if history and history.get("lr_spike"):
        sp = history["lr_spike"]
        ev.append(f"learning rate {float(sp['lr']):.4g} at step {sp['step']}, vs {sp['min_lr']:.4g} in the ring buffer")
    if origin_birth is None:
        if explode:
            return {"cause": "explosion", "detail": "gradients grew across steps", "evidence": ev}
        why = (
            "the loss was not replayed (no loss function): the recorded gradient w.r.t. the model output is already "
            "non-finite, so the op is in code nanreplay did not run; pass --loss-fn to name it"
            if phase == "loss"
            else "no op-level birth was recorded (the op monitor was off, or the value was born in code the replay did not run)"
        )
        return {"cause": "unknown", "detail": why, "evidence": ev}
    b = origin_birth
    out_h = b.get("output")
    out_h = out_h.to_json() if isinstance(out_h, Health) else out_h
    in_h = b.get("inputs")
    in_h = in_h.to_json() if isinstance(in_h, Health) else in_h
    wide = b.get("wider")
    backward = b.get("phase") == "backward"
    dom = domain_explanation(b["op"], backward=backward, node=b.get("node"))
    kinds = [n for n, k in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf")) if out_h and out_h.get(k)]
    dtype = (out_h or {}).get("dtype")
    if wide is not None and wide["finite"]:
        fmax = torch.finfo(getattr(torch, dtype)).max if dtype and hasattr(torch, dtype) else None
        ev.append(
            f"{b['op']} gives {' and '.join(kinds)} in {dtype} but is finite in {wide['dtype']} (largest magnitude {wide['absmax']:.4g}"
            + (f", past the {dtype} maximum {fmax:.4g})" if fmax else ")")
        )
        if in_h and in_h.get("absmax") is not None:
            ev.append(f"its inputs reach magnitude {in_h['absmax']:.4g}")
        if explode:
            return {"cause": "explosion", "detail": f"values grew past the {dtype} range", "evidence": ev}
        return {"cause": "overflow", "detail": f"{b['op']} overflows {dtype}", "evidence": ev}
    if wide is not None:
        ev.append(f"{b['op']} is non-finite in {wide['dtype']} too: a domain error, not a range problem")
    zeros = b.get("input_zeros")
    if zeros and any(zeros):
        ev.append("exact zeros in its inputs: " + ", ".join(f"{z} in input {i}" for i, z in enumerate(zeros) if z))
    if dom:
        ev.append(f"{'backward of ' + (node_forward_op(b.get('node')) or b['op']) if backward else b['op']}: {dom}")
    if explode and not dom:
        return {"cause": "explosion", "detail": "values grew across steps", "evidence": ev}
    return {"cause": "numerics", "detail": dom or f"{b['op']} outside its domain", "evidence": ev}
