"""The Recorder: attaches to a live training loop, keeps a ring buffer of the last steps, and
on the first non-finite gradient (or loss) dumps a self-contained bundle and diagnoses it.

Hot-path design (per step, default options):

* one forward pre-hook and one forward hook on the top-level model: keep references to the
  forward inputs (checked later with the tensor version counter, copied only when the loop is
  seen to reuse or modify a batch tensor in place), RNG states (host only, no device sync),
  and a tensor hook on each output to keep the cotangent;
* one optimizer step pre-hook: one fused ``_foreach_norm`` over all gradients and one host read
  of one scalar (the grad norm, which is NaN/Inf iff some gradient is).

Nothing is copied on the device per step unless ``snapshot_every`` asks for weight snapshots:
the failing step's pre-step weights and optimizer state are still in place when the step pre-hook
fires, so they are written from where they are. Weight snapshots are copied with one
``torch._foreach_copy_`` into slots recycled from evicted snapshots, so steady-state snapshotting
allocates nothing.

With ``check_every=N > 1`` (the sync-free mode, :meth:`Recorder._check_lagged`) the check keeps
its verdict on the device, like GradScaler's ``found_inf``, and the host reads it once every N
steps; a device-side latch keeps the first non-finite step's pre-step state and gradients until
then.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils import _pytree as pytree

from ..core.callables import callable_path, import_callable
from ..core.jsonable import fnum, jsonable
from ..core.state import copy_all, load_buffers
from ..format.bundle import write_bundle
from ..format.records import BundleContent, ForwardRecord, Snapshot, StepRecord
from ..errors import NonFiniteGradientError
from ..core.numerics import fused_norm, is_float
from ..core.rng import RNGState
from ..core.tree import flatten_typed, map_tensors

logger = logging.getLogger(__name__)

__all__ = ["Recorder", "RecorderConfig"]

_ACTIONS = ("raise", "skip", "warn")
_SMALL_BUFFER = 1 << 20  # bytes: buffers up to this size are copied at every step start


@dataclass(kw_only=True)
class RecorderConfig:
    """Options of :class:`Recorder`; every field can also be passed to ``Recorder(...)`` directly.

    Attributes:
        action: what to do on a non-finite step. ``"raise"`` (default): dump, then raise
            :class:`~nanreplay.errors.NonFiniteGradientError` from ``optimizer.step()`` before any
            weight changes. ``"skip"``: dump on the first occurrence, drop this step's gradients so
            the optimizer leaves weights and state untouched, raise after ``max_consecutive``
            consecutive skips. Both put back the step-start buffers (BatchNorm running stats the
            failing forward already wrote). ``"warn"``: dump, log a warning, let the step proceed.
        capacity: steps kept in the ring buffer (>= 1). Each step costs references to its batch
            and cotangents (their bytes count against ``memory_budget``) and ~5 KiB of RNG state.
        snapshot_every: every N steps, copy the step-start weights, buffers and optimizer state
            into the ring buffer (0 = never). Costs one copy of params + optimizer state per
            snapshot (about 3x the parameter bytes for Adam) in time and memory; ``nanreplay
            bisect`` needs it to compare the failing step with an earlier, finite one. The failing
            step's own pre-step state is always saved, at no per-step cost.
        memory_budget: bytes the ring buffer may keep alive beyond what training holds anyway:
            past steps' batches and forward inputs (a kept reference holds the loader's tensor
            too), cotangents, copied buffers, weight snapshots, recycled snapshot slots.
            Oldest snapshots, then oldest steps, are evicted to stay within it; the step in
            progress is kept whole (``held_bytes()`` says what is held now).
        out_dir: directory for bundles (created on first dump).
        bundle_format: ``"h5"`` (HDF5) or ``"safetensors"``.
        max_consecutive: with ``action="skip"``, raise after this many consecutive skipped steps.
        max_dumps: bundles written per Recorder (the first non-finite steps), to keep ``warn`` and
            ``skip`` runs from filling the disk.
        diagnose: replay the failing step in process right after detection and store the
            diagnosis in the bundle and the exception message.
        copy_batch: ``None`` (auto: keep references, switch to copies once a batch tensor is seen
            reused or modified in place), ``True`` (always copy), ``False`` (never copy).
        capture_cotangent: keep the gradient w.r.t. the model's outputs, so a model-only replay
            works without the loss function.
        check_loss: also check the loss given to :meth:`Recorder.log_loss`.
        check_in_optimizer_step: run the check in the optimizer's step pre-hook (default). Turn it
            off when the loop runs forward and backward *inside* ``optimizer.step(closure)``
            (Lightning does), and call :meth:`Recorder.check_step` where the gradients are ready.
        origin_hook: when ``model`` is a ``DistributedDataParallel``, register the comm hook of
            :func:`nanreplay.capture.ddp.register_origin_hook` (each bucket checked before its
            all-reduce, so the rank where a non-finite gradient was born is known). Needs one extra
            copy of the gradients per step (the rank-local gradients, kept until the step ends).
        min_scale: with a GradScaler, dump when a skipped step leaves the loss scale below this.
        max_scaler_skips: with a GradScaler, dump when more than this many consecutive steps were
            skipped for non-finite gradients (a healthy fp16 run skips a few in a row at most).
        check_every: read the check's verdict on the host every N steps (1 = every step, one host
            sync per step). With N > 1 the check is sync-free in between: each step's grad norm
            (and loss) stays a device scalar, and a device-side latch copies the step's pre-step
            weights, optimizer state tensors and gradients into one preallocated slot, with
            ``torch.where`` under the latch, until a non-finite step sets it; from then on the slot
            is frozen. When the host reads the verdicts (one ``tolist()`` every N steps, and at
            :meth:`Recorder.close`) and finds the first non-finite step k, the bundle holds step
            k's batch, RNG states, learning rates, step-start buffers (from the ring buffer, whose
            unchecked steps are never evicted), pre-step weights, optimizer state and gradients
            (from the slot): the same content as with N = 1. What differs: steps k+1.. ran on the
            corrupted weights until the host learned of it; ``"raise"`` and ``"skip"`` put the
            weights and optimizer state back to step k's pre-step values (``"skip"`` then goes
            on from there, so the updates of steps k..k+N-1 are dropped), ``"warn"`` leaves them.
            Cost per step: one masked copy of params + optimizer state + gradients (read 2x,
            write 1x; about 4x the parameter bytes for Adam, held once). Worth it where a host
            sync costs more than that copy (GPUs); on CPU a sync is free and N = 1 is cheaper.
        check_update: also check the optimizer update (off by default). Every step, the
            pre-step weights and optimizer state are copied in the step pre-hook (one copy of
            params + optimizer state: about 3x the parameter bytes for Adam, in memory and in
            device copy time per step), and after ``optimizer.step()`` one fused
            ``_foreach_norm`` over the updated parameters and floating optimizer state with one
            host read tells whether the update made them non-finite. Then the pre-step weights and
            state are put back (for ``raise`` and ``skip``; ``warn`` keeps the update), a bundle is
            written with the pre-step state and the (finite) gradients, and the diagnosis replays
            the update to name the parameter and the state key.
        allow_nonfinite: extra allowlist rules for legitimate non-finite values, ``"MODULE:OP"``
            or ``"MODULE:OP:-inf"`` (fnmatch patterns, see :class:`nanreplay.core.allowlist.AllowRule`),
            on top of the default rules for -Inf attention masks; stored in the bundle
            (``meta["replay_options"]``) for later replays.
    """

    action: str = "raise"
    capacity: int = 4
    snapshot_every: int = 0
    memory_budget: int = 2 << 30
    out_dir: Union[str, Path] = "nanreplay_bundles"
    bundle_format: str = "h5"
    max_consecutive: int = 3
    max_dumps: int = 1
    diagnose: bool = True
    copy_batch: Optional[bool] = None
    capture_cotangent: bool = True
    check_loss: bool = True
    check_in_optimizer_step: bool = True
    origin_hook: bool = True
    min_scale: float = 1.0
    max_scaler_skips: int = 10
    check_every: int = 1
    check_update: bool = False
    allow_nonfinite: tuple = ()

    def __post_init__(self) -> None:
        from ..core.allowlist import AllowRule

        self.allow_nonfinite = tuple(self.allow_nonfinite)
        for r in self.allow_nonfinite:
            if not isinstance(r, AllowRule):
                AllowRule.parse(str(r))  # raises ValueError naming the bad rule
        if self.action not in _ACTIONS:
            raise ValueError(f"action must be one of {_ACTIONS}, got {self.action!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 step, got {self.capacity}")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = off), got {self.snapshot_every}")
        if self.memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {self.memory_budget}")
        if self.bundle_format not in ("h5", "safetensors"):
            raise ValueError(f"bundle_format must be 'h5' or 'safetensors', got {self.bundle_format!r}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.max_scaler_skips < 1:
            raise ValueError(f"max_scaler_skips must be >= 1, got {self.max_scaler_skips}")
        if not self.min_scale >= 0:
            raise ValueError(f"min_scale must be a loss scale >= 0, got {self.min_scale}")
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1 step (1 = check on the host every step), got {self.check_every}")


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class _Ref:
    """A tensor reference plus its version counter at capture time."""

    __slots__ = ("t", "v")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.v = t, t._version

    def fresh(self) -> bool:
        return self.t._version == self.v


class Recorder:
    """Records a training loop and dumps a bundle on the first non-finite gradient.

    Args:
        model: the ``nn.Module`` being trained (the top-level one whose forward the loop calls),
            or its ``DistributedDataParallel`` wrapper: the Recorder then hooks the wrapped module
            (FQNs without the ``module.`` prefix, so the bundle replays on a plain model), takes
            its decisions together with every rank (see :mod:`nanreplay.capture.ddp`) and finds
            the rank where the non-finite value was born. Under ``torch.distributed`` without DDP
            the agreement still happens; bundles are named ``...-rank{r}of{w}``.
        optimizer: its ``torch.optim.Optimizer``; the check runs in its step pre-hook.
        loss_fn: optional ``loss_fn(model, batch) -> loss`` (scalar tensor) computing the loss
            from a batch given to :meth:`record`; a callable, or its import path
            ``"pkg.mod:fn"`` / ``"/path/file.py:fn"``. With it, replay re-runs the whole step;
            without it, replay drives the backward pass with the recorded cotangent.
        model_factory: optional zero-argument callable (or import path) returning a fresh model
            of the same architecture, for ``nanreplay replay`` in another process.
        scaler: optional ``torch.amp.GradScaler``. Steps it skips for Inf/NaN gradients are
            normal and only counted (:attr:`scaler_skips`); see :mod:`nanreplay.capture.amp` for when
            they become a failure. Its state is saved in the bundle and restored by replay.
        config: a :class:`RecorderConfig`; keyword ``options`` override its fields.

    Use as a context manager (``with Recorder(model, opt) as rec:``) or call :meth:`close`.

    Example::

        with Recorder(model, opt, loss_fn=step_loss) as rec:
            for x, y in loader:
                rec.record((x, y))             # optional: the batch the loss needs
                loss = step_loss(model, (x, y))
                rec.log_loss(loss)             # optional: check the loss too
                loss.backward(); opt.step(); opt.zero_grad()

    Raises:
        NonFiniteGradientError: from ``optimizer.step()``, with ``action="raise"``.
        TypeError / ValueError: bad arguments or options.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Any = None,
        model_factory: Any = None,
        scaler: Any = None,
        config: Optional[RecorderConfig] = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        cfg = config or RecorderConfig()
        self.config = dataclasses.replace(cfg, **options) if options else cfg
        from .ddp import RankContext, unwrap_model

        self.wrapper = model
        model = unwrap_model(model)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.loss_fn = import_callable(loss_fn) if isinstance(loss_fn, str) else loss_fn
        self.loss_fn_path = callable_path(loss_fn)
        self.model_factory_path = callable_path(model_factory)
        self._param_fqn = {id(p): n for n, p in model.named_parameters()}
        self.ring: deque[StepRecord] = deque()
        self.step = 0                     # index of the step in progress
        self.bundles: list[Path] = []     # bundles written so far
        self.last_diagnosis: Optional[dict] = None
        self.skipped = 0                  # consecutive skipped steps
        self.nonfinite_steps: list[int] = []
        self._current: Optional[StepRecord] = None
        self._provisional = False         # the step in progress was begun in eval mode (see _begin_step)
        self._copy = self.config.copy_batch is True
        self._storages: dict[int, int] = {}   # storage ptr -> step, to detect recycled input buffers
        self._refs: list[_Ref] = []            # current step's batch references
        self._step_refs: dict[int, list[_Ref]] = {}  # step -> its references, to flag stale ones at dump time
        self._held_cache: dict[int, int] = {}  # step -> bytes it holds, once the step is over
        self._module_names = [(n, m) for n, m in model.named_modules()]  # walked once, not per step
        self._mutable_buffers: Optional[set[str]] = None
        self._buffer_versions: dict[str, int] = {}
        self._pending_loss: Optional[torch.Tensor] = None
        self._pre_update: Optional[Snapshot] = None  # check_update: pre-step weights + state
        self._skip_versions: list[tuple[torch.Tensor, int]] = []  # a skipped step's params and their versions
        self._replaying = False           # set while diagnose_live replays on the live model
        self.extra_meta: dict[str, Any] = {}   # JSON merged into every bundle's metadata
        self._handles: list[Any] = []
        self._closed = False
        if self.config.check_every > 1:
            pg = torch.distributed.is_available() and torch.distributed.is_initialized()
            clash = [n for n, on in (("torch.distributed", pg), ("a GradScaler", scaler is not None), ("check_update=True", self.config.check_update)) if on]
            if clash:
                raise ValueError(
                    f"check_every={self.config.check_every} (the sync-free check) does not yet combine with {', '.join(clash)}; "
                    "use check_every=1 there (one host read per step)"
                )
        self.dist = RankContext.detect(self)    # None outside torch.distributed
        self._amp = None
        if scaler is not None:
            from .amp import ScalerWatch

            self._amp = ScalerWatch(self, scaler)
            self._handles.append(self._amp)
        self._free_slots: list[_Slot] = []       # snapshot slots recycled from evicted snapshots
        self._pending: list[StepRecord] = []    # steps whose verdict is still on the device (check_every > 1)
        self._latch: Optional[_Latch] = None     # the sync-free mode's device-side evidence slot
        self._handles.append(model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._on_forward, with_kwargs=True))
        if self.config.check_in_optimizer_step:
            self._handles.append(optimizer.register_step_pre_hook(self._on_step_pre))
        self._handles.append(optimizer.register_step_post_hook(self._on_step_post))
        if self.dist is not None and self.config.origin_hook and model is not self.wrapper:
            self.dist.attach_origin_hook(self.wrapper)

    @property
    def scaler_skips(self) -> int:
        """Steps the GradScaler skipped for non-finite gradients so far (0 without a scaler)."""
        return self._amp.total_skips if self._amp is not None else 0

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook this Recorder registered. Idempotent. With ``check_every > 1``, first
        reads the verdicts still on the device (one host sync) and dumps a bundle for a
        non-finite step among them; it logs instead of raising."""
        if self._pending and not self._closed:
            try:
                self._check_pending(final=True)
            except Exception:  # close() runs from __exit__, often while another error propagates
                logger.exception("nanreplay: the final check on close() failed")
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._closed = True

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public capture API --------------------------------------------------------------------
    def record(self, batch: Any) -> None:
        """Capture an explicit batch (any nesting of tuples, lists, dicts, dataclasses; tensors
        and plain values as leaves) for the step in progress. Call it once per micro-batch,
        before its forward, in loops whose loss needs more than the model inputs."""
        if self._replaying:
            return
        rec = self._begin_step()
        rec.batches.append(self._capture_tree(batch))

    def log_loss(self, loss: torch.Tensor) -> None:
        """Give the step's loss (a scalar tensor) so a non-finite loss is detected and the loss is
        kept in the ring buffer. No sync: it is read together with the grad norm."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._pending_loss = loss.detach().reshape(())

    # -- hooks ---------------------------------------------------------------------------------
    def _begin_step(self, *, capture: bool = True) -> StepRecord:
        """The step in progress, begun now if none is. ``capture``: called for a batch or a
        forward (not for the check), which ends a provisional step's validation forwards."""
        if self._current is not None:
            if capture and self._provisional and self.model.training:
                self._restart_step(self._current)
            return self._current
        # a step begun in eval mode is provisional: a grad-enabled validation forward (one that
        # forgot torch.no_grad) between two steps looks like the start of the next step until
        # the model is put back in training mode
        self._provisional = not self.model.training
        rec = StepRecord(step=self.step, rng=RNGState.capture())
        rec.training = [n for n, m in self._module_names if m.training]
        rec.buffers = self._capture_buffers()
        se = self.config.snapshot_every
        if se and self.step % se == 0:
            while len(self.ring) >= self._capacity():  # evict first, so its slot can be reused
                self._drop_oldest()
            rec.snapshot = self._take_snapshot()
        self._current = rec
        self._refs = []
        self._step_refs[rec.step] = self._refs
        self.ring.append(rec)
        self._evict()
        return rec

    def _restart_step(self, rec: StepRecord) -> None:
        """The model went back to training mode after the step in progress was begun in eval mode:
        the forwards seen so far were validation, not part of the step. Drop them and take the
        step's RNG states and module modes again, from here (the batches and buffers stay: an
        eval-mode forward leaves BatchNorm's running stats alone)."""
        self._provisional = False
        if rec.forwards:
            logger.info("nanreplay: step %d: %d grad-enabled forward(s) in eval mode before the model went back to training "
                        "mode are treated as validation, not as part of the step", rec.step, len(rec.forwards))
        rec.forwards = []
        rec.rng = RNGState.capture()
        rec.training = [n for n, m in self._module_names if m.training]
        rec.autocast = None
        kept = {id(t) for t in pytree.tree_leaves(rec.batches) if isinstance(t, torch.Tensor)}
        self._refs[:] = [r for r in self._refs if id(r.t) in kept]

    def _capture_buffers(self) -> dict[str, torch.Tensor]:
        """Step-start buffers. Buffers seen to change during a step (BatchNorm running stats) are
        copied; the others are referenced (their version counter proves them unchanged)."""
        out = {}
        for name, b in self.model.named_buffers():
            if self._mutable_buffers is None or name in self._mutable_buffers:
                out[name] = b.detach().clone()
            else:
                out[name] = b.detach()
            self._buffer_versions[name] = b._version
        return out

    def _capture_tree(self, tree: Any) -> Any:
        def cap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            x = x.detach()
            if self.config.copy_batch is not False:
                try:
                    ptr = x.untyped_storage().data_ptr()
                except RuntimeError:
                    ptr = 0
                if ptr and ptr in self._storages and self._storages[ptr] != self.step and not self._copy:
                    self._copy = True
                    logger.info("nanreplay: the loop reuses an input buffer across steps; batches are copied from now on")
                self._storages[ptr] = self.step
            if self._copy:
                return x.clone()
            self._refs.append(_Ref(x))
            return x

        return map_tensors(cap, tree)

    def _on_forward_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # forwards without autograd (evaluation under no_grad) are not part of a training step
        if self._replaying or not torch.is_grad_enabled():
            return None
        rec = self._begin_step()
        if rec.autocast is None:
            rec.autocast = _autocast_state(args, kwargs)
        # a later micro-batch: the loop may have drawn random numbers since the step began
        rng = RNGState.capture() if rec.forwards else None
        rec.forwards.append(ForwardRecord(inputs=self._capture_tree((args, kwargs)), rng=rng))
        return None

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._replaying or not torch.is_grad_enabled():
            return None
        rec = self._current
        if rec is None or not rec.forwards or not self.config.capture_cotangent:
            return None
        fw = rec.forwards[-1]
        leaves, spec = flatten_typed(output)  # dataclass outputs (ModelOutput) included
        cot: list[Any] = [None if isinstance(t, torch.Tensor) else t for t in leaves]
        fw.cotangent = pytree.tree_unflatten(cot, spec)
        holder = {"leaves": cot, "spec": spec}

        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad and is_float(t):

                def hook(g: torch.Tensor, i: int = i, fw: ForwardRecord = fw, h: dict = holder) -> None:
                    h["leaves"][i] = g.detach()
                    fw.cotangent = pytree.tree_unflatten(h["leaves"], h["spec"])

                t.register_hook(hook)
        return None

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    out.append((self._param_fqn.get(id(p), f"<unnamed:{id(p)}>"), p.grad))
        return out

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.check_step()
        return None

    def check_step(self) -> Optional[bool]:
        """Check the gradients now (and the loss given to :meth:`log_loss`): one fused norm and
        one host read; under ``torch.distributed`` one small all-reduce too, so every rank takes
        the same decision. Returns ``True`` when the step is finite (on every rank), else acts
        as ``action`` says (``"raise"`` raises here) and returns ``False``; returns ``None`` with
        ``check_every > 1``, where the verdict stays on the device until the next host read.

        The optimizer step pre-hook calls it; call it yourself with
        ``check_in_optimizer_step=False`` (as the Lightning callback does)."""
        rec = self._begin_step(capture=False)
        rec.lrs = [_lr_value(g["lr"]) for g in self.optimizer.param_groups]
        if self.config.check_every > 1:
            return self._check_lagged(rec)
        grads = self._grads()
        norm = fused_norm([g for _, g in grads])
        loss = self._pending_loss if self.config.check_loss else None
        self._pending_loss = None
        rec.grad_norm, rec.loss, agreed = self._read_check(norm, loss)
        bad_grad = rec.grad_norm is not None and not math.isfinite(rec.grad_norm)
        bad_loss = rec.loss is not None and not math.isfinite(rec.loss)
        rec.finite = not (bad_grad or bad_loss) and agreed is not False
        self._seal(rec)
        if self._amp is not None:
            self._amp.on_checked(rec.finite)
        if rec.finite:
            self.skipped = 0
            if self.config.check_update:
                self._pre_update = self._take_snapshot()  # recycled slot: no allocation in steady state
            return True
        self._handle_nonfinite(rec, grads, bad_grad, bad_loss)
        return False

    def _read_check(self, norm: Optional[torch.Tensor], loss: Optional[torch.Tensor]) -> tuple[Optional[float], Optional[float], Optional[bool]]:
        """(grad norm, loss, agreed finiteness) as host values from one host read. The agreed
        finiteness is ``None`` outside torch.distributed; inside, the ranks' flags are all-reduced
        on the device first (:meth:`nanreplay.capture.ddp.RankContext.agree`)."""
        present = [t for t in (norm, loss) if t is not None]
        if self.dist is None and not present:
            return None, None, None
        device = present[0].device if present else self.dist.device()
        parts = [t.to(device, torch.float32).reshape(1) for t in present]
        flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
        n = len(parts)
        if self.dist is not None:
            flat = torch.cat([flat, self.dist.agree(flat, loss_bad=parts[-1] if loss is not None else None)])
        vals = flat.tolist()  # the one host read
        it = iter(vals[:n])
        g = next(it) if norm is not None else None
        lo = next(it) if loss is not None else None
        agreed = self.dist.decide(vals[n:]) if self.dist is not None else None
        return g, lo, agreed

    def _seal(self, rec: StepRecord) -> None:
        """End-of-step bookkeeping: learn which buffers change in a step and whether the loop
        modified a batch tensor in place (then switch to copying)."""
        if self._mutable_buffers is None:
            # the version counter alone misses BatchNorm's running stats: native_batch_norm writes
            # them inside the kernel without bumping it. The first step copied every buffer, so
            # compare values too (once; NaN compares unequal, which errs on the side of copying).
            # Buffers of at most _SMALL_BUFFER bytes are copied every step whatever step 0 showed:
            # running stats in a branch step 0 did not take change later, invisibly to the version
            # counter, and copying them costs little. Larger ones (masks, rotary caches) are
            # referenced unless step 0 changed them.
            start = rec.buffers or {}
            self._mutable_buffers = {
                n for n, b in self.model.named_buffers()
                if b.numel() * b.element_size() <= _SMALL_BUFFER
                or b._version != self._buffer_versions.get(n) or not _same_tensor(b, start.get(n))
            }
        if self.config.copy_batch is None and not self._copy and any(not r.fresh() for r in self._refs):
            self._copy = True
            logger.info("nanreplay: a batch tensor was modified in place during the step; batches are copied from now on")

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.end_step()

    def end_step(self) -> None:
        """Close the step in progress: the next forward or :meth:`record` starts step
        ``self.step + 1``. The optimizer step post-hook calls it."""
        pre, self._pre_update = self._pre_update, None
        rec = self._current
        self._verify_skip()
        self.step += 1
        self._current = None
        self._pending_loss = None
        self._evict()
        if pre is not None and rec is not None and self._check_update(rec, pre):
            self._release(pre)  # only a finite step's copy goes back to the pool: a restored one may be aliased

    def _verify_skip(self) -> None:
        """After a skipped step: the version counters prove the optimizer left every parameter
        alone. Torch's optimizers skip parameters whose ``.grad`` is ``None``; one that updates
        parameters regardless (weight decay on every parameter, a custom rule) is named."""
        if not self._skip_versions:
            return
        changed = [self._param_fqn.get(id(p), "?") for p, v in self._skip_versions if p._version != v]
        self._skip_versions = []
        if changed:
            logger.warning(
                "nanreplay: action='skip' dropped the gradients of step %d, but %s changed %d parameter(s) anyway "
                "(e.g. %s): this optimizer updates parameters without gradients, so the skip did not leave the "
                "weights as they were; use action='raise' with it",
                self.step, type(self.optimizer).__name__, len(changed), changed[:3],
            )

    def _check_update(self, rec: StepRecord, pre: Snapshot) -> bool:
        """``check_update``: one fused norm over the updated parameters and floating optimizer
        state, one host read; on a non-finite update, restore ``pre`` (unless ``warn``), dump
        and diagnose, then act. Returns ``True`` when the update was finite."""
        state = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and is_float(v) and v.numel() > 1]
        params = [p.detach() for g in self.optimizer.param_groups for p in g["params"]]
        norm = fused_norm(params + state)
        if norm is None or math.isfinite(norm.item()):
            return True
        post = self.snapshot_state(clone=True) if self.config.action == "warn" else None
        self._restore(pre)
        grads = self._grads()
        self.nonfinite_steps.append(rec.step)
        path = None
        if len(self.bundles) < self.config.max_dumps:
            path = self._dump(rec, grads, False, False, state=pre, update=True)
        summary = (self.last_diagnosis or {}).get("summary")
        msg = (
            f"non-finite weights or optimizer state after the update of step {rec.step} (the gradients were finite, grad norm {rec.grad_norm})"
            + (f"; bundle: {path}" if path else "")
            + (f"; diagnosis: {summary.rstrip('.')}" if summary else "")
        )
        if self.config.action == "raise":
            raise NonFiniteGradientError(msg + "; the pre-step weights and optimizer state were restored", step=rec.step,
                                         bundle_path=str(path) if path else None, diagnosis=self.last_diagnosis)
        if self.config.action == "warn":
            self._restore(post)
            logger.warning("nanreplay: %s; the update is kept (action='warn')", msg)
            return False
        logger.warning("nanreplay: %s; the update was undone (action='skip')", msg)
        return False

    def _restore(self, snap: Optional[Snapshot]) -> None:
        """Copy a cloned snapshot back into the live model and optimizer."""
        if snap is None:
            return
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in snap.params:
                    p.copy_(snap.params[n])
        if snap.optimizer is not None:
            self.optimizer.load_state_dict(snap.optimizer)

    # -- weight snapshots in recycled slots -------------------------------------------------------
    def _take_snapshot(self) -> Snapshot:
        """A step-start copy of the weights, buffers and optimizer state, copied with one
        ``torch._foreach_copy_`` into a slot recycled from an evicted snapshot when one of the
        same layout is free (else freshly cloned). Costs one read and one write of the state's
        bytes, no allocation in steady state, no sync."""
        live = self.snapshot_state(clone=False)
        leaves, spec = pytree.tree_flatten((live.params, live.buffers, live.optimizer))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        key = _layout(spec, tensors)
        slot = next((s for s in self._free_slots if s.key == key), None)
        if slot is not None:
            self._free_slots.remove(slot)
            copy_all(slot.tensors, tensors)
        else:
            slot = _Slot(key, [t.clone() for t in tensors])
        it = iter(slot.tensors)
        params, buffers, opt = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        extra = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, live.extra)
        return _SlotSnapshot(params=params, buffers=buffers, optimizer=opt, extra=extra, slot=slot)

    def _release(self, snap: Optional[Snapshot], *, reuse: bool = True) -> None:
        """Give an evicted snapshot's tensors back for reuse (one free slot is kept); with
        ``reuse=False`` (dropped to honour ``memory_budget``) they are freed instead."""
        if isinstance(snap, _SlotSnapshot) and snap.slot is not None:
            if reuse:
                self._free_slots[:] = [snap.slot]
            snap.slot = None

    def _capacity(self) -> int:
        # unchecked steps (check_every > 1) come on top of the steps asked for
        return self.config.capacity + self.config.check_every - 1

    def _drop_oldest(self, *, reuse: bool = True) -> StepRecord:
        r = self.ring.popleft()
        self._release(r.snapshot, reuse=reuse)
        self._held_cache.pop(r.step, None)
        self._step_refs.pop(r.step, None)
        return r

    # -- the sync-free check (check_every > 1) ------------------------------------------------------
    def _check_lagged(self, rec: StepRecord) -> None:
        """Step pre-hook with ``check_every > 1``: keep this step's grad norm and loss on the
        device, move the latch (copy this step's pre-step state and gradients into the slot unless
        an earlier unchecked step was non-finite), and read every pending verdict on the host
        once every ``check_every`` steps."""
        grads = self._grads()
        rec._norm_t = fused_norm([g for _, g in grads])  # type: ignore[attr-defined]
        loss = self._pending_loss if self.config.check_loss else None
        self._pending_loss = None
        rec._loss_t = loss  # type: ignore[attr-defined]
        bad = _nonfinite_flag(rec._norm_t, loss)  # type: ignore[attr-defined]
        if bad is not None:
            if self._latch is None:
                self._latch = _Latch()
            self._latch.update(self, rec, grads, bad)
        self._pending.append(rec)
        self._seal(rec)
        if len(self._pending) >= self.config.check_every:
            self._check_pending(final=False)

    def _check_pending(self, *, final: bool) -> None:
        """Read the pending verdicts (one host sync) and handle the first non-finite step."""
        pending, self._pending = self._pending, []
        vals = []
        for r in pending:
            for t in (getattr(r, "_norm_t", None), getattr(r, "_loss_t", None)):
                if t is not None:
                    vals.append(t.detach().reshape(()).to(torch.float32))
        host = iter(torch.stack([v.to(vals[0].device) for v in vals]).tolist() if vals else [])  # the one sync
        first: Optional[StepRecord] = None
        for r in pending:
            r.grad_norm = next(host) if getattr(r, "_norm_t", None) is not None else None
            r.loss = next(host) if getattr(r, "_loss_t", None) is not None else None
            r._norm_t = r._loss_t = None  # type: ignore[attr-defined]
            bad = any(v is not None and not math.isfinite(v) for v in (r.grad_norm, r.loss))
            r.finite = not bad
            if bad and first is None:
                first = r
        latch = self._latch
        if first is None:
            self.skipped = 0
            if latch is not None:
                latch.reset()
            return
        after = False
        for r in pending:
            if after:
                r.finite = None  # ran on corrupted weights: its verdict says nothing
            after = after or r is first
        assert latch is not None, "a non-finite step has gone through the latch"
        live_sd = self.optimizer.state_dict()
        state = latch.snapshot(self, live_sd, first)
        restore = self.config.action in ("raise", "skip")
        if restore or self.config.diagnose:
            saved = None if restore else self.snapshot_state(clone=True)
            self._load_state(state)
        bad_grad = first.grad_norm is not None and not math.isfinite(first.grad_norm)
        bad_loss = first.loss is not None and not math.isfinite(first.loss)
        try:
            if final:
                self.nonfinite_steps.append(first.step)
                if len(self.bundles) < self.config.max_dumps:
                    self._dump(first, latch.grad_list(), bad_grad, bad_loss, state=state)
                return
            self._handle_nonfinite(first, latch.grad_list(), bad_grad, bad_loss, state=state)
        finally:
            if not restore and self.config.diagnose:
                self._load_state(saved)
            latch.reset()

    def _load_state(self, snap: Snapshot) -> None:
        """Copy a snapshot's weights, buffers and optimizer state tensors into the live ones, in place
        (the live tensors never alias the snapshot's, which may be a reused slot)."""
        live = dict(self.model.named_parameters())
        dst = [live[n].detach() for n in snap.params]
        src = list(snap.params.values())
        bufs = dict(self.model.named_buffers())
        for n, b in snap.buffers.items():
            if n in bufs and bufs[n] is not b:
                dst.append(bufs[n])
                src.append(b)
        if snap.optimizer is not None:
            dst += [t for t in pytree.tree_leaves(self.optimizer.state_dict()["state"]) if isinstance(t, torch.Tensor)]
            src += [t for t in pytree.tree_leaves(snap.optimizer["state"]) if isinstance(t, torch.Tensor)]
        if len(dst) != len(src):
            raise RuntimeError(f"nanreplay: cannot put back the saved state: {len(src)} tensors saved, {len(dst)} live")
        with torch.no_grad():
            copy_all(dst, src)

    # -- the non-finite path -------------------------------------------------------------------
    def snapshot_state(self, *, clone: bool) -> Snapshot:
        """The model's weights and buffers and the optimizer's state now (references, or copies
        with ``clone=True``)."""
        cp = (lambda t: t.detach().clone()) if clone else (lambda t: t.detach())
        opt_sd = self.optimizer.state_dict()
        if clone:
            opt_sd = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, opt_sd)
        extra = {}
        if self._amp is not None:
            extra["scaler"] = self._amp.state_for_bundle()
        elif self.scaler is not None and hasattr(self.scaler, "state_dict"):
            extra["scaler"] = self.scaler.state_dict()
        return Snapshot(
            params={n: cp(p) for n, p in self.model.named_parameters()},
            buffers={n: cp(b) for n, b in self.model.named_buffers()},
            optimizer=opt_sd,
            extra=extra,
        )

    def _handle_nonfinite(
        self,
        rec: StepRecord,
        grads: list,
        bad_grad: bool,
        bad_loss: bool,
        *,
        cause: Optional[dict] = None,
        state: Optional[Snapshot] = None,
    ) -> None:
        """``cause``: JSON merged into the bundle's ``reason``; its ``"message"`` replaces the
        opening words of the error message (used for GradScaler and cross-rank decisions).
        ``state``: the pre-step state to write when it is no longer in the model (sync-free mode)."""
        self.nonfinite_steps.append(rec.step)
        action = self.config.action
        first = len(self.bundles) < self.config.max_dumps and (action == "raise" or self.skipped == 0)
        cause = dict(cause or {})
        if self.dist is not None:
            cause = {**self.dist.reason(), **cause}
        if self._amp is not None:
            cause = {**self._amp.reason(bad_grad), **cause}
        path: Optional[Path] = None
        if first:
            path = self._dump(rec, grads, bad_grad, bad_loss, cause, state=state)
        what = " and ".join(w for w, b in (("gradients", bad_grad), ("loss", bad_loss)) if b) or "values on another rank"
        summary = (self.last_diagnosis or {}).get("summary") if first else None
        head = cause.get("message") or f"non-finite {what}"
        msg = (
            f"{head} at step {rec.step} (grad norm {rec.grad_norm}, loss {rec.loss})"
            + (f"; bundle: {path}" if path else "; no bundle written" if first else "")
            + (f"; diagnosis: {summary.rstrip('.')}" if summary else "")
            + (f"; replay it with: nanreplay replay {path}" if path else "")
        )
        if action == "warn":
            logger.warning("nanreplay: %s; the step proceeds (action='warn')", msg)
            return
        if state is None:  # with check_every > 1, _check_pending already put back the whole pre-step state
            self._restore_buffers(rec)
        if action == "raise":
            raise NonFiniteGradientError(msg, step=rec.step, bundle_path=str(path) if path else None, diagnosis=self.last_diagnosis)
        # skip: drop the gradients so the optimizer leaves weights and state untouched
        self.skipped += 1
        if self.skipped > self.config.max_consecutive:
            raise NonFiniteGradientError(
                f"{msg}; {self.skipped} consecutive steps skipped, more than max_consecutive="
                f"{self.config.max_consecutive}: training is not recovering",
                step=rec.step,
                bundle_path=str(self.bundles[0]) if self.bundles else None,
                diagnosis=self.last_diagnosis,
            )
        logger.warning("nanreplay: %s; skipping this optimizer step (%d in a row)", msg, self.skipped)
        self._skip_versions = [(p, p._version) for g in self.optimizer.param_groups for p in g["params"]]
        # with check_every > 1, _check_pending already put back step rec's pre-step state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _restore_buffers(self, rec: StepRecord) -> None:
        """Put back the step-start buffers of a step that is skipped or raised on: its forward
        already wrote them (BatchNorm's running stats, from a NaN batch, stay NaN for good)."""
        load_buffers(self.model, rec.buffers or {})

    def bundle_content(self, rec: StepRecord, grads: list, reason: dict, state: Optional[Snapshot] = None) -> BundleContent:
        """The content of the bundle for the failing step ``rec`` (references; nothing is copied).
        ``state``: the pre-step state when it is no longer the live one (``check_update``,
        ``check_every > 1``); it is copied shallowly, never modified."""
        state = self.snapshot_state(clone=False) if state is None else dataclasses.replace(state)
        if rec.buffers is not None:
            state.buffers = dict(rec.buffers)   # step-start values, not the post-forward ones
        grad_tensors = {n: g.detach() for n, g in grads}
        if self.dist is not None:
            grad_tensors = self.dist.local_grads(grads, grad_tensors)
        steps = [r for r in self.ring if r.step <= rec.step]
        for r in steps:
            r.lrs = [float(x) for x in r.lrs]  # tensor learning rates are read on the host here, not per step
            # a reference whose version counter moved no longer holds what the step saw
            r.stale_inputs = any(not ref.fresh() for ref in self._step_refs.get(r.step, ()))
            if r.stale_inputs:
                logger.warning("nanreplay: step %d's inputs were modified in place after capture; the bundle marks them stale", r.step)
        group_fqns = [[self._param_fqn.get(id(p), "") for p in g["params"]] for g in self.optimizer.param_groups]
        return BundleContent(
            failing_step=rec.step,
            steps=steps,
            state=state,
            grads=grad_tensors,
            model_info=model_info(self.model),
            optimizer_info={
                "class": callable_path(type(self.optimizer)),
                "param_groups_fqns": group_fqns,
                "defaults": {k: jsonable(v) for k, v in self.optimizer.defaults.items()},
            },
            reason=reason,
            model_factory=self.model_factory_path,
            loss_fn=self.loss_fn_path,
            extra_meta={"replay_options": {"allow_nonfinite": [str(r) for r in self.config.allow_nonfinite]}, **self.extra_meta},
        )

    def _dump(self, rec: StepRecord, grads: list, bad_grad: bool, bad_loss: bool, cause: Optional[dict] = None, *, state: Optional[Snapshot] = None, update: bool = False) -> Optional[Path]:
        t0 = time.perf_counter()
        reason = {
            "nonfinite_grad": bad_grad,
            "nonfinite_loss": bad_loss,
            "nonfinite_update": update,
            "grad_norm": fnum(rec.grad_norm),
            "loss": fnum(rec.loss),
            "action": self.config.action,
            **(cause or {}),
        }
        try:
            content = self.bundle_content(rec, grads, reason, state)
        except Exception:  # never let the recorder kill training by itself
            logger.exception("nanreplay: could not assemble the bundle for step %d", rec.step)
            return None
        if self.config.diagnose:
            try:
                from ..diagnosis.api import diagnose_live

                self._replaying = True  # keep this recorder's own hooks quiet during the replay
                try:
                    content.diagnosis = diagnose_live(self.model, content, loss_fn=self.loss_fn, allow=self.config.allow_nonfinite)
                finally:
                    self._replaying = False
                if self.dist is not None:
                    self.dist.annotate(content.diagnosis)
                self.last_diagnosis = content.diagnosis
            except Exception:
                logger.exception("nanreplay: in-process diagnosis of step %d failed; the bundle is written without it", rec.step)
        ext = ".h5" if self.config.bundle_format == "h5" else ".safetensors"
        path = Path(self.config.out_dir) / f"nanreplay-step{rec.step}{self._name_suffix()}{ext}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            written = write_bundle(path, content)
        except Exception:
            logger.exception("nanreplay: could not write the bundle for step %d to %s; training goes on", rec.step, path)
            return None
        self.bundles.append(written)
        logger.warning("nanreplay: wrote %s for non-finite step %d in %.2f s", written, rec.step, time.perf_counter() - t0)
        return written

    def _name_suffix(self) -> str:
        return self.dist.name_suffix() if self.dist is not None else ""

    def held_bytes(self) -> int:
        """Bytes the ring buffer holds beyond what training holds anyway, as counted against
        ``memory_budget``: copied batches, kept cotangents, weight snapshots and copied
        step-start buffers, summed over the steps held. Host cost: a walk over the ring's
        tensors, no device sync."""
        n = sum(self._held(r) for r in self.ring)
        n += sum(_tensor_bytes(s.tensors) for s in self._free_slots)
        return n + (self._latch.nbytes() if self._latch is not None else 0)

    def _held(self, r: StepRecord) -> int:
        """Bytes step ``r`` keeps alive beyond what training holds anyway: its batches and forward
        inputs (referenced or copied: a reference keeps the loader's tensor alive too), its
        cotangents, its copied buffers and its snapshot. Cached once the step is over (its
        content no longer changes); the snapshot is counted apart, since eviction drops it first."""
        n = self._held_cache.get(r.step) if r is not self._current else None
        if n is None:
            n = sum(_nbytes(fw.inputs) for fw in r.forwards) + _nbytes(r.batches)
            n += sum(_nbytes(fw.cotangent) for fw in r.forwards if fw.cotangent is not None)
            if r.buffers:
                live = {n_: b for n_, b in self.model.named_buffers()}
                n += sum(t.numel() * t.element_size() for k, t in r.buffers.items() if live.get(k) is not t)
            if r is not self._current:
                self._held_cache[r.step] = n
        return n + (r.snapshot.nbytes() if r.snapshot is not None else 0)

    def _evict(self) -> None:
        """Keep the ring buffer within ``capacity`` steps and ``memory_budget`` bytes."""
        while len(self.ring) > self._capacity():
            self._drop_oldest()
        held = self._held
        budget = self.config.memory_budget
        total = sum(held(r) for r in self.ring)
        for r in list(self.ring)[:-1]:  # oldest snapshots first
            if total <= budget:
                return
            if r.snapshot is not None:
                total -= r.snapshot.nbytes()
                self._release(r.snapshot, reuse=False)
                r.snapshot = None
        pending = {id(r) for r in self._pending}  # unchecked steps are never evicted
        while total > budget and len(self.ring) > 1 and id(self.ring[0]) not in pending:
            total -= held(self._drop_oldest(reuse=False))
        if total > budget and self.ring:
            r = self.ring[-1]
            if r.snapshot is not None:
                self._release(r.snapshot, reuse=False)
                r.snapshot = None
                logger.warning("nanreplay: one weight snapshot exceeds memory_budget=%d bytes; snapshots are off", budget)


def _lr_value(lr: Any) -> Any:
    """A param group's learning rate as kept in the ring buffer: a float as is; a tensor (fused
    or capturable optimizers, some schedulers) as a detached copy on its device, because
    ``float()`` of a CUDA tensor would be a host sync every step. Converted at dump time."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)


def model_info(model: torch.nn.Module) -> dict:
    """Architecture facts stored in the bundle and checked by replay: class, parameter and buffer
    FQNs with shape/dtype/device, and every module's FQN and class."""
    return {
        "class": callable_path(type(model)),
        "params": {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device)} for n, p in model.named_parameters()},
        "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", ""), "device": str(b.device)} for n, b in model.named_buffers()},
        "modules": [[n, type(m).__name__] for n, m in model.named_modules()],
    }


def _autocast_state(*trees: Any) -> Optional[dict]:
    """``{"device_type", "dtype"}`` of the autocast region the model's forward runs in, or
    ``None`` outside autocast; replay runs the step under the same autocast."""
    kinds = ["cpu"] + [t.device.type for t in pytree.tree_leaves(trees) if isinstance(t, torch.Tensor) and t.device.type != "cpu"][:1]
    for dev in reversed(kinds):
        try:
            if torch.is_autocast_enabled(dev):
                return {"device_type": dev, "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", "")}
        except (TypeError, RuntimeError):  # a device type this torch has no autocast for
            continue
    return None


def _same_tensor(live: torch.Tensor, saved: Optional[torch.Tensor]) -> bool:
    """Whether ``saved`` (a step-start copy) still equals ``live``: same shape, dtype and values."""
    return saved is not None and saved is not live and saved.shape == live.shape and saved.dtype == live.dtype and torch.equal(saved, live.detach())


def _tensor_bytes(ts: list) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _layout(spec: Any, tensors: list) -> tuple:
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))


def _nonfinite_flag(norm: Optional[torch.Tensor], loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 0-dim bool device tensor: True when the grad norm or the loss is non-finite. No sync."""
    flags = [torch.logical_not(torch.isfinite(t.detach().reshape(()))) for t in (norm, loss) if t is not None]
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = out | f.to(out.device)
    return out


@dataclass
class _Slot:
    """Preallocated tensors of one snapshot layout (``key``), recycled between snapshots."""

    key: tuple
    tensors: list


@dataclass
class _SlotSnapshot(Snapshot):
    slot: Optional[_Slot] = None


class _Latch:
    """The sync-free mode's device-side evidence: the pre-step params, optimizer state tensors
    and gradients of the first non-finite step since the last host check.

    Every step, before its update: ``slot = where(latched, slot, live)`` for each tensor, then
    ``latched |= bad``. So the slot follows the live state until a non-finite step, holds that
    step's values from then on, and the host never has to look in between. The layout of the
    live state (params with and without gradients, optimizer state tensors created lazily on the
    first step) may change while the latch is open; the slot is then reallocated, which is only
    right while nothing has latched, so a layout change also reads the latch (the one case that
    syncs between checks: the first step of a fresh optimizer, and the first after a param starts
    receiving gradients).
    """

    def __init__(self) -> None:
        self.latched: Optional[torch.Tensor] = None  # 0-dim bool, device
        self.key: Optional[tuple] = None
        self.names: list[str] = []
        self.live_spec: Any = None
        self.params: list[torch.Tensor] = []
        self.opt: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []

    def update(self, recorder: "Recorder", rec: StepRecord, grads: list, bad: torch.Tensor) -> None:
        params = [(n, p.detach()) for n, p in recorder.model.named_parameters()]
        opt_leaves, opt_spec = pytree.tree_flatten(recorder.optimizer.state_dict()["state"])
        opt_t = [t for t in opt_leaves if isinstance(t, torch.Tensor)]
        g = [t for _, t in grads]
        key = (tuple(n for n, _ in params), _layout(opt_spec, opt_t), tuple(n for n, _ in grads), _layout(None, g))
        dev = bad.device
        if key != self.key:
            if self.latched is not None and bool(self.latched):  # layout change after a latch: keep it frozen
                self.latched = self.latched | bad
                return
            self.key, self.names, self.live_spec = key, [n for n, _ in grads], opt_spec
            self.params = [p.clone() for _, p in params]
            self.opt = [t.clone() for t in opt_t]
            self.grads = [t.detach().clone() for t in g]
            self.latched = torch.zeros((), dtype=torch.bool, device=dev)
        else:
            keep = self.latched
            for dst, src in zip(self.params + self.opt + self.grads, [p for _, p in params] + opt_t + g):
                torch.where(keep.to(dst.device), dst, src.detach(), out=dst)
        self.latched = self.latched | bad

    def reset(self) -> None:
        """Open the latch again after a host check; the slot's tensors are kept for reuse."""
        if self.latched is not None:
            self.latched = torch.zeros_like(self.latched)

    def snapshot(self, recorder: "Recorder", live_sd: dict, rec: StepRecord) -> Snapshot:
        """The latched step's pre-step state as a Snapshot (params, buffers from the ring record,
        optimizer state with the slot's tensors and the live non-tensor entries, lrs of ``rec``)."""
        names = self.key[0] if self.key else ()
        leaves, spec = pytree.tree_flatten(live_sd["state"])
        it = iter(self.opt)
        state = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        groups = [dict(gr) for gr in live_sd["param_groups"]]
        for gr, lr in zip(groups, rec.lrs):
            gr["lr"] = lr
        return Snapshot(
            params=dict(zip(names, self.params)),
            buffers=dict(rec.buffers or {}),
            optimizer={"state": state, "param_groups": groups},
            extra={},
        )

    def grad_list(self) -> list:
        return list(zip(self.names, self.grads))

    def nbytes(self) -> int:
        return _tensor_bytes(self.params + self.opt + self.grads)
