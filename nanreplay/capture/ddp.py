"""Multi-process training: cross-rank agreement, the origin rank, and per-rank bundles.

In data-parallel training a non-finite gradient born on one rank is averaged into every rank's
gradients by the gradient all-reduce, in the same step. Four mechanisms keep the recorder useful
there; a :class:`~nanreplay.capture.recorder.Recorder` built inside an initialised process group sets
them up itself:

* **Agreement.** Every rank's check all-reduces (``MAX``) one small float32 vector of
  ``world_size + 1`` flags, on the device of the grad norm, folded into the existing check: the
  flags are concatenated with the grad norm and the loss, so the step still has one host read.
  Every rank then takes the same decision (dump, skip, raise) in the same step, and no rank is
  left waiting in a collective while another raises.
* **Origin rank.** With a ``DistributedDataParallel`` model, the gradients are looked at where they
  are still this rank's own: at the end of the backward pass, before DDP's finalisation copies the
  reduced buckets back into ``.grad`` (an autograd-engine callback queued by a post-accumulate-grad
  hook on the parameters; no comm hook, so any comm hook of the user's, registered before or after
  the Recorder, runs unchanged). The flag is ``not isfinite(2-norm of the local gradients)``: one
  fused ``_foreach_norm``, on the device, no host read. Slot ``rank`` of the agreement vector holds
  it (or'd with the local loss's), so after the all-reduce every rank knows which ranks were the
  origin, and a rank whose flag is 0 knows it was clean. The rank-local gradient tensors are kept by
  reference, so the bundle holds them without a copy: DDP writes the reduced values into other
  tensors (:meth:`RankContext._pooling` says which). With ``gradient_as_bucket_view=True`` each gradient is a view of DDP's bucket that
  the all-reduce overwrites in place: there each parameter's gradient is flagged as it is
  accumulated (one 2-norm per parameter) and the bundle holds the reduced gradients.
* **Corrupted state.** On a step found non-finite, each rank also checks its own copy (under DDP)
  or shard (FSDP2, tensor parallel) of the weights and optimizer state as they were at step start
  (one more all-reduce, on the failure path only): a rank whose state already held a NaN or Inf
  is the origin, named with the first such element (:func:`nanreplay.capture.sharded.first_nonfinite_state`).
* **Per-rank bundles.** Each rank writes its own bundle, ``nanreplay-step{N}-rank{r}of{w}.h5``,
  with ``rank``, ``world_size``, every rank's origin flag, the run id and the sibling bundles'
  names in its metadata. Its ``grads`` are the rank-local gradients, so the origin rank's bundle
  replays on a single process (no process group) and reproduces that rank's gradients, and a
  clean rank's replays finite. Then every rank waits (bounded) until every rank has written, so
  that no rank's raise ends a ``torchrun`` job while a sibling is written; the origin rank writes
  torchrun's error file first, so that it is the job's root cause.

Costs per step: one all-reduce of ``world_size + 1`` floats; with origin detection, one
``_foreach_norm`` over the local gradients and one Python call per parameter per backward (the
post-accumulate-grad hook). No copy: the kept local gradients are the tensors autograd produced,
and DDP writes the reduced values into other ones. For gradients in host memory those are the
tensors kept at the last finite step (no allocation in steady state; one set of gradients more
between steps, counted in ``memory_budget``); on a device DDP allocates them, and the kept set
lives from the end of the backward to the check.

Sharded models (FSDP2 ``fully_shard``, tensor parallel ``DTensor`` parameters): the check reads
the local shards (:mod:`nanreplay.capture.sharded`); the origin flag comes from the rank's
unsharded gradients before the reduce-scatter (a wrapped ``set_custom_reduce_scatter``), its local
loss and its outputs' cotangents; each bundle holds the rank's shards and their layout, tied to
its siblings by the run id (see ``docs/distributed.md``).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..core.numerics import fused_norm
from ..engine.shards import describe_state

logger = logging.getLogger(__name__)

__all__ = ["RankContext", "unwrap_model", "unwrap_ddp_only", "rank_summary", "refuse_fsdp1", "write_root_cause"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module a data-parallel wrapper trains (``DistributedDataParallel.module``,
    ``DataParallel.module``); any other module unchanged."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def unwrap_ddp_only(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The ``DistributedDataParallel`` module in ``model``'s wrapper chain, if any."""
    m = model
    for _ in range(8):
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            return m
        m = getattr(m, "module", None) or getattr(m, "_orig_mod", None)
        if not isinstance(m, torch.nn.Module):
            return None
    return None


def refuse_fsdp1(model: torch.nn.Module) -> None:
    """Refuse a model wrapped (anywhere in its module tree) in FSDP1's ``FullyShardedDataParallel``.

    FSDP1 keeps each wrapped module's parameters in one flat parameter whose storage it swaps
    between the sharded and the unsharded views around every forward and backward; what the Recorder
    reads and exports (parameters by FQN, the program traced with fake tensors) would see, and
    could leave, either view.

    Raises:
        TypeError: ``model`` holds a ``FullyShardedDataParallel`` module; the message names FSDP2's
            ``fully_shard``, which the Recorder supports.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return
    found = next((n for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)), None)
    if found is not None:
        where = "the model" if not found else f"the model's submodule {found!r}"
        raise TypeError(
            f"{where} is wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), which the Recorder does not support: "
            "its flat parameters are swapped between sharded and unsharded storage around every pass. Shard the model with "
            "FSDP2 instead (from torch.distributed.fsdp import fully_shard; fully_shard(block) for each block, then "
            "fully_shard(model)), which the Recorder supports, or build the Recorder without FSDP1")


def _norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``t`` as a 0-dim tensor on its device, accumulated in float32 at least (a
    NaN or Inf anywhere makes it non-finite; float32 and float64 as they are)."""
    low = t.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32 if low else None)


class _Bytes:
    """What the ring buffer counts for a copy it does not hold itself (``nbytes()``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()


def write_root_cause(message: str, *, step: int, rank: int, path: Optional[str] = None) -> Optional[str]:
    """Write ``message`` as this process's failure into ``torchrun``'s error file
    (``TORCHELASTIC_ERROR_FILE``, set by ``torchrun`` for each worker), in the JSON layout of
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception``: torchrun
    names as the job's root cause the failed worker whose error file holds the earliest
    ``timestamp`` (whole seconds). Returns the path written, else ``None`` (not under torchrun, or
    the file could not be written: logged, never raised)."""
    target = path or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return None
    text = f"NonFiniteGradientError: {message}"
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time())),
                                                       "nanreplay": {"origin_rank": rank, "step": step}}}}
    try:
        with open(target, "w") as fh:
            json.dump(data, fh)
    except OSError as e:
        logger.warning("nanreplay: could not write torchrun's error file %s (%s)", target, e)
        return None
    return target


class RankContext:
    """This process's place in the process group and the per-step origin state.

    Attributes:
        rank, world_size: of ``group`` (the default group unless given).
        hooked: whether origin detection from this rank's gradients is attached (the DDP
            end-of-backward watch, or the FSDP2 reduce-scatter hooks).
        detection: how the origin rank is found, for the bundle: ``{"on", "method", "why_off"}``
            (``why_off``: why it is partial or off, else ``None``).
        origin_ranks: after a check that found non-finite values, the ranks where they were born:
            those whose weights or optimizer state at step start held a NaN or Inf, else those whose
            local values were non-finite before the gradient all-reduce (sorted ints).
        rank_flags: every rank's local flag from the last check (0/1 per rank).
        state_ranks: the ranks whose step-start state was non-finite (last non-finite check).
        state_origin: this rank's first non-finite state element (see
            :func:`nanreplay.capture.sharded.first_nonfinite_state`), else ``None``.
        run_id: one id for the run's bundles, drawn by rank 0 at construction.
    """

    def __init__(self, *, is_ddp: bool, param_fqn: dict[int, str], optimizer: torch.optim.Optimizer, step: Callable[[], int],
                 group: Any = None, sharded: bool = False, cotangents: Optional[Callable[[], list]] = None,
                 active: Optional[Callable[[], bool]] = None) -> None:
        self.is_ddp = is_ddp
        self.sharded = sharded
        self.fsdp = False  # gradients reduce-scattered across ranks (FSDP2): set by attach_sharded_hooks
        self.cotangents = cotangents
        self.active = active or (lambda: True)
        self.param_fqn = param_fqn
        self.optimizer = optimizer
        self.current_step = step
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.hooked = False
        self.closed = False
        self.origin_ranks: list[int] = []
        self.rank_flags: list[int] = [0] * self.world_size
        self.state_ranks: list[int] = []
        self.state_origin: Optional[dict] = None
        self.any_bad = False
        self.detection: dict = {"on": False, "method": "local check", "why_off": None}
        self._step: Optional[int] = None
        self._local_bad: Optional[torch.Tensor] = None
        self._watched_step: Optional[int] = None     # the step whose gradients the origin watch saw
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, its rank-local gradient)
        self._pool: dict[int, torch.Tensor] = {}     # id(param) -> a gradient tensor free to take the next reduced values
        self._pool_ok: Optional[bool] = None
        self._failed = False
        self._ring: Any = None
        self._view_norms: list[torch.Tensor] = []
        self._queued = False
        self._ddp: Any = None
        self._watched: list[torch.Tensor] = []
        self._in_view = False
        self._handles: list[Any] = []
        self._settled = 0
        self.run_id = self._agree_run_id()

    def _agree_run_id(self) -> str:
        """One id for the run's bundles: rank 0 draws it (from the OS, not from torch's
        generators), one broadcast at construction (never per step)."""
        t = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=self.device())
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return f"{int(t.item()):014x}"

    @classmethod
    def detect(cls, group: Any = None, **kwargs: Any) -> Optional["RankContext"]:
        """A context when ``torch.distributed`` is initialised with more than one rank, else
        ``None``. ``kwargs``: the constructor's keywords."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return None
        return cls(group=group, **kwargs)

    @classmethod
    def for_recorder(cls, wrapper: torch.nn.Module, model: torch.nn.Module, config: Any, **kwargs: Any) -> Optional["RankContext"]:
        """The Recorder's context (see :meth:`detect`) for ``wrapper`` (what the loop calls) around
        ``model`` (the unwrapped module). FSDP1 is refused first (:func:`refuse_fsdp1`); a sharded
        ``model`` (``DTensor`` parameters) has its options checked
        (:func:`nanreplay.capture.sharded.check_sharded_options`), with or without
        ``torch.distributed``. ``kwargs``: the constructor's other keywords."""
        from .sharded import check_sharded_options, is_sharded

        refuse_fsdp1(wrapper)
        sharded = is_sharded(model)
        if sharded:
            check_sharded_options(config)
        return cls.detect(is_ddp=isinstance(wrapper, torch.nn.parallel.DistributedDataParallel), sharded=sharded, **kwargs)

    def attach_hooks(self, wrapper: torch.nn.Module, model: torch.nn.Module, *, origin_hook: bool, ring: Any = None) -> None:
        """The Recorder's last construction step: origin detection (with ``origin_hook``) on
        ``wrapper``'s ``DistributedDataParallel`` (:meth:`attach_ddp_watch`), else for a sharded
        ``model`` the FSDP2 reduce-scatter hooks (:meth:`attach_sharded_hooks`). Logs once, and
        records in every bundle, when detection is off or partial. ``ring``: the Recorder's ring
        buffer, which counts the gradient tensors kept between steps (:meth:`_pooling`)."""
        self._ring = ring
        ddp = unwrap_ddp_only(wrapper)
        if ddp is not None:
            if origin_hook:
                self.attach_ddp_watch(ddp)
            else:
                self.detection = {"on": False, "method": "local loss", "why_off": "origin_hook=False"}
        elif self.sharded:
            self.attach_sharded_hooks(model, hook=origin_hook)
        else:  # no gradient all-reduce the Recorder knows of: the gradients checked are this rank's own
            self.detection = {"on": True, "method": "local check", "why_off": None}
        if not self.detection["on"] or self.detection["why_off"]:
            logger.warning("nanreplay: rank %d: origin detection is %s (%s): on a non-finite step the origin rank is known only from "
                           "the %s; every bundle records this", self.rank, "off" if not self.detection["on"] else "partial",
                           self.detection["why_off"], self.detection["method"])

    def attach_sharded_hooks(self, model: torch.nn.Module, *, hook: bool = True) -> None:
        """Note whether ``model`` reduce-scatters its gradients (FSDP2), and with ``hook`` put the
        FSDP2 origin hook on every ``FSDPModule`` (see
        :func:`nanreplay.capture.sharded.attach_reduce_scatter_hooks`)."""
        from .sharded import attach_reduce_scatter_hooks, has_fsdp, reduce_scatter_base

        self.fsdp = has_fsdp(model)
        if not self.fsdp:
            self.detection = {"on": True, "method": "local check (tensor parallel: no gradient reduce-scatter), local loss and cotangents",
                              "why_off": None}
            return
        if hook:
            self._handles = attach_reduce_scatter_hooks(model, self.note_flat, lambda: not self.closed and self.active())
        self.hooked = bool(self._handles)
        if self.hooked:
            self.detection = {"on": True, "method": "reduce-scatter hook, local loss and cotangents", "why_off": None}
            return
        why = ("origin_hook=False" if not hook else "this torch's FSDP2 has no set_custom_reduce_scatter" if reduce_scatter_base() is None
               else "no module accepted a wrapped reduce-scatter")
        self.detection = {"on": True, "method": "local loss and cotangents", "why_off": f"{why}: a NaN born in the backward of a rank "
                          "whose loss is finite is not told apart"}

    # -- DDP: the rank-local gradients at the end of the backward ------------------------------
    def attach_ddp_watch(self, ddp: torch.nn.Module) -> None:
        """Watch ``ddp``'s parameters: the first post-accumulate-grad hook of a backward that
        reduces gradients queues :meth:`_backward_done` on the autograd engine, which runs after
        every gradient is accumulated and before DDP's own end-of-backward callback (queued when
        its last bucket is ready) copies the reduced values back. Hooks are removed on
        :meth:`close`."""
        self._ddp = ddp
        # gradients that are views of DDP's buckets, or a reducer that is not the C++ one (compiled DDP,
        # a delayed all-reduce): flagged one by one as accumulated, and the bundle holds the reduced ones
        self._in_view = any(bool(getattr(ddp, a, False)) for a in ("gradient_as_bucket_view", "_use_python_reducer", "_delay_all_reduce_all_params"))
        self._watched = [p for p in ddp.module.parameters() if p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._watched]
        self.hooked = bool(self._handles)
        self.detection = {"on": True, "method": "local gradients before the all-reduce, local loss" + (
            "" if not self._in_view else " (each gradient flagged as accumulated: they are views of DDP's buckets, or its reducer is "
            "not the C++ one; the bundle holds the reduced gradients)"), "why_off": None}

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._queued and not self._in_view:
            return  # the end-of-backward callback is queued: nothing to do per parameter
        if self.closed or not self.active() or not getattr(self._ddp, "require_forward_param_sync", True):
            return  # closed, the Recorder's own replay, or a forward under no_sync(): this backward reduces nothing
        if self._in_view and p.grad is not None:  # a view of DDP's bucket: flag it before the bucket is reduced
            self._view_norms.append(_norm(p.grad))
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        """End of the backward pass: :meth:`_take_local`. Never raises into the backward (it runs
        inside it): a failure is logged once and this step's gradients stay DDP's alone."""
        self._queued = False
        try:
            self._take_local()
        except Exception as e:  # noqa: BLE001 - the recorder never makes training worse
            for p, g in self._kept.values():
                if p.grad is None:
                    p.grad = g
            self._kept, self._watched_step = {}, None
            if not self._failed:
                self._failed = True
                logger.warning("nanreplay: rank %d: the origin watch failed at the end of the backward (%s: %s); this step's origin "
                               "is known from the loss only", self.rank, type(e).__name__, e)

    def _take_local(self) -> None:
        """Fold the local gradients' flag into this step's, and keep the gradient tensors
        themselves: ``.grad`` becomes a spare tensor (:meth:`_pooling`) or ``None``, which DDP's
        finalisation fills with the reduced values instead of copying over ours."""
        self._new_step()
        self._watched_step = self._step
        if self._in_view:
            norms, self._view_norms = self._view_norms, []
            if norms:
                self._fold(~torch.isfinite(torch.linalg.vector_norm(torch.stack(norms))))
            return
        pairs = [(p, p.grad) for p in self._watched if p.grad is not None]
        norm = fused_norm([g for _, g in pairs])
        if norm is None:
            return
        self._fold(~torch.isfinite(norm))
        pool, self._pool = self._pool, {}
        for p, g in pairs:
            self._kept[id(p)] = (p, g)
            spare = pool.get(id(p))
            # the last finite step's local gradient, free again: DDP copies the reduced values into it
            # (no allocation); else None, and DDP allocates one
            p.grad = spare if spare is not None and _same_layout(spare, g) else None

    def _pooling(self) -> Optional[bool]:
        """Whether a finite step's rank-local gradient tensors are kept to take the next step's
        reduced values, decided at the first finite step: yes for gradients in host memory (there
        a fresh tensor per gradient per step costs page faults: 13% of the step at 9.5M parameters
        in bench/ddp.py), when they fit in ``memory_budget`` beside what the ring buffer holds
        (counted there as ``ddp_local_grads``) and DDP reduces every gradient
        (``find_unused_parameters=False``: else it leaves a globally unused one's ``.grad`` alone).
        No on a device, whose caching allocator makes a fresh tensor cheap and where holding one
        set of gradients more through the next forward pass would raise the peak."""
        if self._pool_ok is None:
            grads = [g for _, g in self._kept.values()]
            nbytes = sum(g.numel() * g.element_size() for g in grads)
            self._pool_ok = (all(g.device.type == "cpu" for g in grads) and not getattr(self._ddp, "find_unused_parameters", False)
                             and self._ring is not None and self._ring.reserve("ddp_local_grads", nbytes))
            if self._pool_ok:
                self._ring.keep("ddp_local_grads", _Bytes(nbytes))
        return self._pool_ok

    def _put_back_unreduced(self) -> None:
        """A parameter DDP did not reduce this step (globally unused, ``find_unused_parameters``)
        keeps its gradient: DDP leaves such a ``.grad`` untouched, so ours goes back."""
        for p, g in self._kept.values():
            if p.grad is None:
                p.grad = g

    def note_flat(self, buf: torch.Tensor) -> None:
        """Called with this rank's flat unsharded gradients before a reduce-scatter: fold their
        non-finite flag into the step's local flag (device-side, no sync)."""
        self._new_step()
        self._watched_step = self._step
        self._fold(~torch.isfinite(_norm(buf)))

    def _fold(self, flag: torch.Tensor) -> None:
        self._local_bad = flag if self._local_bad is None else self._local_bad | flag

    def device(self) -> torch.device:
        """Where the agreement vector lives when there is no gradient to take it from."""
        backend = str(dist.get_backend(self.group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def close(self) -> None:
        """Remove the hooks and stop keeping anything; gradients held for this step go back."""
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self._put_back_unreduced()
        self._kept = {}
        self._pool = {}
        if self._pool_ok and self._ring is not None:
            self._ring.release("ddp_local_grads")
        self._view_norms = []
        self._local_bad = None

    def _new_step(self) -> None:
        step = self.current_step()
        if self._step != step:
            self._step = step
            self._local_bad = None
            self._kept = {}

    # -- agreement -------------------------------------------------------------------------
    def agree(self, checked: torch.Tensor, *, loss_bad: Optional[torch.Tensor]) -> torch.Tensor:
        """All-reduce (MAX) the flags of this step; returns them on ``checked``'s device.

        ``checked``: this rank's check values (grad norm, loss), float32, possibly empty. The
        result has ``world_size + 1`` entries: entry ``r`` is 1 when rank ``r``'s local values
        were non-finite before any all-reduce, the last is 1 when any rank's check failed."""
        self._new_step()
        self._queued = False  # a backward that raised never ran its callback: watch the next one
        self._put_back_unreduced()
        dev = checked.device
        bad_here = (~torch.isfinite(checked)).any().float() if checked.numel() else torch.zeros((), device=dev)
        loss_flag = (~torch.isfinite(loss_bad)).float().reshape(()) if loss_bad is not None else torch.zeros((), device=dev)
        if self.hooked or self.is_ddp or self.fsdp:
            # the reduced gradients are the same on every rank: only the rank's own values tell
            local = loss_flag
            if self._local_bad is not None:
                local = torch.maximum(local, self._local_bad.float().to(dev))
        else:  # no gradient all-reduce we know of (tensor parallel alone): the gradients checked are this rank's own
            local = bad_here
        if self.sharded and self.cotangents is not None:
            cots = [c.detach() for c in self.cotangents() if isinstance(c, torch.Tensor) and c.numel() and c.is_floating_point()]
            norm = fused_norm(cots)
            if norm is not None:  # the rank's own outputs' cotangents: before any collective of the backward
                local = torch.maximum(local, (~torch.isfinite(norm)).float().to(dev))
        # flags are 0/1 (never NaN: a MAX reduction would drop a NaN)
        flags = torch.zeros(self.world_size + 1, dtype=torch.float32, device=dev)
        flags[self.rank] = local
        flags[self.world_size] = bad_here
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags

    def decide(self, flags: list[float]) -> bool:
        """From the host values of :meth:`agree`: ``True`` when every rank's step is finite. On a
        non-finite step, every rank checks its step-start state too (:meth:`_check_state`, one
        all-reduce on this rare path: every rank is here together)."""
        self.rank_flags = [int(flags[r] > 0) for r in range(self.world_size)]
        self.any_bad = flags[self.world_size] > 0
        if not self.any_bad:
            if self._kept and self._pooling():  # the rank-local gradients are not needed: they take the next step's reduced values
                self._pool = {k: g for k, (p, g) in self._kept.items() if p.grad is not g}
            self._kept = {}
            self.origin_ranks, self.state_ranks, self.state_origin = [], [], None
            return True
        self._check_state()
        self.origin_ranks = list(self.state_ranks) or [r for r, f in enumerate(self.rank_flags) if f]
        return False

    def _check_state(self) -> None:
        """Which ranks' weights or optimizer state (their own copy, or their shard) held a NaN or
        Inf at the start of this step: one all-reduce of ``world_size`` flags."""
        from .sharded import first_nonfinite_state

        try:
            self.state_origin = first_nonfinite_state(self.optimizer, self.param_fqn)
        except Exception as e:  # noqa: BLE001 - the recorder never makes training worse; the collective below still runs
            logger.warning("nanreplay: could not check this rank's weights and optimizer state for non-finite values (%s)", e)
            self.state_origin = None
        t = torch.zeros(self.world_size, dtype=torch.float32, device=self.device())
        t[self.rank] = 1.0 if self.state_origin is not None else 0.0
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.state_ranks = [r for r, v in enumerate(t.tolist()) if v > 0]

    # -- bundle ------------------------------------------------------------------------------
    def local_grads(self, grads: list[tuple[str, torch.Tensor]], reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients the bundle stores: the rank-local ones kept at the end of the backward of
        this step, else the gradients as the optimizer sees them."""
        if not self._kept or self._step != self.current_step():
            return reduced
        out = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    name = self.param_fqn.get(id(p), f"<unnamed:{id(p)}>")
                    kept = self._kept.get(id(p))
                    out[name] = kept[1].detach() if kept is not None else reduced.get(name)
        return out

    def grads_kind(self) -> str:
        if self.sharded:
            return "sharded"
        return "local" if self._kept and self._step == self.current_step() else ("reduced" if self.is_ddp else "local")

    def _watched_now(self) -> bool:
        """Whether this step's local flag came from the rank's gradients (the watch or the
        reduce-scatter hook ran in this step), not only from its loss."""
        return self._watched_step == self.current_step()

    def _clean(self) -> Optional[bool]:
        """``True`` when this rank's own values were finite in a step the detection covered
        (its flag is 0 and its gradients were looked at), ``False`` for an origin rank, ``None``
        when it cannot be said (detection off, or it did not see this step's gradients)."""
        if self.rank in self.origin_ranks:
            return False
        full = self.detection["on"] and (self._watched_now() or not (self.hooked or self.is_ddp or self.fsdp))
        return True if full else None

    def reason(self) -> dict:
        """JSON for the bundle's ``reason`` (and, as ``distributed``, the metadata); a rank that is
        not an origin also gets its ``message``."""
        wire = "reduce-scatter" if self.sharded else "all-reduce"
        state = self.state_origin
        msg = None
        if self.origin_ranks and self.rank not in self.origin_ranks:
            own = "its own values were finite" if self._clean() else "its own values were not checked"
            msg = (f"non-finite values from rank(s) {self.origin_ranks} reached rank {self.rank} through the gradient {wire} "
                   f"({own})")
        info = {
            "rank": self.rank,
            "world_size": self.world_size,
            "origin_ranks": list(self.origin_ranks),
            "is_origin": self.rank in self.origin_ranks,
            "rank_flags": list(self.rank_flags),
            "state_ranks": list(self.state_ranks),
            "state_origin": dict(state) if state is not None else None,
            "clean": self._clean(),
            "origin_method": self.detection["method"],
            "detection": {**self.detection, "this_step": self._watched_now()},
            "grads": self.grads_kind(),
            "run_id": self.run_id,
        }
        return {"distributed": info, **({"message": msg} if msg else {})}

    def note(self) -> str:
        """This rank's part in a non-finite step, for its console line: ``"[rank 1 of 2: the
        origin ...]"`` on an origin rank, ``"[rank 0 of 2: clean ...]"`` on the others."""
        wire = "reduce-scatter" if self.sharded else "all-reduce"
        where = f"rank {self.rank} of {self.world_size}"
        if self.rank in self.origin_ranks:
            state = self.state_origin if self.rank in self.state_ranks else None
            born = f"its {describe_state(state)} at the start of the step" if state is not None else f"before the gradient {wire}"
            return f"[{where}: the origin: non-finite values born on this rank, {born}]"
        if self.origin_ranks:
            own = "clean: its own values were finite" if self._clean() else "its own values were not checked"
            return f"[{where}: {own}; the origin is rank(s) {self.origin_ranks}]"
        return f"[{where}: no rank's own values were non-finite before the gradient {wire}; the origin rank is unknown]"

    def run_meta(self, model: torch.nn.Module, path: Any) -> dict:
        """What every rank's bundle adds to ``distributed`` once its path is known: the sibling
        bundles' file names (same step, every rank) and, for a sharded model, the whole device mesh,
        every rank's coordinate on it, and the layouts."""
        name = path.name if path is not None else ""
        siblings = [re.sub(rf"-rank{self.rank}of{self.world_size}", f"-rank{r}of{self.world_size}", name) for r in range(self.world_size)]
        out: dict[str, Any] = {"run_id": self.run_id, "siblings": siblings}
        if not self.sharded:
            return out
        from .sharded import device_mesh_meta, sharding_meta

        mesh = device_mesh_meta(model)
        coords = (mesh or {}).pop("coordinates", {}) if mesh else {}
        out.update(mesh=mesh, coordinates=coords, coordinate=coords.get(str(dist.get_rank()), []),
                   origin_coordinates={str(r): coords.get(str(self._global(r)), []) for r in self.origin_ranks},
                   sharding=sharding_meta(model, self.optimizer, self.param_fqn))
        return out

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def cause(self, cause: dict, extra_meta: dict) -> dict:
        """A non-finite step's ``cause`` (the bundle's ``reason``) with this rank's part in it
        (:meth:`reason`) under it, and ``extra_meta`` (every bundle's metadata) given ``rank``,
        ``world_size`` and ``distributed``."""
        info = self.reason()
        extra_meta.update(self.meta(info["distributed"]))
        return {**info, **cause}

    def conclude(self, step: int, message: str, *, dumped: bool, raising: bool, timeout_s: float) -> str:
        """The console line of a non-finite ``step`` with this rank's part (:meth:`note`) added;
        after a dump (``dumped``), :meth:`settle` first."""
        message = f"{message} {self.note()}"
        if dumped:
            self.settle(step=step, message=message, raising=raising, timeout_s=timeout_s)
        return message

    def meta(self, info: dict) -> dict:
        """Bundle metadata for this rank (``info``: the ``distributed`` entry of :meth:`reason`)."""
        return {"rank": self.rank, "world_size": self.world_size, "distributed": info}

    def annotate(self, diagnosis: Optional[dict]) -> None:
        """Say in the in-process diagnosis which rank this is and where the failure came from (an
        origin rank's summary already says it: :func:`nanreplay.diagnosis.api.diagnose` reads the
        bundle's ``distributed`` entry)."""
        if not diagnosis:
            return
        diagnosis["distributed"] = {**(diagnosis.get("distributed") or {}), "rank": self.rank, "world_size": self.world_size,
                                    "origin_ranks": list(self.origin_ranks), "rank_flags": list(self.rank_flags), "clean": self._clean()}
        if self.rank in self.origin_ranks:
            return
        where = f"rank {self.rank} of {self.world_size}"
        if self.origin_ranks:
            own = "its local step is finite" if self._clean() else "its own values were not checked"
            note = f"{where}: {own}; the non-finite values came from rank(s) {self.origin_ranks} through the gradient all-reduce: replay their bundles"
        else:
            note = f"{where}: origin rank unknown"
        diagnosis["summary"] = f"{diagnosis.get('summary', '')} [{note}]"

    def name_suffix(self) -> str:
        return f"-rank{self.rank}of{self.world_size}"

    # -- after the bundle: every rank waits for every bundle -------------------------------------
    def settle(self, *, step: int, message: str, raising: bool, timeout_s: float) -> None:
        """After this rank's bundle of ``step`` is written, before the action runs: an origin rank
        that is about to raise writes ``message`` into torchrun's error file
        (:func:`write_root_cause`), then every rank waits until every rank has written its bundle
        (:meth:`wait_for_ranks`); a clean rank that is about to raise under torchrun then waits
        into the next whole second, so that its failure is recorded later than the origin's and
        torchrun names the origin rank as the job's root cause."""
        origin = self.rank in self.origin_ranks
        if raising and origin:
            write_root_cause(message, step=step, rank=self.rank)
        self.wait_for_ranks(timeout_s, step)
        if raising and not origin and self.origin_ranks and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            now = time.time()
            time.sleep(math.floor(now) + 1.25 - now)

    def wait_for_ranks(self, timeout_s: float, step: Optional[int] = None) -> list[int]:
        """Wait until every rank reaches this point (each has written its bundle), at most
        ``timeout_s`` seconds. Through the process group's store when it has one (no collective,
        any backend), else gloo's ``monitored_barrier`` or a plain barrier. Returns the ranks that
        did not arrive (logged, never raised)."""
        self._settled += 1
        try:
            store = dist.distributed_c10d._get_default_store() if self.group is None else None
        except (AttributeError, RuntimeError, ValueError):
            store = None
        if store is not None:
            return self._wait_store(store, timeout_s, step)
        try:
            if "gloo" in str(dist.get_backend(self.group)).lower():
                dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
            else:
                dist.barrier(group=self.group)  # the process group's own timeout applies
        except Exception as e:  # the recorder never makes training worse
            logger.error("nanreplay: rank %d: not every rank finished writing its bundle within dump_barrier_timeout=%gs (%s); going on",
                         self.rank, timeout_s, e)
            return [-1]
        return []

    def _wait_store(self, store: Any, timeout_s: float, step: Optional[int]) -> list[int]:
        prefix = f"nanreplay/{self.run_id}/{self._settled}/"
        keys = [f"{prefix}{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], str(step))
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return []
        except Exception:  # noqa: BLE001 - a timeout (its type differs between stores and torch versions)
            pass
        missing = []
        for r, k in enumerate(keys):
            try:
                if not store.check([k]):
                    missing.append(r)
            except Exception:  # noqa: BLE001
                missing.append(r)
        logger.error("nanreplay: rank %d: rank(s) %s did not finish writing their bundles of step %s within dump_barrier_timeout=%gs "
                     "(still writing, stuck or dead): their bundles may be missing or partial; going on", self.rank, missing, step, timeout_s)
        return missing


def rank_summary(metas: Iterable[dict]) -> dict:
    """Which rank was first, from the metadata of several bundles (one per rank).

    The first failing step is the smallest ``failing_step``; the origin ranks are those whose
    local values were non-finite before the all-reduce in that step (as recorded in every
    rank's bundle). Returns ``{"first_step", "origin_ranks", "ranks", "world_size", "message"}``."""
    metas = list(metas)
    rows = []
    for m in metas:
        d = m.get("distributed") or {}
        rows.append({"rank": m.get("rank"), "step": m.get("failing_step"), "origin_ranks": d.get("origin_ranks") or [],
                     "is_origin": bool(d.get("is_origin")), "state": bool(d.get("state_ranks"))})
    with_rank = [r for r in rows if r["rank"] is not None]
    if not with_rank:
        return {"first_step": None, "origin_ranks": [], "ranks": [], "world_size": None, "message": "no bundle carries a rank: these are single-process bundles"}
    first = min(r["step"] for r in with_rank)
    origins = sorted({o for r in with_rank if r["step"] == first for o in r["origin_ranks"]})
    ws = {m.get("world_size") for m in metas} - {None}
    sharded = any((m.get("distributed") or {}).get("sharding") for m in metas)
    state = any(r["state"] for r in with_rank if r["step"] == first)
    if origins and state:
        msg = f"first non-finite step {first}: the weights or optimizer state of rank(s) {origins} were non-finite at the start of the step"
    elif origins:
        msg = f"first non-finite step {first}: born on rank(s) {origins} before the gradient {'reduce-scatter' if sharded else 'all-reduce'}"
    else:
        msg = f"first non-finite step {first}: the origin rank was not recorded (no rank's own values were seen non-finite)"
    return {
        "first_step": first,
        "origin_ranks": origins,
        "ranks": sorted(r["rank"] for r in with_rank),
        "world_size": next(iter(ws)) if len(ws) == 1 else None,
        "message": msg,
    }
