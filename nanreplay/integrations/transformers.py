"""Hugging Face Trainer integration: :class:`NanReplayCallback` records a ``transformers.Trainer``
run with the same :class:`~nanreplay.Recorder` a plain loop uses and stops training on the first
non-finite step. One line::

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NanReplayCallback(out_dir="bundles")])

Needs transformers (``pip install 'nanreplay[transformers]'``); ``import nanreplay`` never imports it.

What the callback does, hook by hook:

* ``on_train_begin`` (the Trainer has created and ``accelerator.prepare``-d the model and the
  optimizer by then): builds the Recorder on the model (the Trainer's ``model_wrapped`` when the
  callback can see the Trainer, so a DDP wrapper takes part in the all-rank agreement) and on the
  optimizer unwrapped from accelerate's ``AcceleratedOptimizer`` (``.optimizer``), with
  accelerate's GradScaler when there is one. It records how to rebuild a ``PreTrainedModel``
  without the user's code: its class and ``config`` as JSON (``model_init``, replayed by
  :func:`model_from_config`).
  With no ``log_to`` chosen, the Recorder logs its verdicts to the Trainer's ``report_to``
  trackers (``tensorboard``, ``wandb``, ``mlflow``: :func:`report_to_trackers`), with no new
  configuration.
* every grad-enabled forward of the model (the Trainer calls ``model(**inputs)`` once per
  micro-batch, ``gradient_accumulation_steps`` times per optimizer step): the Recorder's forward
  hook keeps the inputs. With the Trainer's default ``compute_loss`` (the model's own ``loss``),
  this callback also records them as the step's batch, ``{"inputs": kwargs, "args": args,
  "divide_by": n}``; :func:`hf_loss` replays the default ``compute_loss`` on such a batch
  (``model(**inputs)``, its ``loss``, divided by the gradient accumulation steps when the Trainer
  divides it), so replay runs the whole step (mode ``loss_fn``).
* ``trainer.compute_loss`` (a ``compute_loss`` override, ``compute_loss_func`` or label smoothing:
  the loss is computed outside the model): what it receives is recorded as the step's batch,
  ``{"inputs": inputs (labels included), "num_items_in_batch": n, "divide_by": d}``, and the
  Recorder's loss function is :class:`TrainerLoss`, the live Trainer's own ``compute_loss`` (for
  the in-process diagnosis and the embedded program), recorded as :func:`trainer_loss`, which
  replays it from the bundle, on a stand-in of the Trainer class, without the Trainer.
* ``trainer.accelerator.backward``: the loss each micro-batch backpropagates goes to the
  Recorder's check (no sync): a NaN loss with finite gradients (a token mean over a micro-batch
  with no label) is caught, and the bundle names its micro-batch, although the Trainer's
  ``logging_nan_inf_filter`` hides it from the logs.
* ``trainer.accelerator.clip_grad_norm_``: its return, the gradient norm before clipping, is the
  step's recorded grad norm (history, early warning), read in the check's one host read.
* the check runs in the optimizer's step pre-hook, as in a plain loop; a non-finite step is
  dumped and its update skipped (the optimizer sees no gradients).
* ``on_optimizer_step``: after a non-finite step, ``control.should_training_stop = True``. Under
  ``torch.distributed`` every rank's Recorder takes the same decision in the same step (one
  all-reduce), so every rank stops.

The three Trainer attributes are instance attributes put back at ``on_train_end``; without the
Trainer in sight (an unusual caller), the model's ``loss`` output is checked instead.

Limits: with ``max_grad_norm > 0`` (the Trainer's default) the Trainer clips before the optimizer
step, and a non-finite norm makes every gradient NaN; the bundle then holds those clipped
gradients and replay says the recorded gradients are the replayed ones times one factor. A
``training_step`` override or ``DataParallel`` (``n_gpu > 1``) change the loss in ways the
callback cannot replay: it then records no loss function and no batch, and replay drives the
backward pass with the recorded gradient of the model's outputs (mode ``cotangent``); a
``--loss-fn`` given to such a bundle is refused with that reason.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "nanreplay.integrations.transformers needs Hugging Face transformers, which is not installed: "
        "pip install 'nanreplay[transformers]' (or pip install transformers accelerate)"
    ) from e

from ..capture.recorder import Recorder, RecorderConfig
from ..capture.trackers import LazyTracker
from .accelerate import AcceleratorWatch
from .common import RecorderCallbackState, patch_attribute
from ..core.callables import callable_path, import_callable, looks_like_import_path
from ..errors import NonFiniteGradientError, ReplayError

logger = logging.getLogger(__name__)

__all__ = ["NanReplayCallback", "TrainerLoss", "hf_loss", "model_from_config", "report_to_trackers", "trainer_loss"]


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The Trainer's default ``compute_loss`` on a batch recorded by :class:`NanReplayCallback`:
    ``model(*batch["args"], **batch["inputs"])``, then its ``loss`` (``outputs["loss"]`` for a
    dict / ``ModelOutput``, else ``outputs[0]``), multiplied by ``batch["multiply_by"]`` and
    divided by ``batch["divide_by"]`` where the Trainer did so (token averaging across processes;
    gradient accumulation). Returns the scalar loss the Trainer backpropagated.

    Raises:
        ReplayError: the model returned no loss (the batch has no ``labels``).
    """
    out = model(*batch.get("args", ()), **batch["inputs"])
    if isinstance(out, dict):
        loss = out.get("loss")
    else:
        loss = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "__getitem__") else None
    if not isinstance(loss, torch.Tensor):
        raise ReplayError(
            f"the model returned {type(out).__name__} without a loss; expected the model to compute it from the "
            "recorded batch (its 'labels'), as the Trainer's default compute_loss does"
        )
    if batch.get("multiply_by") not in (None, 1):
        loss = loss * batch["multiply_by"]
    if batch.get("divide_by"):
        loss = loss / batch["divide_by"]
    return loss


def model_from_config(model_class: str, config: dict, attn_implementation: Optional[str] = None, dtype: Optional[str] = None) -> torch.nn.Module:
    """A randomly initialised transformers model of class ``model_class`` (import path
    ``"transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"``) built from ``config`` (its
    ``config.to_dict()`` as JSON); no download. Replay builds the recorded model with it, then
    loads the recorded weights. ``attn_implementation`` and ``dtype`` (``"float32"``,
    ``"bfloat16"``...) as recorded.

    Raises:
        ReplayError: the class cannot be imported or is not a transformers ``PreTrainedModel``.
    """
    cls = import_callable(model_class)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ReplayError(f"{model_class} is not a transformers PreTrainedModel class; pass --model-factory")
    cfg = cls.config_class.from_dict(dict(config))
    kwargs: dict[str, Any] = {}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if dtype:
        kwargs["dtype"] = getattr(torch, dtype)
    try:
        return cls._from_config(cfg, **kwargs)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        if "dtype" not in kwargs:
            raise
        kwargs["torch_dtype"] = kwargs.pop("dtype")
        return cls._from_config(cfg, **kwargs)


#: the Trainer's ``report_to`` callbacks (class name) -> what to log to, read when an event comes
#: (each creates its writer or run in its own ``on_train_begin``)
REPORT_TO: dict[str, Any] = {
    "TensorBoardCallback": lambda cb: getattr(cb, "tb_writer", None),
    "WandbCallback": lambda cb: getattr(getattr(cb, "_wandb", None), "run", None) if getattr(cb, "_initialized", False) else None,
    "MLflowCallback": lambda cb: getattr(cb, "_ml_flow", None) if getattr(cb, "_initialized", False) else None,
}


def report_to_trackers(trainer: Any) -> list:
    """The trackers of the Trainer's ``report_to`` callbacks (``"tensorboard"``, ``"wandb"``,
    ``"mlflow"``) as :class:`~nanreplay.capture.trackers.LazyTracker` objects for ``log_to``: each
    finds the callback's writer or run when the first event comes; ``[]`` without a Trainer."""
    handler = getattr(trainer, "callback_handler", None) if trainer is not None else None
    found = []
    for cb in getattr(handler, "callbacks", None) or []:
        find = REPORT_TO.get(type(cb).__name__)
        if find is not None and type(cb).__module__.startswith("transformers."):
            found.append(LazyTracker(lambda cb=cb, find=find: find(cb), type(cb).__name__))
    return found


def _unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and similar wrappers)."""
    seen = 0
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer) and seen < 8:
        opt = opt.optimizer
        seen += 1
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"NanReplayCallback: the Trainer's optimizer is a {type(opt).__name__}, expected a torch.optim.Optimizer (or accelerate's wrapper of one)")
    return opt


def _find_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling us (a few frames up)."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        cand = frame.f_locals.get("self")
        if isinstance(cand, transformers.Trainer):
            return cand
        frame = frame.f_back
    return None


def _loss_plan(trainer: Any, args: Any) -> tuple[Optional[str], Optional[str]]:
    """How replay computes the loss the Trainer backpropagates: ``("model", None)``, the model's
    own ``loss`` output (:func:`hf_loss`); ``("compute_loss", None)``, the Trainer's
    ``compute_loss`` (an override, ``compute_loss_func`` or label smoothing: :class:`TrainerLoss`);
    or ``(None, why)`` when neither is the loss (replay then drives backward with the recorded
    gradient of the model's outputs)."""
    if getattr(args, "n_gpu", 1) > 1:
        return None, "DataParallel (n_gpu > 1) averages the loss over GPUs"
    if trainer is None:
        if getattr(args, "label_smoothing_factor", 0):
            return None, "label smoothing computes the loss outside the model, and the callback could not find the Trainer"
        return "model", None
    base = transformers.Trainer
    if type(trainer).training_step is not base.training_step:
        return None, f"{type(trainer).__name__} overrides training_step"
    if (type(trainer).compute_loss is not base.compute_loss or getattr(trainer, "compute_loss_func", None) is not None
            or getattr(args, "label_smoothing_factor", 0)):
        return "compute_loss", None
    return "model", None


class _Args(SimpleNamespace):
    """The recorded ``TrainingArguments`` fields (JSON scalars) for a stand-in Trainer."""

    def __getattr__(self, name: str) -> Any:
        raise ReplayError(f"compute_loss reads args.{name}, which the bundle did not record (only numbers, booleans and plain strings "
                          "of TrainingArguments are); replay from the program embedded in the bundle, or pass --loss-fn")


class _Accelerator:
    """What ``Trainer.compute_loss`` reads of ``accelerate.Accelerator``, without one: one
    process (or the recorded count), no parallelism config, models already unwrapped."""

    parallelism_config = None

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes

    def unwrap_model(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return model

    def gather(self, tensor: Any) -> Any:
        return tensor


def _stand_in(cls: type, model: torch.nn.Module, spec: dict) -> Any:
    """An instance of the recorded Trainer class ``cls`` built without ``__init__`` (so that
    ``super().compute_loss(...)`` works in an override), holding what ``compute_loss`` reads:
    ``model``, ``args`` (the recorded fields), ``label_smoother``, ``compute_loss_func``,
    ``model_accepts_loss_kwargs``, ``accelerator`` (:class:`_Accelerator`), ``get_tp_size()``."""
    from transformers.trainer_pt_utils import LabelSmoother

    if spec.get("compute_loss_func_unrecorded"):
        raise ReplayError("the Trainer's compute_loss_func has no import path (a lambda or a closure), so the bundle could not record it: "
                          "replay from the program embedded in the bundle, or pass --loss-fn")
    trainer = cls.__new__(cls)
    eps = float(spec.get("label_smoothing") or 0.0)
    trainer.__dict__.update(
        model=model, model_wrapped=model, args=_Args(**(spec.get("args") or {})),
        label_smoother=LabelSmoother(epsilon=eps) if eps else None,
        compute_loss_func=import_callable(spec["compute_loss_func"]) if spec.get("compute_loss_func") else None,
        model_accepts_loss_kwargs=bool(spec.get("model_accepts_loss_kwargs")), accelerator=_Accelerator(int(spec.get("num_processes") or 1)),
        is_in_train=True, get_tp_size=lambda: int(spec.get("tp_size") or 1),
    )
    return trainer


def _compute_loss(trainer: Any, fn: Callable, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``fn(trainer, model, inputs, num_items_in_batch=...)`` on a batch recorded by
    :class:`NanReplayCallback`, divided by ``batch["divide_by"]`` where the Trainer divides it:
    the loss it backpropagated for that micro-batch."""
    loss = fn(trainer, model, dict(batch["inputs"]), num_items_in_batch=batch.get("num_items_in_batch"))
    if isinstance(loss, (tuple, list)):
        loss = loss[0]
    if not isinstance(loss, torch.Tensor):
        raise ReplayError(f"{getattr(fn, '__qualname__', fn)} returned {type(loss).__name__}, expected the loss tensor")
    if batch.get("divide_by"):
        loss = loss / batch["divide_by"]
    return loss


def trainer_loss(model: torch.nn.Module, batch: dict, *, trainer_class: str, args: Optional[dict] = None, label_smoothing: float = 0.0,
                 compute_loss_func: Optional[str] = None, compute_loss_func_unrecorded: bool = False, model_accepts_loss_kwargs: bool = False,
                 num_processes: int = 1, tp_size: int = 1) -> torch.Tensor:
    """The Trainer's ``compute_loss`` replayed without the Trainer, as ``loss_fn(model, batch)``:
    ``trainer_class.compute_loss`` (``"train:MyTrainer"``; the user's override, or the default
    one with ``compute_loss_func`` / label smoothing) called on a stand-in instance of that class
    built without ``__init__``, with ``batch["inputs"]`` (labels included) and
    ``batch["num_items_in_batch"]`` as the Trainer passed them, then divided like the Trainer's
    ``training_step`` (``batch["divide_by"]``). The keyword arguments are what
    :class:`TrainerLoss` records in the bundle (``meta["loss_fn_kwargs"]``).

    Limits: the stand-in holds ``model``, ``args`` (the recorded numbers, booleans and strings),
    ``label_smoother``, ``compute_loss_func``, ``model_accepts_loss_kwargs``, ``accelerator``
    (one process, models unwrapped) and ``get_tp_size()``; a ``compute_loss`` that reads anything
    else of the Trainer (an attribute its ``__init__`` set, its callbacks, its state) fails here
    with a :class:`~nanreplay.errors.ReplayError` naming it. The program embedded in the bundle,
    exported with the live Trainer, has no such limit and is what replay uses first.

    Raises:
        ReplayError: the class cannot be imported, or ``compute_loss`` reads what the stand-in
            does not hold.
    """
    cls = import_callable(trainer_class)
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ReplayError(f"{trainer_class} is not a transformers Trainer class; pass --loss-fn")
    spec = {"args": args, "label_smoothing": label_smoothing, "compute_loss_func": compute_loss_func,
            "compute_loss_func_unrecorded": compute_loss_func_unrecorded, "model_accepts_loss_kwargs": model_accepts_loss_kwargs,
            "num_processes": num_processes, "tp_size": tp_size}
    trainer = _stand_in(cls, model, spec)
    try:
        return _compute_loss(trainer, cls.compute_loss, model, batch)
    except AttributeError as e:
        if getattr(e, "obj", None) is not trainer:
            raise
        raise ReplayError(
            f"{cls.__qualname__}.compute_loss reads self.{getattr(e, 'name', '?')}, which the Trainer sets up while it runs and a replay "
            "without the Trainer does not have; replay from the program embedded in the bundle (the default), or pass --loss-fn"
        ) from e


class TrainerLoss:
    """The loss function :class:`NanReplayCallback` gives the Recorder when the Trainer computes
    the loss outside the model (a ``compute_loss`` override, ``compute_loss_func``, label
    smoothing): ``loss_fn(model, batch)`` runs the live Trainer's own ``compute_loss`` (its
    class's, not the callback's recording wrapper) on a recorded micro-batch, so the in-process
    diagnosis and the program export see exactly what training computed. The bundle records it
    as :func:`trainer_loss` with :attr:`spec` (``nanreplay_callable``), which replays it without
    the Trainer."""

    def __init__(self, trainer: Any, spec: dict) -> None:
        self._trainer = trainer
        self.spec = spec

    @property
    def nanreplay_callable(self) -> tuple[Optional[str], Optional[dict]]:
        """How a bundle records this loss function (:func:`nanreplay.core.callables.callable_record`)."""
        return (callable_path(trainer_loss), self.spec) if self.spec.get("trainer_class") else (None, None)

    def __call__(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return _compute_loss(self._trainer, type(self._trainer).compute_loss, model, batch)


def _args_json(args: Any) -> dict:
    """The TrainingArguments fields a stand-in Trainer carries: JSON numbers, booleans, ``None``
    and plain strings (none shaped like an import path), and ``n_gpu``."""
    try:
        fields = args.to_dict()
    except Exception:  # noqa: BLE001 - arguments of an unusual class: the plain attributes
        fields = dict(vars(args))
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if v is None or isinstance(v, (bool, int)) or (isinstance(v, float) and math.isfinite(v)) or (
                isinstance(v, str) and len(v) < 512 and not looks_like_import_path(v)):
            out[str(k)] = v
    out["n_gpu"] = int(getattr(args, "n_gpu", 1) or 1)
    return out


def _trainer_spec(trainer: Any, args: Any) -> dict:
    """What :func:`trainer_loss` needs to replay ``trainer.compute_loss`` without the Trainer."""
    func = getattr(trainer, "compute_loss_func", None)
    func_path = callable_path(func) if func is not None else None
    try:
        procs = int(trainer.accelerator.num_processes)
        tp = int(trainer.get_tp_size()) if hasattr(trainer, "get_tp_size") else 1
    except Exception:  # noqa: BLE001 - an older Trainer without these: one process
        procs, tp = 1, 1
    spec = {"trainer_class": callable_path(type(trainer)), "args": _args_json(args), "label_smoothing": float(getattr(args, "label_smoothing_factor", 0) or 0),
            "model_accepts_loss_kwargs": bool(getattr(trainer, "model_accepts_loss_kwargs", False)), "num_processes": procs, "tp_size": tp}
    if func is not None:
        spec["compute_loss_func"] = None if func_path is None else str(func_path)
        spec["compute_loss_func_unrecorded"] = func_path is None
    if spec["trainer_class"] is None:
        logger.info("nanreplay: %s has no import path; the bundle's embedded program replays its compute_loss, a factory replay cannot",
                    type(trainer).__qualname__)
    else:
        spec["trainer_class"] = str(spec["trainer_class"])
    return spec


class NanReplayCallback(TrainerCallback, RecorderCallbackState):
    """Records a Hugging Face ``Trainer`` run and stops training on the first non-finite step.

    Args:
        on_nonfinite: ``"stop"`` (default): skip the failing optimizer step and set
            ``control.should_training_stop`` (``trainer.train()`` returns normally).
            ``"raise"``: the same, then raise :class:`~nanreplay.errors.NonFiniteGradientError`
            from ``trainer.train()``.
        config: a :class:`~nanreplay.RecorderConfig`; keyword ``options`` override its fields
            (``out_dir``, ``capacity``, ``bundle_format``, ``diagnose``...). ``action`` is managed
            by the callback and cannot be set.

    Attributes:
        recorder: the :class:`~nanreplay.Recorder`, from ``on_train_begin`` on.
        bundle_path: the bundle written for the failing step, else ``None``.
        loss_fn_reason: why no loss function was recorded (replay then uses the recorded output
            gradient), else ``None``.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NanReplayCallback(out_dir="bundles")])
        trainer.train()                   # stops at the first NaN, bundle in bundles/
        # nanreplay replay bundles/nanreplay-step12.h5
    """

    def __init__(self, *, on_nonfinite: str = "stop", config: Optional[RecorderConfig] = None, **options: Any) -> None:
        RecorderCallbackState.__init__(self, on_nonfinite=on_nonfinite, config=config, **options)
        self.loss_fn_reason: Optional[str] = None
        self._trainer: Any = None
        self._model: Optional[torch.nn.Module] = None
        self._opt: Any = None
        self._handles: list = []
        self._failures_seen = 0
        self._ga = 1
        self._loss_mode: Optional[str] = None
        self._checks_backward = False  # the loss is checked at accelerator.backward, not at the model's output

    # -- lifecycle -------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if self.recorder is not None:  # a second train() call: start afresh
            self._close()
        if model is None or optimizer is None:
            raise ValueError("NanReplayCallback: the Trainer passed no model or optimizer to on_train_begin; it needs both")
        self._trainer = _find_trainer()
        wrapped = getattr(self._trainer, "model_wrapped", None) if self._trainer is not None else None
        self._opt = optimizer
        inner_opt = _unwrap_optimizer(optimizer)
        scaler = getattr(optimizer, "scaler", None)
        scaler = scaler if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled() else None
        self._loss_mode, self.loss_fn_reason = _loss_plan(self._trainer, args)
        if self.loss_fn_reason:
            logger.warning("nanreplay: %s; the bundle records no loss function and replay drives backward with the recorded output gradient", self.loss_fn_reason)
        loss_fn: Any = {"model": hf_loss, None: None}.get(self._loss_mode)
        if self._loss_mode == "compute_loss":
            loss_fn = TrainerLoss(self._trainer, _trainer_spec(self._trainer, args))
        target = wrapped if isinstance(wrapped, torch.nn.Module) and _unwraps_to(wrapped, model) else model
        self.recorder = Recorder(
            target,
            inner_opt,
            loss_fn=loss_fn,
            scaler=scaler,
            config=self._config,
            **{**self._options, "action": "skip", "max_consecutive": 1 << 30},
            **self.log_to(report_to_trackers(self._trainer)),
        )
        self._model = self.recorder.model  # unwrapped from DDP by the Recorder
        self.align_steps(state.global_step)  # a resumed run's state is loaded before on_train_begin
        self._failures_seen = 0
        self._ga = int(args.gradient_accumulation_steps or 1)
        init = _model_init(self._model)
        if init is not None:
            self.recorder.extra_meta["model_init"] = init
        self.recorder.extra_meta["transformers"] = {
            "version": transformers.__version__,
            "global_step": int(state.global_step),
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "max_grad_norm": float(args.max_grad_norm or 0.0),
            "trainer_found": self._trainer is not None,
            "loss_fn": {"model": "hf_loss", "compute_loss": "compute_loss"}.get(self._loss_mode),
            "compute_loss": (f"{type(self._trainer).__module__}:{type(self._trainer).__qualname__}.compute_loss"
                             if self._loss_mode == "compute_loss" else None),
            "no_loss_fn_reason": self.loss_fn_reason,
        }
        self._handles = [
            self._model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True),
            self._model.register_forward_hook(self._on_forward),
        ]
        self._handles += self._patch_trainer(self._trainer)

    def _patch_trainer(self, trainer: Any) -> list:
        """The Trainer's own calls the callback listens to, each micro-batch: ``compute_loss``
        (what it receives, labels included, is recorded as the batch when the Trainer computes the
        loss outside the model), ``accelerator.backward`` (the loss it backpropagates goes to the
        Recorder's check: a NaN loss with finite gradients is caught) and
        ``accelerator.clip_grad_norm_`` (its return, the gradient norm before clipping, feeds the
        history and the early warning). Instance attributes, put back on close; none without the
        Trainer (the model's ``loss`` output is checked instead)."""
        acc = getattr(trainer, "accelerator", None) if trainer is not None else None
        if acc is None or not callable(getattr(acc, "backward", None)):
            return []
        handles: list = [AcceleratorWatch(acc, lambda: self.recorder)]
        if self._loss_mode == "compute_loss":
            handles.append(patch_attribute(trainer, "compute_loss", self._compute_loss_wrapper))
        self._checks_backward = True
        return handles

    def _compute_loss_wrapper(self, orig: Callable) -> Callable:
        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self.recorder
            if (rec is not None and not args and not kwargs.get("return_outputs") and isinstance(inputs, dict)
                    and torch.is_grad_enabled() and getattr(model, "training", False)):
                n = kwargs.get("num_items_in_batch")
                batch: dict[str, Any] = {"inputs": dict(inputs), "num_items_in_batch": n}  # before compute_loss pops the labels
                divide = self._divide_by({"num_items_in_batch": n})
                if divide:
                    batch["divide_by"] = divide
                rec.record(batch)  # a no-op while the Recorder replays the step itself
            return orig(model, inputs, *args, **kwargs)

        return compute_loss

    def _close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._checks_backward = False
        if self.recorder is not None:
            self.recorder.close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    # -- per micro-batch ------------------------------------------------------------------------
    def _on_forward_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        rec = self.recorder
        if rec is None or self._loss_mode != "model" or not torch.is_grad_enabled() or not module.training:
            return None
        batch: dict[str, Any] = {"inputs": dict(kwargs)}
        if args:
            batch["args"] = tuple(args)
        divide = self._divide_by(kwargs)
        if divide:
            batch["divide_by"] = divide
        scale = self._multiply_by(kwargs)
        if scale != 1:
            batch["multiply_by"] = scale
        rec.record(batch)  # a no-op while the Recorder replays the step itself
        return None

    def _divide_by(self, kwargs: dict) -> Optional[int]:
        """What the Trainer divides this micro-batch's loss by: the number of micro-batches of
        the step, unless the loss is already scaled for accumulation (the model took
        ``num_items_in_batch``, the token count of the whole step, and normalised by it)."""
        tr = self._trainer
        scaled = getattr(tr, "loss_is_scaled_for_ga", None) if tr is not None else None
        if scaled is None:
            accepts = getattr(tr, "model_accepts_loss_kwargs", True) if tr is not None else True
            scaled = bool(accepts and kwargs.get("num_items_in_batch") is not None) or getattr(tr, "compute_loss_func", None) is not None
        if scaled:
            return None
        steps = getattr(tr, "current_gradient_accumulation_steps", None) if tr is not None else None
        steps = int(steps or self._ga)  # without the Trainer in sight: the configured steps
        return steps if steps > 1 else None

    def _multiply_by(self, kwargs: dict) -> int:
        """Token averaging across processes: the Trainer multiplies the loss by the number of
        data-parallel processes when the model normalised it by the global token count."""
        tr = self._trainer
        if tr is None or kwargs.get("num_items_in_batch") is None or not getattr(tr.args, "average_tokens_across_devices", False):
            return 1
        try:
            n = int(tr.accelerator.num_processes) // int(tr.get_tp_size() if hasattr(tr, "get_tp_size") else 1)
        except Exception:  # an older Trainer without these: one process is what we can vouch for
            return 1
        return max(n, 1)

    def _on_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.recorder is None or self._checks_backward or not torch.is_grad_enabled():
            return None
        loss = output.get("loss") if isinstance(output, dict) else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.recorder.log_loss(loss)  # checked with the gradients, no sync
        return None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A checkpoint was saved (``{output_dir}/checkpoint-{global_step}``): it holds the
        step-start weights of the Recorder's next step; registered with
        :meth:`~nanreplay.capture.recorder.Recorder.note_checkpoint` (which checks that its
        weights are finite), so the rollback plan can name it (``source="checkpoint"``, with its
        path) when it is healthy."""
        if self.recorder is not None:
            out = getattr(args, "output_dir", None)
            path = os.path.join(str(out), f"checkpoint-{int(state.global_step)}") if out else None
            self.recorder.note_checkpoint(path=path)
            self.recorder.extra_meta["last_checkpoint_global_step"] = int(state.global_step)

    # -- per optimizer step ---------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.extra_meta["transformers"]["global_step"] = int(state.global_step)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.recorder
        if rec is None or len(rec.nonfinite_steps) <= self._failures_seen:
            return
        self._failures_seen = len(rec.nonfinite_steps)
        if rec.bundles:
            self.bundle_path = str(rec.bundles[-1])
        step = rec.nonfinite_steps[-1]
        control.should_training_stop = True
        summary = (rec.last_diagnosis or {}).get("summary")
        msg = (
            f"non-finite values at optimizer step {step} (global_step {state.global_step}); the update was skipped and "
            f"training stops; bundle: {self.bundle_path}" + (f"; diagnosis: {summary}" if summary else "")
        )
        logger.warning("nanreplay: %s", msg)
        if self.on_nonfinite == "raise":
            self._close()
            raise NonFiniteGradientError(msg, step=step, bundle_path=self.bundle_path, diagnosis=rec.last_diagnosis)


def _unwraps_to(wrapped: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether ``wrapped`` is ``model`` or a DDP-style wrapper (``.module``) around it."""
    m: Any = wrapped
    for _ in range(4):
        if m is model:
            return True
        m = getattr(m, "module", None)
        if not isinstance(m, torch.nn.Module):
            return False
    return False


def _model_init(model: torch.nn.Module) -> Optional[dict]:
    """``{"class": model_from_config, "kwargs": {...}}`` for a transformers model whose class
    transformers itself provides (replay then needs no user code), else ``None``."""
    if not isinstance(model, transformers.PreTrainedModel):
        return None
    cls_path = callable_path(type(model))
    if cls_path is None or not str(cls_path).startswith("transformers."):
        return None  # a custom class: only its own factory can rebuild it
    try:
        config = json.loads(model.config.to_json_string(use_diff=False))
    except (TypeError, ValueError) as e:
        logger.info("nanreplay: the model's config is not JSON (%s); replay will need --model-factory", e)
        return None
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters()), None)
    return {
        "class": callable_path(model_from_config),
        "kwargs": {"model_class": str(cls_path), "config": config, "attn_implementation": getattr(model.config, "_attn_implementation", None), "dtype": dtype},
    }
