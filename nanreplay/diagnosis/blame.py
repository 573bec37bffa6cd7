"""Which samples, and which optimizer state: replays beyond the one step.

* :func:`samples_to_blame` replays the failing step on subsets of the batch (bisection along the
  batch dimension) and returns the samples that alone make the result non-finite. Cost: about
  ``2 * k * log2(B)`` extra forward/backward passes for ``k`` guilty samples of a batch of ``B``
  (``2B - 1`` in the worst case, capped by ``max_runs``).
* :func:`replay_optimizer_update` rebuilds the optimizer from the bundle (class path, param groups
  by FQN, ``state_dict()``), applies the recorded (finite) gradients to copies of the pre-step
  weights, runs ``optimizer.step()`` under the op monitor, and names the parameter FQN, the
  optimizer state key and the hyperparameter that make the update non-finite. The live model and
  optimizer are never touched.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import replace
from typing import Any, Optional

import torch
from torch.utils.module_tracker import ModuleTracker

from ..core.allowlist import Allowlist
from ..core.state import load_buffers
from ..errors import DiagnosisTimeout
from ..engine.deadline import check_deadline
from .evidence import domain_explanation
from ..format.records import ForwardRecord, Snapshot, StepRecord
from ..core.numerics import is_float
from ..core.tree import map_tensors, tensor_leaves

logger = logging.getLogger(__name__)

__all__ = ["batch_size", "cotangent_rows", "samples_to_blame", "replay_optimizer_update"]


def batch_size(rec: StepRecord, use_loss: bool) -> Optional[int]:
    """Size of dim 0 of the first tensor (of rank >= 1) of the step's batch, or of its first
    forward call's inputs when replay is driven by the cotangent."""
    trees = rec.batches if use_loss else [fw.inputs for fw in rec.forwards]
    for tree in trees:
        for t in tensor_leaves(tree):
            if t.dim() >= 1:
                return int(t.shape[0])
    return None


def cotangent_rows(rec: StepRecord, size: int) -> Optional[dict]:
    """The samples whose recorded output gradient (cotangent) is non-finite: rows along dim 0 of
    every cotangent tensor with ``size`` rows. For a loss that was not replayed (no loss
    function), these rows are where the loss sent its non-finite gradient."""
    bad: set[int] = set()
    for fw in rec.forwards:
        for t in tensor_leaves(fw.cotangent):
            if is_float(t) and t.dim() >= 1 and t.shape[0] == size:
                bad.update(int(i) for i in (~torch.isfinite(t.detach().reshape(size, -1))).any(dim=1).nonzero().flatten().tolist())
    if not bad:
        return None
    return {"indices": sorted(bad)[:64], "batch_size": size, "method": "non-finite rows of the recorded output gradient", "warnings": []}


def take_rows(tree: Any, idx: Any, size: int) -> Any:
    """Slice every tensor leaf of ``tree`` whose dim 0 equals ``size`` (the batch dimension) to
    the rows ``idx`` (a list or a long tensor); other leaves and non-tensors pass unchanged."""
    idx = torch.as_tensor(idx, dtype=torch.long)

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == size:
            return x.index_select(0, idx.to(x.device))
        return x

    return map_tensors(cut, tree)


def _slice_record(rec: StepRecord, idx: list[int], size: int) -> StepRecord:
    ix = torch.tensor(idx, dtype=torch.long)
    return replace(
        rec,
        batches=[take_rows(b, ix, size) for b in rec.batches],
        forwards=[ForwardRecord(inputs=take_rows(fw.inputs, ix, size), cotangent=take_rows(fw.cotangent, ix, size) if fw.cotangent is not None else None) for fw in rec.forwards],
    )


def batch_coupled(model: torch.nn.Module, rec: StepRecord) -> list[str]:
    """FQNs of the layers whose output for one sample depends on the rest of the batch
    (BatchNorm in training mode during step ``rec``): per-sample results can differ there."""
    training = set(rec.training)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and n in training]


def samples_to_blame(model: torch.nn.Module, inp: Any, *, phase: str, device: Optional[torch.device] = None, max_runs: int = 64,
                     progress: Any = None) -> Optional[dict]:
    """The samples of the failing step's batch that alone make the step non-finite.

    Args:
        model: the replay model, holding the step-start weights (buffers are reset from
            ``inp.state`` before each run).
        inp: the :class:`~nanreplay.engine.run.StepInputs` of the failing step.
        phase: ``"forward"``/``"loss"`` (a non-finite model output or loss counts) or
            ``"backward"`` (a non-finite gradient counts).
        max_runs: cap on the extra replays.

    Returns:
        ``{"indices": [int], "batch_size": B, "method": "per-sample replay", "runs": n,
        "complete": bool, "warnings": [str]}``, or ``None`` when the batch has no batch dimension.
    """
    from ..engine.run import StepInputs, run_step

    use_loss = inp.loss_fn is not None and bool(inp.record.batches)
    size = batch_size(inp.record, use_loss)
    if size is None:
        return None
    warnings: list[str] = []
    coupled = batch_coupled(model, inp.record)
    if coupled:
        warnings.append(
            f"batch-coupled layers in training mode ({', '.join(coupled[:4])}): per-sample results can differ from the whole batch"
        )
    runs = 0
    complete = True

    def bad(idx: list[int]) -> bool:
        nonlocal runs, complete
        if runs >= max_runs:
            complete = False
            return False
        check_deadline()
        runs += 1
        if progress is not None:
            progress(f"per-sample replay {runs} (samples {idx[:4]}{'...' if len(idx) > 4 else ''} of {size})")
        load_buffers(model, inp.state.buffers)
        sub = StepInputs(record=_slice_record(inp.record, idx, size), state=inp.state, recorded_grads={}, loss_fn=inp.loss_fn)
        try:
            res = run_step(model, sub, ops=False, device=device)
        except DiagnosisTimeout:
            raise
        except Exception as e:  # e.g. BatchNorm refuses a batch of one in training mode
            msg = f"the replay of samples {idx[:4]}{'...' if len(idx) > 4 else ''} failed: {type(e).__name__}: {str(e)[:120]}"
            if msg not in warnings:
                warnings.append(msg)
            return False
        if phase == "backward":
            return any(is_float(g) and not bool(torch.isfinite(g).all()) for g in res.grads.values())
        hs = [h for h in list(res.outputs) + list(res.losses) if h is not None]
        return any(not h.finite for h in hs)

    def search(idx: list[int], known_bad: bool) -> list[int]:
        if not known_bad and not bad(idx):
            return []
        if len(idx) == 1:
            return idx
        mid = len(idx) // 2
        return search(idx[:mid], False) + search(idx[mid:], False)

    found = search(list(range(size)), size > 1) if size > 1 else ([0] if bad([0]) else [])
    batch_level = size is not None and size > 1 and found == list(range(size))
    if batch_level:
        # blaming every sample names none: report no indices rather than a misleading list
        warnings.append("every sample alone is non-finite: the failure depends on the batch as a whole (or on the weights), not on particular samples")
        found = []
    elif size is not None and size > 1 and not found and complete:
        warnings.append("no sample alone is non-finite: the failure needs several samples together (a batch-level interaction)")
    if not complete:
        warnings.append(f"stopped after {max_runs} per-sample replays; the list may be incomplete")
    return {
        "indices": found,
        "batch_size": size,
        "method": "per-sample replay",
        "batch_level": batch_level,
        "runs": runs,
        "complete": complete,
        "warnings": warnings,
    }


# ---------------------------------------------------------------------------------------------
# the optimizer update
# ---------------------------------------------------------------------------------------------
def _build_optimizer(info: dict, state: Snapshot, device: Optional[torch.device], sd: dict) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The recorded optimizer over fresh copies of the bundle's pre-step parameters."""
    from ..engine.state import optimizer_from_info

    params: dict[str, torch.nn.Parameter] = {}
    for f in (f for fqns in info["param_groups_fqns"] for f in fqns):
        if f not in state.params:
            raise KeyError(f"the optimizer's parameter {f!r} is not among the bundle's weights")
        t = state.params[f].detach().clone()
        params[f] = torch.nn.Parameter(t.to(device) if device is not None else t)
    return optimizer_from_info(info, params, copy.deepcopy(sd)), params


def _step(info: dict, state: Snapshot, grads: dict[str, torch.Tensor], device: Optional[torch.device], sd: dict, monitor: Optional[Any] = None) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    opt, params = _build_optimizer(info, state, device, sd)
    for f, p in params.items():
        g = grads.get(f)
        p.grad = g.detach().clone().to(p.device, p.dtype) if g is not None else None
    if monitor is not None:
        with monitor:
            opt.step()
    else:
        opt.step()
    return opt, params


def _nonfinite(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and is_float(t) and t.numel() > 0 and not bool(torch.isfinite(t).all())


def replay_optimizer_update(state: Snapshot, grads: dict[str, torch.Tensor], info: Optional[dict], *, device: Optional[torch.device] = None,
                            allow: Optional[Allowlist] = None) -> Optional[dict]:
    """Replay ``optimizer.step()`` from the bundle's pre-step state and recorded gradients.

    Args:
        state: pre-step weights and optimizer ``state_dict()`` (``state.optimizer``).
        grads: the step's gradients, FQN -> tensor (finite: otherwise the update is not at fault).
        info: the bundle's ``meta["optimizer"]``: ``class`` (import path), ``param_groups_fqns``.

    Returns:
        ``None`` when the optimizer cannot be rebuilt (no state, no class), else a dict:
        ``nonfinite`` (bool), ``param`` (first non-finite parameter FQN), ``state_key`` (the
        optimizer state key at fault), ``params`` (every non-finite parameter, up to 16),
        ``state`` (FQN -> non-finite state keys), ``group`` (param group index),
        ``hyperparameters`` (that group's scalar settings), ``births`` (op births during the
        step), ``detail`` and ``evidence`` (strings), ``class``.
    """
    from ..engine.monitors import OpMonitor
    from .origin import _event_json

    if state.optimizer is None or not info or not info.get("class") or not info.get("param_groups_fqns"):
        return None
    sd = state.optimizer
    mon = OpMonitor(ModuleTracker(), "", allow=allow)
    mon.phase = "optimizer"
    try:
        opt, params = _step(info, state, grads, device, sd, mon)
    except DiagnosisTimeout:
        raise
    except Exception as e:
        logger.warning("nanreplay: could not replay the optimizer update: %s: %s", type(e).__name__, e)
        return {"nonfinite": False, "error": f"{type(e).__name__}: {e}"}
    fqn_of = {id(p): f for f, p in params.items()}
    bad_params: list[str] = []
    bad_state: dict[str, list[str]] = {}
    group_of: dict[str, int] = {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            f = fqn_of[id(p)]
            group_of[f] = gi
            keys = [k for k, v in opt.state.get(p, {}).items() if _nonfinite(v)]
            if keys:
                bad_state[f] = keys
            if _nonfinite(p.detach()):
                bad_params.append(f)
    out: dict = {"class": info["class"], "nonfinite": bool(bad_params or bad_state), "params": bad_params[:16], "state": bad_state,
                 "births": [_event_json(b) for b in mon.births[:8]], "param": None, "state_key": None, "group": None,
                 "hyperparameters": None, "detail": None, "evidence": []}
    if not out["nonfinite"]:
        return out
    first = bad_params[0] if bad_params else next(iter(bad_state))
    gi = group_of[first]
    hp = {k: v for k, v in sd["param_groups"][gi].items() if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))}
    out.update(param=first, group=gi, hyperparameters={k: (attribution_float(v)) for k, v in hp.items()})
    ev = out["evidence"]
    bad_hp = [k for k, v in hp.items() if isinstance(v, float) and not math.isfinite(v)]
    zero_hp = [k for k, v in hp.items() if isinstance(v, float) and v == 0.0 and k not in ("weight_decay", "momentum", "dampening")]
    for k in bad_hp:
        ev.append(f"{k}={hp[k]} in param group {gi}")
    if bad_state.get(first):
        out["state_key"] = bad_state[first][0]
        ev.append(f"optimizer state {', '.join(bad_state[first])} of {first} becomes non-finite")
    # counterfactual: which state tensor, zero where the update became non-finite, makes the
    # update finite when its zeros are replaced by the dtype's smallest normal value
    p_new = params[first].detach()
    mask = ~torch.isfinite(p_new)
    pid = sd["param_groups"][gi]["params"][info["param_groups_fqns"][gi].index(first)]
    pre = sd["state"].get(pid, {})
    zero_keys = [k for k, v in pre.items() if isinstance(v, torch.Tensor) and is_float(v) and v.shape == p_new.shape and bool((v.to(mask.device)[mask] == 0).any())]
    blamed = []
    for k in zero_keys:
        sd2 = copy.deepcopy(sd)
        v = sd2["state"][pid][k]
        sd2["state"][pid][k] = torch.where(v == 0, torch.full_like(v, torch.finfo(v.dtype).tiny), v)
        try:
            _, params2 = _step(info, state, grads, device, sd2)
        except Exception:
            continue
        if bool(torch.isfinite(params2[first].detach()).all()):
            blamed.append(k)
    if blamed and out["state_key"] is None:
        out["state_key"] = blamed[0]
        ev.append(f"{blamed[0]} of {first} is 0 where the update became non-finite; with those zeros replaced by a tiny positive value the update is finite")
    elif zero_keys:
        ev.append(f"state {', '.join(zero_keys)} of {first} is 0 where the update became non-finite")
    else:  # first step: no pre-step state to vary; name the post-step state that is 0 there
        p_obj = params[first]
        post_zero = [k for k, v in opt.state.get(p_obj, {}).items() if isinstance(v, torch.Tensor) and v.shape == p_new.shape and bool((v[mask] == 0).any())]
        if post_zero:
            out["zero_state"] = post_zero
            ev.append(f"state {', '.join(post_zero)} of {first} is 0 after the step where the update became non-finite (first step: no earlier state)")
    if zero_hp:
        ev.append(f"zero-valued hyperparameters in param group {gi}: {', '.join(f'{k}=0' for k in zero_hp)}")
    for b in mon.births[:1]:
        dom = domain_explanation(b["op"].replace("_foreach_", "").replace("addcdiv", "div"), backward=False)
        ev.append(f"first non-finite value born in op {b['op']} of {info['class']}.step" + (f" ({dom})" if dom else ""))
    if bad_hp:
        out["detail"] = f"{bad_hp[0]}={hp[bad_hp[0]]} in param group {gi} makes the update of {first} non-finite"
    elif out["state_key"]:
        out["detail"] = f"optimizer state {out['state_key']} of {first} makes its update non-finite" + (
            f" ({', '.join(f'{k}=0' for k in zero_hp)})" if zero_hp else "")
    else:
        out["detail"] = f"the update of {first} is non-finite although its gradient is finite"
    return out


def attribution_float(v: Any) -> Any:
    """Hyperparameters for strict JSON: non-finite floats as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [attribution_float(x) for x in v]
    return v
