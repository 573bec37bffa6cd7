"""Op-level attribution of a non-finite birth: the user's source line, the autograd node and its
forward source, legitimate non-finite values (the allowlist), the wider-dtype recomputation that
tells overflow from a domain error, which samples of the batch are to blame, the replay of the
optimizer update, and the cause verdict with its evidence.

The replay engine (:mod:`nanreplay.replay`) calls these helpers; they work on one birth at a time,
so their cost (a stack walk, one recomputation of one op) is paid only where a non-finite value
is born, never per op.

Techniques and where they come from:

* forward source lines: the Python stack at dispatch time (``sys._getframe``), innermost frame
  outside torch, nanreplay and the standard library;
* backward source lines: autograd anomaly mode (``torch.autograd.set_detect_anomaly``) stores the
  forward stack of every autograd node in ``node.metadata["traceback_"]``;
  ``torch._C._current_autograd_node()`` names the node whose backward kernel is running;
* overflow vs domain: the op is recomputed on its inputs in a wider dtype (float16/bfloat16 ->
  float32, float32 -> float64): finite there means the value only left the dtype's range.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import re
import statistics
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from .bundle import fnum
from .health import Health, is_float

logger = logging.getLogger(__name__)

__all__ = [
    "AllowRule",
    "Allowlist",
    "DEFAULT_ALLOW",
    "CAUSES",
    "user_frame_now",
    "user_frame_of_traceback",
    "node_forward_op",
    "domain_explanation",
    "wider_recompute",
    "classify",
]

#: the cause verdicts, in the order they are tested
CAUSES = ("bad input data", "optimizer update", "explosion", "overflow", "numerics", "unknown")

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p
)


def _is_library(filename: str) -> bool:
    if not filename or filename.startswith("<frozen"):
        return True
    f = os.path.abspath(filename)
    if f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR):
        return True
    return f.startswith(_STDLIB_DIRS) and "site-packages" not in f and "dist-packages" not in f


def _frame_dict(filename: str, line: int, function: str, code: Optional[str]) -> dict:
    return {"file": filename, "line": int(line), "function": function, "code": (code or "").strip() or None}


def user_frame_now() -> Optional[dict]:
    """The innermost frame of the current Python stack outside torch, nanreplay and the standard
    library, as ``{"file", "line", "function", "code"}``; ``None`` when every frame is library code."""
    import linecache

    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not _is_library(fn):
            return _frame_dict(fn, f.f_lineno, f.f_code.co_name, linecache.getline(fn, f.f_lineno))
        f = f.f_back
    return None


_TB_LINE = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?P<code>[^\n]*)')


def user_frame_of_traceback(tb: Optional[Sequence[str]]) -> Optional[dict]:
    """The innermost user frame of a forward stack recorded by anomaly mode
    (``node.metadata["traceback_"]``, a list of ``traceback.format_stack()`` strings)."""
    if not tb:
        return None
    for entry in reversed(list(tb)):
        m = _TB_LINE.match(entry)
        if m and not _is_library(m["file"]):
            return _frame_dict(m["file"], int(m["line"]), m["func"].strip(), m["code"])
    return None


def current_node() -> tuple[Optional[str], Optional[dict]]:
    """(name, forward user frame) of the autograd node whose backward kernel runs now."""
    try:
        node = torch._C._current_autograd_node()
    except (AttributeError, RuntimeError):
        return None, None
    if node is None:
        return None, None
    try:
        tb = node.metadata.get("traceback_")
    except (AttributeError, RuntimeError):
        tb = None
    return node.name(), user_frame_of_traceback(tb)


def node_forward_op(node: Optional[str]) -> Optional[str]:
    """The forward op of an autograd node name: ``SqrtBackward0`` -> ``sqrt``,
    ``LogSoftmaxBackward0`` -> ``log_softmax``, ``torch::autograd::AccumulateGrad`` -> ``None``."""
    if not node or "::" in node:
        return None
    base = re.sub(r"Backward\d*$", "", node)
    if base == node or not base:
        return None
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


# ---------------------------------------------------------------------------------------------
# the allowlist of legitimate non-finite values
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllowRule:
    """One allowlist rule: a birth matches when its module FQN matches ``module`` and its aten op
    name matches ``op`` (``fnmatch`` patterns; ``"*"`` matches anything, including "outside the
    model") and, with ``neginf_only``, its output holds -Inf and no NaN or +Inf.

    Written as ``"MODULE:OP"`` or ``"MODULE:OP:-inf"``, e.g. ``"*:masked_fill:-inf"``,
    ``"encoder.*.attn:*"``.
    """

    module: str = "*"
    op: str = "*"
    neginf_only: bool = True

    @classmethod
    def parse(cls, spec: str) -> "AllowRule":
        """Parse ``"MODULE:OP[:-inf]"``.

        Raises:
            ValueError: any other shape, with the expected one.
        """
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2].lower() not in ("-inf", "any")):
            raise ValueError(
                f"an allowlist rule is 'MODULE:OP' or 'MODULE:OP:-inf' (fnmatch patterns, e.g. '*:masked_fill:-inf'), got {spec!r}"
            )
        return cls(parts[0], parts[1], len(parts) == 3 and parts[2].lower() == "-inf")

    def __str__(self) -> str:
        return f"{self.module}:{self.op}" + (":-inf" if self.neginf_only else "")

    def matches(self, module: Optional[str], op: str, output: Optional[Health]) -> bool:
        if output is None:
            return False
        if self.neginf_only and (output.nan or output.posinf or not output.neginf):
            return False
        if not fnmatch.fnmatchcase(op, self.op):
            return False
        return self.module == "*" or (module is not None and fnmatch.fnmatchcase(module, self.module))


#: -Inf written on purpose by attention masking: ``masked_fill(mask, -inf)``, ``torch.where``,
#: ``torch.full(..., -inf)`` (``nn.Transformer.generate_square_subsequent_mask``), fills, copies
#: and index writes. Only -Inf: a NaN (a fully masked softmax row) is never allowed by default.
DEFAULT_ALLOW: tuple[AllowRule, ...] = tuple(
    AllowRule("*", op, True)
    for op in ("masked_fill", "masked_fill_", "where", "full", "full_like", "fill", "fill_", "scalar_tensor",
               "copy_", "_to_copy", "index_put", "index_put_", "masked_scatter", "masked_scatter_", "lift_fresh",
               "clone", "new_full", "triu", "tril", "zero_", "_safe_softmax")
)


class Allowlist:
    """Rules for non-finite values that are legitimate, so they are never called the origin.

    Args:
        rules: extra rules (:class:`AllowRule` or their ``"MODULE:OP[:-inf]"`` strings).
        defaults: include :data:`DEFAULT_ALLOW` (attention masking with -Inf).
    """

    def __init__(self, rules: Iterable[Any] = (), *, defaults: bool = True) -> None:
        extra = [r if isinstance(r, AllowRule) else AllowRule.parse(str(r)) for r in rules]
        self.rules: list[AllowRule] = (list(DEFAULT_ALLOW) if defaults else []) + extra

    def match(self, module: Optional[str], op: str, output: Optional[Health]) -> Optional[AllowRule]:
        return next((r for r in self.rules if r.matches(module, op, output)), None)

    def to_json(self) -> list[str]:
        return [str(r) for r in self.rules]


# ---------------------------------------------------------------------------------------------
# evidence at a birth
# ---------------------------------------------------------------------------------------------
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


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def wider_recompute(func: Callable, args: tuple, kwargs: dict, outs: Sequence[torch.Tensor]) -> Optional[dict]:
    """Recompute one op with its floating inputs cast to a wider dtype (float16/bfloat16 ->
    float32, float32 -> float64) and say whether the result is finite there. Only for ops that
    do not write into their inputs (the inputs must still be the ones the op saw).

    Returns:
        ``{"dtype": "float64", "finite": bool, "absmax": float | None}``, or ``None`` when the op
        cannot be recomputed (float64 already, an in-place op, a failure).
    """
    low = next((t.dtype for t in outs if t.dtype in _WIDER), None)
    if low is None:
        return None
    wide = _WIDER[low]

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in _WIDER and x.dtype.itemsize <= low.itemsize:
            return x.detach().to(wide)
        if isinstance(x, torch.dtype) and x in _WIDER and x.itemsize <= low.itemsize:
            return wide
        return x

    try:
        with torch.no_grad():
            res = func(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
    except Exception as e:  # some ops insist on their dtype; the evidence is then simply absent
        logger.debug("nanreplay: wider recomputation of %s failed: %s", func, e)
        return None
    ts = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor) and is_float(t)]
    if not ts:
        return None
    finite = all(bool(torch.isfinite(t).all()) for t in ts)
    fin = [t[torch.isfinite(t)] for t in ts]
    absmax = max((float(t.abs().max()) for t in fin if t.numel()), default=None)
    return {"dtype": str(wide).replace("torch.", ""), "finite": finite, "absmax": absmax}


def zero_counts(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Exact zeros in each floating input: the usual suspect of a domain error."""
    return [int((t.detach() == 0).sum()) for t in tensors if isinstance(t, torch.Tensor) and is_float(t)]


def nonfinite_rows(outs: Sequence[torch.Tensor], limit: int = 64) -> Optional[dict]:
    """Indices along dim 0 of the first output that hold a non-finite value, and that dim's size."""
    t = next((t for t in outs if is_float(t) and t.dim() >= 1), None)
    if t is None:
        return None
    bad = ~torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
    return {"size": int(t.shape[0]), "indices": [int(i) for i in bad.nonzero().flatten()[:limit].tolist()]}


# ---------------------------------------------------------------------------------------------
# the cause verdict
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# putting it together: the attribution fields of the diagnosis
# ---------------------------------------------------------------------------------------------
def _kinds(h: Any) -> str:
    if h is None:
        return "non-finite value"
    h = h.to_json() if isinstance(h, Health) else h
    parts = [n for n, k in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf")) if h.get(k)]
    return " and ".join(parts) or "non-finite value"


def _where_src(src: Optional[dict]) -> Optional[str]:
    return f"{os.path.basename(src['file'])}:{src['line']}" if src else None


def _compact(b: dict) -> dict:
    out = b.get("output")
    out = out.to_json() if isinstance(out, Health) else out
    return {
        "phase": b["phase"], "op": b["op"], "node": b.get("node"), "module": b.get("module"),
        "source": b.get("source"), "kinds": _kinds(out), "op_index": b.get("op_index"),
    }


def attribute(diag: dict, result: Any, model: torch.nn.Module, inp: Any, *, device: Optional[torch.device] = None, samples: bool = True) -> dict:
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
            nonfinite=_kinds(out_h), dtype=out_h.dtype if out_h else None, shape=out_h.shape if out_h else None,
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
            smp = samples_to_blame(model, inp, phase=phase, device=device)
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


def verdict_phrase(repro: dict) -> str:
    """The reproduction verdict as the summary says it: ``reproduced exactly``, ``reproduced (max
    abs difference X)``, ``reproduced up to one gradient factor C that the loop applied after
    backward`` (see :func:`nanreplay.replay.common_factor`), ``not reproduced``."""
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
