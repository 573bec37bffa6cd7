"""Sharded parameters (FSDP2 ``fully_shard``, tensor parallel ``parallelize_module``): the local
shards the Recorder reads, the sharding metadata a bundle records, and the FSDP2 origin hook.

Under FSDP2 a parameter is a ``DTensor`` whose local tensor is this rank's shard; between a
forward and its backward (``reshard_after_forward=True``) or after the step, the unsharded
storage behind the module's plain-tensor views is freed, so nothing here ever touches a
parameter's ``untyped_storage()`` or its full value: every read goes through :func:`local`
(``DTensor.to_local()``, no collective). What a bundle records per sharded tensor is
:func:`layout`: the global shape, the placements, the mesh shape and this rank's offsets, from
which :mod:`nanreplay.engine.shards` puts the full tensor back together on one process.

The FSDP2 origin hook (:func:`attach_reduce_scatter_hooks`) wraps each ``FSDPModule``'s
reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, feature-detected): the wrapped
collective is first handed this rank's flat buffer of *unsharded* gradients, before any rank's
values are mixed in, and folds ``not isfinite(max |buffer|)`` into the rank's local flag (on the
device, no sync).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["local", "is_sharded", "layout", "sharding_meta", "device_mesh_meta", "first_nonfinite_state", "attach_reduce_scatter_hooks", "check_sharded_options", "reduce_scatter_base", "has_fsdp"]


@functools.lru_cache(maxsize=None)
def _dtensor_type() -> Optional[type]:
    """``DTensor``, looked up once (it is called per parameter per step)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def local(t: Any) -> Any:
    """``t.to_local()`` for a ``DTensor`` (this rank's shard, no collective), else ``t``."""
    dt = _dtensor_type()
    return t.to_local() if dt is not None and isinstance(t, dt) else t


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2, tensor parallel)."""
    dt = _dtensor_type()
    return dt is not None and any(isinstance(p, dt) for p in model.parameters())


def _placement(p: Any) -> str:
    """``"S(d)"`` (sharded on dim d; FSDP over tensor parallel shards the same dim "strided",
    which the offsets already account for), ``"R"`` (replicated), ``"P"`` (partial: a pending
    sum)."""
    if p.is_replicate():
        return "R"
    if p.is_partial():
        return "P"
    return f"S({p.dim})"


def layout(t: Any) -> Optional[dict]:
    """The sharding of a ``DTensor`` as JSON, else ``None``: ``global_shape``, ``local_shape``,
    ``offsets`` (of this rank's shard in the global tensor, per dim), ``placements`` (one per
    mesh dim), ``mesh_shape``, ``mesh_dim_names`` and this rank's ``coordinate`` on the mesh."""
    dt = _dtensor_type()
    if dt is None or not isinstance(t, dt):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return {
        "global_shape": list(t.shape),
        "local_shape": [int(s) for s in shape],
        "offsets": [int(o) for o in offsets],
        "placements": [_placement(p) for p in t.placements],
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names or []),
        "coordinate": list(mesh.get_coordinate() or []),
    }


def sharding_meta(model: torch.nn.Module, optimizer: torch.optim.Optimizer, param_fqn: dict[int, str]) -> dict:
    """The bundle's ``distributed.sharding``: ``params`` (FQN -> :func:`layout`) and
    ``optimizer`` (``"<state index>/<key>"`` -> the FQN whose layout that optimizer state
    tensor shares)."""
    params = {n: lay for n, p in model.named_parameters() if (lay := layout(p)) is not None}
    opt: dict[str, str] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = param_fqn.get(id(p))
            st = optimizer.state.get(p, {})
            for k, v in st.items():
                if name in params and layout(v) is not None:
                    opt[f"{index}/{k}"] = name
            index += 1
    return {"params": params, "optimizer": opt}


def device_mesh_meta(model: torch.nn.Module) -> Optional[dict]:
    """The whole device mesh of ``model``'s first ``DTensor`` parameter, as JSON, else ``None``:
    ``shape``, ``ranks`` (the global ranks laid out on it, nested lists), ``dim_names``, and
    ``coordinates`` (every global rank on the mesh -> its coordinate). A parameter sharded on a
    submesh (FSDP2 on the ``dp`` dimension of a ``(dp, tp)`` mesh) still gives the root mesh, so
    every rank's bundle records the same mesh and every rank's place on it."""
    dt = _dtensor_type()
    mesh = next((p.device_mesh for p in model.parameters() if dt is not None and isinstance(p, dt)), None)
    if mesh is None:
        return None
    root = mesh
    get_root = getattr(mesh, "_get_root_mesh", None)
    if callable(get_root):
        try:
            root = get_root() or mesh
        except Exception:  # noqa: BLE001 - a private helper: the submesh is the next best record
            root = mesh
    t = root.mesh
    coords = {str(int(r)): list(idx) for idx, r in zip(itertools.product(*(range(n) for n in t.shape)), t.flatten().tolist())}  # row-major, as flatten
    return {"shape": list(t.shape), "ranks": t.tolist(), "dim_names": list(root.mesh_dim_names or []), "coordinates": coords}


def first_nonfinite_state(optimizer: torch.optim.Optimizer, param_fqn: dict[int, str]) -> Optional[dict]:
    """This rank's first NaN or Inf in its own weights, else in its optimizer state (its local
    shard of each ``DTensor``, its copy of each plain tensor), in the optimizer's parameter order;
    ``None`` when all are finite. One host read per tensor group, then one per non-finite tensor.

    Returns ``{"kind": "weight" | "optimizer state", "fqn", "key" (the optimizer state's key, else
    None), "value" ("NaN", "+Inf" or "-Inf"), "local_index" (in this rank's shard), "global_index"
    (in the full tensor: the shard's offsets added), "local_shape", "global_shape", "placements"
    (one per mesh dim, else None)}``.
    """
    from ..core.numerics import all_finite_flag, is_float

    params = [p for g in optimizer.param_groups for p in g["params"]]
    rows: list[tuple[str, Optional[str], Any, Any]] = [("weight", None, p, p) for p in params]
    rows += [("optimizer state", k, p, v) for p in params for k, v in optimizer.state.get(p, {}).items()
             if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == tuple(p.shape)]
    tensors = [(kind, key, p, v, local(v).detach()) for kind, key, p, v in rows]
    tensors = [row for row in tensors if is_float(row[4]) and row[4].numel()]
    if not tensors:
        return None
    ok = torch.stack([all_finite_flag(t).to(tensors[0][4].device) for *_, t in tensors]).tolist()
    for (kind, key, p, v, t), fine in zip(tensors, ok):
        if fine:
            continue
        flat = int((~torch.isfinite(t)).flatten().nonzero()[0])
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.dim() else []
        x = float(t.flatten()[flat])
        lay = layout(v)
        offsets = lay["offsets"] if lay is not None else [0] * len(idx)
        return {"kind": kind, "fqn": param_fqn.get(id(p), "?"), "key": key, "value": "NaN" if math.isnan(x) else ("+Inf" if x > 0 else "-Inf"),
                "local_index": idx, "global_index": [i + o for i, o in zip(idx, offsets)], "local_shape": list(t.shape),
                "global_shape": list(v.shape), "placements": lay["placements"] if lay is not None else None}
    return None


def check_sharded_options(config: Any) -> None:
    """Refuse the modes that would let the ranks of a sharded model decide apart.

    Raises:
        ValueError: ``check_update=True`` (its check of the updated shards is rank-local, with no
            agreement: one rank would restore and stop while the others wait in a collective).
    """
    if config.check_update:
        raise ValueError("check_update=True is not supported on a sharded (FSDP2 / DTensor) model: each rank would check its own "
                         "updated shards with no agreement, and the ranks could stop in different steps; pass check_update=False")


def has_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds an FSDP2 ``FSDPModule`` (its gradients are reduce-scattered)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def reduce_scatter_base() -> Optional[type]:
    """FSDP2's ``ReduceScatter`` base class when ``FSDPModule.set_custom_reduce_scatter`` exists
    in this torch, else ``None`` (the feature detection of the origin hook)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import ReduceScatter
    except ImportError:
        return None
    return ReduceScatter if hasattr(FSDPModule, "set_custom_reduce_scatter") else None


def attach_reduce_scatter_hooks(model: torch.nn.Module, note: Callable[[torch.Tensor], None], is_on: Callable[[], bool]) -> list[Any]:
    """Wrap the reduce-scatter of every ``FSDPModule`` in ``model`` so that ``note(buffer)`` sees
    this rank's flat unsharded gradients before the collective (while ``is_on()``). Returns one
    handle per wrapped module (``.remove()`` puts the previous collective back); an empty list
    when this torch's FSDP2 has no ``set_custom_reduce_scatter`` or no module accepted it (then
    the origin is known from the local loss and cotangent only)."""
    base = reduce_scatter_base()
    if base is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    class OriginReduceScatter(base):  # type: ignore[misc, valid-type]
        """The rank's flag from its own gradients, then the wrapped reduce-scatter unchanged."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
            if is_on():
                try:
                    note(input_tensor)
                except Exception as e:  # noqa: BLE001 - inside FSDP's backward: the recorder never makes training worse
                    logger.warning("nanreplay: the origin flag of a reduce-scatter input failed (%s: %s)", type(e).__name__, e)
            return self.inner(output_tensor, input_tensor, group, *args, **kwargs)

    handles = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []
        if not groups:
            continue
        inner = getattr(groups[0], "_reduce_scatter_comm", None)
        if inner is None:
            continue
        try:
            m.set_custom_reduce_scatter(OriginReduceScatter(inner))
        except (ValueError, RuntimeError) as e:  # several param groups (per-parameter meshes)
            logger.warning("nanreplay: could not wrap the reduce-scatter of %s (%s); its gradients are checked after the "
                           "reduce-scatter only", type(m).__name__, e)
            continue
        handles.append(_Handle(m, inner))
    return handles


class _Handle:
    """Puts a module's previous reduce-scatter back; idempotent."""

    def __init__(self, module: Any, inner: Any) -> None:
        self.module, self.inner = module, inner

    def remove(self) -> None:
        if self.module is not None:
            try:
                self.module.set_custom_reduce_scatter(self.inner)
            finally:
                self.module = None
