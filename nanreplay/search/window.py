"""The window ``bisect --over layers`` searches in when the NaN comes steps after the corruption.

By the failing step a corruption made steps earlier has usually spread: every layer's weights have
moved by orders of magnitude, so any one of them alone makes the failing step non-finite and a
search between a finite snapshot and the failing step names whichever layer comes first. The
window narrows the search to where the corruption began:

* the **first abnormal step** comes from the steps search's walk
  (:func:`nanreplay.search.steps.first_abnormal`: the recorded weights from the oldest snapshot on,
  each step judged by its grad norm against the earlier steps' and the bundle's scalar history,
  each update by its norm against the earlier updates', non-finite weights, a non-finite replay);
* the **good** state is the last healthy one before it, the **bad** state the first abnormal one:
  for an abnormal update at step ``A``, the weights before and after it (step ``A``'s and step
  ``A+1``'s pre-step weights) with step ``A+1``'s batch as the probe; for a step whose replay is
  already abnormal, step ``A-1``'s and step ``A``'s pre-step weights with step ``A``'s batch;
* a mix of the two states is **abnormal** when the probe batch replays non-finite on it or its
  grad norm exceeds ``threshold`` x the grad norm of the same batch on the good state (same batch,
  only the weights differ);
* a layer's weights are **abnormal** at a later state when they hold non-finite values or moved,
  relative to the good state, by more than ``threshold`` x (steps between) x the median per-step
  relative update of that layer over the healthy steps walked (1.0, i.e. by more than their own
  norm, without that history). The layers abnormal at the failing step but not at the first
  abnormal state are those the corruption **spread to**.

Nothing here replays on its own account: every replay goes through
:meth:`~nanreplay.search.common.Search.replay` (the budget, the trials).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Optional

from ..format.records import Snapshot, StepRecord
from .common import Outcome, Search, movement, owner
from .steps import Walk

__all__ = ["Window", "window_from", "abnormal_layers", "judge"]


@dataclasses.dataclass
class Window:
    """The two states the layers search compares, and the step whose batch tells them apart.

    Attributes:
        first_abnormal: the walk's first timeline row out of the healthy range (``step``, ``anomalies``, ...).
        kind: ``"update"`` (step ``first_abnormal``'s update left the range) or ``"step"`` (its replay did).
        good_step, good: the last healthy pre-step state (``None`` when the oldest snapshot is already abnormal).
        bad_step, bad: the first abnormal pre-step state.
        probe_step, probe: the step whose batch is replayed on mixes of the two.
    """

    first_abnormal: dict
    kind: str
    good_step: Optional[int]
    good: Optional[Snapshot]
    bad_step: int
    bad: Snapshot
    probe_step: int
    probe: StepRecord

    @property
    def step(self) -> int:
        """The first abnormal step."""
        return int(self.first_abnormal["step"])


def window_from(search: Search, walk: Walk) -> Optional[Window]:
    """The window around the walk's first abnormal step, or ``None`` when the walk found none
    before the failing step."""
    row = walk.first_bad
    if row is None:
        return None
    A, F = int(row["step"]), search.step
    if row.get("anomaly_in") == "update":
        assert walk.pre is not None and walk.after is not None
        probe = search.failing if A + 1 == F else search.bundle.step(A + 1)
        return Window(row, "update", A, walk.pre, A + 1, walk.after, A + 1, probe)
    assert walk.pre is not None
    good_step = None if walk.prev_pre is None else A - 1
    return Window(row, "step", good_step, walk.prev_pre, A, walk.pre, A, search.bundle.step(A) if A != F else search.failing)


def judge(o: Outcome, ref: Outcome, threshold: float) -> Optional[str]:
    """Why replay ``o`` of the probe batch is abnormal next to ``ref`` (the same batch on the good
    state), or ``None`` when it is not."""
    if o.nonfinite:
        return "non-finite " + ("loss" if not o.loss_finite else "gradients")
    g, r = o.grad_norm, ref.grad_norm
    if g is None or r is None or not math.isfinite(r):
        return None
    if (r > 0 and g > threshold * r) or (r == 0 and g > 0):
        return f"grad norm {g:.4g} vs {r:.4g} with the good weights" + (f", {g / r:.3g}x" if r > 0 else "")
    return None


def abnormal_layers(good: Snapshot, later: Snapshot, steps: int, layers: list[str], walk: Walk, threshold: float) -> dict[str, dict]:
    """Each layer's movement from ``good`` to ``later`` (``steps`` steps apart) with ``abnormal``
    (bool) and ``bound`` (the relative change allowed) added; see the module docstring."""
    out: dict[str, dict] = {}
    for L in layers:
        names = [n for n in later.params if owner(n) == L and n in good.params]
        m: dict[str, Any] = movement(good.params, later.params, names)
        hist = [h for h in walk.layer_hist.get(L, []) if math.isfinite(h)]
        per_step = statistics.median(hist) if len(hist) >= walk.min_history else None
        bound = threshold * max(steps, 1) * per_step if per_step else 1.0
        rel = m["relative_change"]
        rel_f = math.inf if isinstance(rel, str) else float(rel)
        m["bound"] = bound
        m["abnormal"] = bool(m["nonfinite_values"]) or rel_f > bound
        out[L] = m
    return out
