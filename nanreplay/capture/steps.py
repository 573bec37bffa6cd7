"""The start of the Recorder's steps, and what each step captures before its check.

:class:`StepStart` begins the step in progress on its first forward or ``Recorder.record``: a
:class:`~nanreplay.format.records.StepRecord` with the step's RNG states (host reads only, no
generator advanced), its modules' training modes, its step-start buffers
(:class:`~nanreplay.capture.snapshots.StepStartBuffers`) and, every ``snapshot_every`` steps, a
weight snapshot copied into the ring's recycled slot; the record is then opened in the ring
buffer, which evicts to stay within ``memory_budget``. Each grad-enabled forward adds its inputs
(:class:`~nanreplay.capture.inputs.InputCapture`: by reference while safe), its autocast state
and a hook on its output for the cotangent (:meth:`StepStart.forward_post`); each ``record(batch)`` adds the batch.

A step begun in eval mode is provisional: a grad-enabled validation forward (one that forgot
``torch.no_grad``) between two steps looks like the start of the next step until the model is put
back in training mode; then the forwards seen so far are dropped and the RNG states and modes are
taken again.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.rng import RNGReader
from ..format.records import ForwardRecord, Snapshot, StepRecord
from .forward import RETAIN_MAX_BYTES, autocast_state, keep_cotangent
from .inputs import InputCapture
from .ring import RingBuffer
from .snapshots import StepStartBuffers

logger = logging.getLogger(__name__)

#: whether any autocast region is on, in one C call (``torch._C._is_any_autocast_enabled``; on a
#: torch without it, always true: :func:`~nanreplay.capture.forward.autocast_state` then looks)
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)

__all__ = ["StepStart"]


class StepStart:
    """Begins the steps and captures their batches and forwards (see the module docstring).

    Args:
        model: the unwrapped model. ring, inputs: the Recorder's ring buffer and input capture.
        step: returns the index of the step in progress.
        replay_state: an object whose ``replaying`` attribute is true while the Recorder replays a
            step itself (its :class:`~nanreplay.capture.dump.Dump`): capture is off then, and once
            :attr:`closed` is set (``Recorder.close``). Both are read as attributes, not through a
            call: the capture runs two or three times a step.
        snapshot_every: weight snapshot period (0: none). snapshot_state: the live state, as
            references (``Recorder.snapshot_state(clone=False)``), copied into the snapshot slot.
        capture_cotangent: ``RecorderConfig.capture_cotangent`` (``False``: no cotangent hook).
    """

    def __init__(self, model: torch.nn.Module, ring: RingBuffer, inputs: InputCapture, *, step: Callable[[], int], replay_state: Any,
                 snapshot_every: int, snapshot_state: Callable[[], Snapshot], capture_cotangent: Optional[bool]) -> None:
        self.model, self.ring, self.inputs = model, ring, inputs
        self._step, self._replay_state = step, replay_state
        self.closed = False
        self._snapshot_every, self._snapshot_state = snapshot_every, snapshot_state
        self._keep_cotangents = capture_cotangent is not False  # False: no cotangent is kept
        self.buffers = StepStartBuffers(model)
        self.rng = RNGReader(spare=ring.spares.take)  # copies a generator's state only when it moved since the last step
        self._modes = ModuleModes(model)
        self.provisional = False  # the step in progress was begun in eval mode
        self._autocast_read: Optional[int] = None  # the step whose autocast state was read
        #: per forward begun and not ended, innermost last: its record when its output's cotangent is
        #: to be kept, else ``None`` (cleared when a step begins: a forward that raised never ends)
        self._open: list[Optional[ForwardRecord]] = []
        #: forwards whose small output retains its gradient, as ``(record, output, output._version)``
        #: (:meth:`forward_post`), until :meth:`cotangents_in`
        self.retained: list[tuple] = []
        self._retain = True  # off once the loop was seen modifying an output in place: a pre-hook keeps every cotangent

    def begin(self, *, capture: bool = True) -> StepRecord:
        """The step in progress, begun now if none is. ``capture``: called for a batch or a
        forward (not for the check), which ends a provisional step's validation forwards."""
        current = self.ring.current
        if current is not None:
            if capture and self.provisional and self.model.training:
                self._restart(current)
            return current
        self.provisional = not self.model.training
        self._open.clear()
        step = self._step()
        rec = StepRecord(step=step, rng=self.rng.capture())
        rec.training = self._modes.training()
        rec.buffers = self.buffers.capture()
        se = self._snapshot_every
        if se and step % se == 0 and not self.ring.snapshots_refused:
            self.ring.make_room()  # evict first, so its slot can be reused
            rec.snapshot = self.ring.pool.take(self._snapshot_state())
        self.ring.begin(rec)
        if rec.snapshot is not None:
            self.ring.evict()  # a snapshot may not fit: now; the step's small copies are counted at its end
        return rec

    def _restart(self, rec: StepRecord) -> None:
        """The model went back to training mode after the step in progress was begun in eval mode:
        the forwards seen so far were validation, not part of the step. Drop them and take the
        step's RNG states and module modes again, from here (the batches and buffers stay: an
        eval-mode forward leaves BatchNorm's running stats alone)."""
        self.provisional = False
        if rec.forwards:
            logger.info("nanreplay: step %d: %d grad-enabled forward(s) in eval mode before the model went back to training "
                        "mode are treated as validation, not as part of the step", rec.step, len(rec.forwards))
        rec.forwards = []
        rec.rng = self.rng.capture()
        rec.training = self._modes.training()
        rec.autocast = self._autocast_read = None
        self.inputs.keep_only(rec.step, [t for t in pytree.tree_leaves(rec.batches) if isinstance(t, torch.Tensor)])

    def batch(self, batch: Any) -> None:
        """``Recorder.record``: keep ``batch`` in the step in progress."""
        if self.closed or self._replay_state.replaying:
            return
        rec = self.begin()
        rec.batches.append(self.inputs.capture(batch, rec.step))

    def forward_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Before a forward (of ``module``: the tap's hook arguments): keep its inputs (and, for a later micro-batch, the RNG states now)."""
        # forwards without autograd (evaluation under no_grad) are not part of a training step
        if self.closed or self._replay_state.replaying or not torch.is_grad_enabled():
            self._open.append(None)
            return
        rec = self.ring.current
        if rec is None or self.provisional:  # else the step began with Recorder.record
            rec = self.begin()
        # a later micro-batch: the loop may have drawn random numbers since the step began
        rng = self.rng.capture() if rec.forwards else None
        inputs = (self.inputs.capture(args, rec.step), self.inputs.capture(kwargs, rec.step) if kwargs else {})  # the args: a flat tuple, as a rule
        fw = ForwardRecord(inputs=inputs, rng=rng)
        rec.forwards.append(fw)
        self._open.append(fw if self._keep_cotangents else None)
        if self._autocast_read != rec.step:  # once a step (a later micro-batch runs in the same region)
            self._autocast_read = rec.step
            if _any_autocast():  # else no region is on: nothing to look up
                rec.autocast = autocast_state(self.inputs.device_type(rec.step))  # from the tensors just kept: no second walk

    def forward_post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """After a forward: keep its output's cotangent, when its :meth:`forward_pre` recorded it
        (the forwards still open are a stack: a forward inside another pairs with its own). The
        usual output, one tensor of at most :data:`RETAIN_MAX_BYTES` made by a node, keeps it by
        ``output.retain_grad()``, appended to :attr:`retained` as ``(record, output,
        output._version)`` (:meth:`cotangents_in` moves ``output.grad`` into the record after the
        backward pass); any other output, or every output once the loop was seen modifying one in
        place, through a hook (:func:`~nanreplay.capture.forward.keep_cotangent`)."""
        fw = self._open.pop() if self._open else None
        if fw is None:
            return
        if (self._retain and isinstance(output, torch.Tensor) and output.requires_grad and not output.is_leaf
                and output.nbytes <= RETAIN_MAX_BYTES):
            output.retain_grad()  # autograd's own C++ hook, which copies the gradient: no Python runs in the backward pass
            self.retained.append((fw, output, output._version))
        else:
            keep_cotangent(fw, output)  # auto: kept until the step is known finite (Recorder.end_step)

    def cotangents_in(self, *, final: bool = False) -> None:
        """After the backward pass, before anything reads a cotangent: each retained output's
        gradient goes into its forward's record (an output still without one waits, unless
        ``final``: the step ends, and that forward had no cotangent). An output modified in
        place after its forward holds the gradient of its new value, not of the model's output:
        that forward keeps none (a replay of its step then needs the loss function, else it runs the
        forward pass only), and from then on every cotangent is kept by a pre-hook of the node that
        made the output."""
        waiting = []
        for fw, out, version in self.retained:
            if out._version != version:
                if self._retain:
                    self._retain = False
                    logger.info("nanreplay: step %d: the loop modified the model's output in place after the forward; its cotangent "
                                "is not kept, and from now on cotangents are kept by a pre-hook of the node that made the output "
                                "(a call into Python in each backward pass)", self._step())
            elif out.grad is not None:
                fw.cotangent = out.grad.detach()  # its own tensor: the Recorder never writes into the output's .grad
            elif not final:
                waiting.append((fw, out, version))
        self.retained = waiting

    def seal(self, rec: StepRecord) -> None:
        """End-of-step bookkeeping: learn which buffers change in a step and whether the loop
        modified a batch tensor in place (then switch to copying)."""
        if self.buffers.mutable is None:  # learnt at the first step
            self.buffers.learn(rec.buffers)
        self.inputs.seal(rec.step)


class ModuleModes:
    """The FQNs of the modules in training mode, read every step. The module tree is walked once
    (modules added later are not seen, as before); each step reads one flag per module (C-speed
    ``map``) and hands back the previous step's list when no flag changed, so a step's record
    shares it instead of holding a list of its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names, self._modules = zip(*model.named_modules())
        self._flags: Optional[tuple] = None
        self._training: list[str] = []

    def training(self) -> list[str]:
        """The FQNs of the modules in training mode now (the same list object while unchanged)."""
        flags = tuple(map(_is_training, self._modules))
        if flags != self._flags:
            self._flags = flags
            self._training = [n for n, on in zip(self._names, flags) if on]
        return self._training


_is_training = attrgetter("training")
