"""accelerate integration: :class:`AcceleratorWatch` hands a :class:`~nanreplay.Recorder` what an
``accelerate.Accelerator`` sees each micro-batch, in a loop that calls ``accelerator.backward``::

    rec = Recorder(model, optimizer, loss_fn=step_loss)
    with AcceleratorWatch(accelerator, rec):
        for batch in loader:
            with accelerator.accumulate(model):
                rec.record(batch)
                loss = step_loss(model, batch)
                accelerator.backward(loss)          # the loss goes to the Recorder's check
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the norm before clipping too
                optimizer.step(); optimizer.zero_grad()

* ``accelerator.backward(loss)``: the loss it backpropagates (divided by accelerate's gradient
  accumulation steps, as accelerate divides it), to :meth:`~nanreplay.Recorder.log_loss`, once per
  micro-batch: a NaN loss is caught even when its gradients are finite, and the bundle names its
  micro-batch.
* ``accelerator.clip_grad_norm_(...)``: its return, the gradient norm before clipping, to
  :meth:`~nanreplay.Recorder.log_grad_norm` (the history and the early warning read it).

Both are instance attributes of the accelerator, put back by :meth:`AcceleratorWatch.remove`
(or leaving the ``with`` block). The Hugging Face callback uses it on the Trainer's accelerator.
Imports no framework: any object with those two methods works.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch

from ..capture.recorder import Recorder
from .common import patch_attribute

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorWatch"]


class AcceleratorWatch:
    """Listens to ``accelerator.backward`` and ``accelerator.clip_grad_norm_`` for a Recorder
    (see the module docstring).

    Args:
        accelerator: an ``accelerate.Accelerator`` (or an object with ``backward``; ``clip_grad_norm_``
            is optional).
        recorder: the :class:`~nanreplay.Recorder`, or a function returning the current one (or
            ``None``: nothing is handed on).

    Raises:
        TypeError: ``accelerator`` has no callable ``backward``.
    """

    def __init__(self, accelerator: Any, recorder: Union[Recorder, Callable[[], Optional[Recorder]]]) -> None:
        if not callable(getattr(accelerator, "backward", None)):
            raise TypeError(f"AcceleratorWatch needs an accelerate.Accelerator (an object with backward()), got {type(accelerator).__name__}")
        self._recorder: Callable[[], Optional[Recorder]] = (lambda: recorder) if isinstance(recorder, Recorder) else recorder
        self._acc = accelerator
        self._patches = [patch_attribute(accelerator, "backward", self._backward)]
        if callable(getattr(accelerator, "clip_grad_norm_", None)):
            self._patches.append(patch_attribute(accelerator, "clip_grad_norm_", self._clip))

    def _backward(self, orig: Callable) -> Callable:
        acc = self._acc

        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._recorder()
            if rec is not None and isinstance(loss, torch.Tensor):
                steps = getattr(acc, "gradient_accumulation_steps", 1)  # 1 under the HF Trainer, which divides itself
                deepspeed = "DEEPSPEED" in str(getattr(acc, "distributed_type", ""))  # DeepSpeed divides inside its engine
                rec.log_loss(loss / steps if isinstance(steps, int) and steps > 1 and not deepspeed else loss)
            return orig(loss, *args, **kwargs)

        return backward

    def _clip(self, orig: Callable) -> Callable:
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = orig(*args, **kwargs)
            rec = self._recorder()
            if rec is not None and norm is not None:
                rec.log_grad_norm(norm)  # the norm before clipping, read with the check
            return norm

        return clip_grad_norm_

    def remove(self) -> None:
        """Put back the accelerator's own methods. Idempotent."""
        for p in self._patches:
            p.remove()
        self._patches = []

    def __enter__(self) -> "AcceleratorWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
