"""From one replay to the diagnosis: where the first non-finite value was born (phase and
origin), the health table of the modules around it and the reproduction verdict."""

from __future__ import annotations

from typing import Optional

import torch

from ..core.numerics import Health
from ..engine.compare import compare_grads, compare_loss
from ..engine.run import ReplayResult
from ..report.summary import summary_sentence

__all__ = ["diagnose"]


def _h(h: Optional[Health]) -> Optional[dict]:
    return h.to_json() if h is not None else None


def _event_json(e: dict) -> dict:
    return {k: (_h(v) if isinstance(v, Health) else v) for k, v in e.items()}


def diagnose(
    result: ReplayResult,
    *,
    step: int,
    recorded_grads: dict[str, torch.Tensor],
    recorded_loss: Optional[float] = None,
    table_rows: int = 8,
) -> dict:
    """Turn a replay into the diagnosis (a JSON-able dict; field names documented in
    ``docs/report.md``): ``phase`` of birth (``weights``, ``input``, ``forward``, ``loss``,
    ``backward``, or ``none``), ``origin`` (module FQN and class, op when known), the
    ``summary`` sentence, the ``health`` table around the origin and the ``reproduction`` verdict."""
    repro = compare_grads(recorded_grads, result.grads)
    compare_loss(repro, recorded_loss, result.losses)
    fwd = [e for e in result.modules.events if e["phase"] == "forward"]
    bwd = [e for e in result.modules.events if e["phase"] == "backward"]
    births = result.ops.births if result.ops is not None else []
    origin: Optional[dict] = None
    phase = "none"
    cause = ""
    model_out_bad = any(h is not None and not h.finite for h in result.outputs)
    loss_bad = any(h is not None and not h.finite for h in result.losses)
    cot_bad = any(h is not None and not h.finite for h in result.cotangents)
    fwd_births = [b for b in births if b["phase"] == "forward"]

    def op_in(module: Optional[str], ph: str) -> Optional[dict]:
        for b in births:
            m = b["module"]
            if b["phase"] == ph and m is not None and (module is None or module == "" or m == module or m.startswith(module + ".")):
                return b
        return None

    if result.weights:
        w = result.weights[0]
        phase, cause = "weights", "the step-start weights were already non-finite (an earlier optimizer update corrupted them)"
        leaf = w["leaf"]
        fqn = leaf.split("'")[3] if leaf.count("'") >= 4 else leaf
        origin = {"module": fqn.rpartition(".")[0], "tensor": fqn, "kind": "producer"}
    elif any(x["health"].nan or x["health"].posinf for x in result.inputs):
        x = next(x for x in result.inputs if x["health"].nan or x["health"].posinf)
        phase, cause = "input", f"the recorded batch already holds {x['health'].kinds()} at {x['leaf']}"
        origin = {"module": None, "leaf": x["leaf"], "samples": x["samples"], "kind": "bad input data"}
    elif model_out_bad:
        prod = next((e for e in fwd if e["born"]), None)
        phase = "forward"
        if prod is not None:
            origin = {"module": prod["module"], "class": prod["class"], "kind": "producer"}
            op = op_in(prod["module"], "forward")
        else:
            op = fwd_births[0] if fwd_births else None
            origin = {"module": op["module"] if op else "", "class": None, "kind": "producer"}
        if op:
            origin["op"] = op["op"]
            origin["op_index"] = op["op_index"]
        cause = "a non-finite value is born in the forward pass"
    elif loss_bad or (result.mode == "cotangent" and cot_bad):
        phase = "loss"
        op = next((b for b in births if b["phase"] == "loss"), None) if result.mode == "loss_fn" else None
        origin = {"module": None, "class": None, "kind": "outside the model"}
        if op:
            origin["op"] = op["op"]
            origin["op_index"] = op["op_index"]
        cause = (
            "the model's forward pass is finite; the non-finite value is born outside the model, in the loss"
            + (" function" if result.mode == "loss_fn" else " (the recorded gradient w.r.t. the model output is non-finite)")
        )
    else:
        bop = next((b for b in births if b["phase"] == "backward"), None)
        first_bad = next((e for e in bwd if e["output"] is not None and not e["output"].finite), None)
        if bop is not None or first_bad is not None:
            phase = "backward"
            module = bop["module"] if bop is not None else first_bad["module"]
            cls = dict(result.modules.fqn_class).get(module) if hasattr(result.modules, "fqn_class") else None
            origin = {"module": module, "class": cls, "kind": "producer"}
            if bop is not None:
                origin["op"] = bop["op"]
                origin["op_index"] = bop["op_index"]
            cause = "the forward pass and the loss are finite; the non-finite value is born in the backward pass"
            if first_bad is not None:
                origin["first_nonfinite_gradient"] = first_bad.get("param") or f"cotangent at {first_bad['module'] or '(model output)'}"
    classes = {e["module"]: e["class"] for e in fwd}
    if origin is not None and origin.get("module") is not None and origin.get("class") is None:
        origin["class"] = classes.get(origin["module"])
    table = _table(fwd, origin, table_rows)
    diag = {
        "step": step,
        "phase": phase,
        "origin": origin,
        "cause": cause,
        "summary": "",
        "mode": result.mode,
        "reproduction": repro,
        "health": table,
        "births": [_event_json(b) for b in births[:16]],
        "propagated_ops": result.ops.propagated if result.ops is not None else None,
        "nonfinite_inputs": [_event_json(x) for x in result.inputs[:8]],
        "nonfinite_weights": [_event_json(x) for x in result.weights[:8]],
        "loss": [_h(h) for h in result.losses],
        "warnings": result.warnings,
    }
    diag["summary"] = summary_sentence(diag)
    return diag


def _table(fwd: list[dict], origin: Optional[dict], rows: int) -> list[dict]:
    """The first ``rows`` module events around the origin (or the first ones), as JSON."""
    idx = 0
    if origin and origin.get("module") is not None:
        idx = next((i for i, e in enumerate(fwd) if e["module"] == origin["module"]), 0)
    lo = max(0, idx - rows // 2)
    roles, born_before = [], []
    for e in fwd:  # forwards complete children first: a parent of an earlier producer only contains it
        if e["born"]:
            inside = any(m == e["module"] or m.startswith(e["module"] + ".") or e["module"] == "" for m in born_before)
            roles.append("contains producer" if inside else "producer")
            born_before.append(e["module"])
        else:
            roles.append("propagator" if e["output"] is not None and not e["output"].finite else "")
    out = []
    for i, e in enumerate(fwd[lo : lo + rows], start=lo):
        role = roles[i]
        out.append({"index": i, "module": e["module"], "class": e["class"], "role": role, "inputs": _h(e["inputs"]), "output": _h(e["output"])})
    return out
