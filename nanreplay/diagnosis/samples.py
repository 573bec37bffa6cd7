"""Which samples of the batch carry the failure, or why no sample can be blamed.

:data:`METHODS` is the rule as a table, tried in order: the non-finite rows of the recorded batch
(bad input), the samples whose indices look up the non-finite rows of an embedding table,
nothing for other failures that come from the weights or the update, the non-finite rows of
the recorded output gradient (a loss not replayed), the non-finite rows of the birth op's output
when it has the batch dimension, a failure that needs the whole batch (the birth op combined the
samples: a batch statistic, a count over the batch, a batch of one), and last a per-sample replay
(bisection over the batch: about ``2 * k * log2(B)`` extra replays for ``k`` guilty samples of a
batch of ``B``, capped), which is refused, with the reason, where one sample cannot be replayed
alone (BatchNorm in training mode) or a replay of a subset fails.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch

from ..core.batch import batch_coupled, batch_size, rows_of, take_rows
from ..core.numerics import any_nonfinite, is_float
from ..core.state import load_buffers
from ..core.tree import tensor_leaves
from ..engine.deadline import check_deadline, replay_error
from ..engine.run import ReplayResult, StepInputs, run_step
from ..format.records import StepRecord
from .lookups import embedding_lookups
from .origin import Found

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "samples_for", "per_sample_replay", "step_batch_size"]


def step_batch_size(rec: StepRecord, uses_loss: bool, micro_batch: Optional[int] = None) -> Optional[int]:
    """The batch size of one micro-batch of a step (the first when ``micro_batch`` is None): of its
    recorded batch when the loss function replays, else of its forward call's inputs."""
    trees = rec.batches if uses_loss else [fw.inputs for fw in rec.forwards]
    if not trees:
        return None
    i = micro_batch if micro_batch is not None and micro_batch < len(trees) else 0
    return batch_size(trees[i])


def _rows_result(indices: list[int], size: Optional[int], method: str, **more: Any) -> dict:
    return {"indices": sorted(indices), "count": len(indices), "batch_size": size, "method": method, "batch_level": False, "warnings": [], **more}


def _batch_level(size: Optional[int], why: str) -> dict:
    return {"indices": [], "batch_size": size, "method": "batch-level", "batch_level": True, "warnings": [], "reason": why}


@dataclasses.dataclass
class _Case:
    found: Found
    inp: StepInputs
    result: ReplayResult
    model: torch.nn.Module
    device: Optional[torch.device]
    search: bool
    progress: Optional[Callable[[str], None]]
    cause: Optional[str]


def _from_batch_rows(c: _Case) -> Optional[dict]:
    if c.found.phase != "input":
        return None
    leaves = c.found.extra.get("leaves") or []
    rows = sorted({i for x in leaves for i in x["samples"]})
    recorded_forward = bool(c.found.origin.get("recorded_forward_inputs"))
    size = step_batch_size(c.inp.record, c.inp.uses_loss and not recorded_forward)
    where = "recorded forward inputs" if recorded_forward else "recorded batch"
    if size is not None and size > 1 and len(rows) == size:
        return _batch_level(size, f"every one of the {size} rows of the {where} holds a non-finite value")
    return _rows_result(rows, size, f"non-finite rows of the {where}")


#: a method's answer "no sample applies": stop, report no samples
NOT_APPLICABLE: dict = {}


def _from_lookups(c: _Case) -> Optional[dict]:
    """Non-finite rows of a lookup table (an ``Embedding``): the samples whose indices look them
    up in this step (:func:`~nanreplay.diagnosis.lookups.embedding_lookups`, one bare replay)."""
    if c.found.phase != "weights" or c.found.origin.get("kind") != "parameter":
        return None
    res = embedding_lookups(c.model, c.inp, c.found.origin["tensor"], device=c.device)
    if res is None or not res["looked_up"]:
        return None
    tensor, rows = res["tensor"], res["rows"]
    where = f" of micro-batch {res['micro_batch']}" if res["micro_batch"] is not None else ""
    others = [f"micro-batch {x['micro_batch']}: samples {x['samples']}" for x in res["lookups"][1:] if x["micro_batch"] != res["micro_batch"]]
    reason = (f"rows {rows[:16]}{' ...' if len(rows) > 16 else ''} of {tensor} are non-finite; the {res['op']} lookups of step "
              f"{c.inp.record.step} read them for samples {res['indices']}{where}" + (f" (and {'; '.join(others[:4])})" if others else ""))
    size = res["batch_size"]
    if size is not None and size > 1 and len(res["indices"]) == size and not others:
        return dict(_batch_level(size, f"every sample looks up a non-finite row: {reason}"), rows=rows)
    return _rows_result(res["indices"], size, "samples whose indices look up non-finite embedding rows", rows=rows, reason=reason,
                        **({"micro_batch": res["micro_batch"]} if res["micro_batch"] is not None else {}))


def _not_samples(c: _Case) -> Optional[dict]:
    """Failures of the weights, the update or an explosion belong to no sample."""
    if c.found.phase in ("weights", "optimizer") or c.found.origin.get("kind") == "explosion" or c.cause == "explosion":
        return NOT_APPLICABLE
    return None


def _from_cotangent(c: _Case) -> Optional[dict]:
    if c.found.origin.get("loss_replayed") is not False:
        return None
    fws = c.inp.record.forwards
    mb = c.found.origin.get("micro_batch")
    mb = mb if isinstance(mb, int) and 0 <= mb < len(fws) else None
    size = step_batch_size(c.inp.record, False, mb)
    if size is None:
        return None
    bad: set[int] = set()
    for fw in [fws[mb]] if mb is not None else fws:  # the rows of the micro-batch the origin names
        for t in tensor_leaves(fw.cotangent):
            if is_float(t) and t.dim() >= 1:
                bad.update(rows_of(~torch.isfinite(t.detach()), size) or [])
    more = {"micro_batch": mb} if mb is not None and len(fws) > 1 else {}
    return _rows_result(sorted(bad), size, "non-finite rows of the recorded output gradient", **more) if bad else None


def _from_birth_rows(c: _Case) -> Optional[dict]:
    b = c.found.birth
    if b is None or not b.get("rows"):
        return None
    mb = b.get("micro_batch")
    size = step_batch_size(c.inp.record, c.inp.uses_loss, mb)
    rows = b["rows"]
    if size is None or rows["size"] != size or not rows["indices"]:
        return None
    if max(rows.get("count", 0), len(rows["indices"])) == size and size > 1:
        return _batch_level(size, f"every one of the {size} rows of the {b['op']} output is non-finite")
    multi = len(c.inp.record.batches if c.inp.uses_loss else c.inp.record.forwards) > 1
    out = _rows_result(rows["indices"], size, "non-finite rows of the producer op's output", **({"micro_batch": mb} if multi else {}))
    if rows.get("count", 0) > len(rows["indices"]):  # the birth keeps the first rows only: say how many there are
        out.update(count=rows["count"], complete=False)
        out["warnings"].append(f"{rows['count']} rows of the {b['op']} output are non-finite; the first {len(rows['indices'])} are listed")
    return out


def _whole_batch(c: _Case) -> Optional[dict]:
    """The failure needs the batch as a whole: the birth op reduces over the batch dimension (an
    operand has it, the output has not: a batch statistic), or the batch holds one sample (a
    sample cannot be told from its batch)."""
    b = c.found.birth
    if b is None or c.found.phase not in ("forward", "loss", "backward"):
        return None
    size = step_batch_size(c.inp.record, c.inp.uses_loss, b.get("micro_batch"))
    if size is None:
        return None
    if size == 1:
        return _batch_level(size, "the batch holds one sample: the failure belongs to the batch, not to a sample of it")
    out_shape = list(getattr(b.get("output"), "shape", None) or [])
    operands = (b.get("operands") or {}).get("tensors") or []
    operand_rows = [o for o in operands if size in (o.get("shape") or [])]
    merged = [o for o in operands if (o.get("merged_rows") or [None])[0] == size]  # [B * T, ...]: the batch merged into dimension 0
    keeps_merged = any(out_shape[:1] == (o.get("shape") or [])[:1] for o in merged)
    if (operand_rows or merged) and size not in out_shape and not keeps_merged and c.found.phase != "backward":
        o = (operand_rows or merged)[0]
        rows = "" if operand_rows else f", {size} samples x {o['merged_rows'][1]} rows"
        return _batch_level(size, f"{b['op']} reduces the batch dimension of its input (shape {o['shape']}{rows} -> {out_shape}): "
                                  f"a statistic of the {size} samples together")
    return None


def _per_sample(c: _Case) -> Optional[dict]:
    if not c.search or c.found.phase not in ("forward", "loss", "backward"):
        return None
    return per_sample_replay(c.model, c.inp, phase=c.found.phase, device=c.device, progress=c.progress)


#: the samples rule, in order: the first method that answers decides
METHODS: tuple[tuple[str, Callable[[_Case], Optional[dict]]], ...] = (
    ("non-finite rows of the recorded batch", _from_batch_rows),
    ("samples whose indices look up non-finite embedding rows", _from_lookups),
    ("not a sample's failure (weights, update, explosion)", _not_samples),
    ("non-finite rows of the recorded output gradient", _from_cotangent),
    ("non-finite rows of the producer op's output", _from_birth_rows),
    ("a batch statistic, or a batch of one", _whole_batch),
    ("per-sample replay", _per_sample),
)


def samples_for(found: Found, inp: StepInputs, result: ReplayResult, model: torch.nn.Module, *, device: Optional[torch.device], search: bool,
                cause: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> Optional[dict]:
    """The samples of the origin by :data:`METHODS`: ``{"indices", "batch_size", "method",
    "batch_level", "warnings"}`` plus ``micro_batch``, ``reason``, ``runs``, ``cannot_tell`` where
    they apply; ``None`` when no method applies."""
    c = _Case(found, inp, result, model, device, search, progress, cause)
    for _, method in METHODS:
        out = method(c)
        if out is NOT_APPLICABLE:
            return None
        if out is not None:
            return _one_sample_batch(out)
    return None


def _one_sample_batch(out: dict) -> dict:
    """A batch of one sample: the failure belongs to the batch, whatever method named row 0."""
    if out.get("batch_size") == 1 and not out.get("batch_level"):
        return dict(out, indices=[], count=0, batch_level=True,
                    reason="the batch holds one sample: the failure belongs to the batch, not to a sample of it")
    return out


def _slice_record(rec: StepRecord, idx: list[int], size: int) -> StepRecord:
    ix = torch.tensor(idx, dtype=torch.long)
    return dataclasses.replace(
        rec,
        batches=[take_rows(b, ix, size) for b in rec.batches],
        forwards=[dataclasses.replace(fw, inputs=take_rows(fw.inputs, ix, size),
                                      cotangent=take_rows(fw.cotangent, ix, size) if fw.cotangent is not None else None) for fw in rec.forwards],
    )


def per_sample_replay(model: torch.nn.Module, inp: StepInputs, *, phase: str, device: Optional[torch.device] = None, max_runs: int = 32,
                      progress: Optional[Callable[[str], None]] = None) -> Optional[dict]:
    """The samples of the failing step's batch that alone make the step non-finite, by replaying
    subsets (bisection along the batch dimension).

    A sample is only blamed on evidence: where one sample cannot be replayed on its own (a
    batch-coupled layer such as BatchNorm in training mode, a loss that needs several samples)
    the answer is ``cannot_tell`` with the reason, and no sample is named.

    Args:
        model: the replay model, holding the step-start weights (buffers are reset from
            ``inp.state`` before each run).
        phase: ``"forward"``/``"loss"`` (a non-finite model output or loss counts) or
            ``"backward"`` (a non-finite gradient counts).
        max_runs: cap on the extra replays.

    Probes first: the first, middle and last samples are replayed alone (three cheap one-sample
    replays). When all three are non-finite, the failure does not depend on particular samples
    (a divisor of the whole batch, the weights) and the answer is batch-level after 3 replays
    instead of the 2B - 2 of a bisection that finds every sample bad. Otherwise the bisection
    runs (reusing the probes' answers).

    Returns:
        ``{"indices", "batch_size", "method": "per-sample replay", "batch_level", "runs",
        "complete", "warnings", "cannot_tell"}``, or ``None`` when the batch has no batch dimension.
    """
    size = step_batch_size(inp.record, inp.uses_loss)
    if size is None:
        return None
    coupled = batch_coupled(model, inp.record.training)
    if coupled:
        why = f"batch-coupled layers in training mode ({', '.join(coupled[:4])}): one sample's result depends on the rest of its batch"
        return {"indices": [], "batch_size": size, "method": "per-sample replay", "batch_level": False, "runs": 0, "complete": False,
                "warnings": [f"cannot tell per sample: {why}"], "cannot_tell": why}
    state = {"runs": 0, "complete": True, "error": None}
    seen: dict[tuple[int, ...], bool] = {}

    def bad(idx: list[int]) -> bool:
        if tuple(idx) in seen:
            return seen[tuple(idx)]
        seen[tuple(idx)] = verdict = _bad(idx)
        return verdict

    def _bad(idx: list[int]) -> bool:
        if state["runs"] >= max_runs:
            state["complete"] = False
            return False
        check_deadline()
        state["runs"] += 1
        if progress is not None:
            progress(f"per-sample replay {state['runs']} (samples {idx[:4]}{'...' if len(idx) > 4 else ''} of {size})")
        load_buffers(model, inp.state.buffers)
        sub = dataclasses.replace(inp, record=_slice_record(inp.record, idx, size), recorded_grads={})
        try:
            res = run_step(model, sub, ops=False, device=device, lean=True, backward=phase == "backward")
        except Exception as e:  # e.g. a loss that needs two samples; one sample cannot be judged alone
            replay_error(e)  # the deadline goes through
            if state["error"] is None:
                state["error"] = f"the replay of samples {idx[:4]}{'...' if len(idx) > 4 else ''} alone failed: {type(e).__name__}: {str(e)[:160]}"
            return False
        if phase == "backward":
            return any_nonfinite(res.grads.values())
        return any(h is not None and not h.finite for h in list(res.outputs) + list(res.losses))

    def search(idx: list[int], known_bad: bool) -> list[int]:
        if not known_bad and not bad(idx):
            return []
        if len(idx) == 1:
            return idx
        mid = len(idx) // 2
        return search(idx[:mid], False) + search(idx[mid:], False)

    probes = sorted({0, size // 2, size - 1})
    if size > 3 and all(bad([i]) for i in probes) and state["error"] is None:
        return {"indices": [], "batch_size": size, "method": "per-sample replay", "batch_level": True, "runs": state["runs"],
                "complete": True, "warnings": [f"samples {probes[0]}, {probes[1]} and {probes[2]} of {size} are each non-finite alone: the "
                                               "failure does not depend on particular samples (the batch as a whole, or the weights)"]}
    found = search(list(range(size)), size > 1) if size > 1 else ([0] if bad([0]) else [])
    out = {"indices": found, "batch_size": size, "method": "per-sample replay", "batch_level": False, "runs": state["runs"],
           "complete": state["complete"], "warnings": []}
    if state["error"] is not None:
        out.update(indices=[], cannot_tell=state["error"])
        out["warnings"].append(f"cannot tell per sample: {state['error']}")
    elif size > 1 and found == list(range(size)):
        out.update(indices=[], batch_level=True)
        out["warnings"].append("every sample alone is non-finite: the failure depends on the batch as a whole (or on the weights), not on particular samples")
    elif size > 1 and not found and state["complete"]:
        out["batch_level"] = True
        out["warnings"].append("no sample alone is non-finite: the failure needs several samples together (a batch-level interaction)")
    if not state["complete"]:
        out["warnings"].append(f"stopped after {max_runs} per-sample replays; the list may be incomplete")
    return out
