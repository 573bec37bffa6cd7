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
* **jump** (the learning rate only): the rate is at least ``LR_JUMP`` times its value at the
  previous step checked, whatever the band learnt (a long decay widens the band: a warm restart
  from 0.001 to 3 after a cosine decay scores only about 6 spreads). Judged after ``WARMUP`` steps
  (a warm-up's first steps multiply the rate by more); a per-step ramp of a warm-up or a one-cycle
  schedule stays far below it. A jump stays *in force* while the rate stays at or above
  ``LR_JUMP`` times its old value, for at most ``WINDOW`` steps: the rollback plan of an alarm in
  that time restores a state from before the jump (:meth:`EarlyWarning.lr_jump_at`).
* **drift** (the loss only): the loss smoothed over about ``DRIFT_SPAN`` steps has risen by more
  than ``DRIFT_RATIO`` times above the lowest smoothed loss of the run. This catches divergences
  that stay finite (clipped gradients, a learning rate far too large) and grow too steadily for
  a band to call any one step a spike.

**The floor.** The loss and the grad norm are judged no finer than their own precision: a value
below ``peak * eps`` (``peak`` the largest smoothed value of the signal so far, ``eps`` the
machine epsilon of the loss's dtype, float32's for the grad norm) counts as that floor. A model
that fits its task drives its loss to 1e-25..1e-32, where every ratio between two values is
rounding noise; at the floor the band is flat and the drift test compares the floor with itself,
so no alarm comes from there, while a loss that climbs back above the floor is judged as usual.

The grad norm judged is the one the loop gave :meth:`nanreplay.capture.recorder.Recorder.log_grad_norm`
when it did (the norm before gradient clipping: ``clip_grad_norm_`` returns it), else the check's
own norm of the gradients the optimizer sees (after clipping, a clipped run's norms are all the
clip value: no signal).

The thresholds come from ``bench/early_warning.py`` (see ``bench/README.md``: recall, lead
steps and false alarms per 10,000 clean steps, warm restarts, one-cycle schedules and near-zero
losses among the runs). A loss that is zero or negative is not judged (log units need a positive
value); the grad norm still is.

:class:`ScalarHistory` keeps ``(step, loss, grad norm, learning rates, finite, loss scale, grad norm
before clipping)`` of the last ``HISTORY_STEPS`` steps (about 60 bytes a step plus the learning
rates), independent of the ring buffer's ``capacity``; every bundle stores it
(``meta["scalar_history"]``).

:class:`SpikeWatch` is the Recorder's room for what follows an alarm (a non-finite step or a
spike): it feeds finite steps to the :class:`EarlyWarning`, acts on a spike through
:data:`nanreplay.capture.actions.SPIKE_ACTIONS`, keeps the last alarm and the non-finite episode
(:class:`~nanreplay.capture.episode.EpisodeLog`: the episode, the checkpoints registered, which
saved states are healthy), secures a healthy weight snapshot against eviction and answers the
rollback plan.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.rollback import plan_phrase
from ..format.records import Snapshot, StepRecord
from .actions import SPIKE_ACTIONS, Incident
from .episode import EPISODE_GAP, Episode, EpisodeLog
from .snapshots import restore_into
from .trackers import event_for_spike

__all__ = ["EarlyWarning", "Band", "ScalarHistory", "SpikeWatch", "Z_SPIKE", "DRIFT_RATIO", "LR_JUMP", "WARMUP", "WINDOW", "HISTORY_STEPS",
           "SIGNALS", "EPISODE_GAP"]

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
#: a learning-rate jump: the rate at least this many times its value at the previous step checked
LR_JUMP = 10.0
#: the floor's precision of a signal whose dtype is not known (float32's machine epsilon)
EPS_FLOAT32 = 2.0 ** -23
#: steps the scalar history holds
HISTORY_STEPS = 1024
#: the most spike rows kept in :attr:`EarlyWarning.spikes`
MAX_SPIKES = 10_000
#: the signals judged
SIGNALS = ("loss", "grad_norm", "lr")
_FAST_RATE = 2.0 / (DRIFT_SPAN + 1)
_FAST_N = (DRIFT_SPAN + 1) / 2  # from this count on the fast EMA's rate is _FAST_RATE (1 / n before)


@dataclass
class Band:
    """A robust running band of one signal, in log units.

    Attributes:
        n: finite positive values seen. centre: EMA of ``log x``. spread: EMA of
        ``|log x - centre|`` (of the clipped value). fast: EMA of ``log x`` over ``DRIFT_SPAN``
        steps. lowest: the lowest ``fast`` after the warm-up (drift baseline). peak: the
        largest ``fast`` so far (the signal's scale, for the floor).
    """

    n: int = 0
    centre: float = 0.0
    spread: float = 0.0
    fast: float = 0.0
    lowest: float = math.inf
    peak: float = -math.inf
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
        self.take(y)

    def take(self, y: float, log_eps: Optional[float] = None) -> Optional[float]:
        """Judge ``y = log x`` and take it in, in one call (what :meth:`EarlyWarning.observe` does
        for each signal of each step): ``y`` raised to the floor ``peak + log_eps`` when
        ``log_eps`` (the log of the signal's precision) is given (:meth:`floored`), its
        :meth:`score` against the band as it was, then the band updated with it (clipped to
        ``centre +- z * spread`` once warm). Returns the score (``None`` while warming up)."""
        n = self.n
        centre, spread = self.centre, self.spread
        if n and log_eps is not None:
            y = max(y, self.peak + log_eps)
        wide = spread if spread > SPREAD_FLOOR else SPREAD_FLOOR
        z = (y - centre) / wide if n >= self.warmup else None
        n = self.n = n + 1
        if n == 1:
            self.centre = self.fast = self.peak = y
            return z
        a = 1.0 / n
        slow = 2.0 / (self.window + 1)
        if slow > a:
            a = slow
        if n > self.warmup:
            half = self.z * wide
            y = min(max(y, centre - half), centre + half)
        self.spread = spread + a * (abs(y - centre) - spread)
        self.centre = centre + a * (y - centre)
        fast = self.fast
        fast = self.fast = fast + (1.0 / n if n < _FAST_N else _FAST_RATE) * (y - fast)
        if fast > self.peak:
            self.peak = fast
        if n >= self.warmup and fast < self.lowest:
            self.lowest = fast
        return z

    def floored(self, y: float, eps: float) -> float:
        """``y = log x`` no lower than the floor ``peak * eps`` (the module's docstring)."""
        return max(y, self.peak + math.log(eps)) if self.n else y


class EarlyWarning:
    """The spikes of one Recorder: bands of the loss, grad norm and learning rate, the episodes, the rows.

    Args:
        z: spike threshold in spreads (:data:`Z_SPIKE`). drift: drift threshold, a ratio of the
            smoothed loss to its lowest (:data:`DRIFT_RATIO`). warmup: finite values before a
            signal is judged. jump: the learning-rate jump threshold (:data:`LR_JUMP`).

    Attributes:
        spikes: one dict per step and signal out of band, oldest first (at most ``MAX_SPIKES``):
            ``{"step", "signal" ("loss" | "grad_norm" | "lr"), "kind" ("spike" | "drift" |
            "jump"), "value" (the signal's value, in its own units), "baseline" (the band's
            centre; for a drift the lowest smoothed loss; for a jump the previous step's rate;
            same units), "score" (spreads above the centre for a spike; the ratio to the baseline
            for a drift or a jump), "episode" (its episode's number), "lr" (the largest learning
            rate)}``.
        episodes: episodes so far (runs of spike steps no more than ``EPISODE_GAP`` steps apart).
        first_step: the first step of the episode in progress, else ``None``.
        eps: the floor's precision per signal (the machine epsilon of the loss's dtype: the
            Recorder sets ``eps["loss"]`` from the loss it is given).
        lr_jump: the last learning-rate jump ``{"step", "lr", "previous"}`` while in force, else ``None``.
    """

    def __init__(self, *, z: float = Z_SPIKE, drift: float = DRIFT_RATIO, warmup: int = WARMUP, jump: float = LR_JUMP) -> None:
        self.z, self.drift, self.warmup, self.jump = z, drift, warmup, jump
        self.bands = {s: Band(z=z, warmup=warmup) for s in SIGNALS}
        self.spikes: list[dict] = []
        self.episodes = 0
        self.first_step: Optional[int] = None
        self.last_spike_step: Optional[int] = None
        self.new_episode = False
        self.eps = {"loss": EPS_FLOAT32, "grad_norm": EPS_FLOAT32}
        self.lr_jump: Optional[dict] = None
        self._prev_lr: Optional[float] = None

    def observe(self, step: int, *, loss: Optional[float], grad_norm: Optional[float], lrs: list) -> list[dict]:
        """Judge one finite step (host floats; no device work). Returns its spike rows (empty
        when every signal is in band); :attr:`new_episode` says whether they open an episode."""
        rows: list[dict] = []
        lr = _max_lr(lrs)
        bands, eps = self.bands, self.eps
        for name, x in (("loss", loss), ("grad_norm", grad_norm), ("lr", lr)):
            if x is None:
                continue
            x = float(x)
            if not 0.0 < x < math.inf:  # log units need a finite positive value (NaN fails too)
                continue
            y = math.log(x)
            band = bands[name]
            centre = band.centre
            if name == "lr":
                row = self._lr_jump(step, band, x)
                z = band.take(y)
            else:
                row = None
                z = band.take(y, math.log(eps[name]))
            if row is None and z is not None and z > self.z:
                row = {"step": step, "signal": name, "kind": "spike", "value": x, "baseline": math.exp(centre), "score": z}
            if row is None and name == "loss":
                r = band.drift_ratio()
                if r is not None and r > self.drift:
                    row = {"step": step, "signal": name, "kind": "drift", "value": x, "baseline": math.exp(band.lowest), "score": r}
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

    def _lr_jump(self, step: int, band: Band, lr: float) -> Optional[dict]:
        """The jump row of the learning rate ``lr`` against the previous step's (judged after the
        warm-up), and whether an earlier jump is still in force."""
        prev, self._prev_lr = self._prev_lr, lr
        j = self.lr_jump
        if j is not None and (lr < j["previous"] * self.jump or step - j["step"] > WINDOW):
            self.lr_jump = None
        if prev is None or band.n < self.warmup or not lr >= prev * self.jump:
            return None
        self.lr_jump = {"step": step, "lr": lr, "previous": prev}
        return {"step": step, "signal": "lr", "kind": "jump", "value": lr, "baseline": prev, "score": lr / prev}

    def lr_jump_at(self, step: int) -> Optional[dict]:
        """The learning-rate jump in force at ``step`` (at or before it, the rate still raised,
        at most ``WINDOW`` steps ago), else ``None``."""
        j = self.lr_jump
        return dict(j) if j is not None and j["step"] <= step <= j["step"] + WINDOW else None


def describe(rows: list[dict]) -> str:
    """One line for a spike step: each signal, its value, its baseline and how far out."""
    parts = []
    for r in rows:
        if r["kind"] == "spike":
            parts.append(f"{r['signal']} {r['value']:.4g} is {r['score']:.1f} spreads above its band (baseline {r['baseline']:.4g})")
        elif r["kind"] == "jump":
            parts.append(f"{r['signal']} jumped to {r['value']:.4g}, {r['score']:.4g}x its value at the previous step ({r['baseline']:.4g})")
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
    """The loss, grad norm, learning rates, verdict, loss scale and grad norm before clipping of
    the last ``size`` steps (host values; a tensor learning rate is kept as is and read at dump
    time, not per step).

    Attributes:
        rows: ``(step, loss, grad_norm, lrs, finite, scale, grad_norm_pre_clip)`` tuples, oldest
            first (``scale``: the GradScaler's loss scale the step ran with, else ``None``;
            ``grad_norm_pre_clip``: what the loop gave ``Recorder.log_grad_norm``, else ``None``).
    """

    size: int = HISTORY_STEPS
    rows: collections.deque = field(default_factory=collections.deque)

    def add(self, step: int, loss: Optional[float], grad_norm: Optional[float], lrs: list, finite: Optional[bool],
            scale: Optional[float] = None, pre_clip: Optional[float] = None) -> None:
        """Append one step (``size`` bounds the rows; the oldest goes first)."""
        if self.rows and self.rows[-1][0] == step:
            last = self.rows.pop()  # a step checked twice (GradScaler, update check) keeps its last verdict
            scale = last[5] if scale is None else scale
            pre_clip = last[6] if pre_clip is None else pre_clip
        self.rows.append((step, loss, grad_norm, list(lrs or []), finite, scale, pre_clip))
        while len(self.rows) > self.size:
            self.rows.popleft()

    def scale_changes(self, upto: Optional[int] = None) -> list[list]:
        """The loss scale history: ``[step, scale]`` at the first step and at every change, steps
        ``<= upto`` (``[]`` without a GradScaler)."""
        out: list[list] = []
        for r in self.rows:
            if (upto is None or r[0] <= upto) and r[5] is not None and (not out or out[-1][1] != r[5]):
                out.append([r[0], r[5]])
        return out

    def to_meta(self, upto: Optional[int] = None) -> dict:
        """The bundle's ``meta["scalar_history"]`` (JSON: non-finite floats as ``"nan"``,
        ``"inf"``, ``"-inf"``), the steps ``<= upto``; the ``scale`` and ``grad_norm_pre_clip``
        columns only where a step has one. See ``docs/bundle-format.md``."""
        from ..core.jsonable import fnum

        rows = [r for r in self.rows if upto is None or r[0] <= upto]
        out = {
            "step": [r[0] for r in rows],
            "loss": [fnum(r[1]) for r in rows],
            "grad_norm": [fnum(r[2]) for r in rows],
            "lrs": [[fnum(float(x)) for x in r[3]] for r in rows],
            "finite": [r[4] for r in rows],
        }
        for name, i in (("scale", 5), ("grad_norm_pre_clip", 6)):
            if any(r[i] is not None for r in rows):
                out[name] = [fnum(r[i]) for r in rows]
        return out


class SpikeWatch:
    """The alarms of one Recorder, its non-finite episode and the rollback plan.

    Args:
        on_spike: the ``on_spike`` option (``None``: no early warning, only non-finite steps alarm).
        ring: the Recorder's :class:`~nanreplay.capture.ring.RingBuffer` (the snapshots it holds).
        extra_meta: the Recorder's ``extra_meta`` (``last_checkpoint_step``, ``data_position``).
        actions: the Recorder's :class:`~nanreplay.capture.actions.Actions`. dump: its
            :class:`~nanreplay.capture.dump.Dump`.
        attach_step: the step the Recorder attached at. attach_clean: its weights were finite then.

    Attributes:
        early: the :class:`EarlyWarning`, else ``None``. alert: the last step found non-finite
        or out of band. secured: ``(step, snapshot)``, the healthy snapshot secured for the plan.
        log: the :class:`~nanreplay.capture.episode.EpisodeLog` (the non-finite episode, the
        checkpoints registered, the corruption windows). written: ``(path, plan)`` of the last
        non-finite bundle written and the plan it holds.
    """

    def __init__(self, on_spike: Optional[str], *, ring: Any, extra_meta: dict, actions: Any, dump: Any, attach_step: int = 0,
                 attach_clean: bool = True) -> None:
        self.on_spike = on_spike
        self.early = EarlyWarning() if on_spike is not None else None
        self.ring, self.extra_meta, self.actions, self.dump = ring, extra_meta, actions, dump
        self.alert: Optional[int] = None
        self.secured: Optional[tuple[int, Snapshot]] = None
        self.log = EpisodeLog(attach_step, attach_clean)
        self.written: Optional[tuple[Any, dict]] = None

    @property
    def spikes(self) -> list[dict]:
        return self.early.spikes if self.early is not None else []

    def nonfinite(self, step: int, what: str, update: str, *, corrupts: bool) -> Episode:
        """A non-finite step: it joins (or opens) the episode, becomes the alert, and a healthy
        snapshot before the episode is secured. ``what``, ``update``, ``corrupts``: see
        :meth:`~nanreplay.capture.episode.EpisodeLog.nonfinite`."""
        ep = self.log.nonfinite(step, what, update, corrupts=corrupts)
        self.alert = step
        self.secure(step)
        return ep

    def first_abnormal(self, step: int) -> int:
        """The first abnormal step ``step`` belongs to: the earliest of ``step``, the first step of
        its non-finite episode, of the spike episode in progress, and of the learning-rate jump
        still in force."""
        firsts = [step]
        ep = self.log.episode_at(step)
        if ep is not None:
            firsts.append(ep.first_step)
        e = self.early
        if e is not None:
            if e.first_step is not None and e.first_step <= step:
                firsts.append(e.first_step)
            jump = e.lr_jump_at(step)
            if jump is not None:
                firsts.append(jump["step"])
        return min(firsts)

    def plan(self, step: Optional[int] = None) -> dict:
        """The rollback plan (see :meth:`nanreplay.capture.recorder.Recorder.rollback_plan`)."""
        step = self.alert if step is None else step
        if step is None:
            return {"step": None, "first_abnormal_step": None, "restore_step": None, "source": None, "path": None, "skip_steps": [],
                    "data_position": None, "episode": None, "lr_jump": None, "weights_corrupted": self.log.weights_corrupted,
                    "rejected": [], "note": None}
        first = self.first_abnormal(step)
        snaps = [r.step for r in self.ring if r.snapshot is not None]
        if self.secured is not None:
            snaps.append(self.secured[0])
        point = self.log.restore_point(snaps, self.extra_meta, first_abnormal=first)
        ep = self.log.episode_at(step)
        note = None
        if point["restore_step"] is None:
            note = ("no held snapshot or registered checkpoint is known healthy (" + "; ".join(
                f"{r['source']} of step {r['step']}: {r['why']}" for r in point["rejected"]) + ")" if point["rejected"] else
                "no healthy state held: set snapshot_every, or register checkpoints with Recorder.note_checkpoint")
        jump = self.early.lr_jump_at(step) if self.early is not None else None
        return {"step": step, "first_abnormal_step": first, "restore_step": point["restore_step"], "source": point["source"],
                "path": point["path"], "skip_steps": list(range(first, step + 1)), "data_position": self.extra_meta.get("data_position"),
                "episode": ep.to_json() if ep is not None else None, "lr_jump": jump if jump is not None and jump["step"] == first else None,
                "weights_corrupted": self.log.weights_corrupted, "rejected": point["rejected"], "note": note}

    def final_plan(self) -> Optional[dict]:
        """The plan of the last alarm (``None`` without one); when it covers the last non-finite
        bundle's step and has grown since that bundle was written (more steps of its episode,
        another restore point), the bundle's ``reason.rollback`` (and its diagnosis's
        ``rollback``) are brought up to date: one rewrite of that bundle
        (:meth:`~nanreplay.capture.dump.Dump.amend`; not for a sharded model's bundles, which the
        ranks write together). Called when ``action="skip"`` gives up and on ``Recorder.close()``."""
        if self.alert is None:
            return None
        plan = self.plan()
        if self.written is not None and not self.dump.sharded:
            path, old = self.written
            same = plan["first_abnormal_step"] is not None and plan["first_abnormal_step"] <= old["step"] <= plan["step"]
            if same and plan != old and self.dump.amend(path, {"rollback": plan}):
                self.written = (path, plan)
        return plan

    def snapshot_at(self, step: int) -> Optional[Snapshot]:
        """The step-start weight snapshot of ``step`` held (secured, or in the ring buffer), else ``None``."""
        if self.secured is not None and self.secured[0] == step:
            return self.secured[1]
        return next((r.snapshot for r in self.ring if r.step == step and r.snapshot is not None), None)

    def roll_back(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: dict, *, now: int) -> Optional[int]:
        """Restore the snapshot ``plan`` names into ``model`` and ``optimizer`` before step
        ``now``; the step restored, else ``None``. The episode is over then, and the weights
        are healthy again (the corruption window closes at ``now``)."""
        if plan.get("source") != "snapshot" or plan.get("restore_step") is None:
            return None
        snap = self.snapshot_at(plan["restore_step"])
        if snap is None:
            return None
        restore_into(model, optimizer, snap)
        self.alert = None
        self.log.rolled_back(now)
        self.log.current = None
        logger.warning("nanreplay: rolled back to the step-start weights and optimizer state of step %d (steps %s to skip)",
                       plan["restore_step"], plan.get("skip_steps"))
        return plan["restore_step"]

    def secure(self, step: int) -> None:
        """At an alarm: copy the latest healthy weight snapshot held for the first abnormal step
        (the restore rule of :mod:`nanreplay.capture.episode`), so that eviction cannot lose it
        before the plan is used. The copy is counted against ``memory_budget`` as
        ``"rollback"`` (skipped when it does not fit: the plan then names what the ring still
        holds); the ring's own record keeps its snapshot, for the bundle and bisect. It stays
        until a later alarm secures a newer one. Cost: one copy per episode."""
        first = self.first_abnormal(step)
        held = [r for r in self.ring if r.snapshot is not None and self.log.why_unhealthy(r.step, first_abnormal=first) is None]
        if not held or (self.secured is not None and self.secured[0] >= held[-1].step
                        and self.log.why_unhealthy(self.secured[0], first_abnormal=first) is None):
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

    def judge(self, rec: StepRecord, grads: Optional[list], live: Any, grad_norm: Optional[float] = None) -> None:
        """Feed a finite step to the early warning; on a spike, act through ``SPIKE_ACTIONS``.
        ``grads``: the step's gradients while its update has not run (``None`` in the sync-free
        mode, where the step is long past: then every row acts as ``"warn"``). ``live``: the
        live state for the bundle (a callable returning a :class:`Snapshot`). ``grad_norm``: the
        norm to judge when it is not the check's (the norm before clipping)."""
        self.log.finite()
        rows = self._observe(rec.step, rec.loss, rec.grad_norm if grad_norm is None else grad_norm, rec.lrs)
        if rows:
            self._alarm(rec.step, rows, rec, grads, live)

    def judge_late(self, steps: list[tuple[int, Optional[float], Optional[float], list]]) -> None:
        """Feed finite steps judged after they are over, ``(step, loss, grad norm, lrs)``, oldest
        first (the Recorder's batch of waiting steps), from their host values alone (their records
        may have left the ring buffer, their gradients are gone): every row acts as ``"warn"``, no
        bundle; the episode log hears of them once."""
        self.log.finite()
        for step, loss, grad_norm, lrs in steps:
            rows = self._observe(step, loss, grad_norm, lrs)
            if rows:
                self._alarm(step, rows, None, None, None)

    def _observe(self, step: int, loss: Optional[float], grad_norm: Optional[float], lrs: list) -> list[dict]:
        """The early warning's rows for one finite step (``[]`` with ``on_spike=None``); host learning rates only."""
        if self.early is None:
            return []
        return self.early.observe(step, loss=loss, grad_norm=grad_norm, lrs=[x for x in lrs if not isinstance(x, torch.Tensor)])

    def _alarm(self, step: int, rows: list[dict], rec: Optional[StepRecord], grads: Optional[list], live: Any) -> None:
        """Step ``step`` is out of band (``rows``): it becomes the alert, secures a healthy snapshot
        when it opens an episode, and its ``SPIKE_ACTIONS`` row acts (``"warn"`` without ``grads``;
        a bundle needs the step's record ``rec``). A later step of an episode makes no plan and
        no message unless its action reads them (:attr:`~nanreplay.capture.actions.Action.reads_every_step`):
        nothing logs them, its rows are in :attr:`spikes`, and the plan is made when read
        (:meth:`plan`). In a long episode most steps are out of band: on a small CPU model they
        took 65 µs each, 1 µs without them (``python bench/episode_cost.py --against f5fb705``)."""
        self.alert = step
        new = self.early.new_episode
        if new:
            self.secure(step)
        name = self.on_spike if grads is not None else "warn"
        action = SPIKE_ACTIONS[name]
        if not new and not action.reads_every_step:
            self.actions.action_for(action, Incident(step, "", spikes=rows, new_episode=False))
            return
        plan = self.plan(step)
        path = None
        if new and rec is not None and action.dumps(self.actions) and self.dump.spike_allowed:
            path = self.dump(rec, grads, live, spike=True, cause={"spike": rows, "rollback": plan,
                                                                  "message": "spike: " + describe(rows)})
        msg = (f"early warning at step {step}: {describe(rows)}; rollback plan: {plan_phrase(plan)}"
               + (f"; bundle: {path}" if path else ""))
        if new and self.dump.trackers:  # log_to: one event per episode, with its bundle when one was written
            self.dump.trackers.emit(event_for_spike(step, rows, message=msg, rollback=plan, bundle=path))
        self.actions.action_for(action, Incident(step, msg, path, None, spikes=rows, rollback=plan, new_episode=new))
