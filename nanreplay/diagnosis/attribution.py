"""Op-level attribution of a diagnosis: the origin's op, source line and autograd node, the
causal chain of births, the samples, the optimizer update replay, the cause verdict and the
summary sentence."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from ..core.numerics import Health, is_float
from ..report.summary import kinds_of, summary_sentence
from .classify import classify
from .evidence import grad_norm_history

logger = logging.getLogger(__name__)

__all__ = ["attribute"]


def _compact(b: dict) -> dict:
    out = b.get("output")
    out = out.to_json() if isinstance(out, Health) else out
    return {
        "phase": b["phase"], "op": b["op"], "node": b.get("node"), "module": b.get("module"),
        "source": b.get("source"), "kinds": kinds_of(out), "op_index": b.get("op_index"),
    }


def attribute(diag: dict, result: Any, model: torch.nn.Module, inp: Any, *, device: Optional[torch.device] = None, samples: bool = True,
              progress: Any = None) -> dict:
    """Add the exact attribution to a diagnosis (``docs/report.md`` documents every field):

    * ``origin`` gains ``aten``, ``node``, ``forward_op``, ``source`` (the user's file/line),
      ``nonfinite`` (``"NaN"``, ``"+Inf"``...), ``dtype``, ``shape``, ``inputs``/``output`` health;
    * ``chain``: the op-level births up to the origin, in execution order (a forward -Inf masked by
      ``torch.where`` before a backward NaN);
    * ``samples``: which samples carry the first non-finite values (rows of the producer op's
      output) or alone make the step non-finite (per-sample replay);
    * ``optimizer``: the replay of ``optimizer.step()`` when the forward and backward are finite;
    * ``classification``: the cause verdict with its evidence; ``history``: grad norms and
      learning rates of the ring buffer; ``allowed_births`` and ``allowlist``;
    * ``summary``: the one actionable sentence.
    """
    from .blame import batch_size, cotangent_rows, replay_optimizer_update, samples_to_blame

    births = result.ops.births if result.ops is not None else []
    origin = diag.get("origin")
    phase = diag["phase"]
    opt_res = None
    grads_finite = all(not (is_float(g) and not bool(torch.isfinite(g).all())) for g in inp.recorded_grads.values())
    if phase == "none" and inp.optimizer_info and inp.state.optimizer is not None and grads_finite and inp.recorded_grads:
        opt_res = replay_optimizer_update(inp.state, inp.recorded_grads, inp.optimizer_info, device=device, allow=result.ops.allow if result.ops else None)
        if opt_res and opt_res.get("nonfinite"):
            phase = diag["phase"] = "optimizer"
            first = opt_res["param"]
            origin = diag["origin"] = {
                "module": first.rpartition(".")[0], "class": None, "kind": "optimizer update", "param": first,
                "state_key": opt_res["state_key"], "optimizer": opt_res["class"],
            }
            classes = dict((n, type(m).__name__) for n, m in model.named_modules())
            origin["class"] = classes.get(origin["module"])
            diag["cause"] = opt_res["detail"]
            if opt_res["births"]:
                origin["op"] = opt_res["births"][0]["op"]
    if phase == "none" and inp.recorded_grads and grads_finite and not (opt_res and opt_res.get("nonfinite")):
        gn = inp.reason.get("grad_norm")
        # under DDP the recorded norm is over the all-reduced gradients, the stored ones are this
        # rank's local gradients: a finite local step there means another rank was the origin
        norm_of_stored = (inp.reason.get("distributed") or {}).get("grads") != "local"
        if gn is not None and not math.isfinite(float(gn)) and norm_of_stored:
            fqn, g = max(inp.recorded_grads.items(), key=lambda kv: float(kv[1].detach().abs().max()) if kv[1].numel() else 0.0)
            phase = diag["phase"] = "backward"
            origin = diag["origin"] = {"module": fqn.rpartition(".")[0], "class": None, "kind": "explosion", "param": fqn,
                                       "largest_gradient": float(g.detach().abs().max().double())}
            origin["class"] = dict((n, type(m).__name__) for n, m in model.named_modules()).get(origin["module"])
            diag["cause"] = ("every gradient is finite but their 2-norm overflows float32; the largest gradient "
                             f"({origin['largest_gradient']:.4g}) is in {fqn}")
            samples = False
    ob = None
    if origin and origin.get("op_index") is not None:
        ob = next((b for b in births if b["op_index"] == origin["op_index"]), None)
    if ob is not None:
        out_h, in_h = ob.get("output"), ob.get("inputs")
        origin.update(
            aten=ob.get("aten"), node=ob.get("node"), forward_op=ob.get("forward_op"), source=ob.get("source"),
            nonfinite=kinds_of(out_h), dtype=out_h.dtype if out_h else None, shape=out_h.shape if out_h else None,
            inputs=in_h.to_json() if isinstance(in_h, Health) else in_h, output=out_h.to_json() if isinstance(out_h, Health) else out_h,
        )
    chain = [_compact(b) for b in births if ob is None or b["op_index"] <= ob["op_index"]] if births else []
    diag["chain"] = chain[:16]
    # samples
    smp = None
    use_loss = inp.loss_fn is not None and bool(inp.record.batches)
    size = batch_size(inp.record, use_loss)
    if phase == "input" and origin:
        smp = {"indices": origin.get("samples", []), "batch_size": size, "method": "non-finite rows of the recorded batch", "warnings": []}
    elif phase in ("forward", "loss", "backward") and size is not None:
        rows = ob.get("rows") if ob is not None and phase != "backward" else None
        if rows and rows["size"] == size and rows["indices"]:
            smp = {"indices": rows["indices"], "batch_size": size, "method": "non-finite rows of the producer op's output", "warnings": []}
        elif phase == "loss" and not use_loss and cotangent_rows(inp.record, size) is not None:
            smp = cotangent_rows(inp.record, size)  # the loss was not replayed: its gradient says where it went bad
        elif samples:
            smp = samples_to_blame(model, inp, phase=phase, device=device, progress=progress)
    several = len(inp.record.batches if use_loss else inp.record.forwards) > 1  # micro-batches (gradient accumulation)
    if several and ob is not None and ob.get("micro_batch") is not None:
        origin["micro_batch"] = ob["micro_batch"]
        if smp is not None and smp["method"] == "non-finite rows of the producer op's output":
            smp["micro_batch"] = ob["micro_batch"]
    diag["samples"] = smp
    if origin is not None and smp is not None and phase != "input":
        origin["samples"] = smp["indices"]
    diag["optimizer"] = opt_res
    hist = grad_norm_history(inp.history, inp.record.step) if inp.history else None
    diag["history"] = hist
    leaf = origin.get("leaf") if origin else None
    diag["classification"] = classify(phase, ob, hist, optimizer=opt_res, input_leaf=leaf)
    diag["allowed_births"] = len(result.ops.allowed) if result.ops is not None else None
    diag["allowlist"] = result.ops.allow.to_json() if result.ops is not None else None
    if smp:
        diag["warnings"] = list(diag.get("warnings", [])) + list(smp.get("warnings", []))
    diag["summary"] = summary_sentence(diag)
    return diag
