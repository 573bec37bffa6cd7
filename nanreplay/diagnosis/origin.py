"""The one rule for the origin of a non-finite step.

The origin is the **first birth, in execution order, of a non-finite value that is not
allowlisted and that reaches what the step produces** (its losses, model outputs and gradients,
or the weights it updates). Execution order starts with what exists before any op runs (the
step-start weights, then the batch), goes through the ops of the forward pass, the loss and the
backward pass, and ends with the optimizer update. The phase and the place follow from where the
birth ran (:meth:`nanreplay.engine.monitors.OpMonitor.where`).

:data:`STAGES` is that order as a table: the first stage that finds a birth names the origin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..core.digest import grad_absmax, grads_nonfinite
from ..core.numerics import Health, kinds
from ..engine.run import ReplayResult, StepInputs, nonfinite_leaves

__all__ = ["Found", "STAGES", "find_origin", "report_origin", "health_json"]


@dataclass
class Found:
    """An origin: its phase, the report's ``origin`` dict and, from the op monitor, the birth."""

    phase: str
    origin: dict
    birth: Optional[dict] = None
    extra: dict = field(default_factory=dict)


@dataclass
class Context:
    result: ReplayResult
    inp: StepInputs
    model: torch.nn.Module
    classes: dict[str, str]
    optimizer_replay: Callable[[], Optional[dict]]


def health_json(h: Any) -> Optional[dict]:
    """A :class:`Health` (or an already plain dict) as JSON."""
    return h.to_json() if isinstance(h, Health) else h


def _tensor_path(leaf: str) -> tuple[str, str]:
    """``"['params']['fc.weight']"`` -> ``("params", "fc.weight")``."""
    parts = [p.strip("'\"") for p in leaf.strip("[]").split("][")]
    return (parts[0], parts[1]) if len(parts) >= 2 else ("params", leaf)


def _weights(c: Context) -> Optional[Found]:
    if not c.result.weights:
        return None
    params = [w for w in c.result.weights if _tensor_path(w["leaf"])[0] == "params"]
    w = (params or c.result.weights)[0]
    kind, fqn = _tensor_path(w["leaf"])
    owner = fqn.rpartition(".")[0]
    origin = {"module": owner, "class": c.classes.get(owner), "kind": "parameter" if kind == "params" else "buffer", "tensor": fqn,
              "nonfinite": w["health"].kinds(), "tensors": [_tensor_path(x["leaf"])[1] for x in c.result.weights[:8]]}
    return Found("weights", origin)


def _input(c: Context) -> Optional[Found]:
    bad = [x for x in c.result.inputs if x["health"].nan or x["health"].posinf]  # -Inf alone may be a mask the model expects
    if not bad:
        return None
    x = bad[0]
    origin = {"module": None, "class": None, "kind": "bad input data", "leaf": x["leaf"], "samples": x["samples"],
              "nonfinite": x["health"].kinds()}
    return Found("input", origin, extra={"leaves": bad})


def origin_of_birth(b: dict, classes: dict[str, str]) -> dict:
    """The report's ``origin`` for an op birth."""
    module = b.get("module")
    if module is None and b.get("method_of") is not None:
        module = b["method_of"]  # a method of a model module called by the loss, e.g. model.compute_loss(...)
    out_h, in_h = b.get("output"), b.get("inputs")
    return {
        "module": module, "class": classes.get(module) if module is not None else None, "kind": "producer",
        "op": b["op"], "aten": b.get("aten"), "op_index": b.get("op_index"), "node": b.get("node"), "forward_op": b.get("forward_op"),
        "source": b.get("source"), "nonfinite": kinds(out_h), "dtype": getattr(out_h, "dtype", None), "shape": getattr(out_h, "shape", None),
        "inputs": health_json(in_h), "output": health_json(out_h), "micro_batch": b.get("micro_batch"),
    }


def _first_reaching(c: Context, phases: tuple[str, ...]) -> Optional[Found]:
    births = c.result.births
    if c.result.ops is None or not births:
        return None
    reaching = c.result.reaching or frozenset()
    first = next((b for b in births if b.get("birth") in reaching and b["phase"] in phases), None)
    return Found(first["phase"], origin_of_birth(first, c.classes), birth=first) if first is not None else None


def _forward_ops(c: Context) -> Optional[Found]:
    """The first birth in the forward pass or the loss whose values reach the step's products."""
    return _first_reaching(c, ("forward", "loss"))


def _backward_ops(c: Context) -> Optional[Found]:
    """The first birth in the backward pass whose values reach the gradients."""
    return _first_reaching(c, ("backward",))


def _any_birth(c: Context) -> Optional[Found]:
    """The products are non-finite but no birth's values traceably reach them (a path the taint
    lost, e.g. an op that rebuilt a tensor from a non-finite one): the first birth."""
    births = c.result.births
    if c.result.ops is None or not births or not c.result.products_nonfinite():
        return None
    return Found(births[0]["phase"], origin_of_birth(births[0], c.classes), birth=births[0])


def _modules(c: Context) -> Optional[Found]:
    """Without the op monitor: the first module whose output turned non-finite from finite inputs."""
    if c.result.ops is not None:
        return None
    fwd = [e for e in c.result.modules.events if e["phase"] == "forward"]
    prod = next((e for e in fwd if e["born"]), None)
    if prod is not None:
        return Found("forward", {"module": prod["module"], "class": prod["class"], "kind": "producer"})
    if any(h is not None and not h.finite for h in c.result.losses):
        return Found("loss", {"module": None, "class": None, "kind": "outside the model"})
    bad = _first_nonfinite_gradient(c.result)
    if bad is not None:
        return Found("backward", {"module": bad["module"], "class": c.classes.get(bad["module"]), "kind": "producer",
                                  "first_nonfinite_gradient": _gradient_name(bad)})
    return None


def _first_nonfinite_gradient(result: ReplayResult) -> Optional[dict]:
    """The first module event of the backward pass whose output (a gradient) is non-finite."""
    return next((e for e in result.modules.events if e["phase"] == "backward" and e.get("output") and kinds(e["output"]) != "finite"), None)


def _gradient_name(e: dict) -> str:
    return e.get("param") or f"cotangent at {e['module'] or '(model output)'}"


def _cotangent(c: Context) -> Optional[Found]:
    """The loss was not replayed and the recorded gradient w.r.t. the model's output is already
    non-finite: the value was born in the loss, in code the replay did not run."""
    bad = [(i, h) for i, h in enumerate(c.result.cotangents) if h is not None and not h.finite] if c.result.mode == "cotangent" else []
    if not bad:
        return None
    i, h = bad[0]  # the first micro-batch (forward call) whose output gradient is non-finite
    return Found("loss", {"module": None, "class": None, "kind": "outside the model", "loss_replayed": False, "nonfinite": h.kinds(),
                          "micro_batch": i})


def _recorded_forward_inputs(c: Context) -> Optional[Found]:
    """The replay fed the recorded batch through the loss function and found no birth, yet the
    model's forward inputs the Recorder captured in training hold NaN/+Inf: code between
    ``record(batch)`` and the model (preprocessing after ``record``) changed the inputs, and the
    model saw invalid ones. The origin is the recorded forward input leaf (phase ``input``)."""
    if not c.inp.uses_loss or c.result.births or c.result.products_nonfinite():
        return None
    bad = [dict(x, micro_batch=i) for i, fw in enumerate(c.inp.record.forwards) for x in nonfinite_leaves(fw.inputs, f"inputs[{i}]")
           if x["health"].nan or x["health"].posinf]
    if not bad:
        return None
    x = bad[0]
    origin = {"module": None, "class": None, "kind": "bad input data", "leaf": x["leaf"], "samples": x["samples"],
              "nonfinite": x["health"].kinds(), "recorded_forward_inputs": True,
              "between_record_and_model": (f"the model's recorded forward input {x['leaf']} holds {x['health'].kinds()}; the recorded batch, "
                                           "fed through the loss function, replays finite: code between record(batch) and the model changed "
                                           "the inputs (preprocessing after record); record the batch the model consumes, or move that code "
                                           "into the loss function")}
    return Found("input", origin, extra={"leaves": bad})


def _explosion(c: Context) -> Optional[Found]:
    """Every recorded gradient is finite, but the recorder saw their float32 2-norm overflow."""
    grads = c.inp.recorded_grads
    reason = c.inp.reason
    gn = reason.get("grad_norm")
    overflowed = bool(reason.get("explosion")) or (gn is not None and math.isinf(float(gn)))
    local = (reason.get("distributed") or {}).get("grads") == "local"  # DDP: the norm is of reduced grads, these are local
    if not grads or not overflowed or local or grads_nonfinite(grads):
        return None
    fqn, g = max(grads.items(), key=lambda kv: grad_absmax(kv[1]))
    owner = fqn.rpartition(".")[0]
    return Found("backward", {"module": owner, "class": c.classes.get(owner), "kind": "explosion", "param": fqn,
                              "largest_gradient": grad_absmax(g)})


def _optimizer(c: Context) -> Optional[Found]:
    grads = c.inp.recorded_grads
    if not grads or grads_nonfinite(grads) or c.result.products_nonfinite():
        return None
    res = c.optimizer_replay()
    if not res or not res.get("nonfinite"):
        return None
    first = res["param"]
    owner = first.rpartition(".")[0]
    origin = {"module": owner, "class": c.classes.get(owner), "kind": "optimizer update", "param": first, "state_key": res["state_key"],
              "optimizer": res["class"], "op": res["births"][0]["op"] if res["births"] else None}
    return Found("optimizer", origin, extra={"optimizer": res})


#: the origin rule, in execution order: the first stage that finds a birth names the origin
STAGES: tuple[tuple[str, Callable[[Context], Optional[Found]]], ...] = (
    ("step-start weights", _weights),
    ("batch", _input),
    ("ops of the forward pass and the loss", _forward_ops),
    ("loss not replayed", _cotangent),
    ("ops of the backward pass", _backward_ops),
    ("modules (op monitor off)", _modules),
    ("any birth", _any_birth),
    ("recorded forward inputs (code between record and the model)", _recorded_forward_inputs),
    ("grad norm overflow", _explosion),
    ("optimizer update", _optimizer),
)


def find_origin(result: ReplayResult, inp: StepInputs, model: torch.nn.Module, *, optimizer_replay: Callable[[], Optional[dict]]) -> Optional[Found]:
    """The origin by :data:`STAGES`, or ``None`` when the replay produced no non-finite value."""
    c = Context(result, inp, model, {n: type(m).__name__ for n, m in model.named_modules()}, optimizer_replay)
    for _, stage in STAGES:
        found = stage(c)
        if found is not None:
            return found
    return None


def report_origin(found: Optional[Found], result: ReplayResult, inp: StepInputs, samples: Optional[dict]) -> Optional[dict]:
    """The report's ``origin`` (``docs/report.md``): the stage's origin with the samples to
    blame (``samples``, from :func:`nanreplay.diagnosis.samples.samples_for`; an input origin
    keeps its own rows), the birth's operands, the first non-finite gradient of a backward
    origin, and the micro-batch only when the step has several and the birth names one."""
    if found is None:
        return None
    origin = dict(found.origin)
    if samples is not None and (found.phase != "input" or samples.get("batch_level")):
        origin["samples"] = samples["indices"] or None
    if found.birth is not None:
        origin["operands"] = found.birth.get("operands")
    if found.phase == "backward" and "first_nonfinite_gradient" not in origin:
        bad = _first_nonfinite_gradient(result)
        if bad is not None:
            origin["first_nonfinite_gradient"] = _gradient_name(bad)
    if origin.get("micro_batch") is None or len(inp.record.batches if inp.uses_loss else inp.record.forwards) <= 1:
        origin.pop("micro_batch", None)
    return origin
