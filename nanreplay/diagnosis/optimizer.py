"""The optimizer's part in a non-finite step.

* :func:`replay_optimizer_update` rebuilds the optimizer from the bundle (class path, param groups
  by FQN, ``state_dict()``), applies the recorded (finite) gradients to copies of the pre-step
  weights, runs ``optimizer.step()`` under the op monitor, and names the parameter FQN, the
  optimizer state key and the hyperparameter that make the update non-finite. The live model and
  optimizer are never touched.
* :func:`weights_evidence` explains weights that are already non-finite at step start, from the
  bundle alone: which parameter, the step whose update did it (the last step whose check
  passed), the optimizer state keys that are non-finite, and the hyperparameters that are 0,
  Inf or NaN once cast to the parameter's dtype, or learning rates that were non-finite.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Optional

import torch
from torch.utils.module_tracker import ModuleTracker

from ..core.allowlist import Allowlist
from ..core.digest import grads_nonfinite
from ..core.numerics import any_nonfinite, is_float
from ..engine.deadline import replay_error
from ..engine.monitors import OpMonitor
from ..engine.run import StepInputs
from ..engine.state import optimizer_from_info
from ..format.records import Snapshot
from .evidence import DOMAIN

logger = logging.getLogger(__name__)

__all__ = ["replay_optimizer_update", "weights_evidence"]


def _build_optimizer(info: dict, state: Snapshot, device: Optional[torch.device], sd: dict) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The recorded optimizer over fresh copies of the bundle's pre-step parameters."""
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


def replay_optimizer_update(state: Snapshot, grads: dict[str, torch.Tensor], info: Optional[dict], *, device: Optional[torch.device] = None,
                            allow: Optional[Allowlist] = None) -> Optional[dict]:
    """Replay ``optimizer.step()`` from the bundle's pre-step state and recorded gradients.

    Args:
        state: pre-step weights and optimizer ``state_dict()`` (``state.optimizer``).
        grads: the step's gradients, FQN -> tensor (finite: otherwise the update is not at fault).
        info: the bundle's ``meta["optimizer"]``: ``class`` (import path), ``param_groups_fqns``.

    Returns:
        ``None`` when the optimizer cannot be rebuilt (no state, no class); when the replay
        raised, ``{"nonfinite": False, "error": "Type: message", "class"}`` (the diagnosis
        reports the error, never a finite update); else a dict:
        ``nonfinite`` (bool), ``param`` (first non-finite parameter FQN), ``state_key`` (the
        optimizer state key at fault), ``params`` (every non-finite parameter, up to 16),
        ``state`` (FQN -> non-finite state keys), ``group`` (param group index),
        ``hyperparameters`` (that group's scalar settings), ``births`` (op births during the
        step), ``detail`` and ``evidence`` (strings), ``class``, ``error`` (``None``).
    """
    if state.optimizer is None or not info or not info.get("class") or not info.get("param_groups_fqns"):
        return None
    sd = state.optimizer
    mon = OpMonitor(ModuleTracker(), None, allow=allow)
    mon.run_phase = "optimizer"
    try:
        opt, params = _step(info, state, grads, device, sd, mon)
    except Exception as e:
        error = replay_error(e)
        logger.warning("nanreplay: could not replay the optimizer update: %s", error)
        return {"class": info["class"], "nonfinite": False, "error": error}
    bad_params, bad_state, group_of = _nonfinite_after(opt, params)
    out: dict = {"class": info["class"], "nonfinite": bool(bad_params or bad_state), "params": bad_params[:16], "state": bad_state,
                 "births": [_birth_json(b) for b in mon.births[:8]], "param": None, "state_key": None, "group": None,
                 "hyperparameters": None, "detail": None, "evidence": [], "error": None}
    if not out["nonfinite"]:
        return out
    first = bad_params[0] if bad_params else next(iter(bad_state))
    gi = group_of[first]
    hp = {k: v for k, v in sd["param_groups"][gi].items() if k != "params" and isinstance(v, (int, float, bool, str, type(None), list, tuple))}
    out.update(param=first, group=gi, hyperparameters={k: _json_hyper(v) for k, v in hp.items()})
    bad_hp = [k for k, v in hp.items() if isinstance(v, float) and not math.isfinite(v)]
    zero_hp = [k for k, v in hp.items() if isinstance(v, float) and v == 0.0 and k not in ("weight_decay", "momentum", "dampening")]
    ev = out["evidence"]
    ev.extend(f"{k}={hp[k]} in param group {gi}" for k in bad_hp)
    if bad_state.get(first):
        out["state_key"] = bad_state[first][0]
        ev.append(f"optimizer state {', '.join(bad_state[first])} of {first} becomes non-finite")
    _zero_state_evidence(out, opt, params, info, state, grads, device, sd)
    if zero_hp:
        ev.append(f"zero-valued hyperparameters in param group {gi}: {', '.join(f'{k}=0' for k in zero_hp)}")
    ev.extend(_birth_evidence(b, info["class"]) for b in mon.births[:1])
    if bad_hp:
        out["detail"] = f"{bad_hp[0]}={hp[bad_hp[0]]} in param group {gi} makes the update of {first} non-finite"
    elif out["state_key"]:
        out["detail"] = f"optimizer state {out['state_key']} of {first} makes its update non-finite" + (
            f" ({', '.join(f'{k}=0' for k in zero_hp)})" if zero_hp else "")
    else:
        out["detail"] = f"the update of {first} is non-finite although its gradient is finite"
    return out


def _nonfinite_after(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, list[str]], dict[str, int]]:
    """After the replayed step: the non-finite parameters (FQNs, in param-group order), the
    non-finite optimizer state keys of each parameter, and each parameter's param group index."""
    fqn_of = {id(p): f for f, p in params.items()}
    bad_params: list[str] = []
    bad_state: dict[str, list[str]] = {}
    group_of: dict[str, int] = {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            f = fqn_of[id(p)]
            group_of[f] = gi
            keys = [k for k, v in opt.state.get(p, {}).items() if any_nonfinite(v)]
            if keys:
                bad_state[f] = keys
            if any_nonfinite(p.detach()):
                bad_params.append(f)
    return bad_params, bad_state, group_of


def _zero_state_evidence(out: dict, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], info: dict, state: Snapshot,
                         grads: dict[str, torch.Tensor], device: Optional[torch.device], sd: dict) -> None:
    """The counterfactual on the pre-step state of ``out["param"]``: which state tensor, zero
    where the update became non-finite, makes the update finite when its zeros are replaced by
    the dtype's smallest normal value; on a first step (no pre-step state), the post-step state
    that is 0 there. Adds to ``out["evidence"]``, may set ``state_key`` and ``zero_state``."""
    first, gi, ev = out["param"], out["group"], out["evidence"]
    p_new = params[first].detach()
    mask = ~torch.isfinite(p_new)
    pid = sd["param_groups"][gi]["params"][info["param_groups_fqns"][gi].index(first)]
    pre = sd["state"].get(pid, {})
    zero_keys = [k for k, v in pre.items() if isinstance(v, torch.Tensor) and is_float(v) and v.shape == p_new.shape and bool((v.to(mask.device)[mask] == 0).any())]
    blamed = [k for k in zero_keys if _finite_without_zeros(k, pid, first, info, state, grads, device, sd)]
    if blamed and out["state_key"] is None:
        out["state_key"] = blamed[0]
        ev.append(f"{blamed[0]} of {first} is 0 where the update became non-finite; with those zeros replaced by a tiny positive value the update is finite")
    elif zero_keys:
        ev.append(f"state {', '.join(zero_keys)} of {first} is 0 where the update became non-finite")
    else:  # first step: no pre-step state to vary; name the post-step state that is 0 there
        post_zero = [k for k, v in opt.state.get(params[first], {}).items() if isinstance(v, torch.Tensor) and v.shape == p_new.shape and bool((v[mask] == 0).any())]
        if post_zero:
            out["zero_state"] = post_zero
            ev.append(f"state {', '.join(post_zero)} of {first} is 0 after the step where the update became non-finite (first step: no earlier state)")


def _finite_without_zeros(key: str, pid: Any, fqn: str, info: dict, state: Snapshot, grads: dict[str, torch.Tensor],
                          device: Optional[torch.device], sd: dict) -> bool:
    """Whether the update of ``fqn`` is finite once the zeros of its pre-step state ``key`` are
    replaced by the dtype's smallest normal value (a replay that fails answers no)."""
    sd2 = copy.deepcopy(sd)
    v = sd2["state"][pid][key]
    sd2["state"][pid][key] = torch.where(v == 0, torch.full_like(v, torch.finfo(v.dtype).tiny), v)
    try:
        _, params2 = _step(info, state, grads, device, sd2)
    except Exception as e:
        logger.info("nanreplay: the optimizer replay without zeros in %s failed: %s", key, replay_error(e))
        return False
    return not any_nonfinite(params2[fqn].detach())


def _birth_evidence(b: dict, cls: str) -> str:
    """The evidence line of the first op birth in the optimizer step, with its domain."""
    d = DOMAIN.get(b["op"].replace("_foreach_", "").replace("addcdiv", "div").strip("_"))
    dom = d.forward if d is not None else None
    return f"first non-finite value born in op {b['op']} of {cls}.step" + (f" ({dom})" if dom else "")


def _json_hyper(v: Any) -> Any:
    """Hyperparameters for strict JSON: non-finite floats as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [_json_hyper(x) for x in v]
    return v


def _birth_json(b: dict) -> dict:
    return {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in b.items() if k != "operands"}


def _param_ids(info: Optional[dict]) -> dict[str, int]:
    """FQN -> the integer key of its state in ``optimizer.state_dict()["state"]`` (params are
    numbered in param-group order)."""
    fqns = [f for group in (info or {}).get("param_groups_fqns", []) for f in group]
    return {f: i for i, f in enumerate(fqns)}


def _hyperparameter_evidence(group: dict, dtype: torch.dtype, found: list[str], ev: list[str]) -> None:
    """The numeric hyperparameters of a param group that are non-finite, or that become 0 or
    non-finite once cast to the parameter's ``dtype``: appended to ``found`` (short) and ``ev``."""
    name = str(dtype).replace("torch.", "")
    for k, v in group.items():
        if k == "params" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        cast = float(torch.tensor(float(v), dtype=torch.float64).to(dtype))
        if not math.isfinite(float(v)):
            found.append(f"{k}={v!r}")
            ev.append(f"hyperparameter {k}={v!r} in its param group")
        elif v != 0 and cast == 0:
            found.append(f"{k}={v!r} is 0 in {name}")
            ev.append(f"hyperparameter {k}={v!r} rounds to 0 in {name}, the parameter's dtype")
        elif not math.isfinite(cast):
            found.append(f"{k}={v!r} is {cast!r} in {name}")
            ev.append(f"hyperparameter {k}={v!r} is {cast!r} in {name}, the parameter's dtype")


def _optimizer_state_evidence(inp: StepInputs, tensor: str, out: dict, ev: list[str]) -> None:
    """The optimizer's side of a non-finite weight ``tensor``: its non-finite state entries
    (``out["state_keys"]``) and its param group's hyperparameters that do not fit its dtype
    (``out["hyperparameters"]``), each with its sentence appended to ``ev``."""
    sd = inp.state.optimizer or {}
    pid = _param_ids(inp.optimizer_info).get(tensor)
    st = (sd.get("state") or {}).get(pid, (sd.get("state") or {}).get(str(pid), {})) if pid is not None else {}
    keys = [k for k, v in st.items() if any_nonfinite(v)]
    out["state_keys"] = keys
    if keys:
        ev.append(f"optimizer state {', '.join(keys)} of {tensor} is non-finite too")
    param = inp.state.params.get(tensor)
    group = next((g for g in sd.get("param_groups", []) if pid is not None and pid in g.get("params", [])), None)
    if group is not None and param is not None and param.is_floating_point():
        _hyperparameter_evidence(group, param.dtype, out["hyperparameters"], ev)


def weights_evidence(inp: StepInputs, tensor: str, *, is_param: bool) -> dict:
    """Why the step-start tensor ``tensor`` (an FQN) is already non-finite, from the bundle alone.

    Returns:
        ``{"detail", "evidence": [str], "state_keys": [str], "update_step": int | None,
        "hyperparameters": [str], "nonfinite_lr": [step, lr] | None, "nonfinite_since"}``;
        ``nonfinite_since`` is ``"before recording"`` (the Recorder's attach-time scan found the
        tensor non-finite), ``{"after": step, "by": step}`` (finite at attach, non-finite at the
        failing step's start) or ``None`` (no attach scan in the bundle).
    """
    ev: list[str] = []
    out: dict[str, Any] = {"state_keys": [], "update_step": None, "hyperparameters": [], "nonfinite_lr": None}
    if not is_param:
        out["detail"] = (f"buffer {tensor} is non-finite at the step's start; no optimizer updates a buffer, so the model's code "
                         "(a running statistic, a weight computed from data) or the code that set it made it non-finite")
        out["evidence"] = [f"buffer {tensor} holds non-finite values before any op of step {inp.record.step} runs"]
        return out
    history = [r for r in inp.history if r.step < inp.record.step]
    passed = [r for r in history if r.finite]
    scan = inp.attach_scan if isinstance(inp.attach_scan, dict) else None
    before = scan is not None and tensor in (scan.get("nonfinite") or [])
    if before:
        out["nonfinite_since"] = "before recording"
        ev.append(f"the Recorder's scan when it attached (step {scan.get('step')}) found {tensor} already non-finite: a loaded checkpoint, "
                  "the initialisation or code that ran before it; no recorded update made it non-finite")
    elif scan is not None:
        out["nonfinite_since"] = {"after": scan.get("step"), "by": inp.record.step}
        ev.append(f"{tensor} was finite when the Recorder attached (step {scan.get('step')}) and is non-finite at the start of step "
                  f"{inp.record.step}: a step in between made it non-finite")
    else:
        out["nonfinite_since"] = None
        ev.append("the bundle has no attach-time scan (an older Recorder): when the weights became non-finite is unknown")
    if passed and not before:
        out["update_step"] = passed[-1].step
        ev.append(f"the last step whose check passed is {passed[-1].step}; its optimizer update ran after that check and was not re-executed "
                  "here (check_update=True checks each update)")
    bad_lr = next(((r.step, lr) for r in history for lr in r.lrs if lr is not None and not math.isfinite(lr)), None)
    if bad_lr is not None:
        out["nonfinite_lr"] = [bad_lr[0], repr(bad_lr[1])]
        ev.append(f"the learning rate was {bad_lr[1]!r} at step {bad_lr[0]} (recorded in the ring buffer)")
    _optimizer_state_evidence(inp, tensor, out, ev)
    grads_finite = not grads_nonfinite(inp.recorded_grads)
    ev.append("the recorded gradients of this step are " + ("finite" if grads_finite else "non-finite (they follow from the weights)"))
    why = out["hyperparameters"][0] if out["hyperparameters"] else (f"learning rate {out['nonfinite_lr'][1]} at step {out['nonfinite_lr'][0]}"
                                                                     if out["nonfinite_lr"] else None)
    if before:
        out["detail"] = (f"{tensor} was already non-finite when the Recorder attached (step {scan.get('step')}): how it became so is "
                         "unknown (check the checkpoint or the initialisation that produced it)")
    else:
        where = (f"the update of step {out['update_step']}" if out["update_step"] is not None else "an earlier optimizer update")
        out["detail"] = (f"{tensor} is non-finite before the step; the last update that ran is {where}, unreplayed: check_update=True "
                         "checks each update") + (f" ({why})" if why else "")
    out["evidence"] = ev
    return out
