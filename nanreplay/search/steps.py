"""``bisect --over steps``: the first step that leaves the healthy range.

From the oldest snapshot in the ring buffer, replay every recorded step in order: its batch and
RNG states, forward and backward (the loss function, or the recorded cotangent), then the
optimizer update with the step's recorded learning rates, on an optimizer rebuilt from the bundle
(``meta["optimizer"]``) with the snapshot's state. A step leaves the healthy range when its loss
or gradients are non-finite, its grad norm or optimizer update norm exceeds ``threshold`` x the
median of the earlier replayed steps', or its update makes weights non-finite. On the way the
replayed losses and grad norms are verified against the recorded ones; when the recorded grad
norm is smaller (the loop called ``clip_grad_norm_``), the gradients are rescaled to it before
the update.

Needs a snapshot (weights and optimizer state) and every step after it in the ring buffer.
Replays: one per step replayed.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

import torch

from ..core.jsonable import fnum
from ..engine.state import build_optimizer, load_state
from ..errors import ReplayError
from ..format.records import Snapshot
from .common import BudgetExhausted, Outcome, Search, held_snapshots, movement, owner

__all__ = ["bisect_steps"]


def bisect_steps(search: Search, min_history: int = 2) -> dict:
    """Run the search; the culprit is the timeline row of the first step out of the healthy range
    (``min_history``: how many earlier steps the median needs)."""
    start, steps, snap = _replay_range(search)
    load_state(search.model, snap)
    walk = _Trajectory(search, build_optimizer(search.bundle, search.model, snap.optimizer), min_history)
    status = "found"
    try:
        for s in steps:
            if walk.replay_step(s):
                break
    except BudgetExhausted:
        status = "incomplete"
    return _report(search, walk, start, status)


def _replay_range(search: Search) -> tuple[int, list[int], Snapshot]:
    """The oldest snapshot's step, the steps from it to the failing step, and the snapshot.

    Raises:
        ReplayError: no snapshot up to the failing step, or the ring buffer misses a step in between.
    """
    b, F = search.bundle, search.step
    start = held_snapshots(search, F)[0]
    steps = [s for s in b.steps if start <= s <= F]
    gaps = [s for s in range(start, F + 1) if s not in steps]
    if gaps:
        raise ReplayError(f"{b.path}: the ring buffer misses steps {gaps[:8]} between the snapshot at step {start} and the failing step {F}; bisect --over steps needs every step in between")
    snap = b.step(start).snapshot
    assert snap is not None
    return start, steps, snap


class _Trajectory:
    """The steps replayed so far: one timeline row each, the grad norm and update norm histories
    the threshold test compares against, the first anomalous row and the first step whose replay
    differs from the recording."""

    def __init__(self, search: Search, opt: torch.optim.Optimizer, min_history: int) -> None:
        self.search, self.opt, self.min_history = search, opt, min_history
        self.params = dict(search.model.named_parameters())
        names = list(self.params)
        self.layers = sorted({owner(n) for n in names}, key=lambda L: names.index(next(n for n in names if owner(n) == L)))
        self.timeline: list[dict] = []
        self.first_bad: Optional[dict] = None
        self.first_mismatch: Optional[int] = None
        self.grad_hist: list[float] = []
        self.upd_hist: list[float] = []

    def replay_step(self, s: int) -> bool:
        """Replay step ``s`` and, before the failing step and unless it is non-finite, its
        optimizer update; add its row to the timeline. Returns whether it is non-finite."""
        rec, F = self.search.bundle.step(s), self.search.step
        cur = Snapshot(params={n: p.detach() for n, p in self.params.items()}, buffers=dict(self.search.model.named_buffers()))
        o = self.search.replay(rec, cur, f"step {s}" + (" (the failing step)" if s == F else ""))
        row: dict[str, Any] = {"step": s, "lrs": [fnum(x) for x in rec.lrs], "loss": fnum(o.loss), "grad_norm": fnum(o.grad_norm),
                               "recorded_loss": fnum(rec.loss), "recorded_grad_norm": fnum(rec.grad_norm)}
        self._verify(s, o, rec.loss, rec.grad_norm, row)
        reasons = self._grad_anomalies(o)
        if not o.nonfinite and s < F:
            reasons += self._update(rec.lrs, row)
        if o.grad_norm is not None and math.isfinite(o.grad_norm):
            self.grad_hist.append(o.grad_norm)
        row["anomalies"] = reasons
        self.timeline.append(row)
        if reasons and self.first_bad is None:
            self.first_bad = row
        if not o.nonfinite:
            for p in self.params.values():
                p.grad = None
        return o.nonfinite

    def _verify(self, s: int, o: Outcome, loss: Optional[float], grad_norm: Optional[float], row: dict) -> None:
        """Compare the replay with the recorded loss and grad norm. The optimizer consumed
        gradients of the recorded norm: a smaller recorded norm means the loop rescaled them
        between backward and ``optimizer.step()`` (``clip_grad_norm_``); do the same."""
        clipped = (
            not o.nonfinite and o.grad_norm is not None and grad_norm is not None and math.isfinite(grad_norm)
            and o.grad_norm > 0 and grad_norm < o.grad_norm * (1 - 1e-4)
        )
        if clipped:
            torch._foreach_mul_([p.grad for p in self.params.values() if p.grad is not None], grad_norm / o.grad_norm)
            row["clipped_to"] = fnum(grad_norm)
        checks = [c for c in (True if clipped else _close(o.grad_norm, grad_norm), _close(o.loss, loss) if o.loss is not None else None) if c is not None]
        row["matches_recording"] = all(checks) if checks else None
        if checks and not all(checks) and self.first_mismatch is None:
            self.first_mismatch = s

    def _grad_anomalies(self, o: Outcome) -> list[str]:
        if o.nonfinite:
            return ["non-finite " + ("loss" if not o.loss_finite else "gradients")]
        med = self._over_median(o.grad_norm, self.grad_hist)
        if med is None or o.grad_norm is None:
            return []
        return [f"grad norm {o.grad_norm:.4g} is {o.grad_norm / med:.3g}x the median {med:.4g} of the earlier steps"]

    def _update(self, lrs: list, row: dict) -> list[str]:
        """Take the optimizer step with the recorded learning rates and measure it per layer."""
        before = {n: p.detach().clone() for n, p in self.params.items()}
        for g, lr in zip(self.opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        self.opt.step()
        after = {n: p.detach() for n, p in self.params.items()}
        per = {L: movement(before, after, [n for n in self.params if owner(n) == L]) for L in self.layers}
        upd = math.sqrt(sum(float(v["diff_norm"]) ** 2 for v in per.values() if not isinstance(v["diff_norm"], str)))
        bad_w = sum(v["nonfinite_values"] for v in per.values())
        top = max(self.layers, key=lambda L: float(per[L]["relative_change"]))
        row.update({"update_norm": fnum(upd), "largest_relative_update": {"layer": top, **per[top]}})
        med = None if bad_w else self._over_median(upd, self.upd_hist)
        self.upd_hist.append(upd)
        if bad_w:
            return [f"the optimizer update made {bad_w} weight value(s) non-finite"]
        if med is not None:
            return [f"the optimizer update norm {upd:.4g} is {upd / med:.3g}x the median {med:.4g} of the earlier steps; "
                    f"the largest relative change is in {top or '(root)'} ({float(per[top]['relative_change']):.3g})"]
        return []

    def _over_median(self, x: Optional[float], history: list[float]) -> Optional[float]:
        """The median of ``history`` when ``x`` exceeds ``threshold`` x it (with enough history), else ``None``."""
        if x is None or len(history) < self.min_history:
            return None
        med = statistics.median(history)
        return med if med > 0 and x > self.search.threshold * med else None


def _close(a: Optional[float], b: Optional[float], rtol: float = 1e-4) -> Optional[bool]:
    if a is None or b is None:
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-12


def _report(search: Search, walk: _Trajectory, start: int, status: str) -> dict:
    F, timeline = search.step, walk.timeline
    details: dict[str, Any] = {"start_step": start, "threshold": search.threshold, "timeline": timeline, "first_mismatch": walk.first_mismatch}
    if walk.first_mismatch is None:
        verify = f"the replayed losses and grad norms match the recording for steps {start}..{timeline[-1]['step'] if timeline else start}"
    else:
        verify = f"the replay matches the recording up to step {walk.first_mismatch - 1} and differs from step {walk.first_mismatch} on (results after that are less reliable)"
    n_clip = sum(1 for r in timeline if "clipped_to" in r)
    if n_clip:
        verify += (f" ({n_clip} step(s) had smaller recorded grad norms, as after clip_grad_norm_: the replay rescaled its gradients "
                   "to the recorded norm before the update)")
    details["verification"] = verify
    first_bad = walk.first_bad
    if first_bad is None and status == "incomplete":
        return search.out_of_replays(details, before=f" before reaching step {F}")
    if first_bad is None:
        return search.result("not reproduced", f"Replaying steps {start}..{F} from the snapshot at step {start} stays in the healthy range; {verify}.", [], details)
    answer = f"Step {first_bad['step']} is the first to leave the healthy range: {'; '.join(first_bad['anomalies'])}; {verify}."
    return search.result(status, answer, [first_bad], details)
