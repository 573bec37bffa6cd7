"""Mixed precision: telling a GradScaler's normal overflow from a real failure.

With fp16 autocast and a ``torch.amp.GradScaler``, Inf/NaN gradients are expected every few
hundred steps: ``scaler.step(optimizer)`` finds them while unscaling, does not call
``optimizer.step()`` and ``scaler.update()`` halves the scale. Such steps are normal: the
Recorder counts them (``Recorder.scaler_skips``) and dumps nothing. A bundle is written when

* the gradients are non-finite after unscaling and the scaler did **not** skip (the optimizer's
  step pre-hook sees them: the loop called ``optimizer.step()`` itself, or the scaler is
  disabled): the Recorder's ordinary check catches it, with ``reason.scaler.skipped = false``;
* a skip leaves the scale below ``RecorderConfig.min_scale`` (the scale collapsed: no scale makes
  the step finite, typically an overflow in the forward pass or a NaN in the data);
* more than ``RecorderConfig.max_scaler_skips`` consecutive steps were skipped.

Mechanism, with no extra sync on ordinary steps: the Recorder's :class:`ScalerWatch` wraps the
scaler's ``update`` (on the instance; ``Recorder.close()`` restores it). A step that began (a
forward or ``Recorder.record`` was seen) and reaches ``update()`` without an ``optimizer.step()``
was skipped by the scaler, which has already read its ``found_inf`` flags on the host. Only on
such a step does the watch read the scale (two host reads: the state before ``update``, for the
bundle, and the scale after it).

The bundle stores the scaler's ``state_dict()`` as it was during the failing step (under
``state/extra/scaler/``) and whether the recorded gradients were already unscaled; replay builds a
``torch.amp.GradScaler`` from it, scales the replayed loss, and unscales the replayed gradients
with the scaler's own ``unscale_``, so they compare bit for bit with the recorded ones.

bf16 autocast needs no scaler (bf16 has float32's exponent range): there every non-finite
gradient is a real failure, and the Recorder treats it so. Replay runs each step under the
autocast recorded for it (``StepRecord.autocast``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["ScalerWatch"]


def _grads_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> Optional[bool]:
    """Whether ``scaler.unscale_`` already ran for ``optimizer`` this iteration (GradScaler's own
    per-optimizer stage); ``None`` when the scaler does not expose it."""
    try:
        from torch.amp.grad_scaler import OptState

        states = scaler._per_optimizer_states
        if id(optimizer) not in states:
            return False
        return states[id(optimizer)]["stage"] in (OptState.UNSCALED, OptState.STEPPED)
    except (AttributeError, ImportError, KeyError, TypeError):
        return None


class ScalerWatch:
    """Counts a GradScaler's skipped steps and says when they are a failure. A removable handle:
    ``remove()`` puts the scaler's own ``update`` back.

    Args:
        scaler: the ``torch.amp.GradScaler`` the loop calls ``scaler.step()``/``update()`` on.
        optimizer: the optimizer it steps.
        step_open: ``step_open()`` says whether a step began (a forward or a batch was seen) and no
            ``optimizer.step()`` ended it yet; an ``update()`` then means the scaler skipped it.
        on_skip: called with the scale after ``update()`` (a host float) for each skipped step;
            :meth:`failure` says whether that skip is a failure, :meth:`state_for_bundle` and
            :meth:`reason` describe it.

    Attributes:
        total_skips: steps skipped by the scaler since the watch was built.
        consecutive: skipped steps in a row (reset by a step that reaches ``optimizer.step()``
            with finite gradients).
        last_scale: the scale after the last skipped step (float), else ``None``.
    """

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer, *, step_open: Callable[[], bool], on_skip: Callable[[float], None]) -> None:
        for attr in ("update", "state_dict", "get_scale", "is_enabled"):
            if not callable(getattr(scaler, attr, None)):
                raise TypeError(
                    f"scaler must be a torch.amp.GradScaler (expected a method {attr}()), got {type(scaler).__name__}; "
                    "pass the GradScaler the loop calls scaler.step()/update() on"
                )
        self.scaler = scaler
        self.optimizer = optimizer
        self._step_open = step_open
        self._on_skip = on_skip
        self.total_skips = 0
        self.consecutive = 0
        self.last_scale: Optional[float] = None
        self._state: Optional[dict] = None
        self._unscaled: Optional[bool] = None
        self._skipped = False
        self._removed = False
        self._orig = scaler.update
        scaler.update = self._update

    def remove(self) -> None:
        """Restore the scaler's ``update``. Idempotent."""
        self._removed = True
        if self.scaler.__dict__.get("update") == self._update:
            del self.scaler.__dict__["update"]

    def _update(self, new_scale: Any = None) -> None:
        if self._removed or not self.scaler.is_enabled() or not self._step_open() or new_scale is not None:
            return self._orig(new_scale)
        # the step began and no optimizer.step() followed: the scaler skipped it
        unscaled = _grads_unscaled(self.scaler, self.optimizer)
        state = self.scaler.state_dict()        # host read, skipped steps only
        self._orig(new_scale)
        scale = float(self.scaler.get_scale())  # host read, skipped steps only
        self.total_skips += 1
        self.consecutive += 1
        self.last_scale = scale
        logger.info("nanreplay: GradScaler skipped a step (scale now %g, %d in a row)", scale, self.consecutive)
        self._state, self._skipped, self._unscaled = state, True, unscaled
        try:
            self._on_skip(scale)
        finally:
            self._state, self._skipped, self._unscaled = None, False, None
        return None

    def failure(self, min_scale: float, max_skips: int) -> Optional[tuple[str, str]]:
        """For the skip being reported: ``(why, kind)`` when the loss scale cannot fix it (the
        scale collapsed below ``min_scale``, or more than ``max_skips`` skips in a row), else ``None``."""
        scale = self.last_scale if self.last_scale is not None else math.inf
        if scale < min_scale:
            return f"the GradScaler's scale collapsed to {scale:g}, below min_scale={min_scale:g}", "scale collapsed"
        if self.consecutive > max_skips:
            return f"the GradScaler skipped {self.consecutive} consecutive steps, more than max_scaler_skips={max_skips}", "consecutive skips"
        return None

    def on_checked(self, finite: bool) -> None:
        """Called by the Recorder's check (a step that reached ``optimizer.step()``)."""
        if finite:
            self.consecutive = 0

    def state_for_bundle(self) -> dict:
        """The scaler's ``state_dict()`` as it was during the failing step."""
        return self._state if self._state is not None else self.scaler.state_dict()

    def reason(self, bad_grad: bool = True) -> dict:
        """JSON for the bundle's ``reason``: what the scaler did in the failing step."""
        unscaled = self._unscaled if self._skipped else _grads_unscaled(self.scaler, self.optimizer)
        info = {
            "enabled": bool(self.scaler.is_enabled()),
            "skipped": self._skipped,
            "grads_unscaled": unscaled,
            "consecutive_skips": self.consecutive,
            "total_skips": self.total_skips,
            "scale_after": self.last_scale if self._skipped else None,
        }
        out: dict = {"scaler": info}
        if not self._skipped and info["enabled"] and bad_grad:
            out["message"] = "non-finite gradients after unscaling, and the GradScaler did not skip the step"
        return out
