"""The early warning: robust running bands of the loss, the grad norm and the learning rate, the
spikes that leave them, and the cheap scalar history of the last steps.

:class:`EarlyWarning` watches three signals per step (the loss, the grad norm, the largest
learning rate of the param groups), all already on the host after the check's one read (:func:`nanreplay.capture.check.read_check`), so the default mode pays no extra host
sync and no extra transfer; in the sync-free mode (``check_every > 1``) it is fed when the
verdicts are read, every N steps, so it stays sync-free and warns up to N - 1 steps later.

Each signal is judged in log units (a factor, not a difference: a grad norm that goes from 1 to
10 is as far out as one that goes from 100 to 1000):

* **spike**: ``z = (log x - centre) / max(spread, SPREAD_FLOOR)`` with ``centre`` an EMA of
  ``log x`` and ``spread`` an EMA of ``|log x - centre|`` (window about ``WINDOW`` steps), judged
  after ``WARMUP`` finite values; a step is a spike when ``z > Z_SPIKE``. The value that updates
  the band is clipped to ``centre +- Z_SPIKE * spread`` first (winsorised), so an explosion does
  not drag its own baseline along, while a lasting level shift is followed within some tens of
  steps.
  The learning rate is judged the same way: a schedule's warm-up and decay stay in band, a ramp
  or a jump of the learning rate (a range test, a per-group rate gone wrong) does not; a tensor
  learning rate is not read (that would be a host sync), so it is not judged.
* **drift** (the loss only): the loss smoothed over about ``DRIFT_SPAN`` steps has risen by more
  than ``DRIFT_RATIO`` times above the lowest smoothed loss of the run. This catches divergences
  that stay finite (clipped gradients, a learning rate far too large) and grow too steadily for
  a band to call any one step a spike.

The thresholds come from ``bench/early_warning.py`` (see ``bench/README.md``: recall, lead
steps and false alarms per 10,000 clean steps). A loss that is zero or negative is not judged
(log units need a positive value); the grad norm still is.

:class:`ScalarHistory` keeps ``(step, loss, grad norm, learning rates, finite)`` of the last
``HISTORY_STEPS`` steps (about 40 bytes a step plus the learning rates), independent of the ring
buffer's ``capacity``; every bundle stores it (``meta["scalar_history"]``).

:class:`SpikeWatch` is the Recorder's room for what follows an alarm (a non-finite step or a
spike): it feeds finite steps to the :class:`EarlyWarning`, acts on a spike through
:data:`nanreplay.capture.actions.SPIKE_ACTIONS`, keeps the last alarm, secures a healthy weight
snapshot against eviction and answers the rollback plan.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..format.records import Snapshot, StepRecord
from .actions import SPIKE_ACTIONS, Incident
from .snapshots import restore_into
from .trackers import event_for_spike

__all__ = ["EarlyWarning", "Band", "ScalarHistory", "SpikeWatch", "Z_SPIKE", "DRIFT_RATIO", "WARMUP", "WINDOW", "HISTORY_STEPS", "SIGNALS"]

logger = logging.getLogger(__name__)

#: a spike: this many spreads above the band's centre (log units; chosen in bench/early_warning.py)
Z_SPIKE = 12.0
#: a divergence: the smoothed loss this many times above its lowest smoothed value so far
DRIFT_RATIO = 30.0
#: steps over which the smoothed loss of the drift test averages (EMA span)
DRIFT_SPAN = 8
#: finite values of a signal seen before it is judged
WARMUP = 20
#: the band's EMA span, in steps
WINDOW = 64
#: the smallest spread (log units, about 5 %), so a near-constant signal is not judged on noise alone
SPREAD_FLOOR = 0.05
#: steps back in band that end an episode (one warning per episode)
EPISODE_GAP = 5
#: steps the scalar history holds
HISTORY_STEPS = 1024
#: the most spike rows kept in :attr:`EarlyWarning.spikes`
MAX_SPIKES = 10_000
#: the signals judged
SIGNALS = ("loss", "grad_norm", "lr")


@dataclass
class Band:
    """A robust running band of one signal, in log units.

    Attributes:
        n: finite positive values seen. centre: EMA of ``log x``. spread: EMA of
        ``|log x - centre|`` (of the clipped value). fast: EMA of ``log x`` over ``DRIFT_SPAN``
        steps. lowest: the lowest ``fast`` after the warm-up (drift baseline).
    """

    n: int = 0
    centre: float = 0.0
    spread: float = 0.0
    fast: float = 0.0
    lowest: float = math.inf
    z: float = Z_SPIKE
    drift: Optional[float] = None
    warmup: int = WARMUP
    window: int = WINDOW

    def score(self, y: float) -> Optional[float]:
        """``z`` of ``y = log x`` against the band, ``None`` while warming up."""
        if self.n < self.warmup:
            return None
        return (y - self.centre) / max(self.spread, SPREAD_FLOOR)

    def drift_ratio(self) -> Optional[float]:
        """How many times the smoothed value is above its lowest (``None`` while warming up)."""
        if self.n < self.warmup or not math.isfinite(self.lowest):
            return None
        return math.exp(self.fast - self.lowest)

    def update(self, y: float) -> None:
        """Take ``y = log x`` into the band (clipped to ``centre +- z * spread`` once warm)."""
        self.n += 1
        if self.n == 1:
            self.centre = self.fast = y
            return
        a = max(1.0 / self.n, 2.0 / (self.window + 1))
        if self.n > self.warmup:
            half = self.z * max(self.spread, SPREAD_FLOOR)
            y = min(max(y, self.centre - half), self.centre + half)
        self.spread += a * (abs(y - self.centre) - self.spread)
        self.centre += a * (y - self.centre)
        self.fast += max(1.0 / self.n, 2.0 / (DRIFT_SPAN + 1)) * (y - self.fast)
        if self.n >= self.warmup:
            self.lowest = min(self.lowest, self.fast)


def _log(x: Any) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return math.log(x) if x > 0 and math.isfinite(x) else None


class EarlyWarning:
    """The spikes of one Recorder: bands of the loss and grad norm, the episodes, the rows.

    Args:
        z: spike threshold in spreads (:data:`Z_SPIKE`). drift: drift threshold, a ratio of the
            smoothed loss to its lowest (:data:`DRIFT_RATIO`). warmup: finite values before a
            signal is judged.

    Attributes:
        spikes: one dict per step and signal out of band, oldest first (at most ``MAX_SPIKES``):
            ``{"step", "signal" ("loss" | "grad_norm" | "lr"), "kind" ("spike" | "drift"), "value"
            (the signal's value, in its own units), "baseline" (the band's centre, same units),
            "score" (spreads above the centre for a spike; the ratio to the lowest smoothed loss
            for a drift), "episode" (its episode's number), "lr" (the largest learning rate)}``.
        episodes: episodes so far (runs of spike steps no more than ``EPISODE_GAP`` steps apart).
        first_step: the first step of the episode in progress, else ``None``.
    """

    def __init__(self, *, z: float = Z_SPIKE, drift: float = DRIFT_RATIO, warmup: int = WARMUP) -> None:
        self.z, self.drift, self.warmup = z, drift, warmup
        self.bands = {s: Band(z=z, warmup=warmup) for s in SIGNALS}
        self.spikes: list[dict] = []
        self.episodes = 0
        self.first_step: Optional[int] = None
        self.last_spike_step: Optional[int] = None
        self.new_episode = False

    def observe(self, step: int, *, loss: Optional[float], grad_norm: Optional[float], lrs: list) -> list[dict]:
        """Judge one finite step (host floats; no device work). Returns its spike rows (empty
        when every signal is in band); :attr:`new_episode` says whether they open an episode."""
        rows: list[dict] = []
        lr = _max_lr(lrs)
        for name, x in (("loss", loss), ("grad_norm", grad_norm), ("lr", lr)):
            y = _log(x)
            if y is None:
                continue
            band = self.bands[name]
            z = band.score(y)
            row = None
            if z is not None and z > self.z:
                row = {"step": step, "signal": name, "kind": "spike", "value": float(x), "baseline": math.exp(band.centre), "score": z}
            band.update(y)
            if row is None and name == "loss":
                r = band.drift_ratio()
                if r is not None and r > self.drift:
                    row = {"step": step, "signal": name, "kind": "drift", "value": float(x), "baseline": math.exp(band.lowest), "score": r}
            if row is not None:
                row["lr"] = lr
                rows.append(row)
        if rows:
            new = self.last_spike_step is None or step - self.last_spike_step > EPISODE_GAP
            if new:
                self.episodes += 1
                self.first_step = step
            self.last_spike_step = step
            for r in rows:
                r["episode"] = self.episodes
                if len(self.spikes) < MAX_SPIKES:
                    self.spikes.append(r)
            self.new_episode = new
        elif self.last_spike_step is not None and step - self.last_spike_step > EPISODE_GAP:
            self.first_step = None
        return rows


def describe(rows: list[dict]) -> str:
    """One line for a spike step: each signal, its value, its baseline and how far out."""
    parts = []
    for r in rows:
        if r["kind"] == "spike":
            parts.append(f"{r['signal']} {r['value']:.4g} is {r['score']:.1f} spreads above its band (baseline {r['baseline']:.4g})")
        else:
            parts.append(f"{r['signal']} {r['value']:.4g} has drifted {r['score']:.1f}x above its lowest smoothed value "
                         f"({r['baseline']:.4g}): divergence")
    lr = rows[0].get("lr")
    shown = isinstance(lr, float) and not any(r["signal"] == "lr" for r in rows)
    return "; ".join(parts) + (f"; lr {lr:.4g}" if shown else "")


def _max_lr(lrs: list) -> Optional[float]:
    vals = [float(v) for v in lrs or [] if not isinstance(v, torch.Tensor) or v.device.type == "cpu"]
    return max(vals) if vals else None


@dataclass
class ScalarHistory:
    """The loss, grad norm, learning rates and verdict of the last ``size`` steps (host values;
    a tensor learning rate is kept as is and read at dump time, not per step).

    Attributes:
        rows: ``(step, loss, grad_norm, lrs, finite)`` tuples, oldest first.
    """

    size: int = HISTORY_STEPS
    rows: collections.deque = field(default_factory=collections.deque)

    def add(self, step: int, loss: Optional[float], grad_norm: Optional[float], lrs: list, finite: Optional[bool]) -> None:
        """Append one step (``size`` bounds the rows; the oldest goes first)."""
        if self.rows and self.rows[-1][0] == step:
            self.rows.pop()  # a step checked twice (GradScaler, update check) keeps its last verdict
        self.rows.append((step, loss, grad_norm, list(lrs or []), finite))
        while len(self.rows) > self.size:
            self.rows.popleft()

    def to_meta(self, upto: Optional[int] = None) -> dict:
        """The bundle's ``meta["scalar_history"]`` (JSON: non-finite floats as ``"nan"``,
        ``"inf"``, ``"-inf"``), the steps ``<= upto``. See ``docs/bundle-format.md``."""
        from ..core.jsonable import fnum

        rows = [r for r in self.rows if upto is None or r[0] <= upto]
        return {
            "step": [r[0] for r in rows],
            "loss": [fnum(r[1]) for r in rows],
            "grad_norm": [fnum(r[2]) for r in rows],
            "lrs": [[fnum(float(x)) for x in r[3]] for r in rows],
            "finite": [r[4] for r in rows],
        }


class SpikeWatch:
    """The alarms of one Recorder and their rollback plan.

    Args:
        on_spike: the ``on_spike`` option (``None``: no early warning, only non-finite steps alarm).
        ring: the Recorder's :class:`~nanreplay.capture.ring.RingBuffer` (the snapshots it holds).
        extra_meta: the Recorder's ``extra_meta`` (``last_checkpoint_step``, ``data_position``).
        actions: the Recorder's :class:`~nanreplay.capture.actions.Actions`. dump: its
            :class:`~nanreplay.capture.dump.Dump`.

    Attributes:
        early: the :class:`EarlyWarning`, else ``None``. alert: the last step found non-finite
        or out of band. secured: ``(step, snapshot)``, the healthy snapshot secured for the plan.
    """

    def __init__(self, on_spike: Optional[str], *, ring: Any, extra_meta: dict, actions: Any, dump: Any) -> None:
        self.on_spike = on_spike
        self.early = EarlyWarning() if on_spike is not None else None
        self.ring, self.extra_meta, self.actions, self.dump = ring, extra_meta, actions, dump
        self.alert: Optional[int] = None
        self.secured: Optional[tuple[int, Snapshot]] = None

    @property
    def spikes(self) -> list[dict]:
        return self.early.spikes if self.early is not None else []

    def alarm(self, step: int) -> None:
        """A non-finite step: remember it and secure a healthy snapshot before it."""
        self.alert = step
        self.secure(step)

    def first_abnormal(self, step: int) -> int:
        """The first step of the spike episode that ``step`` ends or belongs to, else ``step``."""
        e = self.early
        return e.first_step if e is not None and e.first_step is not None and e.first_step <= step else step

    def plan(self, step: Optional[int] = None) -> dict:
        """The rollback plan (see :meth:`nanreplay.capture.recorder.Recorder.rollback_plan`)."""
        step = self.alert if step is None else step
        if step is None:
            return {"step": None, "first_abnormal_step": None, "restore_step": None, "source": None, "skip_steps": [], "data_position": None}
        first = self.first_abnormal(step)
        snaps = [r.step for r in self.ring if r.snapshot is not None and r.step < first and r.finite is not False]
        if self.secured is not None and self.secured[0] < first:
            snaps.append(self.secured[0])
        ckpt = self.extra_meta.get("last_checkpoint_step")
        ckpt = ckpt if isinstance(ckpt, int) and ckpt < first else None
        restore, source = (max(snaps), "snapshot") if snaps else ((ckpt, "checkpoint") if ckpt is not None else (None, None))
        if snaps and ckpt is not None and ckpt > max(snaps):
            restore, source = ckpt, "checkpoint"
        return {"step": step, "first_abnormal_step": first, "restore_step": restore, "source": source,
                "skip_steps": list(range(first, step + 1)), "data_position": self.extra_meta.get("data_position")}

    def snapshot_at(self, step: int) -> Optional[Snapshot]:
        """The step-start weight snapshot of ``step`` held (secured, or in the ring buffer), else ``None``."""
        if self.secured is not None and self.secured[0] == step:
            return self.secured[1]
        return next((r.snapshot for r in self.ring if r.step == step and r.snapshot is not None), None)

    def roll_back(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: dict) -> Optional[int]:
        """Restore the snapshot ``plan`` names into ``model`` and ``optimizer``; the step restored, else ``None``."""
        if plan.get("source") != "snapshot" or plan.get("restore_step") is None:
            return None
        snap = self.snapshot_at(plan["restore_step"])
        if snap is None:
            return None
        restore_into(model, optimizer, snap)
        self.alert = None
        logger.warning("nanreplay: rolled back to the step-start weights and optimizer state of step %d (steps %s to skip)",
                       plan["restore_step"], plan.get("skip_steps"))
        return plan["restore_step"]

    def secure(self, step: int) -> None:
        """At an alarm: copy the latest healthy weight snapshot before its first abnormal step,
        so that eviction cannot lose it before the plan is used. The copy is counted against
        ``memory_budget`` as ``"rollback"`` (skipped when it does not fit: the plan then names
        what the ring still holds); the ring's own record keeps its snapshot, for the bundle and
        bisect. It stays until a later alarm secures a newer one. Cost: one copy per episode."""
        first = self.first_abnormal(step)
        held = [r for r in self.ring if r.snapshot is not None and r.step < first and r.finite is not False]
        if not held or (self.secured is not None and self.secured[0] >= held[-1].step):
            return
        r = held[-1]
        snap = r.snapshot
        if not self.ring.reserve("rollback", snap.nbytes()):
            return
        copy = Snapshot(params={k: v.detach().clone() for k, v in snap.params.items()},
                        buffers={k: v.detach().clone() for k, v in (snap.buffers or {}).items()},
                        optimizer=pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, snap.optimizer),
                        extra=dict(snap.extra or {}))
        self.secured = (r.step, copy)
        self.ring.keep("rollback", copy)

    def judge(self, rec: StepRecord, grads: Optional[list], live: Any) -> None:
        """Feed a finite step to the early warning; on a spike, act through ``SPIKE_ACTIONS``.
        ``grads``: the step's gradients while its update has not run (``None`` in the sync-free
        mode, where the step is long past: then every row acts as ``"warn"``). ``live``: the
        live state for the bundle (a callable returning a :class:`Snapshot`)."""
        if self.early is None:
            return
        rows = self.early.observe(rec.step, loss=rec.loss, grad_norm=rec.grad_norm, lrs=[x for x in rec.lrs if not isinstance(x, torch.Tensor)])
        if not rows:
            return
        self.alert = rec.step
        new = self.early.new_episode
        if new:
            self.secure(rec.step)
        name = self.on_spike if grads is not None else "warn"
        action = SPIKE_ACTIONS[name]
        plan = self.plan(rec.step)
        path = None
        if new and action.dumps(self.actions) and self.dump.spike_allowed:
            path = self.dump(rec, grads, live, spike=True, cause={"spike": rows, "rollback": plan,
                                                                  "message": "spike: " + describe(rows)})
        msg = (f"early warning at step {rec.step}: {describe(rows)}; rollback plan: "
               + (f"restore step {plan['restore_step']} ({plan['source']})" if plan["restore_step"] is not None else "no healthy weights held (set snapshot_every)")
               + f", skip the batches of steps {plan['first_abnormal_step']}..{plan['step']}" + (f"; bundle: {path}" if path else ""))
        if new and self.dump.trackers:  # log_to: one event per episode, with its bundle when one was written
            self.dump.trackers.emit(event_for_spike(rec.step, rows, message=msg, rollback=plan, bundle=path))
        self.actions.action_for(action, Incident(rec.step, msg, path, None, spikes=rows, rollback=plan, new_episode=new))
