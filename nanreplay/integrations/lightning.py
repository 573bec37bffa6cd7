"""Lightning integration: :class:`NanReplayCallback` records a ``Trainer`` run through the same
:class:`~nanreplay.Recorder` a plain loop uses, and stops every rank on the first non-finite step.

Needs Lightning (``pip install 'nanreplay[lightning]'``); ``import nanreplay`` never imports it.
Works with ``lightning.pytorch`` (Lightning >= 2.1) and the older ``pytorch_lightning`` package.

What the callback does, hook by hook (the NaN-capture callback pattern):

* ``on_fit_start``: builds the Recorder on the LightningModule and its optimizer, with the
  precision plugin's GradScaler when there is one (``precision="16-mixed"`` on GPU), and records
  how to rebuild the module: its class and ``self.hparams`` (from ``save_hyperparameters()``) as
  JSON, the way ``LightningModule.load_from_checkpoint`` rebuilds it.
  With no ``log_to`` chosen, the Recorder logs its verdicts to the trainer's own loggers
  (``TensorBoardLogger``, ``WandbLogger``, ``MLFlowLogger``: :func:`trainer_trackers`), with no
  new configuration.
* ``on_train_batch_start``: records ``{"batch": batch, "batch_idx": batch_idx}`` and, for the
  first micro-batch of a step, the RNG states.
* ``on_before_backward``: gives the loss of each micro-batch (``training_step``'s, divided by
  ``accumulate_grad_batches`` as Lightning backpropagates it) to the Recorder, checked with the
  gradients, no sync: a NaN loss whose gradients are finite is caught, in whichever micro-batch.
* ``on_before_optimizer_step``: the finiteness check. Lightning runs ``training_step`` and
  ``backward`` inside ``optimizer.step(closure)``, after the optimizer's step pre-hook, so the
  check runs here instead, before Lightning clips the gradients (with a GradScaler, Lightning
  steps the optimizer after the closure and the scaler's own skip decision, so the Recorder's
  pre-hook and GradScaler watch are used, and the gradient norm before clipping is given here).
  A non-finite step is dumped, and its gradients dropped so the optimizer leaves the weights as
  they were.
* ``on_train_batch_end``: ``trainer.strategy.reduce_boolean_decision(failed, all=False)``: if
  any rank failed, every rank sets ``trainer.should_stop`` (and raises
  :class:`~nanreplay.errors.NonFiniteGradientError` with ``on_nonfinite="raise"``).

Replay needs no Lightning-specific step: ``nanreplay replay BUNDLE`` rebuilds the module from the
recorded class and hyperparameters and uses :func:`training_step_loss` (the module's own
``training_step``) as the loss function.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "nanreplay.integrations.lightning needs Lightning, which is not installed: "
            "pip install 'nanreplay[lightning]' (or pip install lightning)"
        ) from e

from ..errors import NonFiniteGradientError
from ..capture.recorder import Recorder, RecorderConfig
from ..capture.trackers import resolve
from .common import RecorderCallbackState
from ..core.callables import callable_path
from ..core.numerics import fused_norm

logger = logging.getLogger(__name__)

__all__ = ["NanReplayCallback", "training_step_loss", "trainer_trackers"]


def training_step_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The loss function replay uses for a LightningModule: ``model.training_step(batch["batch"],
    batch["batch_idx"])``, returning the loss tensor (or the ``"loss"`` entry of a returned dict).

    Raises:
        TypeError: ``training_step`` returned neither a tensor nor a dict with ``"loss"``.
    """
    out = model.training_step(batch["batch"], batch["batch_idx"])
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__}.training_step returned {type(out).__name__}; expected the loss tensor or a dict "
            "with a 'loss' tensor (manual optimization is not supported by replay)"
        )
    return out


def trainer_trackers(trainer: Any) -> list:
    """The trainer's configured loggers that keep a verdict (``TensorBoardLogger``,
    ``WandbLogger``, ``MLFlowLogger``; a CSV logger, or another rank's dummy, is left out) as
    :class:`~nanreplay.capture.trackers.Tracker` objects for ``log_to``."""
    try:
        return resolve(list(getattr(trainer, "loggers", None) or []), strict=False)
    except Exception as e:  # a logger whose experiment cannot be opened: training goes on without it
        logger.warning("nanreplay: could not reach the trainer's loggers (%s: %s); verdicts are not logged there", type(e).__name__, e)
        return []


def _hparams_json(module: torch.nn.Module) -> Optional[dict]:
    """``module.hparams`` as JSON-able kwargs, or ``None`` (logged) when they are not JSON."""
    hp = dict(getattr(module, "hparams", {}) or {})
    try:
        return json.loads(json.dumps(hp, allow_nan=False))
    except (TypeError, ValueError) as e:
        logger.warning(
            "nanreplay: %s.hparams are not JSON (%s); the bundle cannot rebuild the module by itself. "
            "Fix: save only JSON-able hyperparameters (numbers, strings, lists, dicts), or pass "
            "--model-factory to nanreplay replay",
            type(module).__name__,
            e,
        )
        return None


class NanReplayCallback(Callback, RecorderCallbackState):
    """Records a Lightning training run and stops every rank on the first non-finite step.

    Args:
        on_nonfinite: ``"stop"`` (default): skip the failing optimizer step on every rank and set
            ``trainer.should_stop`` (the run ends after this batch, unless ``min_steps`` /
            ``min_epochs`` say otherwise). ``"raise"``: the same, then raise
            :class:`~nanreplay.errors.NonFiniteGradientError` from ``trainer.fit`` on every rank.
        config: a :class:`~nanreplay.RecorderConfig`; keyword ``options`` override its fields
            (``out_dir``, ``capacity``, ``bundle_format``, ...). ``action`` is managed by the
            callback and cannot be set.

    Attributes:
        recorder: the :class:`~nanreplay.Recorder`, from ``on_fit_start`` on.
        bundle_path: the bundle written for the failing step, else ``None``.

    Example::

        trainer = Trainer(callbacks=[NanReplayCallback(out_dir="bundles")])
        trainer.fit(model, loader)        # stops at the first NaN, bundle in bundles/
        # nanreplay replay bundles/nanreplay-step12.h5
    """

    def __init__(self, *, on_nonfinite: str = "stop", config: Optional[RecorderConfig] = None, **options: Any) -> None:
        RecorderCallbackState.__init__(self, on_nonfinite=on_nonfinite, config=config, **options)
        self._failures_before = 0

    # -- lifecycle -------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        opts = trainer.optimizers
        if len(opts) != 1:
            raise ValueError(
                f"NanReplayCallback records one optimizer, found {len(opts)} in configure_optimizers(); "
                "return a single optimizer, or use nanreplay.Recorder directly in a manual-optimization module"
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaler = scaler if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled() else None
        self.recorder = Recorder(
            pl_module,
            opts[0],
            loss_fn=training_step_loss,
            scaler=scaler,
            config=self._config,
            **{**self._options, "action": "skip", "check_in_optimizer_step": scaler is not None, "max_consecutive": 1 << 30},
            **self.log_to(trainer_trackers(trainer)),
        )
        hp = _hparams_json(pl_module)
        cls = callable_path(type(pl_module))
        if hp is not None and cls is not None:
            self.recorder.extra_meta["model_init"] = {"class": cls, "kwargs": hp}
        self.recorder.extra_meta["lightning"] = {"global_step": int(trainer.global_step), "strategy": type(trainer.strategy).__name__}
        self.align_steps(trainer.global_step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # a resumed run's global step is restored after on_fit_start: number the steps from it
        self.align_steps(trainer.global_step)

    def _close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        """A checkpoint is being saved: it holds the step-start weights of the Recorder's next
        step; registered with :meth:`~nanreplay.capture.recorder.Recorder.note_checkpoint` (which
        checks that its weights are finite), so the rollback plan can name it
        (``source="checkpoint"``) when it is healthy."""
        if self.recorder is not None:
            self.recorder.note_checkpoint()
            self.recorder.extra_meta["last_checkpoint_global_step"] = int(trainer.global_step)

    # -- per batch -------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is not None:
            self._failures_before = len(self.recorder.nonfinite_steps)
            self.recorder.record({"batch": batch, "batch_idx": batch_idx})

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.log_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        rec = self.recorder
        if rec is None:
            return
        if rec.config.check_in_optimizer_step:
            # with a GradScaler the optimizer's pre-hook checks, after the scaler's decision and after
            # Lightning's clipping: the norm before clipping (unscaled by now) is taken here, on the device
            if getattr(trainer, "gradient_clip_val", None):
                rec.log_grad_norm(fused_norm([p.grad for p in pl_module.parameters() if p.grad is not None]))
            return
        rec.extra_meta["lightning"]["global_step"] = int(trainer.global_step)
        rec.check_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rec = self.recorder
        if rec is None:
            return
        failed = len(rec.nonfinite_steps) > self._failures_before
        if not trainer.strategy.reduce_boolean_decision(failed, all=False):
            return
        if rec.bundles:
            self.bundle_path = str(rec.bundles[-1])
        step = rec.nonfinite_steps[-1] if rec.nonfinite_steps else rec.step
        trainer.should_stop = True
        summary = (rec.last_diagnosis or {}).get("summary")
        msg = (
            f"non-finite values at optimizer step {step} (global_step {trainer.global_step})"
            + ("" if failed else " on another rank")
            + f"; the step was skipped on every rank and training stops; bundle: {self.bundle_path}"
            + (f"; diagnosis: {summary}" if summary else "")
        )
        logger.warning("nanreplay: %s", msg)
        if self.on_nonfinite == "raise":
            raise NonFiniteGradientError(msg, step=step, bundle_path=self.bundle_path, diagnosis=rec.last_diagnosis)
