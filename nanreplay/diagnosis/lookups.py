"""Which samples looked up the non-finite rows of an embedding table (issue 19, item 2).

When the step-start weights are already non-finite, the failure belongs to no sample, except for
a lookup table: an ``Embedding`` (or ``EmbeddingBag``, or any code that gathers rows of a weight
with ``F.embedding`` / ``index_select``) whose non-finite rows only some samples' indices reach
(a rare token). :func:`embedding_lookups` replays the step once, bare, under a dispatch mode that
sees every lookup op reading the weight (matched by storage, so tied weights and functional
lookups count), and names the samples (and the micro-batch) whose indices hit a non-finite row.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.batch import batch_size, rows_of
from ..core.state import load_buffers
from ..engine.deadline import replay_error
from ..engine.run import StepInputs, run_step

logger = logging.getLogger(__name__)

__all__ = ["embedding_lookups", "nonfinite_rows"]

#: the ops that gather rows of a weight (weight first, indices second), and index_select(weight, 0, indices)
_aten = torch.ops.aten
_LOOKUPS = {_aten.embedding.default: "embedding", _aten._embedding_bag.default: "embedding_bag",
            _aten._embedding_bag_forward_only.default: "embedding_bag"}
#: rows listed at most
MAX_ROWS = 1024


def nonfinite_rows(weight: torch.Tensor) -> list[int]:
    """The dim-0 rows of ``weight`` holding a non-finite value (at most :data:`MAX_ROWS`)."""
    if weight.dim() < 2 or not weight.is_floating_point():
        return []
    bad = (~torch.isfinite(weight.detach())).reshape(weight.shape[0], -1).any(dim=1)
    return [int(i) for i in bad.nonzero().flatten()[:MAX_ROWS].tolist()]


class _Lookups(TorchDispatchMode):
    """Records ``(op name, indices, offsets)`` of every lookup op that reads a tensor sharing the
    storage of ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.ptr = weight.untyped_storage().data_ptr()
        self.seen: list[tuple[str, torch.Tensor, Optional[torch.Tensor], int]] = []
        self.calls = 0  # the model's forward calls so far (micro-batch = calls - 1)

    def _reads_weight(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _LOOKUPS.get(func)
        if name is not None and len(args) >= 2 and self._reads_weight(args[0]):
            self.seen.append((name, args[1].detach().clone(), args[2].detach().clone() if name == "embedding_bag" and len(args) > 2 else None,
                              self.calls - 1))
        elif func is _aten.index_select.default and len(args) >= 3 and args[1] == 0 and self._reads_weight(args[0]):
            self.seen.append(("index_select", args[2].detach().clone(), None, self.calls - 1))
        return func(*args, **kwargs)


def _sample_rows(op: str, idx: torch.Tensor, offsets: Optional[torch.Tensor], bad: torch.Tensor, size: int) -> Optional[list[int]]:
    """The batch rows whose indices hit ``bad`` rows, ``None`` when the indices have no batch dimension."""
    hit = torch.isin(idx, bad)
    if op == "embedding_bag" and idx.dim() == 1 and offsets is not None and offsets.dim() == 1:
        if offsets.numel() not in (size, size + 1):
            return None
        bags = torch.searchsorted(offsets[:size].contiguous(), torch.arange(idx.numel()), right=True) - 1
        return sorted({int(b) for b in bags[hit].tolist()})
    return rows_of(hit, size)


def embedding_lookups(model: torch.nn.Module, inp: StepInputs, tensor: str, *, device: Optional[torch.device] = None) -> Optional[dict]:
    """The samples of the failing step whose indices look up the non-finite rows of the weight
    ``tensor`` (an FQN of ``model``, holding its step-start value).

    Replays the step once (bare: no monitors) under a dispatch mode that watches the lookups; the
    model's buffers and gradients are put back afterwards.

    Returns:
        ``None`` when the weight has no non-finite row or no lookup op reads it in the step (it is
        not a lookup table); else ``{"rows": [...], "indices": [sample, ...], "batch_size",
        "micro_batch" (int or None), "op", "lookups": [{"micro_batch", "samples"}, ...],
        "looked_up": bool}``: ``looked_up`` false when no index of the step reaches a non-finite
        row (the table is read, but its bad rows are not). A replay that raises gives ``None``.
    """
    params = dict(model.named_parameters())
    weight = params.get(tensor)
    if weight is None:
        return None
    rows = nonfinite_rows(weight)
    if not rows:
        return None
    mode = _Lookups(weight)

    def count(module: torch.nn.Module, args: tuple) -> None:
        mode.calls += 1

    grads = {p: p.grad for p in model.parameters()}
    hook = model.register_forward_pre_hook(count)
    try:
        with mode:
            run_step(model, dataclasses.replace(inp, recorded_grads={}), ops=False, device=device, monitors=False)
    except Exception as e:
        logger.info("nanreplay: the lookup replay failed (%s)", replay_error(e))
        return None
    finally:
        hook.remove()
        load_buffers(model, inp.state.buffers)
        for p, g in grads.items():
            p.grad = g
    if not mode.seen:
        return None
    trees = inp.record.batches if inp.uses_loss else [fw.inputs for fw in inp.record.forwards]

    def step_batch_size(mb: int) -> Optional[int]:
        return batch_size(trees[mb]) if 0 <= mb < len(trees) else None

    bad = torch.tensor(rows, dtype=torch.long)
    micro = len(inp.record.batches if inp.uses_loss else inp.record.forwards)
    lookups = []
    for k, (op, idx, offsets, call) in enumerate(mode.seen):
        mb = call if 0 <= call < micro else (k * micro // len(mode.seen) if micro > 1 else 0)
        size = step_batch_size(mb)
        samples = _sample_rows(op, idx.cpu(), offsets.cpu() if offsets is not None else None, bad, size) if size else None
        if samples:
            lookups.append({"micro_batch": mb, "samples": samples, "op": op, "batch_size": size})
    first = lookups[0] if lookups else None
    return {"rows": rows, "tensor": tensor, "looked_up": bool(lookups), "lookups": lookups,
            "indices": list(first["samples"]) if first else [], "batch_size": first["batch_size"] if first else step_batch_size(0),
            "micro_batch": first["micro_batch"] if first and micro > 1 else None, "op": first["op"] if first else mode.seen[0][0]}
