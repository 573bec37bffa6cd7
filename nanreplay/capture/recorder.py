"""The Recorder: attaches to a live training loop, keeps a ring buffer of the last steps, and on
the first non-finite gradient (or loss) dumps a self-contained bundle and diagnoses it.

It coordinates rooms with one job each. The walk of a step, default options:

1. a forward (or :meth:`Recorder.record`) begins the step (:mod:`~nanreplay.capture.steps`): RNG
   states (host only, copied only when they moved: :class:`~nanreplay.core.rng.RNGReader`),
   step-start buffers (:mod:`~nanreplay.capture.snapshots`), a
   :class:`StepRecord` in the ring buffer (:mod:`~nanreplay.capture.ring`, which evicts to stay
   within ``memory_budget``); the forward tap (:mod:`~nanreplay.capture.forward`) calls it to keep
   the inputs (:mod:`~nanreplay.capture.inputs`: by reference while safe) and a hook on each output
   for the cotangent;
2. the optimizer's step pre-hook checks: one fused ``_foreach_norm``, one host read
   (:mod:`~nanreplay.capture.check`; with ``check_every > 1`` none,
   :mod:`~nanreplay.capture.lagged`; with ``check_update`` a pre-step copy,
   :mod:`~nanreplay.capture.update`);
3. on a non-finite step: the dump (:mod:`~nanreplay.capture.dump`: bundle, program, in-process
   diagnosis), then the action (:data:`nanreplay.capture.actions.ACTIONS`: raise, skip, warn);
   a finite step goes to the early warning and the rollback plan
   (:class:`~nanreplay.capture.early.SpikeWatch`);
4. the step post-hook ends the step (the update check, :func:`~nanreplay.capture.update.check_update`; eviction).

Nothing is copied on the device per step unless ``snapshot_every`` asks for weight snapshots:
the failing step's pre-step state is still in place when the pre-hook fires. On the host a step
costs about 85-100 microseconds on a small CPU model at that machine's usual speed, 105-125 in its
slow phases (``bench/README.md``; ``bench/hostcost.py`` compares revisions side by side; half a
microsecond to a microsecond per Python call nanreplay makes in a training step, so the hot path
makes few), whatever the number of modules and parameters (beyond the fused norm's gradient
list): nothing walks the module tree or the held steps per step (``bench/overhead.py`` measures it;
``tests/capture/test_hot_path.py`` checks its structure). Nothing is done at start-up beyond one
scan of the weights: the program is exported when a step fails (``export_early``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from itertools import chain
from operator import attrgetter, is_not, itemgetter
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.callables import callable_path, callable_record, import_callable
from ..core.numerics import combined_norm, fused_norm, tensor_norms
from ..core.state import load_buffers
from ..format.records import BundleContent, Snapshot, StepRecord
from .actions import ACTIONS, Actions, Incident
from .config import RecorderConfig
from .dump import Dump, check_out_dir, model_info
from .early import ScalarHistory, SpikeWatch
from .check import HOST_NORMS, explosion, lr_value, nonfinite_micro_batch, read_check, read_norms
from .forward import ForwardTap, unwrap_model, unwrap_optimizer
from .inputs import InputCapture
from .lagged import LaggedCheck, advise, can_freeze, check_combination
from .ring import RingBuffer, check_budget
from .sharded import is_sharded, local
from .compiled import compile_state
from .settings import run_config
from .snapshots import attach_scan, live_state
from .steps import StepStart
from .update import UpdateCheck, check_update

logger = logging.getLogger(__name__)

__all__ = ["Recorder", "RecorderConfig", "model_info", "WAIT_STEPS", "WAIT_SECONDS"]

_PARAMS, _GRAD, _LR = itemgetter("params"), attrgetter("grad"), itemgetter("lr")
_NOT_NONE = partial(is_not, None)  # a gradient that exists

#: most finite steps whose scalar history and early warning wait to be taken in together (:meth:`Recorder._digest`)
WAIT_STEPS = 64
#: most seconds the oldest of them waits (a slow step is taken in at once)
WAIT_SECONDS = 1.0


class Recorder:
    """Records a training loop and dumps a bundle on the first non-finite gradient.

    Args:
        model: the ``nn.Module`` being trained (the top-level one whose forward the loop calls),
            its ``DistributedDataParallel`` wrapper (the Recorder then takes its decisions together
            with every rank, see :mod:`nanreplay.capture.ddp`, and finds the rank where the
            non-finite value was born), an FSDP2 (``fully_shard``) or tensor-parallel model with
            ``DTensor`` parameters (the Recorder reads only local shards; each rank writes its
            shards; see :mod:`nanreplay.capture.sharded` and ``docs/distributed.md``; every rank
            must build its Recorder), or a compiled model (``torch.compile(model)`` or after
            ``model.compile()``: the capture runs outside the compiled region, adding no graph
            break). Names are always the unwrapped module's (no ``module.`` / ``_orig_mod.``
            prefix), so the bundle replays on a plain model. Under ``torch.distributed`` without
            DDP the agreement still happens; bundles are named ``...-rank{r}of{w}``.
        optimizer: its ``torch.optim.Optimizer``; the check runs in its step pre-hook.
        loss_fn: optional ``loss_fn(model, batch) -> loss`` (scalar tensor) computing the loss
            from a batch given to :meth:`record`; a callable, or its import path
            ``"pkg.mod:fn"`` / ``"/path/file.py:fn"`` (a ``functools.partial`` of an importable
            function is recorded with its JSON keyword arguments, ``meta["loss_fn_kwargs"]``).
            With it, replay re-runs the whole step; without it, replay drives the backward pass
            with the recorded cotangent.
        model_factory: optional zero-argument callable (or import path) returning a fresh model
            of the same architecture, for ``nanreplay replay`` in another process.
        scaler: optional ``torch.amp.GradScaler``. Steps it skips for Inf/NaN gradients while
            its scale is large and falling are normal and only counted (:attr:`scaler_skips`); a
            non-finite loss, gradients still non-finite at a scale at or below ``min_scale``, or a
            scale that stopped falling are failures (:mod:`nanreplay.capture.amp`). Its scale is
            followed per step (the scalar history) and its state saved in the bundle and
            restored by replay.
        config: a :class:`RecorderConfig`; keyword ``options`` override its fields.

    Use as a context manager (``with Recorder(model, opt) as rec:``) or call :meth:`close`.

    Memory: ``memory_budget`` caps everything the Recorder keeps, in every mode (the ring buffer
    counts it all and evicts). A budget below the copy ``check_update`` or ``check_every > 1``
    needs raises ``ValueError`` here, naming the minimum; if the optimizer's state, created at its
    first step, makes that copy outgrow the budget, the mode is turned off then, with a warning.

    Random streams: per-step capture only reads the RNG states (it never advances a generator),
    and the Recorder's own random work at a dump (program check, in-process diagnosis) draws
    from private generators when other threads are alive (:class:`~nanreplay.core.rng.ReplayRNG`),
    so training threads, this one included, see the same draws as without nanreplay. Limits with
    other threads alive: a model or loss function that draws from Python's ``random`` or NumPy's
    global generator in ``forward`` is replayed with other numbers and advances those shared
    streams; on CUDA, attention kernels with built-in dropout draw from the device's generator.

    Example::

        with Recorder(model, opt, loss_fn=step_loss) as rec:
            for x, y in loader:
                rec.record((x, y))             # optional: the batch the loss needs
                loss = step_loss(model, (x, y))
                rec.log_loss(loss)             # optional: check the loss too
                loss.backward(); opt.step(); opt.zero_grad()

    Attributes:
        step: index of the step in progress (``step_offset`` plus the count of ``optimizer.step()`` calls seen).
        ring: the ring buffer, a sequence of :class:`~nanreplay.format.records.StepRecord`.
        bundles: paths of the bundles written so far.
        nonfinite_steps: the steps found non-finite so far (a GradScaler's routine skips are not).
        episode: the current non-finite episode (:mod:`nanreplay.capture.episode`), else ``None``.
        should_rollback, weights_corrupted: see below.
        last_diagnosis: the diagnosis dict of the last in-process diagnosis, else ``None``.
        extra_meta: JSON merged into every bundle's metadata (integrations put theirs here).

    Raises:
        NonFiniteGradientError: from ``optimizer.step()``, with ``action="raise"``.
        TypeError / ValueError: bad arguments or options; ``out_dir`` is not a writable directory.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: Any = None, model_factory: Any = None,
                 scaler: Any = None, config: Optional[RecorderConfig] = None, **options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        optimizer = unwrap_optimizer(optimizer)
        cfg = config or RecorderConfig()
        self.config = dataclasses.replace(cfg, **options) if options else cfg
        check_out_dir(self.config.out_dir)
        self.wrapper = model
        self.model = unwrap_model(model)
        self.optimizer = optimizer
        self.scaler = scaler
        self.loss_fn = import_callable(loss_fn) if isinstance(loss_fn, str) else loss_fn
        self.loss_fn_path, loss_kwargs = callable_record(loss_fn)  # a partial: its function and JSON keyword arguments
        self.model_factory_path = callable_path(model_factory)
        self._param_fqn = {id(p): n for n, p in self.model.named_parameters()}
        self._sharded = is_sharded(self.model)  # DTensor parameters: their gradients are read as local shards
        check_combination(self.config, scaler=scaler)
        advise(self.config, self.model, scaler=scaler)
        check_budget(self.config, self.model, optimizer)

        # what the ring buffer keeps (all of the memory budget), and the modes that add to it
        self._inputs = InputCapture(self.config.copy_batch)
        self.ring = RingBuffer(self.config.capacity + self.config.check_every - 1, self.config.memory_budget,
                               model=self.model, inputs=self._inputs)
        self._lagged = (LaggedCheck(self.config.check_every, self.ring, freeze=can_freeze(optimizer) and ACTIONS[self.config.action].restores)
                        if self.config.check_every > 1 else None)
        self._update = UpdateCheck(self.ring) if self.config.check_update else None

        # the step in progress and the outcomes so far
        self.step = self.config.step_offset
        self._pending_loss: Optional[torch.Tensor] = None  # the step's loss so far: the sum of its micro-batches' losses
        self._micro_losses: list[torch.Tensor] = []        # each micro-batch's loss, for the index of a non-finite one
        self._pending_grad_norm: Any = None  # log_grad_norm: the norm before clipping, read with the check
        self.nonfinite_steps: list[int] = []
        self.extra_meta: dict[str, Any] = {}
        self.extra_meta["attach_scan"] = attach_scan(self.model, self.step)
        self._loss_dtype: Any = None
        if loss_kwargs:
            self.extra_meta["loss_fn_kwargs"] = loss_kwargs
        self._closed = False

        # hooks, each behind a handle this Recorder owns
        self._handles: list[Any] = []
        from .ddp import RankContext

        self.dist = RankContext.for_recorder(model, self.model, self.config, param_fqn=self._param_fqn, optimizer=optimizer, active=lambda: not (self._closed or self._dump.replaying),
                                             step=lambda: self.step, cotangents=lambda: [c for fw in (self._current.forwards if self._current else []) for c in pytree.tree_leaves(fw.cotangent)])
        self._dump = Dump(self.model, optimizer, self.config, ring=self.ring, inputs=self._inputs, loss_fn=self.loss_fn,
                          loss_fn_path=self.loss_fn_path, model_factory_path=self.model_factory_path, dist=self.dist,
                          extra_meta=self.extra_meta)
        self._actions = Actions(self.config.action, optimizer, dump=self._dump, max_consecutive=self.config.max_consecutive,
                                param_fqn=self._param_fqn)
        # the early warning and rollback plan (capture.early), and the scalar history; reached through
        # the _watch and _history properties, which first take in the finite steps still waiting
        self._spike_watch = SpikeWatch(self.config.on_spike, ring=self.ring, extra_meta=self.extra_meta, actions=self._actions, dump=self._dump,
                                 attach_step=self.step, attach_clean=not self.extra_meta["attach_scan"]["count"])
        self._actions.final_plan = self._spike_watch.final_plan  # the plan a give-up (skip past max_consecutive) carries
        self._scalars = ScalarHistory(self.config.history_steps)
        self._dump.history = self._scalars  # every dump comes after a _digest
        # finite steps waiting to be taken in together (_digest), where the early warning acts by a log line alone: host
        # values (step, loss, grad norm, lrs, norm before clipping, loss scale), nothing of their records (they may leave the ring)
        self._waiting: Optional[list[tuple]] = (
            [] if self.config.on_spike in (None, "warn") and not self.config.snapshot_every and self.config.check_every == 1 else None)
        self._waiting_since = 0.0
        self._amp = None
        if scaler is not None:
            from .amp import ScalerWatch

            self._amp = ScalerWatch(scaler, optimizer, step_open=lambda: not self._closed and self._current is not None,
                                    on_skip=self._on_scaler_skip)
            self._handles.append(self._amp)
        #: the check's usual step (:meth:`_check`): one process, no GradScaler, no update check, finite steps taken in together
        self._usual = self._waiting is not None and self.dist is None and self._amp is None and self._update is None
        self._verdict: Optional[bool] = None  # the last check's verdict (check_step returns it)
        #: a replay of a finite step runs the loss function (capture_cotangent left to auto): its cotangents are dropped
        self._cotangent_unneeded = self.config.capture_cotangent is None and self.loss_fn is not None
        self._steps = StepStart(self.model, self.ring, self._inputs, step=lambda: self.step, replay_state=self._dump,
                                snapshot_every=self.config.snapshot_every, snapshot_state=self._live, capture_cotangent=self.config.capture_cotangent)
        self._attach(model, optimizer)

    def _attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hook into the training loop, each hook behind a handle this Recorder owns: the forward
        tap on ``model`` (as given: a wrapper's call is where the capture runs eagerly), the
        optimizer's step pre-hook (the check) and post-hook (the end of the step), and under
        ``torch.distributed`` the ranks' own hooks."""
        self._tap = ForwardTap(model, self._steps.forward_pre, self._steps.forward_post)
        self._dump.compile_state = lambda: compile_state(self.wrapper, self.model, self._tap.compiled_wrapper)
        self._dump.run_config = lambda steps: run_config(self.wrapper, self.model, self.optimizer, steps)  # at the dump, never per step
        self._handles.append(self._tap)
        if self.config.check_in_optimizer_step:
            self._handles.append(optimizer.register_step_pre_hook(self._check))
        self._handles.append(optimizer.register_step_post_hook(self.end_step))
        if self.dist is not None:
            self.dist.attach_hooks(model, self.model, origin_hook=self.config.origin_hook, ring=self.ring)

    @property
    def _watch(self) -> SpikeWatch:
        """The early warning, the episode log and the rollback plan, up to date (:meth:`_digest`)."""
        self._digest()
        return self._spike_watch

    @property
    def _history(self) -> ScalarHistory:
        """The scalar history, up to date (:meth:`_digest`)."""
        self._digest()
        return self._scalars

    def _digest(self) -> None:
        """Take the finite steps that wait into the scalar history and the early warning, oldest
        first. A finite step's history row and early-warning judgement are host arithmetic on
        floats already read; in the default mode (``on_spike`` ``"warn"`` or ``None``, no weight
        snapshots, ``check_every=1``) they wait for up to :data:`WAIT_STEPS` steps or
        :data:`WAIT_SECONDS` and are done together, where the code and its data are still in the
        caches (done one step at a time right after the optimizer's step, they cost several
        times more). Everything that reads them (a non-finite step, a dump, :attr:`spikes`, the
        rollback plan, :meth:`close`) goes through here first; a spike's log line names its own
        step, up to that many steps later."""
        waiting = self._waiting
        if not waiting:
            return
        self._waiting = []
        add = self._scalars.add
        for step, loss, norm, lrs, pre_clip, scale in waiting:
            add(step, loss, norm, lrs, True, scale, pre_clip)
        self._spike_watch.judge_late([(step, loss, norm if pre_clip is None else pre_clip, lrs)
                                      for step, loss, norm, lrs, pre_clip, _ in waiting])

    @property
    def _current(self) -> Optional[StepRecord]:
        """The step in progress, else ``None``."""
        return self.ring.current

    @property
    def bundles(self) -> list[Path]:
        """Paths of the bundles written so far."""
        return self._dump.bundles

    @property
    def last_diagnosis(self) -> Optional[dict]:
        """The diagnosis dict of the last in-process diagnosis, else ``None``."""
        return self._dump.last_diagnosis

    @property
    def skipped(self) -> int:
        """Consecutive steps skipped so far (``action="skip"``)."""
        return self._actions.skipped

    @property
    def scaler_skips(self) -> int:
        """Steps the GradScaler skipped for non-finite gradients so far (0 without a scaler)."""
        return self._amp.total_skips if self._amp is not None else 0

    @property
    def episode(self) -> Optional[dict]:
        """The current non-finite episode, else ``None``: ``{"first_step", "last_step", "steps",
        "consecutive", "runs": [{"first", "last", "nonfinite", "update"}], "weights_corrupted_at"}``
        (``docs/report.md``, ``rollback.episode``): every non-finite step since the first, what
        was non-finite and whether each update was ``"applied"`` (``action="warn"``),
        ``"skipped"``, ``"skipped by the scaler"`` or ``"undone"`` (``check_update``)."""
        ep = self._watch.log.episode_at(self.step - 1) or self._watch.log.episode_at(self.step)
        return ep.to_json() if ep is not None else None

    @property
    def weights_corrupted(self) -> bool:
        """Whether the live weights took an update with non-finite values (``action="warn"``, or
        weights non-finite at attach) that nothing has undone since (:meth:`roll_back`, or a
        checkpoint registered with finite weights)."""
        return self._watch.log.weights_corrupted

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook this Recorder registered. Idempotent. With ``check_every > 1``, first
        reads the verdicts still on the device (one host sync) and dumps a bundle for a
        non-finite step among them; it logs instead of raising."""
        if self._lagged is not None and self._lagged.pending and not self._closed:
            try:
                self._check_pending(final=True)
            except Exception:  # close() runs from __exit__, often while another error propagates
                logger.exception("nanreplay: the final check on close() failed")
        if not self._closed:
            try:
                self._watch.final_plan()  # the bundle's plan covers the whole episode (one rewrite when it grew)
            except Exception:
                logger.exception("nanreplay: could not bring the bundle's rollback plan up to date on close()")
        for h in self._handles:
            h.remove()
        self._handles.clear()
        LaggedCheck.after_step(self.optimizer)  # a found_inf flag left by a step that raised
        self._steps.closed = True
        if self.dist is not None:
            self.dist.close()
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
        self._steps.batch(batch)

    def log_loss(self, loss: torch.Tensor) -> None:
        """Give the loss of a micro-batch (a scalar tensor, as it is backpropagated: divided by
        the accumulation steps where the loop divides it), once per micro-batch: a non-finite
        loss in any of them is detected, even when its gradients are finite (a mean over a
        micro-batch with no valid token is 0/0). The step's loss, kept in the ring buffer and
        the scalar history, is the sum of the micro-batches' losses (the mean loss of the
        step when each is divided by the accumulation steps); with one call per step, that
        loss. No sync: it is read together with the grad norm (one float32 add per micro-batch
        on the device); on a non-finite loss the bundle names the first micro-batch whose loss
        was non-finite (``reason["nonfinite_loss_micro_batch"]``). Its dtype sets the precision
        of the early warning's floor (:mod:`nanreplay.capture.early`)."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            if loss.dtype is not self._loss_dtype:
                self._loss_dtype = loss.dtype
                if self._watch.early is not None and loss.is_floating_point():
                    self._watch.early.eps["loss"] = torch.finfo(loss.dtype).eps
            loss = loss.detach()
            if loss.dim() or loss.dtype is not torch.float32:  # the usual 0-dim float32 loss: no view, no cast
                loss = loss.reshape(()).float()
            self._micro_losses.append(loss)
            self._pending_loss = loss if self._pending_loss is None else self._pending_loss + loss

    def log_grad_norm(self, norm: Any) -> None:
        """Give the step's grad norm *before* gradient clipping (what
        ``torch.nn.utils.clip_grad_norm_`` returns: a 0-dim tensor on the gradients' device, or a
        float), for the early warning and the scalar history. Under clipping the gradients the
        optimizer sees have a norm of at most the clip value, so the check's own norm carries no
        signal of a divergence; this one does. No sync: a tensor is read in the check's one host
        read (with ``check_every > 1`` only a float is used). The non-finite check still reads
        the gradients themselves. Call it between the backward pass and ``optimizer.step()``::

            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            rec.log_grad_norm(norm)
        """
        if isinstance(norm, torch.Tensor):
            if norm.numel() == 1:
                self._pending_grad_norm = norm.detach().reshape(())
        elif isinstance(norm, (int, float)) and not isinstance(norm, bool):
            self._pending_grad_norm = float(norm)

    def note_checkpoint(self, step: Optional[int] = None, path: Any = None) -> dict:
        """Register a checkpoint the loop saved, so the rollback plan can name it: ``step`` is the
        step whose step-start weights it holds (default :attr:`step`: the weights as they are
        now, between steps; the trainer's global step after that many updates), ``path`` where
        it is. The Recorder checks whether the weights, the optimizer state and the buffers are
        finite now (one fused ``_foreach_norm`` of their largest magnitude and one host read:
        about one read of them, once per checkpoint) and never names a checkpoint that was not,
        or that was saved after the first update with non-finite or abnormal values
        (:mod:`nanreplay.capture.episode`). Also sets ``extra_meta["last_checkpoint_step"]``.
        The Lightning and Hugging Face callbacks call it when the trainer saves.

        Returns:
            ``{"step", "path", "finite"}``.
        """
        step = self.step if step is None else int(step)
        finite = UpdateCheck.finite(self.optimizer, self.model.buffers())
        entry = self._watch.log.note_checkpoint(step, None if path is None else str(path), finite, now=self.step)
        self.extra_meta["last_checkpoint_step"] = step
        if not finite:
            logger.warning("nanreplay: the checkpoint of step %d%s holds non-finite weights or optimizer state; the rollback plan "
                           "will not name it", step, f" ({path})" if path is not None else "")
        return entry

    def held_bytes(self) -> int:
        """Bytes the Recorder holds beyond what training holds anyway, as counted against
        ``memory_budget`` (:mod:`nanreplay.capture.ring` lists them). Host cost: a running total
        (each step is counted once, as it ends), no walk and no device sync."""
        return self.ring.held_bytes()

    # -- steps ---------------------------------------------------------------------------------
    def _grad_tensors(self) -> list[torch.Tensor]:
        """The gradients :meth:`_grads` pairs with their FQNs, in the same order, without the names
        (walked by C iterators: no Python bytecode per parameter)."""
        grads = filter(_NOT_NONE, map(_GRAD, chain.from_iterable(map(_PARAMS, self.optimizer.param_groups))))
        return list(map(local, grads) if self._sharded else grads)

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        sharded, fqn = self._sharded, self._param_fqn
        return [(fqn.get(id(p)) or f"<unnamed:{id(p)}>", local(p.grad) if sharded else p.grad)  # a DTensor's local shard
                for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def check_step(self) -> Optional[bool]:
        """Check the gradients now (and the loss given to :meth:`log_loss`): one fused norm and
        one host read; under ``torch.distributed`` one small all-reduce too, so every rank takes
        the same decision. Returns ``True`` when the step is finite (on every rank), else acts
        as ``action`` says (``"raise"`` raises here) and returns ``False``; returns ``None`` with
        ``check_every > 1``, where the verdict stays on the device until the next host read.

        A step whose gradients are all finite but whose float32 2-norm overflows is an exploding
        step, not a non-finite one: it is logged with the grad-norm history (and dumped with
        ``dump_on_explosion``), and its true norm (float64) is kept in the ring buffer. Telling
        the two apart costs one more ``_foreach_norm`` (max norm) on that rare path only.

        The optimizer step pre-hook calls it; call it yourself with
        ``check_in_optimizer_step=False`` (as the Lightning callback does)."""
        self._check()
        return self._verdict

    def _check(self, *hook_args: Any) -> None:
        """:meth:`check_step`, registered as the optimizer's step pre-hook itself (``hook_args``:
        the optimizer, args and kwargs, unused; a pre-hook returns ``None``), its verdict left in
        ``_verdict``. The usual finite step (one process, no GradScaler, no ``check_update``, the
        early warning batched: ``_waiting``) is read here by :func:`~nanreplay.capture.check.read_norms`,
        without :func:`~nanreplay.capture.check.read_check`'s cases and the extra frame of a hook
        that calls :meth:`check_step` (with the changes to the capture that went with it, a few µs
        less a step on a small CPU model: ``bench/README.md``); every other step, and a non-finite one, goes on in
        :meth:`_check_rest` (a non-finite step is read there again: one more host read, on that step only)."""
        if self._closed:
            self._verdict = True
            return
        self._tap.check()
        steps = self._steps
        if steps.retained:
            steps.cotangents_in()
        rec = self.ring.current or steps.begin(capture=False)
        rec.lrs = list(map(lr_value, map(_LR, self.optimizer.param_groups)))
        norms = tensor_norms(self._grad_tensors())  # the (FQN, gradient) pairs only where a path needs them
        # the step's loss (None without one or with check_loss=False) and its micro-batches' losses, taken
        loss = self._step_loss() if self.config.check_loss else None
        micro, pre = self._micro_losses, self._pending_grad_norm
        self._pending_loss, self._micro_losses, self._pending_grad_norm = None, [], None
        # the usual step: its per-tensor norms and its loss (0-dim float32 from log_loss) on one device, one host read
        read = read_norms(norms, loss) if self._usual and norms and len(norms) <= HOST_NORMS and not isinstance(pre, torch.Tensor) else None
        if read is not None:
            rec.grad_norm, rec.loss = g, lo = read
            if math.isfinite(g) and (lo is None or math.isfinite(lo)):
                rec.grad_norm_pre_clip, rec.finite = pre, True
                steps.seal(rec)
                self._take_in(rec, None)  # waits for the next ones (_digest)
                self._actions.finite()
                if not self._dump.programs.tried:
                    self._dump.programs.early(rec, self._grads(), self._live, verify=True)
                self._verdict = True
                return
        self._verdict = self._check_rest(rec, norms, loss, micro, pre)

    def _check_rest(self, rec: StepRecord, norms: list[torch.Tensor], loss: Optional[torch.Tensor], micro: list[torch.Tensor],
                    pre: Any) -> Optional[bool]:
        """:meth:`check_step` past the loss and the norms, for every step :meth:`_check` does not
        take in itself: the sync-free mode, torch.distributed, a GradScaler, ``check_update``, a
        norm before clipping given as a tensor, and every step that is not finite (read again:
        one more host read, on that step only)."""
        if self._lagged is not None and self._check_sync_free(rec, norms, loss, pre):
            return None
        scale_t = self._amp.scale_tensor() if self._amp is not None else None
        rec.grad_norm, rec.loss, agreed, (scale, pre_t) = read_check(norms, loss, self.dist, extra=(scale_t, pre if isinstance(pre, torch.Tensor) else None))
        rec.grad_norm_pre_clip = pre if isinstance(pre, float) else pre_t
        bad_grad = rec.grad_norm is not None and not math.isfinite(rec.grad_norm)
        if bad_grad:
            self._digest()  # an exploding step's bundle holds the scalar history
            if explosion(rec, self._grads(), agreed, ring=self.ring, dump=self._dump, live=self._live, dumping=self.config.dump_on_explosion):
                bad_grad = False  # every gradient is finite: the float32 2-norm overflowed
        bad_loss = rec.loss is not None and not math.isfinite(rec.loss)
        rec.finite = not (bad_grad or bad_loss) and agreed is not False
        self._steps.seal(rec)
        waits = self._take_in(rec, scale)
        if self._amp is not None:
            self._amp.on_checked(rec.finite)
        if rec.finite:
            self._actions.finite()
            if not self._dump.programs.tried:  # export_early: the program, once, off the failing step
                self._dump.programs.early(rec, self._grads(), self._live, verify=self.dist is None and self.scaler is None)
            if self._update is not None and self._update.on:
                self._update.keep(self.snapshot_state(clone=False))
            if not waits:
                self._spike_watch.judge(rec, self._grads(), self._live, grad_norm=rec.grad_norm_pre_clip)
            return True
        self._handle_nonfinite(rec, self._grads(), bad_grad, bad_loss, cause=nonfinite_micro_batch(micro) if bad_loss else None)
        return False

    def _check_sync_free(self, rec: StepRecord, norms: list[torch.Tensor], loss: Optional[torch.Tensor], pre: Any) -> bool:
        """:meth:`check_step` with ``check_every > 1``: read the earlier steps' verdicts when due,
        then leave this step's on the device. Returns whether it did (``check_step`` then returns
        ``None``); ``False`` when the latch could not grow within the budget, the mode is off
        (:meth:`_lagged_off`) and the step is checked on the host as usual."""
        assert self._lagged is not None
        rec.grad_norm_pre_clip = pre if isinstance(pre, float) else None  # a tensor norm is not read in the sync-free mode
        # the earlier steps' verdicts first: their values are on the host by now, and this step's forward and backward
        # pass, queued, keep the device busy (reading after this step's push would wait for them)
        if self._lagged.due() and self._check_pending(final=False):
            rec.finite = None  # it ran on the weights of a non-finite episode; the action has dealt with its update
            self._steps.seal(rec)
            self._history.add(rec.step, None, None, rec.lrs, None)  # its values stay unread: no sync for them
            return True
        if self._lagged.push(rec, combined_norm(norms), loss, self.model, self.optimizer, self._grads()):
            self._steps.seal(rec)
            return True
        self._lagged_off()
        return False

    def _take_in(self, rec: StepRecord, scale: Optional[float]) -> bool:
        """Give the checked step ``rec`` to the scalar history now, or, a finite step in the default
        mode, make it wait for the next few steps' (:meth:`_digest`, which also judges it). Returns
        whether it waits (else a finite step is judged by the caller, with its gradients)."""
        waiting = self._waiting
        if rec.finite and waiting is not None:
            if not waiting:
                self._waiting_since = time.monotonic()
            waiting.append((rec.step, rec.loss, rec.grad_norm, rec.lrs, rec.grad_norm_pre_clip, scale))
            if len(waiting) >= WAIT_STEPS or time.monotonic() - self._waiting_since > WAIT_SECONDS:
                self._digest()
            return True
        self._history.add(rec.step, rec.loss, rec.grad_norm, rec.lrs, rec.finite, scale, rec.grad_norm_pre_clip)
        return False

    def _step_loss(self) -> Optional[torch.Tensor]:
        """The step's loss: the one given to :meth:`log_loss`, else the one the loop gave the
        GradScaler's ``scale()``, else ``None``."""
        if self._pending_loss is not None or self._amp is None:
            return self._pending_loss
        return self._amp.loss

    def end_step(self, *hook_args: Any) -> None:
        """Close the step in progress: the next forward or :meth:`record` starts step
        ``self.step + 1``. It is the optimizer's step post-hook (``hook_args``: the hook's
        optimizer, args and kwargs, unused)."""
        pre = self._update.take() if self._update is not None else None
        if self._steps.retained:
            self._steps.cotangents_in(final=True)
        rec = self.ring.current
        if self._cotangent_unneeded and rec is not None and rec.finite and rec.batches:
            for fw in rec.forwards:  # a replay runs the loss function: a finite step's cotangent is not needed
                fw.cotangent = None
        self._actions.verify_skip(self.step)
        if self._amp is not None:
            self._amp.end_step()
        if self._lagged is not None:
            self._lagged.after_step(self.optimizer)
        self.step += 1
        self.ring.end()
        self._pending_loss, self._micro_losses, self._pending_grad_norm = None, [], None
        if pre is not None and rec is not None and check_update(rec, pre, model=self.model, optimizer=self.optimizer, actions=self._actions,
                                                              dump=self._dump, live_copy=lambda: self.snapshot_state(clone=True),
                                                              grads=self._grads, nonfinite_steps=self.nonfinite_steps,
                                                              on_nonfinite=self._update_episode):
            self._update.recycle(pre)
        self.ring.evict()  # after the release: the recycled slot counts against the budget too
        if self.ring.over_budget and self._lagged is not None and self._lagged.pending:
            self._check_pending(final=False)  # only unchecked steps are left to evict: read their verdicts now (one sync)
            self.ring.evict()

    # -- the sync-free check (check_every > 1) ------------------------------------------------------
    def _check_pending(self, *, final: bool) -> bool:
        """Read the pending verdicts (:meth:`LaggedCheck.read`) and handle the first non-finite
        step: put back its pre-step state from the latch (``raise``, ``skip``; for the diagnosis
        only with ``warn``), dump, act. Returns whether there was one (and the action did not raise)."""
        assert self._lagged is not None
        pending = self._lagged.pending
        first = self._lagged.read()
        for r in pending:  # the values just read: the history and the early warning stay sync-free
            self._history.add(r.step, r.loss, r.grad_norm, r.lrs, r.finite)
            if r.finite:
                self._watch.judge(r, None, self._live, grad_norm=r.grad_norm_pre_clip)
        if first is None:
            self._actions.finite()
            return False
        bad_grad = first.grad_norm is not None and not math.isfinite(first.grad_norm)
        bad_loss = first.loss is not None and not math.isfinite(first.loss)
        with self._lagged.pre_step_state(first, self.model, self.optimizer, restore=self._actions.restores, diagnose=self.config.diagnose,
                                         live_copy=lambda: self.snapshot_state(clone=True)) as (state, grads):
            if final:
                self.nonfinite_steps.append(first.step)
                if self._dump.allowed:
                    self._dump(first, grads, state, bad_grad=bad_grad, bad_loss=bad_loss)
                return True
            self._handle_nonfinite(first, grads, bad_grad, bad_loss, state=state)
        return True

    def _lagged_off(self) -> None:
        """The latch cannot grow to the size it needs within ``memory_budget``: read the verdicts
        still on the device (all finite: nothing is latched when the latch grows) and check on the
        host every step from now on, with a warning that says the budget the mode needs."""
        lagged = self._lagged
        assert lagged is not None
        required = self.ring.required
        if lagged.pending:
            self._check_pending(final=False)
        self._lagged = None
        lagged.after_step(self.optimizer)
        lagged.close(required)
        self.ring.capacity = self.config.capacity

    # -- GradScaler ------------------------------------------------------------------------------
    def _on_scaler_skip(self, scale: float) -> None:
        """The GradScaler skipped the step in progress (``scaler.update()`` without an
        ``optimizer.step()``): a routine skip while its scale is large and falling, a failure
        when the loss is non-finite, the scale is at its floor, or it stopped falling
        (:meth:`nanreplay.capture.amp.ScalerWatch.failure`)."""
        rec = self._current
        assert rec is not None and self._amp is not None
        if self._steps.retained:
            self._steps.cotangents_in()
        rec.scaler_skipped = True
        rec.finite = False
        rec.lrs = [lr_value(g["lr"]) for g in self.optimizer.param_groups]
        loss = self._step_loss()
        rec.loss = float(loss) if loss is not None else None  # host read: skipped steps only
        self._steps.seal(rec)
        self._history.add(rec.step, rec.loss, None, rec.lrs, False, self._amp.scale_before)
        try:
            failure = self._amp.failure(self.config.min_scale, self.config.max_scaler_skips, loss=rec.loss if self.config.check_loss else None)
            if failure is None:
                self._watch.log.routine_skip(rec.step)
                return
            why, kind = failure
            grads = self._grads()
            norm = fused_norm([g for _, g in grads])
            rec.grad_norm = float(norm) if norm is not None else None
            bad_loss = self.config.check_loss and rec.loss is not None and not math.isfinite(rec.loss)
            self._handle_nonfinite(rec, grads, bad_grad=True, bad_loss=bad_loss,
                                   cause={"message": (f"non-finite loss under the GradScaler: {why}" if kind == "nonfinite loss" else
                                                      f"non-finite gradients that no loss scale fixes: {why}"), "scaler_failure": kind})
        finally:
            self.end_step()

    # -- the non-finite path -------------------------------------------------------------------
    def snapshot_state(self, *, clone: bool) -> Snapshot:
        """The model's weights and buffers and the optimizer's state now (references, or copies
        with ``clone=True``), with the GradScaler's state under ``extra["scaler"]``."""
        extra = {}
        if self._amp is not None:
            extra["scaler"] = self._amp.state_for_bundle()
        elif self.scaler is not None and hasattr(self.scaler, "state_dict"):
            extra["scaler"] = self.scaler.state_dict()
        return live_state(self.model, self.optimizer, clone=clone, extra=extra)

    def _handle_nonfinite(self, rec: StepRecord, grads: list, bad_grad: bool, bad_loss: bool, *, cause: Optional[dict] = None,
                          state: Optional[Snapshot] = None) -> None:
        """``cause``: JSON merged into the bundle's ``reason``; its ``"message"`` replaces the
        opening words of the error message (used for GradScaler and cross-rank decisions).
        ``state``: the pre-step state to write when it is no longer in the model (sync-free mode)."""
        self.nonfinite_steps.append(rec.step)
        what = " and ".join(w for w, b in (("gradients", bad_grad), ("loss", bad_loss)) if b) or "values on another rank"
        update = "skipped by the scaler" if rec.scaler_skipped else ("skipped" if self._actions.restores else "applied")
        self._watch.nonfinite(rec.step, what, update, corrupts=update == "applied" and what != "loss")
        first = self._dump.allowed and self._actions.dumps()
        cause = dict(cause or {})
        if first:  # the plan lists every step of the episode: made for a bundle only, never per step of a long episode
            cause.setdefault("rollback", self.rollback_plan(rec.step))
        if self.dist is not None:  # the ranks' part in it, into the bundle's reason and metadata
            cause = self.dist.cause(cause, self.extra_meta)
        if self._amp is not None:
            cause = {**self._amp.reason(bad_grad, self._history.scale_changes(rec.step)), **cause}
        path: Optional[Path] = None
        if first:
            path = self._dump(rec, grads, self._live if state is None else state, bad_grad=bad_grad, bad_loss=bad_loss, cause=cause)
            if path is not None:
                self._watch.written = (path, cause["rollback"])
        if "nonfinite_loss_micro_batch" in cause:
            what += f" (first in micro-batch {cause['nonfinite_loss_micro_batch']} of {cause['micro_batches']})"
        head = cause.get("message") or f"non-finite {what}"
        msg = f"{head} at step {rec.step} (grad norm {rec.grad_norm}, loss {rec.loss})" + (self._dump.outcome(path) if first else "")
        if self.dist is not None:  # every rank waits for every bundle; the origin's failure is the job's root cause
            msg = self.dist.conclude(rec.step, msg, dumped=first, raising=self._actions.raises, timeout_s=self.config.dump_barrier_timeout)
        if self._actions.restores and state is None:  # with check_every > 1, _check_pending already put back the whole pre-step state
            load_buffers(self.model, rec.buffers or {})  # the failing forward already wrote them (BatchNorm stats)
        self._actions(Incident(rec.step, msg, path, self.last_diagnosis if first else None))

    def _update_episode(self, step: int) -> None:
        """``check_update`` found step ``step``'s update non-finite: it joins the episode (kept
        under ``warn``: the weights are corrupted from it on; else undone)."""
        applied = not self._actions.restores
        self._watch.nonfinite(step, "update", "applied" if applied else "undone", corrupts=applied)

    # -- the early warning and the rollback plan (capture.early.SpikeWatch) ------------------------
    @property
    def spikes(self) -> list[dict]:
        """Every step and signal found out of its band so far, oldest first: ``{"step", "signal"
        ("loss" | "grad_norm"), "kind" ("spike" | "drift"), "value", "baseline" (the signal's own
        units), "score" (spreads above the band for a spike; times the lowest smoothed loss for a
        drift), "episode", "lr"}`` (see :mod:`nanreplay.capture.early`). ``[]`` with ``on_spike=None``."""
        return self._watch.spikes

    @property
    def should_rollback(self) -> bool:
        """Whether the consecutive non-finite steps reached ``max_consecutive`` (KempnerForge's
        flag: training is not recovering by itself). Then :meth:`rollback_plan` says where to go
        back to and which steps to skip; :attr:`weights_corrupted` says whether the live weights
        took a non-finite update. For hand-written loops::

            if rec.should_rollback:
                plan = rec.rollback_plan()   # {"restore_step": 120, "source": "snapshot", "skip_steps": [120, ...], ...}
                rec.roll_back(plan)          # a snapshot: restored in place; a checkpoint: load plan["path"] yourself
        """
        return self._watch.log.consecutive >= self.config.max_consecutive

    def rollback_plan(self, step: Optional[int] = None) -> dict:
        """The rollback plan for ``step`` (default: the last step found non-finite or out of band).

        The restore point is the latest state, a weight snapshot held (``snapshot_every``) or a
        checkpoint registered (:meth:`note_checkpoint`), known healthy: no later than the first
        abnormal step, saved before any update with non-finite values not undone since, and, for
        a checkpoint, finite when registered (:mod:`nanreplay.capture.episode`). A plan never
        names a checkpoint saved after the first non-finite update; when nothing held is
        healthy, ``restore_step`` is ``None`` and ``note`` says why.

        Returns:
            JSON-able, ``docs/report.md`` (``rollback``): ``{"step", "first_abnormal_step" (the
            first step of the non-finite episode, of the spike episode before it, or of a
            learning-rate jump still in force), "restore_step", "source" (``"snapshot"``:
            :meth:`snapshot_at`; ``"checkpoint"``; ``None``), "path", "skip_steps" (every step from
            the first abnormal one through ``step``), "data_position", "episode" (:attr:`episode`),
            "lr_jump", "weights_corrupted", "rejected" (the newer states refused, with why), "note"}``.
        """
        return self._watch.plan(step)

    def snapshot_at(self, step: int) -> Optional[Snapshot]:
        """The step-start weight snapshot of ``step`` held in the ring buffer (``snapshot_every``), else ``None``."""
        return self._watch.snapshot_at(step)

    def roll_back(self, plan: Optional[dict] = None) -> Optional[int]:
        """Carry out ``plan`` (default: :meth:`rollback_plan`) when its source is a snapshot: copy
        that step's step-start weights, buffers and optimizer state back into the live model and
        optimizer (in place). Returns the step restored, or ``None`` (no snapshot held: the plan's
        ``source`` is ``"checkpoint"`` or ``None``, and loading it is the loop's job). Skipping
        the plan's ``skip_steps`` batches is the loop's job too; the learning rate schedule is
        left as it is."""
        return self._watch.roll_back(self.model, self.optimizer, self.rollback_plan() if plan is None else plan, now=self.step)

    def bundle_content(self, rec: StepRecord, grads: list, reason: dict, state: Optional[Snapshot] = None) -> BundleContent:
        """The content of the bundle for the failing step ``rec`` (references; nothing is copied).
        ``state``: the pre-step state when it is no longer the live one (``check_update``,
        ``check_every > 1``); it is copied shallowly, never modified."""
        return self._dump.content(rec, grads, reason, self.snapshot_state(clone=False) if state is None else state)

    def _live(self) -> Snapshot:
        return self.snapshot_state(clone=False)

