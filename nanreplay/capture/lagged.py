"""The sync-free check (``check_every=N > 1``): the verdict stays on the device, like
GradScaler's ``found_inf``, and the host reads it once every N steps.

:class:`LaggedCheck` owns the mode's state: the steps whose verdict is still on the device (their
grad norm and loss as device scalars, the steps pinned in the ring buffer until read) and the
:class:`Latch`, a device-side slot that keeps the first non-finite step's pre-step weights,
optimizer state and gradients until the host reads the verdicts, so its bundle holds the same
content as with a per-step check. :func:`nonfinite_flag` is the device-side verdict of one step.

Memory: the latch (params + optimizer state + gradients) counts against ``memory_budget`` in the
ring buffer. When it would have to grow (the optimizer creates its state at its first step) past
what the budget can hold beside the step in progress, :meth:`LaggedCheck.push` says so and the
Recorder falls back to the per-step check. Unchecked steps are never evicted; when they alone keep
the ring over its budget, the Recorder reads their verdicts early (one host sync) so they can be.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import contextlib
import logging
import math
from itertools import chain
from operator import attrgetter, is_, itemgetter

import torch
from torch.utils import _pytree as pytree

from ..format.records import Snapshot, StepRecord
from .ring import MiB, tensor_bytes
from .sharded import local

logger = logging.getLogger(__name__)

__all__ = ["LaggedCheck", "Latch", "advise", "can_freeze", "check_combination", "nonfinite_flag"]


def check_combination(config: Any, *, scaler: Any) -> None:
    """Refuse ``check_every > 1`` with what it does not combine with yet.

    Raises:
        ValueError: with torch.distributed initialised, a GradScaler, or ``check_update=True``.
    """
    if config.check_every <= 1:
        return
    pg = torch.distributed.is_available() and torch.distributed.is_initialized()
    clash = [n for n, on in (("torch.distributed", pg), ("a GradScaler", scaler is not None), ("check_update=True", config.check_update)) if on]
    if clash:
        raise ValueError(
            f"check_every={config.check_every} (the sync-free check) does not yet combine with {', '.join(clash)}; "
            "use check_every=1 there (one host read per step)"
        )


def advise(config: Any, model: torch.nn.Module, *, scaler: Any) -> None:
    """One INFO line when the per-step check (``check_every=1``) runs on a CUDA model where the
    sync-free mode could: its one host read per step lets the device's queue run dry (1.19x
    against 1.024x for ``check_every=8`` on GPT-2 small's shape on an H200, ``bench/README.md``)."""
    if config.check_every != 1 or scaler is not None or config.check_update:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        logger.info("nanreplay: the check reads one value on the host per step, after which the GPU's queue runs dry until "
                    "the next kernels are launched; Recorder(..., check_every=8) reads every 8 steps without a sync "
                    "(the same bundle, its verdict up to 8 steps later; measured in bench/README.md)")


def nonfinite_flag(norm: Optional[torch.Tensor], loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 0-dim bool device tensor: True when the grad norm or the loss is non-finite. No sync."""
    flags = [torch.logical_not(torch.isfinite(t.detach().reshape(()))) for t in (norm, loss) if t is not None]
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = out | f.to(out.device)
    return out


_PARAMS, _SHAPE = itemgetter("params"), attrgetter("shape")


def _layout(tensors: list) -> tuple:
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def can_freeze(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its own update on the device when given a ``found_inf`` flag,
    as it does under a GradScaler: torch's fused optimizers (``fused=True``: Adam, AdamW, SGD,
    Adagrad) say so with ``_step_supports_amp_scaling``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class Latch:
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

    With ``freeze`` (a fused optimizer, whose update the flag skips on the device: the
    Recorder sets ``optimizer.found_inf`` to ``latched``, as GradScaler does) the params and
    optimizer state stay as they were before the first non-finite step by themselves: only the
    gradients are latched, the slot holds no copy of the weights (a third of the bytes and of
    the per-step ``where`` calls for Adam).

    Tensors off the flag's device type (a non-fused optimizer's ``step`` counters stay on the
    CPU beside CUDA weights) cannot be selected by a device flag without a sync: each step's
    values of those are kept on the host (:meth:`update`'s ``step``) and the first non-finite
    step's are put in the slot when the host has read which step that was (:meth:`settle`).
    """

    def __init__(self, freeze: bool = False) -> None:
        self.freeze = freeze
        self.latched: Optional[torch.Tensor] = None  # 0-dim bool, device
        self.key: Optional[tuple] = None
        self.names: list[str] = []
        self.slot: list[torch.Tensor] = []  # the copies: params + optimizer state + gradients (gradients only with freeze)
        self.live: list[torch.Tensor] = []  # with freeze: the live params + optimizer state tensors, not copied
        self.split = (0, 0)  # (params, optimizer state tensors) counts
        self.off: list[int] = []  # slot positions off the flag's device type, kept per step in history
        self.history: dict[int, list[torch.Tensor]] = {}
        self.param_names: list[str] = []
        self._ids: Any = None  # what identified the live params and optimizer state when the module tree was last walked
        self._params: list = []

    @property
    def params(self) -> list[torch.Tensor]:
        return (self.live if self.freeze else self.slot)[:self.split[0]]

    @property
    def opt(self) -> list[torch.Tensor]:
        n_p, n_o = self.split
        return (self.live if self.freeze else self.slot)[n_p:n_p + n_o]

    @property
    def grads(self) -> list[torch.Tensor]:
        return self.slot[len(self.slot) - len(self.names):]

    def update(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list, bad: torch.Tensor, *,
               room: Optional[Callable[[int], bool]] = None, step: int = 0) -> bool:
        """Move the latch for step ``step``: ``grads`` are its ``(fqn, gradient)`` pairs, ``bad``
        its 0-dim bool device flag (non-finite grad norm or loss). No host sync, but on a layout
        change. ``room(nbytes)``: asked before the slot is (re)allocated; when it says no,
        nothing changes and ``False`` is returned."""
        params, opt_t, ids = self._live_state(model, optimizer)
        g = [t.detach() for _, t in grads]
        live = [p for _, p in params] + opt_t
        copied = g if self.freeze else live + g
        key = (ids, tuple(n for n, _ in grads), _layout(g), None if self.freeze else tuple(map(_SHAPE, live)))
        dev = bad.device
        if key != self.key:
            if self.latched is not None and bool(self.latched):  # layout change after a latch: keep it frozen
                self.latched = self.latched | bad
                return True
            if room is not None and not room(tensor_bytes(copied)):
                return False
            self.key, self.names, self.split = key, [n for n, _ in grads], (len(params), len(opt_t))
            self.param_names = [n for n, _ in params]
            self.slot = [t.detach().clone() for t in copied]
            self.off = [i for i, t in enumerate(copied) if t.device.type != dev.type]
            self.history = {}
            self.latched = torch.zeros((), dtype=torch.bool, device=dev)
        else:
            keep, off = self.latched, set(self.off)
            keeps = {dev: keep}
            with torch.no_grad():
                for i, (dst, src) in enumerate(zip(self.slot, copied)):
                    if i not in off:
                        d = dst.device
                        torch.where(keeps[d] if d in keeps else keeps.setdefault(d, keep.to(d)), dst, src, out=dst)
        if self.off:
            self.history[step] = [copied[i].detach().clone() for i in self.off]
        if self.freeze:
            self.live = live
        self.latched = self.latched | bad
        return True

    def _live_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list, Any]:
        """The live ``(fqn, parameter)`` pairs and optimizer state tensors (in the order of
        ``optimizer.state_dict()["state"]`` flattened, which :meth:`snapshot` follows), and what
        identifies them. Per step one pass over ``optimizer.state`` and the param groups; the
        module tree and the state dict are walked again only when those objects changed (the
        state created at a first step, ``load_state_dict``), or every step for an optimizer
        whose ``state_dict()`` does not hand out its state's own tensors in that order."""
        opt_t = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        ids = (tuple(map(id, chain.from_iterable(map(_PARAMS, optimizer.param_groups)))), tuple(map(id, opt_t)))
        if ids == self._ids:
            return self._params, opt_t, ids
        params = [(n, local(p)) for n, p in model.named_parameters()]  # DTensor: this rank's shard
        leaves = pytree.tree_leaves(optimizer.state_dict()["state"])
        sd_t = [local(t) for t in leaves if isinstance(t, torch.Tensor)]
        same = len(sd_t) == len(opt_t) and all(map(is_, sd_t, opt_t))
        self._ids, self._params = (ids if same else None), params
        return params, sd_t, (ids if same else tuple(map(id, sd_t)))

    def settle(self, step: int) -> None:
        """Put step ``step``'s values (the first non-finite step's, read on the host) of the
        tensors off the flag's device into the slot."""
        kept = self.history.get(step)
        if kept is not None:
            for i, t in zip(self.off, kept):
                self.slot[i].copy_(t)

    def reset(self) -> None:
        """Open the latch again after a host check; the slot's tensors are kept for reuse."""
        self.history = {}
        if self.latched is not None:
            self.latched = torch.zeros_like(self.latched)

    def snapshot(self, live_sd: dict, rec: StepRecord) -> Snapshot:
        """The latched step's pre-step state as a Snapshot (params, buffers from the ring record,
        optimizer state with the slot's tensors and the live non-tensor entries, lrs of ``rec``)."""
        names = self.param_names
        leaves, spec = pytree.tree_flatten(live_sd["state"])
        it = iter(self.opt)
        state = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        groups = [dict(gr) for gr in live_sd["param_groups"]]
        for gr, lr in zip(groups, rec.lrs):
            gr["lr"] = lr
        return Snapshot(
            params={n: p.detach() for n, p in zip(names, self.params)},
            buffers=dict(rec.buffers or {}),
            optimizer={"state": state, "param_groups": groups},
            extra={},
        )

    def grad_list(self) -> list:
        return list(zip(self.names, self.grads))

    def nbytes(self) -> int:
        """Bytes of the copies the latch holds (the slot, and the host history of the tensors off the flag's device)."""
        return tensor_bytes(self.slot) + sum(tensor_bytes(h) for h in self.history.values())


def _to_host(values: list) -> tuple[Optional[torch.Tensor], Any]:
    """A step's device scalars as one float32 tensor, and on CUDA its copy to pinned host memory
    started now with the event that marks it done: ``(values, event or None)``. No sync."""
    if not values:
        return None, None
    dev = values[0].device
    flat = torch.stack([v.detach().reshape(()).to(device=dev, dtype=torch.float32) for v in values])
    if dev.type != "cuda":
        return flat, None
    host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class LaggedCheck:
    """The sync-free check's state: the latch, and the steps whose verdict is still on the device.

    Args:
        every: ``check_every``, the steps between host reads.
        ring: the ring buffer: it pins the unchecked steps and counts the latch (as ``"latch"``).
        freeze: the optimizer skips its update on the device once the latch holds
            (:func:`can_freeze`; only where the action puts the pre-step state back anyway, so
            the state after the host read is the same): :meth:`push` sets its ``found_inf``,
            :meth:`after_step` takes it away.

    Attributes:
        latch: the :class:`Latch`. refused: bytes the latch needed when :meth:`push` refused it.
    """

    def __init__(self, every: int, ring: Any, *, freeze: bool = False) -> None:
        self.every = every
        self.ring = ring
        self.latch = Latch(freeze)
        self.refused = 0
        # per unread step: its record, whether it has a norm / a loss, their values (a device tensor, or on
        # CUDA a pinned host buffer being filled) and the CUDA event recorded after the copy (else None)
        self._pending: list[tuple[StepRecord, bool, bool, Optional[torch.Tensor], Any]] = []

    @property
    def freeze(self) -> bool:
        """Whether the optimizer skips its own update under the latch (the latch's mode)."""
        return self.latch.freeze

    @property
    def pending(self) -> list[StepRecord]:
        """The steps whose verdict is still on the device, oldest first."""
        return [p[0] for p in self._pending]

    def push(self, rec: StepRecord, norm: Optional[torch.Tensor], loss: Optional[torch.Tensor], model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, grads: list) -> bool:
        """Keep step ``rec``'s grad norm and loss (device scalars) unread and move the latch. No
        host sync. Returns ``False``, keeping nothing, when the latch would have to grow past what
        the memory budget can hold (then :attr:`refused` says how many bytes it needed)."""

        def room(nbytes: int) -> bool:
            if self.ring.reserve("latch", nbytes):
                return True
            self.refused = nbytes
            return False

        bad = nonfinite_flag(norm, loss)
        if bad is not None:
            if not self.latch.update(model, optimizer, grads, bad, room=room, step=rec.step):
                return False
            self.ring.keep("latch", self.latch)
            if self.freeze:  # the fused update reads it (as under a GradScaler): skipped from the first non-finite step on
                optimizer.found_inf = self.latch.latched.to(torch.float32)
        self._pending.append((rec, norm is not None, loss is not None, *_to_host([t for t in (norm, loss) if t is not None])))
        self.ring.pin(rec)
        return True

    def due(self) -> bool:
        """Whether ``every`` steps wait for their verdict."""
        return len(self._pending) >= self.every

    def read(self) -> Optional[StepRecord]:
        """Read every pending verdict into its step's ``grad_norm``, ``loss`` and ``finite``, and
        unpin the steps. On CUDA the values were copied to pinned host memory when each step was
        pushed, so this waits only for the event recorded after the last step's copy, never for
        the stream's later work (the Recorder reads before it pushes the step in progress: the
        forward and backward pass it has queued keep the device busy meanwhile); elsewhere it is
        one host read. Returns the first non-finite step, whose pre-step state and gradients the
        latch holds (the steps after it ran on corrupted weights, or on the frozen ones: their
        ``finite`` is ``None``); else ``None``, and the latch opens again."""
        pending, self._pending = self._pending, []
        events = [p[4] for p in pending if p[4] is not None]
        if events and not events[-1].query():  # stream order: the last copy done means all are
            events[-1].synchronize()
        vals = [p[3] for p in pending if p[3] is not None]
        host = iter(torch.cat([v.to(vals[0].device) for v in vals]).tolist() if vals else [])  # one read (host memory on CUDA)
        first: Optional[StepRecord] = None
        for r, has_norm, has_loss, _, _ in pending:
            self.ring.unpin(r)
            r.grad_norm = next(host) if has_norm else None
            r.loss = next(host) if has_loss else None
            if first is not None:
                r.finite = None  # ran on corrupted weights: its verdict says nothing
                continue
            r.finite = not any(v is not None and not math.isfinite(v) for v in (r.grad_norm, r.loss))
            if not r.finite:
                first = r
        if first is None:
            self.latch.reset()
        else:
            self.latch.settle(first.step)
        return first

    @staticmethod
    def after_step(optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step is over: the ``found_inf`` flag :meth:`push` gave it goes."""
        optimizer.__dict__.pop("found_inf", None)

    @contextlib.contextmanager
    def pre_step_state(self, first: StepRecord, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, restore: bool,
                       diagnose: bool, live_copy: Callable[[], Snapshot]) -> Iterator[tuple[Snapshot, list]]:
        """For the non-finite step ``first`` that :meth:`read` returned: its pre-step state from the
        latch and its gradients. With ``restore`` (the action puts the state back) the state is
        put into ``model`` and ``optimizer`` for good; with ``diagnose`` only, for the block (the
        live state, ``live_copy()``, comes back after it). The latch opens again after the block."""
        from .snapshots import restore_into

        latch = self.latch
        state = latch.snapshot(optimizer.state_dict(), first)
        saved = None
        if restore or diagnose:  # frozen (a fused optimizer), the live params and state already are the pre-step ones: the buffers are not
            saved = None if restore else live_copy()
            restore_into(model, optimizer, state)
        try:
            yield state, latch.grad_list()
        finally:
            if saved is not None:
                restore_into(model, optimizer, saved)
            latch.reset()

    def close(self, required: int) -> None:
        """The mode is over because its latch needed :attr:`refused` bytes, and the budget
        ``required`` bytes with the step in progress: warn, free the latch, stop counting it."""
        budget = self.ring.budget
        logger.warning(
            "nanreplay: check_every=%d keeps a device-side copy of the weights, optimizer state and gradients (%d bytes, %.2f "
            "MiB), which memory_budget=%d bytes (%.2f MiB) cannot hold beside the step in progress; the check reads its "
            "verdict on the host every step from now on (check_every=1). Raise memory_budget to at least %d bytes (%.2f MiB) "
            "to keep it sync-free", self.every, self.refused, self.refused / MiB, budget, budget / MiB, required, required / MiB)
        for p in self._pending:
            self.ring.unpin(p[0])
        self._pending = []
        self.ring.release("latch")
        self.latch = Latch()
