"""Keeping a step's batch and forward inputs at no copy cost, while it is safe.

Batches are kept as references and their version counters are checked later: a tensor the loop
modified in place after capture (a recycled input buffer, ``x.mul_(...)`` on the batch) no longer
holds what the step saw. The first time that is seen (or a storage seen in an earlier step comes
back as an input), capture switches to copies for the rest of the run; steps captured by reference
before that are marked stale when a bundle is written.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..core.tree import map_tensors

logger = logging.getLogger(__name__)

__all__ = ["InputCapture"]


class _Ref:
    """A tensor reference plus its version counter at capture time."""

    __slots__ = ("t", "v")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.v = t, t._version

    def fresh(self) -> bool:
        return self.t._version == self.v


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
        self._storages: dict[int, int] = {}        # storage address -> last step it was an input of
        self._refs: dict[int, list[_Ref]] = {}     # step -> references captured in it

    def capture(self, tree: Any, step: int) -> Any:
        """``tree`` with every tensor detached and referenced (or cloned), for step ``step``."""
        refs = self._refs.setdefault(step, [])

        def cap(x: torch.Tensor) -> torch.Tensor:
            x = x.detach()
            if self.policy is not False:
                try:
                    ptr = x.untyped_storage().data_ptr()
                except RuntimeError:  # a tensor without storage (e.g. a functional wrapper)
                    ptr = 0
                if ptr and self._storages.get(ptr, step) != step and not self.copying:
                    self.copying = True
                    logger.info("nanreplay: the loop reuses an input buffer across steps; batches are copied from now on")
                if ptr:
                    self._storages[ptr] = step
            if self.copying:
                return x.clone()
            refs.append(_Ref(x))
            return x

        return map_tensors(cap, tree)

    def seal(self, step: int) -> None:
        """End of step ``step``: switch to copies (auto policy) when one of its references was
        modified in place during the step."""
        if self.policy is None and not self.copying and any(not r.fresh() for r in self._refs.get(step, ())):
            self.copying = True
            logger.info("nanreplay: a batch tensor was modified in place during the step; batches are copied from now on")

    def stale(self, step: int) -> bool:
        """Whether a reference kept for step ``step`` was modified in place since capture."""
        return any(not r.fresh() for r in self._refs.get(step, ()))

    def keep_only(self, step: int, tensors: list[torch.Tensor]) -> None:
        """Forget the references of step ``step`` except those to ``tensors``."""
        kept = {id(t) for t in tensors}
        self._refs[step] = [r for r in self._refs.get(step, []) if id(r.t) in kept]

    def forget(self, step: int) -> None:
        """Drop the references of a step that left the ring buffer."""
        self._refs.pop(step, None)
