"""Model and optimizer state at a step's start: taking it, keeping it cheaply, putting it back.

* :func:`live_state`: the weights, buffers and optimizer state now, as references or copies.
* :class:`SnapshotPool`: weight snapshots for ``snapshot_every``, copied with one multi-tensor
  ``torch._foreach_copy_`` into slots recycled from evicted snapshots, so steady-state
  snapshotting allocates nothing.
* :func:`restore_into`: the one routine that copies a saved state back into the live model and
  optimizer, in place (a skipped or rolled-back step).
* :class:`StepStartBuffers`: the buffers at a step's start; buffers seen to change within a step
  (BatchNorm running stats) are copied, the others referenced.
* :func:`attach_scan`: the weights and buffers already non-finite when the Recorder attaches.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.numerics import all_finite_flag
from ..core.state import copy_all
from ..format.records import Snapshot
from .sharded import is_sharded, local

logger = logging.getLogger(__name__)

__all__ = ["attach_scan", "live_state", "SnapshotPool", "restore_into", "StepStartBuffers", "storage_bytes"]

#: bytes: buffers up to this size are copied at every step start
SMALL_BUFFER = 1 << 20


def storage_bytes(tensors: Iterable[Any], *, exclude: Optional[AbstractSet[int]] = None) -> int:
    """Bytes of the storages behind ``tensors`` (non-tensors skipped), each storage counted once:
    a view of a larger tensor keeps its whole storage alive. ``exclude``: storage addresses not to
    count (the live parameters and buffers, which training holds anyway; read, not copied)."""
    skip = exclude if exclude is not None else frozenset()
    seen: set[int] = set()
    n = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except RuntimeError:  # no storage to speak of
            ptr, st = id(t), None
        if ptr in seen or ptr in skip:
            continue
        seen.add(ptr)
        n += st.nbytes() if st is not None else t.numel() * t.element_size()
    return n


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, clone: bool, extra: Optional[dict] = None) -> Snapshot:
    """The model's weights and buffers and the optimizer's ``state_dict()`` now: references, or
    copies with ``clone=True``. Sharded (``DTensor``) parameters and optimizer state are taken as
    this rank's local shards (:func:`nanreplay.capture.sharded.local`). ``extra``: other ``state_dict()``s to include (``"scaler"``)."""
    cp = (lambda t: local(t).detach().clone()) if clone else (lambda t: local(t).detach())
    opt_sd = optimizer.state_dict()
    if clone:
        opt_sd = pytree.tree_map(lambda x: local(x).clone() if isinstance(x, torch.Tensor) else x, opt_sd)
    elif is_sharded(model):
        opt_sd = pytree.tree_map(lambda x: local(x) if isinstance(x, torch.Tensor) else x, opt_sd)
    return Snapshot(
        params={n: cp(p) for n, p in model.named_parameters()},
        buffers={n: cp(b) for n, b in model.named_buffers()},
        optimizer=opt_sd,
        extra=dict(extra or {}),
    )


def restore_into(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], snap: Snapshot) -> None:
    """Copy ``snap``'s weights, buffers and optimizer state back into the live ones, in place
    (one ``_foreach_copy_``; the live tensors never alias the snapshot's, which may be a recycled
    slot). When the optimizer state's layout changed since ``snap`` was taken (state created
    lazily on a first step), the optimizer is restored with ``load_state_dict`` instead.

    Raises:
        RuntimeError: ``snap`` names a parameter the model does not have.
    """
    params = dict(model.named_parameters())
    missing = [n for n in snap.params if n not in params]
    if missing:
        raise RuntimeError(f"nanreplay: cannot put back the saved state: the model has no parameter {missing[:3]}")
    dst = [local(params[n]).detach() for n in snap.params]
    src = list(snap.params.values())
    live_buffers = dict(model.named_buffers())
    for n, b in snap.buffers.items():
        live = live_buffers.get(n)
        if live is not None and live is not b and live.shape == b.shape:
            dst.append(live)
            src.append(b)
    reload = None
    if optimizer is not None and snap.optimizer is not None:
        live_opt = [local(t) for t in pytree.tree_leaves(optimizer.state_dict()["state"]) if isinstance(t, torch.Tensor)]
        saved_opt = [t for t in pytree.tree_leaves(snap.optimizer["state"]) if isinstance(t, torch.Tensor)]
        if len(live_opt) == len(saved_opt) and all(a.shape == b.shape for a, b in zip(live_opt, saved_opt)):
            dst += live_opt
            src += saved_opt
        else:
            reload = snap.optimizer
    with torch.no_grad():
        copy_all(dst, [s.to(d.device) if s.device != d.device else s for d, s in zip(dst, src)])
    if reload is not None:
        optimizer.load_state_dict(reload)


@dataclass
class _Slot:
    """Preallocated tensors of one snapshot layout (``key``), recycled between snapshots."""

    key: tuple
    tensors: list

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)  # the shapes never change


@dataclass
class SlotSnapshot(Snapshot):
    """A :class:`Snapshot` whose tensors live in a recyclable slot."""

    slot: Optional[_Slot] = None


def _layout(spec: Any, tensors: list) -> tuple:
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))


class SnapshotPool:
    """Weight snapshots copied into recycled slots: one read and one write of the state's bytes
    per snapshot, no allocation in steady state, no sync."""

    def __init__(self) -> None:
        self._free: list[_Slot] = []

    def take(self, live: Snapshot) -> SlotSnapshot:
        """A copy of ``live`` (references to the live state, from :func:`live_state`)."""
        leaves, spec = pytree.tree_flatten((live.params, live.buffers, live.optimizer))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        key = _layout(spec, tensors)
        slot = next((s for s in self._free if s.key == key), None)
        if slot is not None:
            self._free.remove(slot)
            copy_all(slot.tensors, tensors)
        else:
            slot = _Slot(key, [t.clone() for t in tensors])
        it = iter(slot.tensors)
        params, buffers, opt = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        extra = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, live.extra)
        return SlotSnapshot(params=params, buffers=buffers, optimizer=opt, extra=extra, slot=slot)

    def release(self, snap: Optional[Snapshot], *, reuse: bool = True) -> None:
        """Give a snapshot's tensors back for reuse (one free slot is kept); with ``reuse=False``
        (dropped to honour the memory budget) they are freed instead."""
        if isinstance(snap, SlotSnapshot) and snap.slot is not None:
            if reuse:
                self._free[:] = [snap.slot]
            snap.slot = None

    def clear(self) -> None:
        """Free the spare slots (to honour the memory budget)."""
        self._free.clear()

    def nbytes(self) -> int:
        """Bytes held in free slots."""
        return sum(s.nbytes for s in self._free) if self._free else 0


class StepStartBuffers:
    """The model's buffers at each step's start.

    The version counter alone misses BatchNorm's running stats (``native_batch_norm`` writes them
    inside the kernel without bumping it), so the first step copies every buffer and compares
    values at its end. From then on, buffers of at most :data:`SMALL_BUFFER` bytes are copied
    every step whatever step 0 showed (running stats in a branch step 0 did not take change
    later, invisibly to the version counter, and copying them costs little); larger ones (masks,
    rotary caches) are referenced unless step 0 changed them.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.mutable: Optional[set[str]] = None
        self._versions: dict[str, int] = {}
        self._where = _buffer_slots(model)

    def capture(self) -> dict[str, torch.Tensor]:
        """The buffers now: copies of the mutable ones, references to the others. Reads each
        buffer through its module's ``_buffers`` (found by one walk of the module tree at
        construction and again after the first step, not per step)."""
        out = {}
        for name, slots, key in self._where:
            b = slots.get(key)
            if b is None:
                continue
            out[name] = b.detach().clone() if self.mutable is None or name in self.mutable else b.detach()
            self._versions[name] = b._version
        return out

    def learn(self, start: Optional[dict[str, torch.Tensor]]) -> None:
        """After the first step: which buffers change within a step (compared by version and by
        value; NaN compares unequal, which errs on the side of copying)."""
        if self.mutable is not None:
            return
        start = start or {}
        self.mutable = {
            n for n, b in self.model.named_buffers()
            if b.numel() * b.element_size() <= SMALL_BUFFER
            or b._version != self._versions.get(n) or not _same_tensor(b, start.get(n))
        }
        self._where = _buffer_slots(self.model)  # buffers a first forward registered

    def copied_bytes(self, buffers: Optional[dict[str, torch.Tensor]]) -> int:
        """Bytes of ``buffers`` that are copies, not references to the live buffers."""
        if not buffers:
            return 0
        return storage_bytes(buffers.values(), exclude={b.untyped_storage().data_ptr() for b in self.model.buffers()})


def _buffer_slots(model: torch.nn.Module) -> list[tuple[str, dict, str]]:
    """``(FQN, the owning module's _buffers dict, key)`` for each buffer of ``model`` (one walk;
    the FQNs and order of ``model.named_buffers()``)."""
    owners = dict(model.named_modules(remove_duplicate=False))
    out = []
    for fqn, _ in model.named_buffers():
        mod, _, key = fqn.rpartition(".")
        out.append((fqn, owners[mod]._buffers, key))
    return out


def _same_tensor(live: torch.Tensor, saved: Optional[torch.Tensor]) -> bool:
    """Whether ``saved`` (a step-start copy) still equals ``live``: same shape, dtype and values."""
    return saved is not None and saved is not live and saved.shape == live.shape and saved.dtype == live.dtype and torch.equal(saved, live.detach())


def replace_snapshot(snap: Snapshot, **changes: Any) -> Snapshot:
    """A shallow copy of ``snap`` with ``changes`` (a plain :class:`Snapshot`, never a slot)."""
    fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(Snapshot)}
    fields.update(changes)
    return Snapshot(**fields)


def attach_scan(model: torch.nn.Module, step: int) -> dict:
    """The weights and buffers that are already non-finite when the Recorder attaches (a loaded
    checkpoint, the initialisation), scanned once: ``{"step", "nonfinite": [FQN] (up to 64),
    "count"}``; stored in every bundle (``meta["attach_scan"]``) so a diagnosis can tell weights
    non-finite before recording from weights a recorded step made non-finite. Cost: one read of
    every weight, fused (:func:`finite_flags`), and one host read."""
    named = [(n, t.detach()) for n, t in list(model.named_parameters()) + list(model.named_buffers())
             if (t.is_floating_point() or t.is_complex()) and t.numel()]
    bad = [n for (n, _), ok in zip(named, finite_flags([t for _, t in named])) if not ok]
    return {"step": step, "nonfinite": bad[:64], "count": len(bad)}


def finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each floating or complex tensor is finite everywhere. One multi-tensor 2-norm
    (``_foreach_norm``, in float32) per (device, dtype) and one host read for all: a NaN or Inf
    makes the norm NaN or Inf, and the few tensors whose norm is not finite are read again with
    ``aminmax`` (:func:`~nanreplay.core.numerics.all_finite_flag`), since very large finite
    values overflow a float32 sum of squares too. ``DTensor`` s (their whole value) and dtypes the
    multi-tensor norm lacks (float8: widened) are checked one by one."""
    flags: list[Optional[torch.Tensor]] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if local(t) is not t:  # a DTensor: its whole value, as one flag (a collective)
            flags[i] = torch.tensor(bool(torch.isfinite(t).all()))
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for idx in groups.values():
        ts = [tensors[i] for i in idx]
        try:
            per = [torch.isfinite(n) for n in torch._foreach_norm(ts, 2, dtype=torch.float32)]
        except (RuntimeError, TypeError, NotImplementedError):  # float8 and other dtypes it lacks a kernel for: widened
            per = [all_finite_flag(t if t.is_complex() else t.float()) for t in ts]
        for i, f in zip(idx, torch.stack(per).cpu().unbind()):
            flags[i] = f
    if not flags:
        return []
    out = [bool(f) for f in torch.stack([f.reshape(()) for f in flags]).tolist()]  # the one host read
    for i, ok in enumerate(out):
        if not ok and local(tensors[i]) is tensors[i]:  # the norm overflowed, or a value is NaN / Inf: look again
            t = tensors[i]
            out[i] = bool(all_finite_flag(t if t.is_complex() or t.element_size() > 1 else t.float()))
    return out
