"""Facts for the visual report (``nanreplay report``), added to the diagnosis dict as new keys
and documented in ``docs/report.md``:

* ``timeline``: the recorded loss, grad norm and learning rates of every step up to the failing
  one that the scalar history (``meta["scalar_history"]``, the last ~1,000 steps) or the ring
  buffer holds (the curves before the failure);
* ``forward_modules``: the output health of every module call of the replayed forward pass, in
  execution order, with its role, the health of the gradient at its output in the backward
  pass, and the allowlisted births (legitimate ``-Inf`` masks) inside it;
* ``batch_leaves``: every leaf of the recorded batch (or forward inputs) with the batch rows
  that hold non-finite values.

:func:`health_table` (the ``health`` key of every diagnosis) and ``forward_modules`` share one
role rule (:func:`forward_roles`).

Everything here reads what the replay already observed; nothing is replayed again.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.batch import batch_size, rows_of
from ..core.jsonable import fnum
from ..core.numerics import count_nonfinite, is_float
from ..core.tree import to_typed

__all__ = ["report_facts", "health_table", "forward_roles", "MAX_MODULES", "MAX_LEAVES", "MAX_ROWS"]

#: the most module calls ``forward_modules`` lists (the first ones in execution order)
MAX_MODULES = 1024
#: the most batch leaves ``batch_leaves`` lists
MAX_LEAVES = 32
#: the most row indices listed per batch leaf
MAX_ROWS = 1024


def _nonfinite(summary: Optional[dict]) -> bool:
    return bool(summary and (summary["nan"] or summary["posinf"] or summary["neginf"]))


def forward_roles(events: list[dict]) -> list[str]:
    """The role of each forward module event, in completion order: ``producer`` (a non-finite
    output from finite inputs), ``contains producer`` (a parent of an earlier producer: forwards
    complete children first), ``propagator`` (passed a non-finite value on), or ``""``."""
    roles, born_before = [], []
    for e in events:
        if e["born"]:
            inside = any(m == e["module"] or m.startswith(e["module"] + ".") or e["module"] == "" for m in born_before)
            roles.append("contains producer" if inside else "producer")
            born_before.append(e["module"])
        else:
            roles.append("propagator" if _nonfinite(e["output"]) else "")
    return roles


def health_table(result: Any, origin: Optional[dict], rows: int = 8) -> list[dict]:
    """The forward module events around the origin (``rows`` of them), with their roles."""
    fwd = [e for e in result.modules.events if e["phase"] == "forward"]
    idx = 0
    if origin and origin.get("module") is not None:
        idx = next((i for i, e in enumerate(fwd) if e["module"] == origin["module"]), 0)
    lo = max(0, idx - rows // 2)
    roles = forward_roles(fwd)
    return [{"index": i, "module": e["module"], "class": e["class"], "role": roles[i], "inputs_finite": e["inputs_finite"], "output": e["output"]}
            for i, e in enumerate(fwd[lo: lo + rows], start=lo)]


def _compact(h: Optional[dict]) -> Optional[dict]:
    """``{nan, posinf, neginf, numel, absmax}`` of a module event's summary (absmax over the finite values)."""
    if h is None:
        return None
    return {"nan": h["nan"], "posinf": h["posinf"], "neginf": h["neginf"], "numel": h["numel"], "absmax": fnum(h.get("absmax"))}


def _merge(a: Optional[dict], h: Optional[dict]) -> Optional[dict]:
    """Add the counts of summary ``h`` to the compact health ``a`` (absmax: the larger)."""
    b = _compact(h)
    if a is None or b is None:
        return a or b
    big = [x for x in (a["absmax"], b["absmax"]) if isinstance(x, float)]
    return {k: a[k] + b[k] for k in ("nan", "posinf", "neginf", "numel")} | {"absmax": max(big) if big else None}


def _timeline(history: Iterable[Any], failing_step: int) -> list[dict]:
    return [
        {"step": s.step, "loss": fnum(s.loss), "grad_norm": fnum(s.grad_norm), "lrs": [fnum(x) for x in (s.lrs or [])],
         "finite": s.finite, "failing": s.step == failing_step}
        for s in sorted(history, key=lambda s: s.step) if s.step <= failing_step
    ]


def _forward_modules(result: Any) -> list[dict]:
    events = [e for e in result.modules.events if e["phase"] == "forward"]
    roles = forward_roles(events)
    grads: dict[str, Optional[dict]] = {}
    for e in result.modules.events:
        if e["phase"] == "backward" and e.get("kind") == "output cotangent":
            grads[e["module"]] = _merge(grads.get(e["module"]), e["output"])
    allowed: dict[Optional[str], dict[str, int]] = {}
    for a in (result.ops.allowed if result.ops is not None else []):
        if a["phase"] != "backward":
            ops = allowed.setdefault(a["module"], {})
            ops[a["op"]] = ops.get(a["op"], 0) + 1
    return [{"index": i, "module": e["module"], "class": e["class"], "depth": 0 if e["module"] == "" else e["module"].count(".") + 1,
             "role": roles[i], "output": _compact(e["output"]), "grad": grads.get(e["module"]), "allowed": allowed.get(e["module"], {})}
            for i, e in enumerate(events[:MAX_MODULES])]


def _leaf_rows(t: torch.Tensor, size: Optional[int]) -> tuple[list[int], tuple[int, int, int]]:
    """(batch rows holding a non-finite value, up to MAX_ROWS; (NaN, +Inf, -Inf) counts)."""
    counts = count_nonfinite(t)
    if not sum(counts) or t.dim() == 0 or size is None:
        return [], counts
    return (rows_of(~torch.isfinite(t), size) or [])[:MAX_ROWS], counts


def _batch_leaves(inp: Any) -> list[dict]:
    rec = inp.record
    use_loss = inp.uses_loss
    trees = list(rec.batches) if use_loss else [fw.inputs for fw in rec.forwards]
    root = "batch" if use_loss else "inputs"
    out: list[dict] = []
    for i, tree in enumerate(trees):
        prefix = f"{root}[{i}]" if (len(trees) > 1 or not use_loss) else root
        size = batch_size(tree)
        for path, leaf in pytree.tree_flatten_with_path(to_typed(tree))[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            if len(out) >= MAX_LEAVES:
                return out
            fl = is_float(leaf)
            rows, (nan, pos, neg) = _leaf_rows(leaf.detach(), size) if fl and leaf.numel() else ([], (0, 0, 0))
            out.append({
                "leaf": prefix + pytree.keystr(path), "micro_batch": i, "shape": list(leaf.shape), "dtype": str(leaf.dtype).replace("torch.", ""),
                "floating": fl, "rows": rows, "nan": nan, "posinf": pos, "neginf": neg,
            })
    return out


def report_facts(result: Any, inp: Any) -> dict:
    """The report's extra keys for one replayed step.

    Args:
        result: the :class:`~nanreplay.engine.run.ReplayResult` of the step.
        inp: its :class:`~nanreplay.engine.run.StepInputs` (``history`` holds the ring buffer).

    Returns:
        ``{"timeline": [...], "forward_modules": [...], "batch_leaves": [...]}``, JSON-able;
        the fields are documented in ``docs/report.md``.
    """
    return {
        "timeline": _timeline(inp.long_history() or [inp.record], inp.record.step),
        "forward_modules": _forward_modules(result),
        "batch_leaves": _batch_leaves(inp),
    }
