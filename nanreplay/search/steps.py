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

:func:`first_abnormal` is the same walk for ``--over layers``: it follows the recorded weights
(each step starts from its snapshot when the ring buffer holds one, so a corruption made outside
``optimizer.step()`` is seen too), judges grad norms against the bundle's scalar history as well,
stops at the first step out of the healthy range, and keeps the weights on either side of it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

import torch

from ..core.jsonable import fnum
from ..engine.state import build_optimizer, load_state
from ..errors import ReplayError
from ..format.records import Snapshot, scalar_history_records
from .common import BudgetExhausted, Outcome, Search, held_snapshots, movement, owner

__all__ = ["bisect_steps", "first_abnormal", "Walk"]


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

    def __init__(self, search: Search, opt: Optional[torch.optim.Optimizer], min_history: int) -> None:
        self.search, self.opt, self.min_history = search, opt, min_history
        self.params = dict(search.model.named_parameters())
        names = list(self.params)
        self.layers = sorted({owner(n) for n in names}, key=lambda L: names.index(next(n for n in names if owner(n) == L)))
        self.timeline: list[dict] = []
        self.first_bad: Optional[dict] = None
        self.first_mismatch: Optional[int] = None
        self.grad_hist: list[float] = []
        self.upd_hist: list[float] = []
        self.update_kind = "the optimizer update"  # what changed the weights of the last step, for the anomaly's words

    def replay_step(self, s: int) -> bool:
        """Replay step ``s`` and, before the failing step and unless it is non-finite, its
        optimizer update; add its row to the timeline. Returns whether it is non-finite."""
        rec, F = self.search.bundle.step(s), self.search.step
        self._begin(s)
        cur = Snapshot(params={n: p.detach() for n, p in self.params.items()}, buffers=dict(self.search.model.named_buffers()))
        o = self.search.replay(rec, cur, f"step {s}" + (" (the failing step)" if s == F else ""))
        row: dict[str, Any] = {"step": s, "lrs": [fnum(x) for x in rec.lrs], "loss": fnum(o.loss), "grad_norm": fnum(o.grad_norm),
                               "recorded_loss": fnum(rec.loss), "recorded_grad_norm": fnum(rec.grad_norm)}
        self._verify(s, o, rec.loss, rec.grad_norm, row)
        gn = self._judged_norm(o, row)
        reasons = self._grad_anomalies(o, gn)
        if reasons:
            row["anomaly_in"] = "step"
        if not o.nonfinite and s < F:
            upd = self._update(s, rec.lrs, row)
            if upd and not reasons:
                row["anomaly_in"] = "update"
            reasons += upd
        if gn is not None and math.isfinite(gn):
            self.grad_hist.append(gn)
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

    def _begin(self, s: int) -> None:
        """Before step ``s`` is replayed (the recorded walk starts it from its snapshot)."""

    def _judged_norm(self, o: Outcome, row: dict) -> Optional[float]:
        """The grad norm the threshold test judges and keeps: the replayed one."""
        return o.grad_norm

    def grad_anomalies(self, o: Outcome, gn: Optional[float]) -> list[str]:
        """Why replay ``o`` (grad norm ``gn``) is out of the healthy range of the steps judged so far ([] when it is not)."""
        return self._grad_anomalies(o, gn)

    def _grad_anomalies(self, o: Outcome, gn: Optional[float]) -> list[str]:
        if o.nonfinite:
            return ["non-finite " + ("loss" if not o.loss_finite else "gradients")]
        med = self._over_median(gn, self.grad_hist)
        if med is None or gn is None:
            return []
        return [f"grad norm {gn:.4g} is {gn / med:.3g}x the median {med:.4g} of the earlier steps"]

    def _advance(self, s: int, lrs: list) -> dict[str, torch.Tensor]:
        """Take step ``s``'s optimizer step with the recorded learning rates; the weights after it."""
        assert self.opt is not None
        for g, lr in zip(self.opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        self.opt.step()
        return {n: p.detach() for n, p in self.params.items()}

    def _update(self, s: int, lrs: list, row: dict) -> list[str]:
        """Take the optimizer step with the recorded learning rates and measure it per layer."""
        before = {n: p.detach().clone() for n, p in self.params.items()}
        after = self._advance(s, lrs)
        per = {L: movement(before, after, [n for n in self.params if owner(n) == L]) for L in self.layers}
        self._moved(before, after, per)
        upd = math.sqrt(sum(float(v["diff_norm"]) ** 2 for v in per.values() if not isinstance(v["diff_norm"], str)))
        bad_w = sum(v["nonfinite_values"] for v in per.values())
        top = max(self.layers, key=lambda L: float(per[L]["relative_change"]))
        row.update({"update_norm": fnum(upd), "largest_relative_update": {"layer": top, **per[top]}})
        med = None if bad_w else self._over_median(upd, self.upd_hist)
        self.upd_hist.append(upd)
        if bad_w:
            return [f"{self.update_kind} made {bad_w} weight value(s) non-finite"]
        if med is not None:
            return [f"{self.update_kind} norm {upd:.4g} is {upd / med:.3g}x the median {med:.4g} of the earlier steps; "
                    f"the largest relative change is in {top or '(root)'} ({float(per[top]['relative_change']):.3g})"]
        return []

    def _moved(self, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], per: dict[str, dict]) -> None:
        """After an update: the weights on either side and each layer's movement (the recorded walk keeps them)."""

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


#: how many of the scalar history's steps before the walk's first step its grad norms are judged against
PRIOR_STEPS = 64


class Walk(_Trajectory):
    """The walk of :func:`first_abnormal`: the recorded weights (each step starts from its snapshot
    when one is held; between snapshots the rebuilt optimizer carries them), grad norms judged as
    the optimizer consumed them (after ``clip_grad_norm_``, as the scalar history holds them).

    Attributes:
        pre, prev_pre: the pre-step weights and buffers of the step replayed last and of the one before.
        after: the weights after the last update. layer_hist: each layer's relative change per healthy step.
    """

    def __init__(self, search: Search, min_history: int, prior: list[float], held: set[int]) -> None:
        super().__init__(search, None, min_history)
        self.grad_hist = list(prior)
        self.held = held
        self.opt_state: Optional[dict] = None
        self.pre: Optional[Snapshot] = None
        self.prev_pre: Optional[Snapshot] = None
        self.after: Optional[Snapshot] = None
        self.layer_hist: dict[str, list[float]] = {L: [] for L in self.layers}
        self._per: dict[str, dict] = {}

    def _begin(self, s: int) -> None:
        if s in self.held:
            snap = self.search.bundle.step(s).snapshot
            assert snap is not None
            load_state(self.search.model, snap)
            self.opt, self.opt_state = None, snap.optimizer
        self.prev_pre, self.pre = self.pre, self._capture()

    def _capture(self, params: Optional[dict[str, torch.Tensor]] = None) -> Snapshot:
        ps = params if params is not None else {n: p.detach() for n, p in self.params.items()}
        return Snapshot(params={n: t.clone() for n, t in ps.items()},
                        buffers={n: t.detach().clone() for n, t in self.search.model.named_buffers()})

    def _judged_norm(self, o: Outcome, row: dict) -> Optional[float]:
        clipped = row.get("clipped_to")
        return float(clipped) if isinstance(clipped, float) else o.grad_norm

    def _advance(self, s: int, lrs: list) -> dict[str, torch.Tensor]:
        F, nxt = self.search.step, s + 1
        snap = self.search.state if nxt == F else (self.search.bundle.step(nxt).snapshot if nxt in self.held else None)
        if snap is not None:  # the recorded weights after the step: whatever changed them, optimizer or not
            self.update_kind = f"the recorded update (step {s}'s weights to step {nxt}'s)"
            load_state(self.search.model, snap)
            return {n: p.detach() for n, p in self.params.items()}
        if self.opt is None:
            self.opt = build_optimizer(self.search.bundle, self.search.model, self.opt_state)
        self.update_kind = "the optimizer update"
        return super()._advance(s, lrs)

    def _moved(self, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], per: dict[str, dict]) -> None:
        self.after, self._per = self._capture(after), per

    def keep_healthy(self) -> None:
        """The last step was healthy: keep its per-layer update in :attr:`layer_hist`."""
        for L, m in self._per.items():
            rel = m["relative_change"]
            self.layer_hist[L].append(math.inf if isinstance(rel, str) else float(rel))
        self._per = {}


def first_abnormal(search: Search, min_history: int = 2, reserve: int = 0) -> Walk:
    """The steps search's walk, for ``bisect --over layers``: from the oldest snapshot held, replay
    each step before the failing one on the recorded weights and stop at the first step out of the
    healthy range (the walk's ``first_bad``; ``None`` when every step before the failing one is
    healthy, or when the oldest snapshot is the step just before the failing one: nothing to walk).
    ``reserve``: replays to leave for the caller; when the budget cannot walk from the oldest
    snapshot, the walk starts at the oldest snapshot it can walk from (and says so in the
    search's warnings), or does not walk at all. The grad norms of up to :data:`PRIOR_STEPS` scalar-history steps before the oldest
    snapshot seed the median, so the walk's first steps are judged too.

    Replays: one per step walked.

    Raises:
        ReplayError: no snapshot before the failing step, the ring buffer misses a step in
            between, or the optimizer that carries the weights between snapshots cannot be rebuilt.
        BudgetExhausted: ``max_replays`` ran out.
    """
    b, F = search.bundle, search.step
    start, steps, _ = _replay_range(search)
    if start >= F - 1:  # one step before the failing one: its window is the layers search's own (that step's weights and the failing step's)
        return Walk(search, min_history, [], set())
    held = {int(s["step"]) for s in b.meta.get("steps", []) if s.get("snapshot")}
    room = search.runner.max_replays - search.runner.count - reserve
    if F - start > room:
        later = sorted(s for s in held if start < s < F - 1 and F - s <= room)
        if not later:
            search.warnings.append(f"--max-replays {search.runner.max_replays} leaves too few replays to walk the steps before step {F} "
                                   "for the first abnormal one; raise it")
            return Walk(search, min_history, [], set())
        search.warnings.append(f"walked steps {later[0]}..{F - 1} for the first abnormal one, not from the oldest snapshot (step {start}), "
                               f"to leave replays for the layers; raise --max-replays (now {search.runner.max_replays}) to walk them all")
        start, steps = later[0], [s for s in steps if s >= later[0]]
    prior = [r.grad_norm for r in scalar_history_records(b.meta.get("scalar_history"))
             if r.step < start and r.finite and r.grad_norm is not None and math.isfinite(r.grad_norm)][-PRIOR_STEPS:]
    walk = Walk(search, min_history, prior, held)
    for s in steps:
        if s >= F:
            break
        n = len(walk.grad_hist)
        walk.replay_step(s)
        if walk.first_bad is not None:
            del walk.grad_hist[n:]  # the median stays that of the healthy steps
            break
        walk.keep_healthy()
    return walk
