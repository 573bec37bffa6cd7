"""Multi-process training: cross-rank agreement, the origin rank, and per-rank bundles.

In data-parallel training a non-finite gradient born on one rank is averaged into every rank's
gradients by the gradient all-reduce, in the same step. Three mechanisms keep the recorder useful
there; a :class:`~nanreplay.capture.recorder.Recorder` built inside an initialised process group sets
them up itself:

* **Agreement.** Every rank's check all-reduces (``MAX``) one small float32 vector of
  ``world_size + 1`` flags, on the device of the grad norm, folded into the existing check: the
  flags are concatenated with the grad norm and the loss, so the step still has one host read.
  Every rank then takes the same decision (dump, skip, raise) in the same step, and no rank is
  left waiting in a collective while another raises.
* **Origin rank.** With a ``DistributedDataParallel`` model, a DDP communication hook
  (:func:`register_origin_hook`) sees each gradient bucket *before* its all-reduce, computes a
  device-side flag ``not isfinite(max |bucket|)`` (no host sync) and keeps a copy of the bucket:
  the rank-local gradients. Slot ``rank`` of the agreement vector holds that flag (or the local
  loss's), so after the all-reduce every rank knows which ranks were the origin.
* **Per-rank bundles.** Each rank writes its own bundle, ``nanreplay-step{N}-rank{r}of{w}.h5``,
  with ``rank``, ``world_size`` and ``origin_ranks`` in its metadata. Its ``grads`` are the
  rank-local gradients (before the all-reduce), so the origin rank's bundle replays on a single
  process (no process group) and reproduces that rank's gradients; the averaged gradients would
  not reproduce on one process. ``nanreplay inspect a.h5 b.h5`` names the origin rank.

Costs per step: one all-reduce of ``world_size + 1`` floats; with the origin hook, one extra
copy of the gradients (about the parameter bytes, as large as DDP's own buckets), kept until the
step ends, and one ``inf``-norm reduction per bucket.

Sharded models (FSDP2 ``fully_shard``, tensor parallel ``DTensor`` parameters): the check reads
the local shards (:mod:`nanreplay.capture.sharded`); the origin flag comes from the rank's
unsharded gradients before the reduce-scatter (a wrapped ``set_custom_reduce_scatter``), its local
loss and its outputs' cotangents; each bundle holds the rank's shards and their layout, tied to
its siblings by a run id (see ``docs/distributed.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["RankContext", "register_origin_hook", "unwrap_model", "unwrap_ddp_only", "rank_summary"]


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


class RankContext:
    """This process's place in the process group and the per-step origin state.

    Attributes:
        rank, world_size: of ``group`` (the default group unless given).
        hooked: whether an origin comm hook feeds this context.
        origin_ranks: after a check that found non-finite values, the ranks whose local values
            were non-finite before the gradient all-reduce (sorted ints).
    """

    def __init__(self, *, is_ddp: bool, param_fqn: dict[int, str], optimizer: torch.optim.Optimizer, step: Callable[[], int],
                 group: Any = None, sharded: bool = False, cotangents: Optional[Callable[[], list]] = None) -> None:
        self.is_ddp = is_ddp
        self.sharded = sharded
        self.fsdp = False  # gradients reduce-scattered across ranks (FSDP2): set by attach_sharded_hooks
        self.cotangents = cotangents
        self.run_id: Optional[str] = None
        self.param_fqn = param_fqn
        self.optimizer = optimizer
        self.current_step = step
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.hooked = False
        self.closed = False
        self.origin_ranks: list[int] = []
        self.any_bad = False
        self._step: Optional[int] = None
        self._local_bad: Optional[torch.Tensor] = None
        self._local: dict[int, torch.Tensor] = {}     # id(param) -> rank-local gradient copy
        self._buckets: list[tuple[int, torch.Tensor]] = []
        self._handles: list[Any] = []
        self._unhooked_why = "origin_hook=False"
        if sharded:
            self.run_id = self._agree_run_id()

    def _agree_run_id(self) -> str:
        """One id for the run's bundles: rank 0 draws it (from the OS, not from torch's
        generators), one broadcast at construction (never per step)."""
        import os

        t = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=self.device())
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return f"{int(t.item()):014x}"

    def attach_sharded_hooks(self, model: torch.nn.Module, *, hook: bool = True) -> None:
        """Note whether ``model`` reduce-scatters its gradients (FSDP2), and with ``hook`` put the
        FSDP2 origin hook on every ``FSDPModule`` (see
        :func:`nanreplay.capture.sharded.attach_reduce_scatter_hooks`)."""
        from .sharded import attach_reduce_scatter_hooks, has_fsdp, reduce_scatter_base

        self.fsdp = has_fsdp(model)
        if not hook or not self.fsdp:
            return
        self._handles = attach_reduce_scatter_hooks(model, self.note_flat, lambda: not self.closed)
        self.hooked = bool(self._handles)
        if not self.hooked:
            self._unhooked_why = "this torch's FSDP2 has no set_custom_reduce_scatter" if reduce_scatter_base() is None else "no module accepted it"
            logger.info("nanreplay: no FSDP2 reduce-scatter could be wrapped (%s); the origin rank is known from the local loss and "
                        "cotangents", self._unhooked_why)

    def wait_for_ranks(self, timeout_s: float) -> None:
        """Wait until every rank reaches this point (each has written its bundle), at most
        ``timeout_s`` seconds; log, never raise, when some did not (gloo names them)."""
        import datetime

        try:
            if "gloo" in str(dist.get_backend(self.group)).lower():
                dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
            else:
                dist.barrier(group=self.group)  # the process group's own timeout applies
        except Exception as e:  # the recorder never makes training worse
            logger.error("nanreplay: not every rank wrote its bundle within dump_barrier_timeout=%gs (%s); going on", timeout_s, e)

    def note_flat(self, buf: torch.Tensor) -> None:
        """Called with this rank's flat unsharded gradients before a reduce-scatter: fold their
        non-finite flag into the step's local flag (device-side, no sync)."""
        self._new_step()
        flag = ~torch.isfinite(torch.linalg.vector_norm(buf.detach().float(), float("inf")))
        self._local_bad = flag if self._local_bad is None else self._local_bad | flag

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
        ``model`` (the unwrapped module); a sharded ``model`` (``DTensor`` parameters) first has
        its options checked (:func:`nanreplay.capture.sharded.check_sharded_options`), with or
        without ``torch.distributed``. ``kwargs``: the constructor's other keywords."""
        from .sharded import check_sharded_options, is_sharded

        sharded = is_sharded(model)
        if sharded:
            check_sharded_options(config)
        return cls.detect(is_ddp=isinstance(wrapper, torch.nn.parallel.DistributedDataParallel), sharded=sharded, **kwargs)

    def attach_hooks(self, wrapper: torch.nn.Module, model: torch.nn.Module, *, origin_hook: bool) -> None:
        """The Recorder's last construction step: the DDP origin comm hook on ``wrapper``'s
        ``DistributedDataParallel`` (with ``origin_hook``), else for a sharded ``model`` the FSDP2
        reduce-scatter hooks (:meth:`attach_sharded_hooks`)."""
        ddp = unwrap_ddp_only(wrapper)
        if origin_hook and ddp is not None:
            self.attach_origin_hook(ddp)
        elif self.sharded:
            self.attach_sharded_hooks(model, hook=origin_hook)

    def device(self) -> torch.device:
        """Where the agreement vector lives when there is no gradient to take it from."""
        backend = str(dist.get_backend(self.group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- origin hook -----------------------------------------------------------------------
    def attach_origin_hook(self, ddp: torch.nn.Module) -> None:
        """Register :func:`register_origin_hook` on ``ddp``; log (not raise) when DDP refuses
        because the model already has a comm hook."""
        try:
            register_origin_hook(ddp, self)
        except RuntimeError as e:
            logger.warning(
                "nanreplay: could not register the origin comm hook (%s); the origin rank will be known only from "
                "the local loss. Fix: build the Recorder with origin_hook=False and call "
                "nanreplay.capture.ddp.register_origin_hook(ddp, recorder.dist, hook=your_hook, state=your_state)",
                e,
            )

    def close(self) -> None:
        """Stop keeping anything: DDP cannot unregister a comm hook, so the hook becomes a plain
        pass-through to the wrapped hook (no flag, no copy of the buckets), and what it kept is freed."""
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self._local = {}
        self._buckets = []
        self._local_bad = None

    def _new_step(self) -> None:
        step = self.current_step()
        if self._step != step:
            self._step = step
            self._local_bad = None
            self._local = {}
            self._buckets = []

    def note_bucket(self, bucket: "dist.GradBucket", keep: bool = True) -> None:
        """Called by the comm hook before a bucket is reduced: fold its non-finite flag into
        this step's local flag (on the device, no sync) and keep a copy of its gradients."""
        self._new_step()
        buf = bucket.buffer()
        flag = ~torch.isfinite(torch.linalg.vector_norm(buf.detach(), float("inf")))
        self._buckets.append((bucket.index(), flag))
        self._local_bad = flag if self._local_bad is None else self._local_bad | flag
        if not keep:
            return
        local = buf.detach().clone()
        base = buf.storage_offset()
        ptr = buf.untyped_storage().data_ptr()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if g.untyped_storage().data_ptr() == ptr:
                off = g.storage_offset() - base
                self._local[id(p)] = local[off : off + g.numel()].view(g.shape)
            else:  # not a view of the bucket: copy it alone
                self._local[id(p)] = g.detach().clone()

    # -- agreement -------------------------------------------------------------------------
    def agree(self, checked: torch.Tensor, *, loss_bad: Optional[torch.Tensor]) -> torch.Tensor:
        """All-reduce (MAX) the flags of this step; returns them on ``checked``'s device.

        ``checked``: this rank's check values (grad norm, loss), float32, possibly empty. The
        result has ``world_size + 1`` entries: entry ``r`` is 1 when rank ``r``'s local values
        were non-finite before any all-reduce, the last is 1 when any rank's check failed."""
        self._new_step()
        dev = checked.device
        bad_here = (~torch.isfinite(checked)).any().float() if checked.numel() else torch.zeros((), device=dev)
        if self.hooked:
            local = self._local_bad.float().to(dev) if self._local_bad is not None else torch.zeros((), device=dev)
            if loss_bad is not None:
                local = torch.maximum(local, (~torch.isfinite(loss_bad)).float().reshape(()))
        elif self.is_ddp or self.fsdp:
            # reduced gradients are the same on every rank: only the loss is rank-local
            local = (~torch.isfinite(loss_bad)).float().reshape(()) if loss_bad is not None else torch.zeros((), device=dev)
        else:  # no gradient all-reduce we know of (tensor parallel alone): the gradients checked are this rank's own
            local = bad_here
        if self.sharded and self.cotangents is not None:
            cots = [c for c in self.cotangents() if isinstance(c, torch.Tensor) and c.numel()]
            if cots:  # the rank's own outputs' cotangents: before any collective of the backward
                cbad = torch.stack([~torch.isfinite(torch.linalg.vector_norm(c.detach().float(), float("inf"))) for c in cots]).any()
                local = torch.maximum(local, cbad.float().to(dev))
        # flags are 0/1 (never NaN: a MAX reduction would drop a NaN)
        flags = torch.zeros(self.world_size + 1, dtype=torch.float32, device=dev)
        flags[self.rank] = local
        flags[self.world_size] = bad_here
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags

    def decide(self, flags: list[float]) -> bool:
        """From the host values of :meth:`agree`: ``True`` when every rank's step is finite."""
        self.origin_ranks = [r for r in range(self.world_size) if flags[r] > 0]
        self.any_bad = flags[self.world_size] > 0
        return not self.any_bad

    # -- bundle ------------------------------------------------------------------------------
    def local_grads(self, grads: list[tuple[str, torch.Tensor]], reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients the bundle stores: the rank-local copies kept by the comm hook when it
        ran this step, else the gradients as the optimizer sees them."""
        if not self._local or self._step != self.current_step():
            return reduced
        fqn = self.param_fqn
        out = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    name = fqn.get(id(p), f"<unnamed:{id(p)}>")
                    out[name] = self._local.get(id(p), reduced.get(name))
        return out

    def grads_kind(self) -> str:
        if self.sharded:
            return "sharded"
        return "local" if self._local and self._step == self.current_step() else ("reduced" if self.is_ddp else "local")

    def reason(self) -> dict:
        """JSON for the bundle's ``reason`` (and, as ``distributed``, the metadata)."""
        msg = None
        if self.origin_ranks and self.rank not in self.origin_ranks:
            msg = (f"non-finite values from rank(s) {self.origin_ranks} reached rank {self.rank} through the gradient "
                   f"{'reduce-scatter' if self.sharded else 'all-reduce'}")
        info = {
            "rank": self.rank,
            "world_size": self.world_size,
            "origin_ranks": list(self.origin_ranks),
            "is_origin": self.rank in self.origin_ranks,
            "origin_method": self._origin_method(),
            "grads": self.grads_kind(),
        }
        return {"distributed": info, **({"message": msg} if msg else {})}

    def _origin_method(self) -> str:
        if self.sharded:
            if not self.fsdp:
                return "local check (tensor parallel: no gradient reduce-scatter), local loss and cotangents"
            return ("reduce-scatter hook, local loss and cotangents" if self.hooked else
                    f"local loss and cotangents ({self._unhooked_why}: a NaN born in the backward "
                    "of a rank whose loss is finite is not told apart)")
        return "comm hook" if self.hooked else "local loss" if self.is_ddp else "local check"

    def sharded_meta(self, model: torch.nn.Module, path: Any) -> dict:
        """What a sharded run's bundle adds to ``distributed``: the run id, the sibling bundles'
        file names (same step, every rank), this rank's mesh coordinates and the layouts."""
        import re

        from .sharded import sharding_meta

        name = path.name if path is not None else ""
        siblings = [re.sub(rf"-rank{self.rank}of{self.world_size}", f"-rank{r}of{self.world_size}", name) for r in range(self.world_size)]
        sharding = sharding_meta(model, self.optimizer, self.param_fqn)
        from .sharded import mesh_ranks

        ranks = mesh_ranks(model)
        mesh = None
        coords: dict[str, list[int]] = {}
        if ranks is not None:
            t = torch.tensor(ranks)
            mesh = {"shape": list(t.shape), "ranks": ranks,
                    "dim_names": next((lay["mesh_dim_names"] for lay in sharding["params"].values()), [])}
            coords = {str(r): [int(i) for i in (t == r).nonzero()[0].tolist()] for r in range(self.world_size) if bool((t == r).any())}
        return {"run_id": self.run_id, "siblings": siblings, "mesh": mesh, "coordinate": coords.get(str(self.rank), []),
                "origin_coordinates": {str(r): coords.get(str(r), []) for r in self.origin_ranks}, "sharding": sharding}

    def meta(self, info: dict) -> dict:
        """Bundle metadata for this rank (``info``: the ``distributed`` entry of :meth:`reason`)."""
        return {"rank": self.rank, "world_size": self.world_size, "distributed": info}

    def annotate(self, diagnosis: Optional[dict]) -> None:
        """Say in the diagnosis which rank this is and where the failure came from."""
        if not diagnosis:
            return
        diagnosis["distributed"] = {"rank": self.rank, "world_size": self.world_size, "origin_ranks": list(self.origin_ranks)}
        where = f"rank {self.rank} of {self.world_size}"
        if self.rank in self.origin_ranks:
            note = f"{where} is an origin rank (non-finite before the gradient {'reduce-scatter' if self.sharded else 'all-reduce'})"
        elif self.origin_ranks:
            note = f"{where}: its local step is finite; the non-finite values came from rank(s) {self.origin_ranks} through the gradient all-reduce: replay their bundles"
        else:
            note = f"{where}: origin rank unknown"
        diagnosis["summary"] = f"{diagnosis.get('summary', '')} [{note}]"

    def name_suffix(self) -> str:
        return f"-rank{self.rank}of{self.world_size}"


def register_origin_hook(
    ddp: torch.nn.parallel.DistributedDataParallel,
    context: RankContext,
    *,
    hook: Optional[Callable] = None,
    state: Any = None,
    keep_local_grads: bool = True,
) -> None:
    """Register a DDP communication hook that checks each gradient bucket on this rank before
    it is reduced, then runs ``hook(state, bucket)`` (default: torch's ``allreduce_hook`` with
    ``state`` = the process group), so any user hook keeps working.

    Args:
        ddp: the ``DistributedDataParallel`` model, before its first backward.
        context: the recorder's :class:`RankContext` (``recorder.dist``).
        hook, state: the comm hook to wrap and its state (``ddp.register_comm_hook`` arguments).
        keep_local_grads: keep a copy of each bucket (the rank-local gradients) for the bundle;
            costs one copy of the gradients per step. Without it the bundle holds the reduced
            gradients, and replay of the origin rank cannot verify reproduction.

    Raises:
        RuntimeError: from DDP, when ``ddp`` already has a comm hook (wrap it with ``hook=``).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = hook or default_hooks.allreduce_hook
    inner_state = state if hook is not None else (state if state is not None else context.group)

    def nanreplay_origin_hook(_, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations: none here
        if not context.closed:
            context.note_bucket(bucket, keep=keep_local_grads)
        return inner(inner_state, bucket)

    ddp.register_comm_hook(None, nanreplay_origin_hook)
    context.hooked = True


def rank_summary(metas: Iterable[dict]) -> dict:
    """Which rank was first, from the metadata of several bundles (one per rank).

    The first failing step is the smallest ``failing_step``; the origin ranks are those whose
    local values were non-finite before the all-reduce in that step (as recorded in every
    rank's bundle). Returns ``{"first_step", "origin_ranks", "ranks", "world_size", "message"}``."""
    metas = list(metas)
    rows = []
    for m in metas:
        d = m.get("distributed") or {}
        rows.append({"rank": m.get("rank"), "step": m.get("failing_step"), "origin_ranks": d.get("origin_ranks") or [], "is_origin": bool(d.get("is_origin"))})
    with_rank = [r for r in rows if r["rank"] is not None]
    if not with_rank:
        return {"first_step": None, "origin_ranks": [], "ranks": [], "world_size": None, "message": "no bundle carries a rank: these are single-process bundles"}
    first = min(r["step"] for r in with_rank)
    origins = sorted({o for r in with_rank if r["step"] == first for o in r["origin_ranks"]})
    ws = {m.get("world_size") for m in metas} - {None}
    sharded = any((m.get("distributed") or {}).get("run_id") for m in metas)
    if origins:
        msg = f"first non-finite step {first}: born on rank(s) {origins} before the gradient {'reduce-scatter' if sharded else 'all-reduce'}"
    else:
        msg = f"first non-finite step {first}: the origin rank was not recorded (no origin comm hook)"
    return {
        "first_step": first,
        "origin_ranks": origins,
        "ranks": sorted(r["rank"] for r in with_rank),
        "world_size": next(iter(ws)) if len(ws) == 1 else None,
        "message": msg,
    }
