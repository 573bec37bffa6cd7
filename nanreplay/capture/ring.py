"""The ring buffer of the last steps, kept within a number of steps and a number of bytes.

Eviction order when over the byte budget: weight snapshots of older steps first (they are the
largest and only ``bisect`` needs them), then whole older steps; the step in progress and the
steps whose verdict is still on the device (the sync-free check) are never evicted. What cannot
fit at all (a single snapshot larger than the budget) is refused once, with a warning, rather
than copied every step and dropped again.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Collection, Iterator, Optional

from ..format.records import StepRecord

logger = logging.getLogger(__name__)

__all__ = ["RingBuffer"]


class RingBuffer:
    """The last ``capacity`` steps, oldest first; a sequence of :class:`StepRecord`.

    Args:
        capacity: most steps kept.
        budget: most bytes the kept steps (and ``extra`` bytes given to :meth:`evict`) may hold.
        held: bytes a step keeps alive beyond what training holds anyway, its snapshot excluded
            (the recorder counts batch storages, cotangents and copied buffers).
        on_drop: called with a step that leaves the buffer and whether its snapshot slot may be
            reused (``False`` when dropped to honour the budget).
    """

    def __init__(self, capacity: int, budget: int, *, held: Callable[[StepRecord], int],
                 on_drop: Callable[[StepRecord, bool], None], on_snapshot_drop: Callable[[StepRecord], None]) -> None:
        self.capacity = capacity
        self.budget = budget
        self._held = held
        self._on_drop = on_drop
        self._on_snapshot_drop = on_snapshot_drop
        self._steps: deque[StepRecord] = deque()
        self._cache: dict[int, int] = {}   # step -> held bytes, once the step is over
        self.snapshots_refused = False     # a single snapshot was larger than the budget

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

    # -- bookkeeping -------------------------------------------------------------------------
    def append(self, rec: StepRecord) -> None:
        self._steps.append(rec)

    def drop_oldest(self, *, reuse: bool = True) -> StepRecord:
        r = self._steps.popleft()
        self._cache.pop(r.step, None)
        self._on_drop(r, reuse)
        return r

    def bytes_of(self, r: StepRecord, *, current: Optional[StepRecord] = None) -> int:
        """Bytes step ``r`` keeps alive, its snapshot included. Cached once the step is over (its
        content no longer changes); the snapshot is counted apart, since eviction drops it first."""
        n = self._cache.get(r.step) if r is not current else None
        if n is None:
            n = self._held(r)
            if r is not current:
                self._cache[r.step] = n
        return n + (r.snapshot.nbytes() if r.snapshot is not None else 0)

    def held_bytes(self, *, current: Optional[StepRecord] = None) -> int:
        return sum(self.bytes_of(r, current=current) for r in self._steps)

    def make_room(self) -> None:
        """Drop the oldest steps until one more fits within ``capacity``."""
        while len(self._steps) >= self.capacity:
            self.drop_oldest()

    def evict(self, *, extra: int = 0, protect: Collection[int] = (), current: Optional[StepRecord] = None) -> int:
        """Keep within ``capacity`` steps and ``budget`` bytes (``extra``: bytes held elsewhere that
        count against the same budget and cannot be evicted here). ``protect``: ids of records
        never evicted. Returns the bytes held after eviction (``extra`` included)."""
        while len(self._steps) > self.capacity and id(self._steps[0]) not in protect:
            self.drop_oldest()
        total = self.held_bytes(current=current) + extra
        for r in list(self._steps)[:-1]:  # oldest snapshots first
            if total <= self.budget:
                return total
            if r.snapshot is not None:
                total -= r.snapshot.nbytes()
                self._on_snapshot_drop(r)
        while total > self.budget and len(self._steps) > 1 and id(self._steps[0]) not in protect and self._steps[0] is not current:
            total -= self.bytes_of(self.drop_oldest(reuse=False), current=current)
        if total > self.budget and self._steps:
            r = self._steps[-1]
            if r.snapshot is not None:
                size = r.snapshot.nbytes()
                total -= size
                self._on_snapshot_drop(r)
                if not self.snapshots_refused:
                    self.snapshots_refused = True
                    logger.warning(
                        "nanreplay: one weight snapshot (%d bytes) does not fit in memory_budget=%d bytes with the rest of the "
                        "ring buffer; weight snapshots are off from now on (bisect --over layers/steps will lack them). Raise "
                        "memory_budget or lower capacity to keep them", size, self.budget)
        return total
