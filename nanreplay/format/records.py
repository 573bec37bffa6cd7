"""The records a bundle is made of, in memory: one step of the ring buffer (:class:`StepRecord`,
with its top-level forward calls, :class:`ForwardRecord`), a model/optimizer state
(:class:`Snapshot`) and the whole content of a bundle (:class:`BundleContent`).

The recorder fills them; :func:`nanreplay.format.bundle.write_bundle` writes a
:class:`BundleContent` and :meth:`nanreplay.format.bundle.Bundle.content` reads one back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.digest import RecordedGrad
from ..core.rng import RNGState

__all__ = ["ForwardRecord", "Snapshot", "StepRecord", "BundleContent", "scalar_history_records"]


@dataclass(slots=True)
class ForwardRecord:
    """One top-level forward call of the model: its inputs as ``(args, kwargs)``, after the
    backward pass the gradient w.r.t. its outputs (the cotangent, same structure as the output
    with ``None`` where an output leaf received no gradient), and for every forward after the
    step's first the RNG states just before it (the loop may draw between micro-batches, e.g.
    for augmentation; the first forward's are the step's ``rng``)."""

    inputs: Any
    cotangent: Any = None
    rng: Optional[RNGState] = None


@dataclass
class Snapshot:
    """Model and optimizer state at the start of a step (before its first forward).

    Attributes:
        params: FQN -> parameter tensor. buffers: FQN -> buffer tensor.
        optimizer: ``optimizer.state_dict()`` (tensors inside), or ``None``.
        extra: other ``state_dict()``s keyed by name (``"scaler"`` for a GradScaler).
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: Optional[dict] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of every tensor held (params, buffers, optimizer and extra states). Computed
        once and cached: the ring buffer asks every step, and a snapshot's tensors keep their
        shapes once taken (slots recycled by the recorder are copied into, not resized)."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            leaves = [*self.params.values(), *self.buffers.values(), *pytree.tree_leaves(self.optimizer), *pytree.tree_leaves(self.extra)]
            cached = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
            self.__dict__["_nbytes"] = cached
        return cached


@dataclass(slots=True)
class StepRecord:
    """One step in the ring buffer.

    Attributes:
        step: index of the optimizer step (0-based count of ``optimizer.step()`` calls seen).
        rng: RNG states at the start of the step, before its first forward.
        forwards: the model's top-level forward calls of the step, in order (micro-batches).
        batches: explicit batches given to ``Recorder.record`` in this step, in order.
        training: FQNs of modules that were in training mode at the start of the step.
        lrs: learning rate of each optimizer param group (floats).
        loss: the loss as a host float when known (``Recorder.log_loss``), else ``None``.
        grad_norm: the 2-norm over all gradients computed by the check (float32), else ``None``.
        grad_norm_pre_clip: the grad norm before clipping the loop gave
            ``Recorder.log_grad_norm``, else ``None``.
        finite: ``True``/``False`` once checked, ``None`` before.
        buffers: step-start buffers (FQN -> tensor) when kept for this step.
        snapshot: step-start weights and optimizer state, when ``snapshot_every`` chose this step.
        autocast: ``{"device_type": "cuda", "dtype": "float16"}`` when the model's forward ran
            under ``torch.autocast``, else ``None``; replay runs the step under the same autocast.
        scaler_skipped: ``True`` when a GradScaler skipped this step's optimizer step.
        stale_inputs: ``True`` when a batch or input tensor kept by reference was modified in
            place after capture (a recycled input buffer; their version counters changed): the
            stored values are not what the step saw.
    """

    step: int
    rng: RNGState
    forwards: list[ForwardRecord] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)
    training: list[str] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    grad_norm_pre_clip: Optional[float] = None
    finite: Optional[bool] = None
    buffers: Optional[dict[str, torch.Tensor]] = None
    snapshot: Optional[Snapshot] = None
    autocast: Optional[dict] = None
    scaler_skipped: Optional[bool] = None
    stale_inputs: bool = False


@dataclass
class BundleContent:
    """Everything a bundle holds, in memory. See ``docs/bundle-format.md``.

    ``trusted``: whether the code this content names (model factory, loss function, classes in
    the metadata) may run on replay without asking; :func:`~nanreplay.format.bundle.write_bundle`
    records a bundle written from trusted content in this user's trust store. ``True`` for
    content built in this process (the Recorder); :meth:`~nanreplay.format.bundle.Bundle.content`
    sets it to whether the bundle read was trusted, so rewriting a stranger's bundle does not
    make it trusted.
    """

    failing_step: int
    steps: list[StepRecord]
    state: Snapshot                          # the failing step's pre-step state
    grads: dict[str, RecordedGrad]           # the failing step's gradients, FQN -> tensor or GradDigest (core.digest)
    model_info: dict
    optimizer_info: dict
    reason: dict
    model_factory: Optional[str] = None
    loss_fn: Optional[str] = None
    diagnosis: Optional[dict] = None
    extra_meta: dict = field(default_factory=dict)
    # tensors stored under their own keys, outside the layout above (e.g. an embedded program's
    # constants under ``program/``); listed in ``meta["extra_tensors"]``
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    trusted: bool = True


def scalar_history_records(meta: Optional[dict]) -> list:
    """The rows of a bundle's ``meta["scalar_history"]`` (schema-checked by
    :mod:`nanreplay.format.meta`) as light records with ``step``, ``loss``, ``grad_norm``,
    ``lrs``, ``finite``, ``scale`` and ``grad_norm_pre_clip`` (``None`` where the bundle has no such
    column), oldest first; ``[]`` for a bundle written before the field existed."""
    if not meta:
        return []
    from types import SimpleNamespace

    def num(v: Any) -> Optional[float]:
        return None if v is None else float(v)

    n = len(meta["step"])
    scale, pre = meta.get("scale") or [None] * n, meta.get("grad_norm_pre_clip") or [None] * n
    return [SimpleNamespace(step=int(s), loss=num(lo), grad_norm=num(g), lrs=[float(x) for x in lr], finite=f, scale=num(sc),
                            grad_norm_pre_clip=num(p))
            for s, lo, g, lr, f, sc, p in zip(meta["step"], meta["loss"], meta["grad_norm"], meta["lrs"], meta["finite"], scale, pre)]
