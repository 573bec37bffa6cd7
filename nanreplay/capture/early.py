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
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["EarlyWarning", "Band", "ScalarHistory", "Z_SPIKE", "DRIFT_RATIO", "WARMUP", "WINDOW", "HISTORY_STEPS", "SIGNALS"]

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
