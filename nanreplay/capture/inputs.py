"""Keeping a step's batch and forward inputs at no copy cost, while it is safe.

Batches are kept as references and their version counters are checked later: a tensor the loop
modified in place after capture (a recycled input buffer, ``x.mul_(...)`` on the batch) no longer
holds what the step saw. The first time that is seen (or a storage seen in an earlier step comes
back as an input), capture switches to copies for the rest of the run; steps captured by reference
before that are marked stale when a bundle is written.
"""

from __future__ import annotations

import logging
from itertools import repeat
from operator import itemgetter
from typing import Any, Optional

import torch

from ..core.tree import map_tensors

logger = logging.getLogger(__name__)

__all__ = ["InputCapture"]

_TENSOR = repeat(torch.Tensor)
_TENSOR_OF = itemgetter(0)  # the tensor of a captured (tensor, version, address) tuple


#: the version a copy keeps in its captured tuple. Each captured tensor is kept per step as
#: ``(tensor, version, storage address)``: a reference keeps its version counter at capture time,
#: a copy (which nothing outside the Recorder can change) this; the address is its storage's while
#: it is watched for reuse, else 0. (Tuples, not objects: two or more are made every step.)
_REF_COPY = None


class InputCapture:
    """Captures batch trees for the ring buffer, by reference or by copy.

    Args:
        copy_batch: ``None`` (auto: references until a batch tensor is seen reused or modified in
            place, copies from then on), ``True`` (always copy), ``False`` (never copy).

    Attributes:
        copying: whether captures are copies now.
    """

    def __init__(self, copy_batch: Optional[bool]) -> None:
        self.policy = copy_batch
        self.copying = copy_batch is True
        self._storages: dict[int, int] = {}        # storage address -> last step it was an input of (steps held only)
        self._refs: dict[int, list[tuple]] = {}    # step -> every tensor captured in it, as (tensor, version, address)
        self._same_step: Optional[int] = None
        self._same: dict[int, tuple] = {}          # id(tensor given) -> (it, its capture), within the step in progress
        #: ``spare(like)``: a recycled tensor of ``like``'s shape to copy a batch tensor into, or ``None``
        #: (a long ring's :class:`~nanreplay.capture.ring.Spares`; ``None`` here: references only)
        self.spare: Optional[Any] = None

    def capture(self, tree: Any, step: int) -> Any:
        """``tree`` with every tensor referenced (detached first when it requires grad) or cloned, for step ``step``; the
        tensors kept are listed in :meth:`tensors` (one walk of ``tree``). A tensor already
        captured in the step (the batch given to ``record`` and then to the model) is kept once."""
        self._refs.setdefault(step, [])  # what _cap appends to (a method: no closure made per call)
        if self._same_step != step:
            self._same_step, self._same = step, {}
        kind = type(tree)
        if (kind is tuple or kind is list) and all(map(isinstance, tree, _TENSOR)):  # a flat batch or forward args
            return tuple(map(self._cap, tree)) if kind is tuple else list(map(self._cap, tree))
        return map_tensors(self._cap, tree)

    def _cap(self, x: torch.Tensor) -> torch.Tensor:
        """One tensor of :meth:`capture`'s tree, for the step of the last capture: its reference or copy, as kept."""
        known = self._same.get(id(x))
        if known is not None and known[0] is x:
            return known[1]
        orig, step = x, self._same_step
        refs = self._refs[step]
        if x.requires_grad:  # a batch tensor is usually a leaf without grad: kept as is, no new tensor object
            x = x.detach()
        spare = self.spare(x) if self.spare is not None and self.policy is not False and x.is_contiguous() else None
        if spare is not None:  # a long ring: into a recycled tensor, not a reference that pins the loop's allocation
            x = spare.copy_(x)
            refs.append((x, _REF_COPY, 0))
        else:
            ptr = 0
            if not self.copying and self.policy is not False:
                # its storage is watched: an input of an earlier step still held means the loop refills one
                # buffer (the references held would change under the ring buffer): copies from now on
                try:
                    ptr = x.untyped_storage().data_ptr()
                except RuntimeError:  # a tensor without storage (e.g. a functional wrapper)
                    pass
                if ptr and self._storages.get(ptr, step) != step:
                    ptr = 0
                    self._copy_from_now("the loop reuses an input buffer across steps")
                elif ptr:
                    self._storages[ptr] = step
            if self.copying:
                x = x.clone()
            refs.append((x, _REF_COPY if self.copying else x._version, ptr))
        self._same[id(orig)] = (orig, x)
        return x

    def _copy_from_now(self, why: str) -> None:
        """Switch to copies (auto policy), saying ``why``; the watched storages are not needed any more."""
        self.copying = True
        self._storages.clear()
        logger.info("nanreplay: %s; batches are copied from now on", why)

    def copies(self, step: int) -> list[torch.Tensor]:
        """The tensors of step ``step`` that are copies this capture made (nothing outside the
        Recorder has them), in capture order."""
        return [t for t, v, _ in self._refs.get(step, ()) if v is None]

    def tensors(self, step: int) -> list[torch.Tensor]:
        """Every tensor captured for step ``step`` (references or copies), in capture order."""
        return list(map(_TENSOR_OF, self._refs.get(step, ())))

    def device_type(self, step: int) -> Optional[str]:
        """The device type of the first tensor captured for step ``step`` that is not on the CPU, else ``None``."""
        for t, _, _ in self._refs.get(step, ()):
            if not t.is_cpu:
                return t.device.type
        return None

    def seal(self, step: int) -> None:
        """End of step ``step``: switch to copies (auto policy) when one of its references was
        modified in place during the step."""
        if self.policy is None and not self.copying and self.stale(step):
            self._copy_from_now("a batch tensor was modified in place during the step")

    def stale(self, step: int) -> bool:
        """Whether a reference kept for step ``step`` was modified in place since capture."""
        for t, v, _ in self._refs.get(step, ()):  # a reference whose version counter moved (a copy has none)
            if v is not None and t._version != v:
                return True
        return False

    def keep_only(self, step: int, tensors: list[torch.Tensor]) -> None:
        """Forget the references of step ``step`` except those to ``tensors``."""
        kept = {id(t) for t in tensors}
        self._refs[step] = [r for r in self._refs.get(step, []) if id(r[0]) in kept]
        self._same = {k: v for k, v in self._same.items() if id(v[1]) in kept}

    def forget(self, step: int) -> None:
        """Drop the references of a step that left the ring buffer, and its storages: once no
        step holds a reference to one, the allocator may hand its address to a new batch, which
        is no reuse."""
        for _, _, ptr in self._refs.pop(step, ()):
            if ptr and self._storages.get(ptr) == step:
                del self._storages[ptr]
