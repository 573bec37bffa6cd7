"""The ring buffer of the last steps, and the whole of the Recorder's memory budget.

Everything the Recorder keeps alive beyond what training holds anyway is counted here, and only
here: each step's batches, forward inputs and cotangents (the storages behind them: a kept view
holds its whole storage), its copied step-start buffers and its weight snapshot; the spare
snapshot slot (:class:`~nanreplay.capture.snapshots.SnapshotPool`); the free spares of a long
ring (:class:`Spares`); and the copies other parts
keep outside the steps, registered by name with :meth:`RingBuffer.keep` (``check_update``'s
pre-step copy, the sync-free check's latch).

Eviction order when over the byte budget: weight snapshots of older steps (the largest, and
only ``bisect`` needs them), the spare snapshot slot, the free spares, whole older steps, then the newest step's
snapshot. The count is a running total, kept as steps end and leave: keeping within the budget
costs a few additions per step, not a walk over the held steps (:meth:`RingBuffer.recount` walks
them all, for checking). Never evicted: the step in progress and the pinned steps (those whose verdict is still
on the device, :mod:`nanreplay.capture.lagged`): their owner reads them early when
:attr:`RingBuffer.over_budget` says so. A snapshot that cannot fit at all is refused once, with a
warning, rather than copied every step and dropped again; a kept copy that cannot fit beside the
step in progress is refused by :meth:`RingBuffer.reserve`, and its owner turns its mode off.

Not counted: each step's record on the host (about 3 KiB of Python objects) and its RNG states
(:class:`~nanreplay.core.rng.RNGReader`: shared with the step before while unchanged; else about
5 KiB for torch's CPU generator, 3 KiB for NumPy's and 2.5 KiB for Python's ``random``, kept as its raw
Mersenne Twister state).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from itertools import islice
from typing import Any, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.tree import tensor_leaves
from ..format.records import StepRecord
from .inputs import InputCapture
from .sharded import local
from .snapshots import SnapshotPool, storage_bytes

logger = logging.getLogger(__name__)

__all__ = ["RingBuffer", "MiB", "check_budget", "tensor_bytes"]

MiB = 1 << 20


class RingBuffer:
    """The last ``capacity`` steps, oldest first (a sequence of :class:`StepRecord`), kept within
    ``budget`` bytes together with the copies registered by :meth:`keep`.

    Args:
        capacity: most steps kept.
        budget: most bytes held (``memory_budget``).
        model: the unwrapped model; storages of its parameters and buffers are not counted.
        inputs: the batch capture; a step leaving the buffer drops its references there.

    Attributes:
        current: the step in progress (never evicted; its bytes are not cached).
        pool: the recycled snapshot slots.
        snapshots_refused: a single snapshot was larger than the budget; no more are taken.
        over_budget: after the last :meth:`evict`, more than ``budget`` bytes are held (only
            the step in progress and pinned steps are left to blame).
        required: the budget the last copy refused by :meth:`reserve` would have needed.
    """

    def __init__(self, capacity: int, budget: int, *, model: torch.nn.Module, inputs: InputCapture) -> None:
        self.capacity = capacity
        self.budget = budget
        self.model = model
        self.inputs = inputs
        self.pool = SnapshotPool()
        self.spares = Spares(on=capacity >= RECYCLE_FROM, burst=capacity + 1, room=lambda n: self.held_bytes() + n <= self.budget // 4)
        if self.spares.on and inputs.policy is not False:
            inputs.spare = self.spares.take  # a long ring copies its batches into recycled tensors
        self.current: Optional[StepRecord] = None
        self.snapshots_refused = False
        self.over_budget = False
        self.required = 0
        self._steps: deque[StepRecord] = deque()
        self._cache: dict[int, int] = {}     # step -> bytes of its tensors (its snapshot apart), once the step is over
        self._done = 0                       # bytes of the steps that are over, snapshots included (kept up to date)
        self._live = self._live_storages()   # storages of the live parameters and buffers: not counted
        self._live_read_after_step = False
        self._pinned: set[int] = set()       # ids of steps never evicted
        self._kept: dict[str, Any] = {}      # name -> a copy held outside the steps (has nbytes())

    # -- a read-only sequence of StepRecords ------------------------------------------------
    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, i: int) -> StepRecord:
        return self._steps[i]

    def upto(self, step: int) -> list[StepRecord]:
        """The steps held up to ``step`` (inclusive), oldest first."""
        return [r for r in self._steps if r.step <= step]

    # -- the step lifecycle ------------------------------------------------------------------
    def begin(self, rec: StepRecord) -> None:
        """``rec`` is the step in progress: append it (after making room for one more step)."""
        self.make_room()
        self._steps.append(rec)
        self.current = rec

    def end(self) -> None:
        """The step in progress is over: its bytes are counted now, once (its content no longer
        changes), and added to the running total."""
        rec = self.current
        if rec is not None:
            if not self._live_read_after_step:  # lazily created weights and buffers exist after the first step
                self._live, self._live_read_after_step = self._live_storages(), True
            if self.spares.on:
                self.spares.settle(rec)
            n = self._tensor_bytes(rec)
            self._cache[rec.step] = n
            self._done += n + _snapshot_bytes(rec)
        self.current = None

    def make_room(self) -> None:
        """Drop the oldest steps until one more fits within ``capacity`` (pinned ones stay)."""
        while len(self._steps) >= self.capacity and id(self._steps[0]) not in self._pinned:
            self._drop_oldest()

    def pin(self, rec: StepRecord) -> None:
        """Never evict ``rec`` until :meth:`unpin` (its verdict is still on the device)."""
        self._pinned.add(id(rec))

    def unpin(self, rec: StepRecord) -> None:
        self._pinned.discard(id(rec))

    # -- copies held outside the steps ---------------------------------------------------------
    def keep(self, name: str, copy: Any) -> None:
        """Count ``copy`` (anything with ``nbytes()``) against the budget under ``name``, in place
        of what was kept under that name before."""
        self._kept[name] = copy

    def release(self, name: str) -> Any:
        """Stop counting the copy kept under ``name``; returns it (``None`` if none)."""
        return self._kept.pop(name, None)

    def reserve(self, name: str, nbytes: int, *, from_pool: bool = False) -> bool:
        """Whether a copy of ``nbytes`` can be kept under ``name`` (replacing what is kept there)
        within the budget beside the step in progress and the other kept copies; when it can,
        evict now to make room for it. ``from_pool``: the copy will go into the spare snapshot
        slot (already counted). ``False`` means it cannot fit beside the step in progress; then
        :attr:`required` says the budget it would take."""
        others = sum(c.nbytes() for k, c in self._kept.items() if k != name)
        current = self._current_bytes()
        if nbytes + others + current > self.budget:
            self.required = nbytes + others + current
            return False
        reused = (self._kept[name].nbytes() if name in self._kept else 0) + (self.pool.nbytes() if from_pool else 0)
        extra = max(0, nbytes - reused)
        if self._done + current + self.kept_bytes() + extra > self.budget:
            self.evict(extra=extra)
        return True

    # -- bytes -----------------------------------------------------------------------------------
    def _live_storages(self) -> frozenset[int]:
        """Storage addresses of the live parameters and buffers (local shards: an FSDP2 parameter's
        unsharded storage may be freed, never touch it). Read at construction and after the first
        step, not per step: a weight moved later (``model.to()`` after the Recorder attached) that
        a batch refers to is counted as held."""
        return frozenset(local(t).untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def _tensor_bytes(self, r: StepRecord, live: Optional[frozenset] = None, *, walk: bool = False) -> int:
        """Bytes of the storages behind step ``r``'s batches, forward inputs, cotangents and copied
        buffers, each storage once, the live parameters' and buffers' excluded. The batches and
        inputs are the tensors the input capture listed as it kept them (no walk of their trees);
        ``walk``: walk the trees instead (:meth:`recount`)."""
        if walk:
            kept = [t for tree in [r.batches] + [fw.inputs for fw in r.forwards] for t in tensor_leaves(tree)]
        else:
            kept = self.inputs.tensors(r.step)
        for fw in r.forwards:
            c = fw.cotangent
            if isinstance(c, torch.Tensor):
                kept.append(c)
            elif c is not None:
                kept += pytree.tree_leaves(c)
        if r.buffers:
            kept += r.buffers.values()
        return storage_bytes(kept, exclude=self._live if live is None else live)

    def bytes_of(self, r: StepRecord) -> int:
        """Bytes step ``r`` keeps alive, its snapshot included: the storages of its batches,
        forward inputs and cotangents and its copied buffers (the live parameters' and buffers'
        storages excluded). Counted once the step is over (its content no longer changes); the
        snapshot is counted apart, since eviction drops it first."""
        n = self._cache.get(r.step) if r is not self.current else None
        if n is None:
            n = self._tensor_bytes(r)
        return n + _snapshot_bytes(r)

    def _current_bytes(self) -> int:
        """Bytes of the step in progress (a walk over its own tensors only)."""
        return 0 if self.current is None else self.bytes_of(self.current)

    def kept_bytes(self) -> int:
        """Bytes held outside the steps: the spare snapshot slot, the free spares and the kept copies."""
        return self.pool.nbytes() + self.spares.nbytes() + (sum(c.nbytes() for c in self._kept.values()) if self._kept else 0)

    def held_bytes(self) -> int:
        """Every byte counted against the budget now: a running total of the steps that are
        over, plus the step in progress and the kept copies (no walk over the held steps)."""
        return self._done + self._current_bytes() + self.kept_bytes()

    def recount(self) -> int:
        """:meth:`held_bytes` counted again from scratch (every held step walked, the live
        storages read again, nothing cached): what the running total must equal. For tests and
        debugging; costs a walk over the whole ring."""
        live = self._live_storages()
        return sum(self._tensor_bytes(r, live, walk=True) + _snapshot_bytes(r) for r in self._steps) + self.kept_bytes()

    # -- eviction --------------------------------------------------------------------------------
    def _drop_oldest(self, *, reuse: bool = True) -> int:
        """Drop the oldest step; returns the bytes that frees (from the running total)."""
        r = self._steps.popleft()
        freed = self._cache.pop(r.step, 0)
        if r.snapshot is not None:
            freed += r.snapshot.nbytes()
            self.pool.release(r.snapshot, reuse=reuse)
        self._done -= freed
        if self.spares.on:
            self.spares.reclaim(r, copies=self.inputs.copies(r.step))
        self.inputs.forget(r.step)
        return freed

    def _drop_snapshot(self, r: StepRecord) -> int:
        size = _snapshot_bytes(r)
        if r is not self.current:
            self._done -= size
        self.pool.release(r.snapshot, reuse=False)
        r.snapshot = None
        return size

    def _evictable(self) -> bool:
        first = self._steps[0]
        return len(self._steps) > 1 and id(first) not in self._pinned and first is not self.current

    def evict(self, *, extra: int = 0) -> int:
        """Keep within ``capacity`` steps and ``budget`` bytes (``extra``: bytes about to be kept,
        counted as if they were). Returns the bytes held after eviction (``extra`` included) and
        sets :attr:`over_budget`. Within the budget it costs a few additions (no walk)."""
        while len(self._steps) > self.capacity and id(self._steps[0]) not in self._pinned:
            self._drop_oldest()
        total = self._done + self.kept_bytes() + extra + (self._current_bytes() if self.current is not None else 0)  # held_bytes()
        if total > self.budget:
            for r in islice(self._steps, len(self._steps) - 1):  # oldest snapshots first
                if total <= self.budget:
                    break
                total -= self._drop_snapshot(r)
        if total > self.budget and self.pool.nbytes():
            total -= self.pool.nbytes()
            self.pool.clear()  # the spare slot next
        if total > self.budget and self.spares.nbytes():
            total -= self.spares.nbytes()
            self.spares.clear()  # then the free spares
        while total > self.budget and self._evictable():
            total -= self._drop_oldest(reuse=False)
        if total > self.budget and self._steps and self._steps[-1].snapshot is not None:
            size = self._drop_snapshot(self._steps[-1])
            total -= size
            if not self.snapshots_refused:
                self.snapshots_refused = True
                logger.warning(
                    "nanreplay: one weight snapshot (%d bytes) does not fit in memory_budget=%d bytes with the rest of the "
                    "ring buffer; weight snapshots are off from now on (bisect --over layers/steps will lack them). Raise "
                    "memory_budget or lower capacity to keep them", size, self.budget)
        self.over_budget = total > self.budget
        return total


class Spares:
    """Small tensors of steps that left the ring (a cotangent, a torch RNG state), copied into
    by the steps that follow instead of keeping a new allocation per step.

    A ring buffer that keeps what autograd allocated in the middle of a backward pass (a
    cotangent) pins that spot of the heap for ``capacity`` steps; glibc's allocator then cannot
    reuse or return the memory freed around it, and the process's RSS grows far beyond the bytes
    held (measured: +120 MiB over 3,000 steps with ``capacity=1000`` and a 5 KiB cotangent a step,
    while the plain loop stays flat). Recycling the few tensors a step keeps on the host side of
    its own allocations (copied into once the step is over: :meth:`settle`) makes the heap reach a
    steady state after one pass of the ring.

    A tensor is taken back (:meth:`reclaim`) only when nothing but its step refers to it
    (reference counts: a step record kept by the caller, or an RNG state shared with a later step,
    is left alone). At most :attr:`limit` spares are kept; they are not counted against the
    budget (each is the size of the one the next step keeps).

    In a long ring the first pass allocates too: each step's cotangent and moved RNG state, made
    in the middle of the step's own allocations and kept for ``capacity`` steps, fragments the
    heap the same way before any step has left. So the first time a kind of spare (shape, dtype,
    device) is missing, ``burst`` of them are made at once, next to each other (only for tensors
    under :data:`BURST_MAX_BYTES`, which glibc serves from its heap rather than from their own
    mappings, and only when ``room(bytes)`` says they fit: a quarter of the budget); free spares
    count against the budget (:meth:`nbytes`, :meth:`RingBuffer.kept_bytes`) and are dropped
    before any step is evicted. The input capture copies small batch tensors into spares too
    (:attr:`~nanreplay.capture.inputs.InputCapture.spare`). A burst is zero-filled: its pages are
    the process's at once (the budget counts them from then on), so the RSS does not creep up by
    the ring's size as the ring fills. Measured with ``capacity=1000`` (``bench/README.md``): 2.1
    MiB of RSS growth over steps 100-3,000 (28 MiB while the ring filled, before the fill), 0.3 MiB
    once the ring is full.

    Off (``on=False``) for a ring shorter than :data:`RECYCLE_FROM` steps: the few allocations it
    pins turn over within a few steps, so recycling (a copy and a few reference counts a step,
    about 10 µs on a small CPU model) buys nothing there."""

    limit = 4

    def __init__(self, *, on: bool = True, burst: int = 0, room: Optional[Any] = None) -> None:
        self.on = on
        self.burst = burst if on else 0
        self._room = room
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._made: set[tuple] = set()   # kinds made in a burst already (once each)
        self._bytes = 0

    def nbytes(self) -> int:
        """Bytes of the free spares (counted against the budget)."""
        return self._bytes

    def clear(self) -> None:
        """Drop the free spares (the ring is over its budget)."""
        self._free.clear()
        self._bytes = 0

    def take(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """A spare (contiguous) of ``like``'s shape, dtype and device, removed from the spares, else
        ``None``; the first time a kind is missing in a long ring, a burst of them is made."""
        if not self.on:
            return None
        key = (like.shape, like.dtype, like.device)
        free = self._free.get(key)
        if free:
            t = free.pop()
            self._bytes -= _bytes_of(t)
            return t
        size = _bytes_of(like)
        if self.burst > 1 and key not in self._made and size <= BURST_MAX_BYTES and (self._room is None or self._room(size * self.burst)):
            self._made.add(key)
            made = [torch.zeros(like.shape, dtype=like.dtype, device=like.device) for _ in range(self.burst)]  # touched now
            t = made.pop()
            self._free[key] = made
            self._bytes += size * len(made)
            return t
        return None

    def settle(self, rec: StepRecord) -> None:
        """The step is over: each cotangent it keeps as a plain tensor moves into a spare, when one
        fits (the one autograd allocated is freed; with the spares off, :meth:`take` finds none)."""
        for fw in rec.forwards:
            c = fw.cotangent
            if isinstance(c, torch.Tensor) and c.is_contiguous() and not c.requires_grad:  # an expanded one holds next to nothing
                spare = self.take(c)
                if spare is not None:
                    spare.copy_(c)
                    fw.cotangent = spare

    def reclaim(self, r: StepRecord, copies: Any = ()) -> None:
        """``r`` left the ring: keep its cotangents and torch RNG state as spares, when nothing
        else refers to them (nor to ``r``), and ``copies``, the batch copies the input capture
        made for it (only ``r`` refers to them when nothing else refers to ``r``)."""
        if not self.on or sys.getrefcount(r) > _REFS_OF_DROPPED_STEP:
            return
        for t in copies:
            if _sole_storage(t):
                self._offer(t)
        for fw in r.forwards:
            c = fw.cotangent
            if isinstance(c, torch.Tensor) and sys.getrefcount(c) <= _REFS_OF_ATTRIBUTE and _sole_storage(c):
                fw.cotangent = None
                self._offer(c)
        st = r.rng
        if st is not None and sys.getrefcount(st) <= _REFS_OF_ATTRIBUTE:
            t = st.torch_cpu
            if sys.getrefcount(t) <= _REFS_OF_ATTRIBUTE and _sole_storage(t):
                self._offer(t)

    def _offer(self, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            return
        free = self._free.setdefault((t.shape, t.dtype, t.device), [])
        if len(free) < max(self.limit, self.burst):
            free.append(t)
            self._bytes += _bytes_of(t)


def _bytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its storage)."""
    return t.numel() * t.element_size()


#: the largest spare made in a burst, bytes: glibc serves larger allocations from their own
#: mappings (its mmap threshold starts at 128 KiB), which leave the heap unfragmented
BURST_MAX_BYTES = 64 << 10
#: the shortest ring buffer, in steps, whose cotangents and RNG states are recycled (:class:`Spares`)
RECYCLE_FROM = 16
#: ``sys.getrefcount`` of a step record that only :meth:`RingBuffer._drop_oldest` and
#: :meth:`Spares.reclaim` hold (their names and the call's argument)
_REFS_OF_DROPPED_STEP = 3
#: ``sys.getrefcount`` of an object that one attribute refers to, read into a local name
_REFS_OF_ATTRIBUTE = 3


def _sole_storage(t: torch.Tensor) -> bool:
    """Whether no other tensor shares ``t``'s storage (a view the user kept, the gradient autograd
    handed a hook of theirs): then writing into ``t`` changes nothing anyone else sees. ``False``
    when torch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    try:
        return use_count(t.untyped_storage()._cdata) <= 2  # t's own, and the storage object just made to ask
    except (RuntimeError, AttributeError):
        return False


def _snapshot_bytes(r: StepRecord) -> int:
    return r.snapshot.nbytes() if r.snapshot is not None else 0


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the elements of the tensors among ``tensors`` (an iterable; anything else is
    skipped), as the copies the modes keep count them."""
    return sum(_bytes_of(t) for t in tensors if isinstance(t, torch.Tensor))


def _nbytes(tensors: Any) -> int:
    """:func:`tensor_bytes` of this rank's shards (a ``DTensor``'s local tensor)."""
    return tensor_bytes(map(local, tensors))


def check_budget(config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, at construction, a mode whose fixed copy cannot fit in ``config.memory_budget``:
    ``check_update`` keeps one copy of the weights, buffers and optimizer state; ``check_every > 1``
    one copy of the weights, optimizer state and gradients (the latch). Optimizer state created
    lazily at the first step is not known yet: then the Recorder turns the mode off at that step,
    with a warning, if the copy has outgrown the budget (:meth:`RingBuffer.reserve`).

    Raises:
        ValueError: the budget is below the mode's copy; the message says the minimum in bytes and
            MiB and the two ways out.
    """
    needs = []
    if config.check_update or config.check_every > 1:
        params = _nbytes(model.parameters())
        state = _nbytes(pytree.tree_leaves(optimizer.state_dict()["state"]))
        if config.check_update:
            needs.append(("check_update=True", "check_update", "one copy of the weights, buffers and optimizer state",
                          params + _nbytes(model.buffers()) + state))
        if config.check_every > 1:
            grads = _nbytes(p for p in model.parameters() if p.requires_grad)
            needs.append((f"check_every={config.check_every}", "check_every=1", "one device-side copy of the weights, optimizer "
                          "state and gradients", params + state + grads))
    budget = config.memory_budget
    for mode, off, what, need in needs:
        if budget < need:
            raise ValueError(
                f"memory_budget={budget} bytes ({budget / MiB:.2f} MiB) cannot hold what {mode} keeps: {what}, {need} bytes "
                f"({need / MiB:.2f} MiB) for this model and optimizer (more once the optimizer creates its state); raise "
                f"memory_budget to at least {need} bytes ({need / MiB:.2f} MiB), or use {off if '=' in off else off + '=False'}"
            )
