"""Mixed precision: the GradScaler's loss scale followed as state, and the unscaled problem judged.

With fp16 autocast and a ``torch.amp.GradScaler``, Inf/NaN gradients are expected while the scale
is too large: ``scaler.step(optimizer)`` finds them while unscaling, does not call
``optimizer.step()``, and ``scaler.update()`` backs the scale off. Such steps are normal, however
many there are while the scale is large and falling (Megatron-LM's ``init_scale=2**32`` skips
about 20 steps in a row on a clean run): the Recorder counts them (``Recorder.scaler_skips``),
dumps nothing and raises nothing. What it judges is the *unscaled* problem. A skipped step is a
failure when

* **the loss is non-finite** (``scaler_failure: "nonfinite loss"``): the forward pass is not
  scaled, so no loss scale explains a non-finite loss (a NaN in the data, an overflow in the
  forward pass); it is a failure at once, at its first step. The loss is the one given to
  ``Recorder.log_loss`` or, without it, the one the loop gave ``scaler.scale(loss)`` (the loss the
  trainer backpropagates; over micro-batches, non-finite when any of them was);
* **the gradients are non-finite after unscaling at a scale at or below the floor**
  (``"scale collapsed"``): the floor is ``RecorderConfig.min_scale`` (default 1: at scale 1 the
  gradients are not scaled at all), or the scaler's own minimum when it has one and it is larger
  (a ``min_scale`` / ``min_loss_scale`` attribute); the scale fell to it and the step still
  overflows, so no scale makes it finite;
* **the scale stopped falling** (``"scale stalled"``): more than ``RecorderConfig.max_scaler_skips``
  consecutive skips left the scale where it was (a scaler pinned at its own minimum, or one with
  hysteresis that no longer backs off).

A failure is dumped and acted on like any non-finite step; its episode
(:mod:`nanreplay.capture.episode`) starts at the first of the consecutive skips before it, so the
bundle's rollback plan names the step where the values went non-finite, not the step where the
scale ran out. The bundle's ``reason.scaler`` holds the scale the step ran with, the scale after,
and the scale history (``scale_history``: ``[step, scale]`` at every change over the scalar
history), and the scalar history holds the scale of every step (``meta["scalar_history"]["scale"]``).

Also a failure, through the Recorder's ordinary check: non-finite gradients after unscaling that
the scaler did **not** skip (the optimizer's step pre-hook sees them: the loop called
``optimizer.step()`` itself, or the scaler is disabled), with ``reason.scaler.skipped = false``.

Mechanism, with no extra host sync on ordinary steps: :class:`ScalerWatch` wraps the scaler's
``scale`` and ``update`` (on the instance; ``Recorder.close()`` restores them). ``scale(loss)``
keeps a reference to the scalar loss (no copy, no sync). The scale the step runs with is the
scaler's device tensor (``_scale``), read in the check's one host read together with the grad norm
and the loss (:func:`nanreplay.capture.check.read_check`). A step that began and reaches
``update()`` without an ``optimizer.step()`` was skipped by the scaler, which has already read its
``found_inf`` flags on the host; only then does the watch read more (the state before ``update``
for the bundle, the scale after it, and the loss).

Which dynamic loss scalers are followed: ``torch.amp.GradScaler`` and everything built on it or
exposing its protocol (``scale``, ``update``, ``get_scale``, ``is_enabled``, ``state_dict``, the
``_scale`` tensor): ``torch.cuda.amp.GradScaler``, FSDP's ``ShardedGradScaler``, and the scaler the
HF Trainer, accelerate and Lightning's ``MixedPrecision`` plugin create (each a
``torch.amp.GradScaler``; pass it as ``scaler=``). Not yet followed: apex's ``LossScaler``,
DeepSpeed's ``DynamicLossScaler`` and Megatron-LM's ``DynamicGradScaler``, whose overflow flag is
decided inside their own optimizer wrappers (``update_scale(overflow)``, ``update(found_inf)``)
rather than by a skipped ``optimizer.step()``; with them, leave ``scaler`` unset and the Recorder
checks the steps that reach the inner optimizer.

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


#: attributes a dynamic loss scaler may hold its own minimum scale in
_FLOOR_ATTRS = ("min_scale", "min_loss_scale", "_min_loss_scale")


class ScalerWatch:
    """Follows a GradScaler's loss scale and says when a skipped step is a failure (see the
    module's docstring). A removable handle: ``remove()`` puts the scaler's own ``scale`` and
    ``update`` back.

    Args:
        scaler: the ``torch.amp.GradScaler`` the loop calls ``scaler.scale()`` / ``step()`` /
            ``update()`` on.
        optimizer: the optimizer it steps.
        step_open: ``step_open()`` says whether a step began (a forward or a batch was seen) and no
            ``optimizer.step()`` ended it yet; an ``update()`` then means the scaler skipped it.
        on_skip: called for each skipped step, after ``update()``; :meth:`failure` says whether
            that skip is a failure, :meth:`state_for_bundle` and :meth:`reason` describe it.

    Attributes:
        total_skips: steps skipped by the scaler since the watch was built.
        consecutive: skipped steps in a row (reset by a step that reaches ``optimizer.step()``
            with finite gradients).
        stalled: skipped steps in a row that left the scale where it was (reset when it falls).
        scale_before, last_scale: the scale the last skipped step ran with, and the scale after
            its ``update()`` (host floats), else ``None``.
        loss: the scalar loss given to ``scaler.scale()`` in the step in progress (a detached
            reference; across micro-batches the last one's value, made NaN when an earlier one
            was non-finite), else ``None``.
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
        self.stalled = 0
        self.scale_before: Optional[float] = None
        self.last_scale: Optional[float] = None
        self.loss: Optional[torch.Tensor] = None
        self._state: Optional[dict] = None
        self._unscaled: Optional[bool] = None
        self._skipped = False
        self._removed = False
        self._orig = scaler.update
        scaler.update = self._update
        self._orig_scale = getattr(scaler, "scale", None)
        if callable(self._orig_scale):
            scaler.scale = self._scale

    def remove(self) -> None:
        """Restore the scaler's ``scale`` and ``update``. Idempotent."""
        self._removed = True
        for name, mine in (("update", self._update), ("scale", self._scale)):
            if self.scaler.__dict__.get(name) == mine:
                del self.scaler.__dict__[name]

    def _scale(self, outputs: Any) -> Any:
        """``scaler.scale(outputs)``, keeping a reference to a scalar loss (no copy, no sync)."""
        if not self._removed and isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and self._step_open():
            loss = outputs.detach().reshape(())
            self.loss = loss if self.loss is None else loss + self.loss * 0  # NaN when an earlier micro-batch's loss was non-finite
        return self._orig_scale(outputs)

    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The scale the step in progress runs with, as the scaler's own device tensor (read in
        the check's one host read; ``None`` before the first ``scale()`` or when disabled)."""
        t = getattr(self.scaler, "_scale", None)
        return t if isinstance(t, torch.Tensor) and t.numel() == 1 and getattr(self.scaler, "_enabled", True) else None

    def end_step(self) -> None:
        """The step ended: forget its loss."""
        self.loss = None

    def _update(self, new_scale: Any = None) -> None:
        if self._removed or not self.scaler.is_enabled() or not self._step_open() or new_scale is not None:
            return self._orig(new_scale)
        # the step began and no optimizer.step() followed: the scaler skipped it
        unscaled = _grads_unscaled(self.scaler, self.optimizer)
        state = self.scaler.state_dict()        # host read, skipped steps only
        self._orig(new_scale)
        scale = float(self.scaler.get_scale())  # host read, skipped steps only
        before = state.get("scale")
        before = float(before) if isinstance(before, (int, float)) else None
        self.total_skips += 1
        self.consecutive += 1
        self.stalled = self.stalled + 1 if before is not None and scale >= before else 0
        self.scale_before, self.last_scale = before, scale
        logger.info("nanreplay: GradScaler skipped a step (scale %s -> %g, %d in a row)", before, scale, self.consecutive)
        self._state, self._skipped, self._unscaled = state, True, unscaled
        try:
            self._on_skip(scale)
        finally:
            self._state, self._skipped, self._unscaled = None, False, None
        return None

    def floor(self, min_scale: float) -> float:
        """The scale at or below which a skip is a failure: ``min_scale``, or the scaler's own
        minimum when it has one and it is larger."""
        own = [float(v) for v in (getattr(self.scaler, a, None) for a in _FLOOR_ATTRS) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return max([min_scale, *own])

    def failure(self, min_scale: float, max_stalled: int, *, loss: Optional[float] = None) -> Optional[tuple[str, str]]:
        """For the skip being reported: ``(why, kind)`` when it is a failure (the module's
        docstring: a non-finite ``loss``, a scale at or below the floor, or more than
        ``max_stalled`` skips in a row that did not lower the scale), else ``None``."""
        before = self.scale_before if self.scale_before is not None else math.inf
        if loss is not None and not math.isfinite(loss):
            return (f"the loss is {loss}, and loss scaling does not scale the forward pass: no routine overflow, although the "
                    f"GradScaler skipped the step (its scale was {before:g})", "nonfinite loss")
        floor = self.floor(min_scale)
        if before <= floor:
            return (f"they are still non-finite after unscaling at a loss scale of {before:g}, at or below the floor {floor:g} "
                    f"(min_scale), after {self.consecutive} skip(s) in a row", "scale collapsed")
        if self.stalled > max_stalled:
            return (f"the GradScaler skipped {self.stalled} consecutive steps without lowering its scale ({before:g}), more than "
                    f"max_scaler_skips={max_stalled}: the scale cannot fall further", "scale stalled")
        return None

    def on_checked(self, finite: bool) -> None:
        """Called by the Recorder's check (a step that reached ``optimizer.step()``)."""
        if finite:
            self.consecutive = 0
            self.stalled = 0

    def state_for_bundle(self) -> dict:
        """The scaler's ``state_dict()`` as it was during the failing step."""
        return self._state if self._state is not None else self.scaler.state_dict()

    def reason(self, bad_grad: bool = True, scale_history: Optional[list] = None) -> dict:
        """JSON for the bundle's ``reason``: what the scaler did in the failing step and the
        scale history (``[step, scale]`` at each change)."""
        unscaled = self._unscaled if self._skipped else _grads_unscaled(self.scaler, self.optimizer)
        info = {
            "enabled": bool(self.scaler.is_enabled()),
            "skipped": self._skipped,
            "grads_unscaled": unscaled,
            "consecutive_skips": self.consecutive,
            "total_skips": self.total_skips,
            "scale_before": self.scale_before if self._skipped else None,
            "scale_after": self.last_scale if self._skipped else None,
            "scale_history": list(scale_history or []),
        }
        out: dict = {"scaler": info}
        if not self._skipped and info["enabled"] and bad_grad:
            out["message"] = "non-finite gradients after unscaling, and the GradScaler did not skip the step"
        return out
