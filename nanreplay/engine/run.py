"""Running one recorded step again: restore the step's RNG states and module modes, feed the
recorded batch (or forward inputs and cotangents), run forward, the loss and backward under the
monitors (:mod:`nanreplay.engine.monitors`), with deterministic algorithms where torch has them.

The result is plain data (:class:`ReplayResult`): module events, op births, losses and gradients.
The diagnosis (:mod:`nanreplay.diagnosis`) interprets it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.module_tracker import ModuleTracker

from ..core.allowlist import Allowlist
from ..core.numerics import Health, is_float, tensor_health
from ..core.rng import RNGState
from ..core.tree import flatten_typed, map_tensors, tensor_leaves, to_typed
from ..errors import ReplayError
from ..format.records import Snapshot, StepRecord
from .monitors import ModuleMonitor, OpMonitor
from .state import replay_scaler

logger = logging.getLogger(__name__)

__all__ = ["StepInputs", "ReplayResult", "run_step", "preserve_live"]



@dataclass
class StepInputs:
    """What a replay of one step needs, wherever it comes from (live recorder or bundle)."""

    record: StepRecord
    state: Snapshot
    recorded_grads: dict[str, torch.Tensor]
    loss_fn: Optional[Callable] = None
    scaler: Optional[dict] = None          # GradScaler state_dict of the step, when one was used
    grads_unscaled: Optional[bool] = None  # whether the recorded gradients were unscaled
    allow: Optional[Allowlist] = None            # legitimate non-finite values (default: -Inf masks)
    optimizer_info: Optional[dict] = None        # bundle meta["optimizer"]: class path, param_groups_fqns
    history: list = field(default_factory=list)  # ring-buffer StepRecords up to the failing step
    reason: dict = field(default_factory=dict)   # why the recorder dumped (meta["reason"])


@dataclass
class ReplayResult:
    """The outcome of one replay, turned into the diagnosis dict by :func:`diagnose`."""

    mode: str                                    # "loss_fn" | "cotangent" | "forward-only"
    modules: ModuleMonitor
    ops: Optional[OpMonitor]
    losses: list[Optional[Health]]
    cotangents: list[Optional[Health]]
    inputs: list[dict]                           # non-finite input leaves
    weights: list[dict]                          # non-finite step-start params/buffers
    grads: dict[str, torch.Tensor]
    outputs: list[Optional[Health]]
    warnings: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_bench = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        torch.backends.cudnn.benchmark = prev_bench


@contextlib.contextmanager
def _anomaly(on: bool) -> Iterator[None]:
    """Autograd anomaly mode without the NaN check: torch then stores each autograd node's forward
    stack in ``node.metadata["traceback_"]``, which names the forward line of a backward birth."""
    if not on:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            yield


def _to_device(tree: Any, device: Optional[torch.device]) -> Any:
    if device is None:
        return tree
    return map_tensors(lambda x: x.to(device), tree)


def _nonfinite_leaves(tree: Any, root: str) -> list[dict]:
    """The non-finite float leaves of ``tree`` (dataclass and namedtuple fields included), each
    with its path under ``root`` (e.g. ``batch.image``), health and the dim-0 rows holding them."""
    out = []
    for path, leaf in pytree.tree_flatten_with_path(to_typed(tree))[0]:
        if isinstance(leaf, torch.Tensor) and is_float(leaf) and leaf.numel():
            h = tensor_health([leaf])
            if h is not None and not h.finite:
                bad = (~torch.isfinite(leaf.detach())).nonzero()
                samples = sorted({int(i) for i in bad[:, 0].tolist()})[:16] if leaf.dim() else []
                out.append({"leaf": root + pytree.keystr(path), "health": h, "samples": samples})
    return out


def _rng_restorer(rec: StepRecord) -> Callable:
    """A forward pre-hook for the top-level model that puts back, before its i-th grad-enabled
    forward of the replayed step, the RNG states recorded before the i-th forward in training
    (draws the loop made between micro-batches, e.g. augmentation, then replay exactly)."""
    count = [0]

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return None
        i = count[0]
        count[0] += 1
        if i < len(rec.forwards) and rec.forwards[i].rng is not None:
            rec.forwards[i].rng.restore()
        return None

    return hook


def run_step(model: torch.nn.Module, inp: StepInputs, *, ops: bool = True, device: Optional[torch.device] = None) -> ReplayResult:
    """Re-execute one step on ``model``, whose weights and buffers must already hold the
    step-start state: restore the step's RNG states, run forward (and the loss, or the recorded
    cotangent) and backward under the monitors. Leaves the replayed gradients in ``.grad``."""
    rec = inp.record
    for p in model.parameters():
        p.grad = None
    training = set(rec.training)
    for name, m in model.named_modules():  # each module's recorded mode, exactly (train() would recurse)
        m.training = name in training
    weights = _nonfinite_leaves({"params": inp.state.params, "buffers": inp.state.buffers}, "")
    use_loss = inp.loss_fn is not None and bool(rec.batches)
    if use_loss:
        mode = "loss_fn"
        inputs = [x for i, b in enumerate(rec.batches) for x in _nonfinite_leaves(b, f"batch[{i}]" if len(rec.batches) > 1 else "batch")]
    else:
        have_cot = bool(rec.forwards) and all(fw.cotangent is not None for fw in rec.forwards)
        mode = "cotangent" if have_cot else "forward-only"
        inputs = [x for i, fw in enumerate(rec.forwards) for x in _nonfinite_leaves(fw.inputs, f"inputs[{i}]")]
    if not rec.batches and not rec.forwards:
        raise ReplayError(
            f"step {rec.step} has no recorded batch or forward call; the recorder saw no grad-enabled forward "
            "of the model in that step. Call Recorder.record(batch) in the loop."
        )
    dev = device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    scaler = replay_scaler(inp.scaler, dev)
    ac = rec.autocast
    autocast = torch.autocast(dev.type, dtype=getattr(torch, ac["dtype"])) if ac else contextlib.nullcontext()
    rng_hook = model.register_forward_pre_hook(_rng_restorer(rec))
    mon = ModuleMonitor(model)
    tracker = ModuleTracker()
    opmon = OpMonitor(tracker, type(model).__name__, allow=inp.allow) if ops else None
    losses: list[Optional[Health]] = []
    cots: list[Optional[Health]] = []
    outs: list[Optional[Health]] = []
    warnings: list[str] = []
    if rec.stale_inputs:
        warnings.append(
            f"step {rec.step}'s recorded inputs were modified in place after capture (a recycled input buffer): "
            "the replay feeds values the step did not see; record with copy_batch=True"
        )
    try:
        with _deterministic(), _anomaly(ops), tracker, (opmon if opmon is not None else contextlib.nullcontext()):
            rec.rng.restore()
            if use_loss:
                for i, b in enumerate(rec.batches):
                    mon.phase = "forward"
                    if opmon:
                        opmon.phase, opmon.micro_batch = "loss_fn", i
                    n0 = len(mon.events)
                    with autocast:
                        loss = inp.loss_fn(model, _to_device(b, device))
                    top = [e for e in mon.events[n0:] if e["module"] == ""]
                    outs.append(top[-1]["output"] if top else None)
                    if not isinstance(loss, torch.Tensor):
                        raise ReplayError(f"the loss function returned {type(loss).__name__}, expected a scalar tensor")
                    losses.append(tensor_health([loss]))
                    mon.phase = "backward"
                    if opmon:
                        opmon.phase = "backward"
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            else:
                pending = []
                for i, fw in enumerate(rec.forwards):
                    mon.phase = "forward"
                    if opmon:
                        opmon.phase, opmon.micro_batch = "forward", i
                    args, kwargs = _to_device(fw.inputs, device)
                    with autocast:
                        out = model(*args, **kwargs)
                    outs.append(tensor_health(tensor_leaves(out)))
                    if mode == "cotangent":
                        pending.append((out, _to_device(fw.cotangent, device)))
                # backward after all forwards: each micro-batch's graph is independent
                for i, (out, cot) in enumerate(pending):
                    mon.phase = "backward"
                    if opmon:
                        opmon.phase, opmon.micro_batch = "backward", i
                    o_leaves = flatten_typed(out)[0]
                    c_leaves = pytree.tree_leaves(to_typed(cot), is_leaf=lambda x: x is None)
                    pairs = [(o, c) for o, c in zip(o_leaves, c_leaves) if isinstance(o, torch.Tensor) and isinstance(c, torch.Tensor) and o.requires_grad]
                    cots.append(tensor_health([c for _, c in pairs]))
                    if pairs:
                        # The recorded cotangent of an output is the *total* gradient there. When one
                        # output also feeds another inside the model, autograd would add that internal
                        # path on top of the seed: pin each output's gradient to its recorded value.
                        pins = [o.register_hook(lambda g, c=c: c) for o, c in pairs] if len(pairs) > 1 else []
                        try:
                            torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
                        finally:
                            for h in pins:
                                h.remove()
                if mode == "forward-only":
                    warnings.append("no cotangent and no loss function: only the forward pass was replayed")
            if scaler is not None and inp.grads_unscaled is not False and mode != "forward-only":
                # the recorded gradients were unscaled by the scaler: unscale the replayed ones the same way
                scaler.unscale_(torch.optim.SGD([p for p in model.parameters() if p.grad is not None] or [torch.zeros(1)], lr=0.0))
    finally:
        mon.close()
        rng_hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return ReplayResult(mode, mon, opmon, losses, cots, inputs, weights, grads, outs, warnings)


@contextlib.contextmanager
def preserve_live(model: torch.nn.Module) -> Iterator[None]:
    """Around an in-process replay: keep the live gradients, buffers, module modes and RNG."""
    grads = {p: p.grad for p in model.parameters()}
    bufs = {n: b.detach().clone() for n, b in model.named_buffers()}
    modes = {m: m.training for m in model.modules()}
    rng = RNGState.capture()
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in bufs:
                    b.copy_(bufs[n])
        for m, t in modes.items():
            m.train(t)
        rng.restore()
