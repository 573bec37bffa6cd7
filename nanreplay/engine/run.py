"""Running one recorded step again: restore the step's RNG states and module modes, feed the
recorded batch (or forward inputs and cotangents), run forward, the loss and backward under the
monitors (:mod:`nanreplay.engine.monitors`), with deterministic algorithms where torch has them.

The result is plain data (:class:`ReplayResult`): module events, op births, which births reach
what the step produces, losses and gradients. The diagnosis (:mod:`nanreplay.diagnosis`)
interprets it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.allowlist import Allowlist
from ..core.batch import batch_size, rows_of
from ..core.digest import RecordedGrad
from ..core.numerics import Health, all_finite_flag, any_nonfinite, is_float, tensor_health
from ..core.rng import ReplayRNG, RNGState
from ..core.tree import flatten_typed, map_tensors, tensor_leaves, to_typed
from ..errors import ReplayError
from ..format.records import Snapshot, StepRecord
from .monitors import ModuleMonitor, OpMonitor, RootTracker
from .state import replay_scaler

logger = logging.getLogger(__name__)

__all__ = ["StepInputs", "ReplayResult", "run_step", "preserve_live", "nonfinite_leaves", "nonfinite_state", "discrete_leaves"]


@dataclass
class StepInputs:
    """What a replay of one step needs, wherever it comes from (live recorder or bundle)."""

    record: StepRecord
    state: Snapshot
    recorded_grads: dict[str, RecordedGrad]  # FQN -> tensor, or its GradDigest where the bundle keeps one
    loss_fn: Optional[Callable] = None
    scaler: Optional[dict] = None          # GradScaler state_dict of the step, when one was used
    grads_unscaled: Optional[bool] = None  # whether the recorded gradients were unscaled
    allow: Optional[Allowlist] = None            # legitimate non-finite values (default: -Inf masks)
    optimizer_info: Optional[dict] = None        # bundle meta["optimizer"]: class path, param_groups_fqns
    history: list = field(default_factory=list)  # ring-buffer StepRecords up to the failing step
    reason: dict = field(default_factory=dict)   # why the recorder dumped (meta["reason"])
    attach_scan: Optional[dict] = None           # meta["attach_scan"]: tensors non-finite when the Recorder attached
    scalars: list = field(default_factory=list)  # the scalar history (meta["scalar_history"]) as light records
    compile_state: Optional[dict] = None         # meta["compile"]: the recording's torch.compile state (capture.compiled)
    # what the replay runs against what was recorded, for the verdict ladder (diagnosis.fidelity):
    # "model"/"loss" ("live", "recorded", "program" or "given"), "model_source", "environment" and
    # "recorded_environment" (format.bundle.environment), "device" and "recorded_device" (types)
    setup: dict = field(default_factory=dict)

    def long_history(self) -> list:
        """The scalar history merged with the ring buffer's steps (a ring step wins), oldest
        first, up to the failing step: the steps a capacity-sized ring alone would not show."""
        by_step = {r.step: r for r in self.scalars}
        by_step.update({r.step: r for r in self.history})
        return [by_step[k] for k in sorted(by_step) if k <= self.record.step]

    @property
    def uses_loss(self) -> bool:
        """Whether the replay runs the loss function (it needs one and a recorded batch)."""
        return self.loss_fn is not None and bool(self.record.batches)


@dataclass
class ReplayResult:
    """The outcome of one replay, turned into the diagnosis dict by :mod:`nanreplay.diagnosis`.

    Attributes:
        mode: ``"loss_fn"`` (the whole step), ``"cotangent"`` (the model driven by the recorded
            output gradient) or ``"forward-only"``.
        modules: the module monitor's events.
        ops: the op monitor (births, allowed births, propagated count), or ``None`` when off.
        losses: health of each replayed loss (one per micro-batch), ``loss_values`` their floats.
        cotangents, outputs: health of the recorded cotangents fed and of the model's outputs.
        inputs, weights: non-finite batch leaves and step-start tensors (``leaf``, ``health``,
            ``samples``).
        grads: the replayed gradients, FQN -> tensor.
        reaching: indices of the births whose non-finite values reach what the step produces
            (losses, model outputs, gradients); ``None`` without the op monitor.
    """

    mode: str
    modules: ModuleMonitor
    ops: Optional[OpMonitor]
    losses: list[Optional[Health]]
    cotangents: list[Optional[Health]]
    inputs: list[dict]
    weights: list[dict]
    grads: dict[str, torch.Tensor]
    outputs: list[Optional[Health]]
    warnings: list[str] = field(default_factory=list)
    loss_values: list[float] = field(default_factory=list)
    reaching: Optional[frozenset] = None

    @property
    def births(self) -> list[dict]:
        return self.ops.births if self.ops is not None else []

    def products_nonfinite(self) -> bool:
        """Whether what the step produced (its losses, model outputs or gradients) holds a
        non-finite value."""
        return any(h is not None and not h.finite for h in list(self.losses) + list(self.outputs)) or any_nonfinite(self.grads.values())


@contextlib.contextmanager
def _deterministic(on: bool = True) -> Iterator[None]:
    """Deterministic algorithms (where torch has them, warning where not) and no cuDNN
    autotuning for the block; ``on=False`` (``bisect --over config`` replaying a recording that
    ran without them) turns them off and leaves cuDNN's flags as they are."""
    if not on:
        prev = torch.are_deterministic_algorithms_enabled()
        prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_bench = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        with warnings.catch_warnings():  # ops without a deterministic kernel warn once each: not the user's business here
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            # torch's cuBLAS alert: CUBLAS_WORKSPACE_CONFIG unset when this process first used cuBLAS (engine.state.deterministic_cublas).
            # The setting matters to streams sharing a workspace; a replay runs on one stream, with the kernels training chose
            warnings.filterwarnings("ignore", message=".*because it uses CuBLAS.*")
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


def _leaves_with_paths(tree: Any, root: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``tree`` (dataclass and namedtuple fields included) with its path under
    ``root``, e.g. ``batch['image']``."""
    return [(root + pytree.keystr(path), leaf) for path, leaf in pytree.tree_flatten_with_path(to_typed(tree))[0] if isinstance(leaf, torch.Tensor)]


def nonfinite_leaves(tree: Any, root: str) -> list[dict]:
    """The non-finite float leaves of ``tree``, each with its path under ``root``, health and the
    batch rows holding them (along each leaf's batch dimension, see :mod:`nanreplay.core.batch`)."""
    out = []
    size = batch_size(tree)
    for path, leaf in _leaves_with_paths(tree, root):
        if is_float(leaf) and leaf.numel() and not bool(all_finite_flag(leaf.detach())):  # only a non-finite leaf pays for its health
            h = tensor_health([leaf])
            if h is not None and not h.finite:
                rows = rows_of(~torch.isfinite(leaf.detach()), size) if size is not None and leaf.dim() else None
                out.append({"leaf": path, "health": h, "samples": rows or []})  # every row: a cut list would hide samples
    return out


def nonfinite_state(state: Any) -> list:
    """``nonfinite_leaves`` of a step-start state's parameters and buffers, computed once per
    state object (a diagnosis reads it before replaying, then replays the same state many times:
    per-sample replays, counterfactuals)."""
    cached = getattr(state, "_nanreplay_nonfinite", None)
    if cached is None:
        cached = nonfinite_leaves({"params": state.params, "buffers": state.buffers}, "")
        try:
            state._nanreplay_nonfinite = cached
        except AttributeError:  # a state type without a __dict__: no cache
            pass
    return cached


def discrete_leaves(inp: "StepInputs") -> dict[str, bool]:
    """Every tensor leaf of the step's recorded batches (or forward inputs), by the path the
    replay's provenance names it with (``batch['mask']``), and whether it is discrete: an integer
    or bool dtype (labels, masks, lengths, counts, indices), not continuous values."""
    rec = inp.record
    trees = rec.batches if inp.uses_loss else [fw.inputs for fw in rec.forwards]
    return {path: not (leaf.is_floating_point() or leaf.is_complex())
            for i, tree in enumerate(trees) for path, leaf in _leaves_with_paths(tree, _batch_root(rec, inp.uses_loss, i))}


def _batch_root(rec: StepRecord, uses_loss: bool, i: int) -> str:
    if uses_loss:
        return f"batch[{i}]" if len(rec.batches) > 1 else "batch"
    return f"inputs[{i}]"


def _replay_state(state: RNGState, cuda: bool) -> RNGState:
    """The recorded ``state`` as a replay on a CUDA device (``cuda``) or another one loads it: a
    replay off CUDA leaves the CUDA generators alone (:meth:`RNGState.without_cuda`)."""
    return state if cuda else state.without_cuda()


def _rng_restorer(rec: StepRecord, rng: ReplayRNG, cuda: bool) -> Callable:
    """A forward pre-hook for the top-level model that puts back, before its i-th grad-enabled
    forward of the replayed step, the RNG states recorded before the i-th forward in training
    (draws the loop made between micro-batches, e.g. augmentation, then replay exactly), into
    the replay's generators ``rng`` (``cuda``: the replay runs on a CUDA device)."""
    count = [0]

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return None
        i = count[0]
        count[0] += 1
        if i < len(rec.forwards) and rec.forwards[i].rng is not None:
            rng.load(_replay_state(rec.forwards[i].rng, cuda))
        return None

    return hook


def _input_feeder(run: "_Run", rec: StepRecord) -> Callable:
    """A forward pre-hook for the top-level model that hands its i-th grad-enabled forward of the
    replayed step the model's forward inputs the Recorder captured in training (``rec.forwards[i]``),
    in place of what the loss function passes: what the model saw, when code between
    ``record(batch)`` and the model changed the batch."""
    count = [0]

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not torch.is_grad_enabled():
            return None
        i = count[0]
        count[0] += 1
        if i >= len(rec.forwards):
            return None
        fed_args, fed_kwargs = run.seed(rec.forwards[i].inputs, _batch_root(rec, False, i))
        return tuple(fed_args), dict(fed_kwargs)

    return hook


class _NoModuleMonitor:
    """The module monitor of a replay run without one (``run_step(..., monitors=False)``)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.phase = "forward"

    def close(self) -> None:
        return None


class _Run:
    """One replay in progress: the monitors, the phase bookkeeping and what was collected.
    ``runner`` is what the step calls (the model, or a compiled wrapper of it)."""

    def __init__(self, model: torch.nn.Module, inp: StepInputs, ops: bool, device: Optional[torch.device], *, monitors: bool = True,
                 runner: Optional[torch.nn.Module] = None, lean: bool = False, watch: Optional[frozenset] = None, settle: bool = False,
                 backward: bool = True) -> None:
        self.model, self.inp, self.device = model, inp, device
        self.settle, self.backward = settle, backward
        self.runner = runner if runner is not None else model
        self.mon: Any = ModuleMonitor(model, backward=not lean, counts=not lean) if monitors else _NoModuleMonitor()
        self.tracker: Any = RootTracker() if monitors else contextlib.nullcontext()
        self.opmon = OpMonitor(self.tracker, model, allow=inp.allow, watch=watch) if ops else None
        self.losses: list[Optional[Health]] = []
        self.loss_values: list[float] = []
        self.cots: list[Optional[Health]] = []
        self.outs: list[Optional[Health]] = []
        self.products: list[torch.Tensor] = []   # what the step produces: losses, outputs driven by cotangents
        self.warnings: list[str] = []

    def phase(self, phase: str, micro_batch: Optional[int] = None) -> None:
        self.mon.phase = "backward" if phase == "backward" else "forward"
        if self.opmon is not None:
            if phase == "backward" and self.settle:
                self.opmon.settle(self.products)  # a forward origin that reaches the products: backward ops unchecked
            self.opmon.run_phase = phase
            if micro_batch is not None:
                self.opmon.micro_batch = micro_batch

    def enter_roots(self, roots: list) -> None:
        """The modules that returned the tensors a backward pass starts from take part in it
        (:class:`~nanreplay.engine.monitors.RootTracker`)."""
        if isinstance(self.tracker, RootTracker):
            self.tracker.enter_roots(roots)

    def seed(self, tree: Any, root: str) -> Any:
        """Move a recorded batch to the replay device and declare its leaves sources."""
        moved = _to_device(tree, self.device)
        if self.opmon is not None:
            self.opmon.batch_size = batch_size(moved)
            for path, leaf in _leaves_with_paths(moved, root):
                self.opmon.facts.seed(leaf, f"batch:{path}")
        return moved

    def with_loss(self, scaler: Any, autocast: Any) -> None:
        """The whole step: the loss function on each recorded batch, then backward."""
        rec = self.inp.record
        for i, b in enumerate(rec.batches):
            self.phase("loss_fn", i)
            n0 = len(self.mon.events)
            with autocast:
                loss = self.inp.loss_fn(self.runner, self.seed(b, _batch_root(rec, True, i)))
            top = [e for e in self.mon.events[n0:] if e["module"] == ""]
            self.outs.append(_as_health(top[-1]["output"]) if top else None)
            if not isinstance(loss, torch.Tensor):
                raise ReplayError(f"the loss function returned {type(loss).__name__}, expected a scalar tensor")
            self.losses.append(tensor_health([loss]))
            self.loss_values.append(float(loss.detach().float().sum()) if loss.numel() else math.nan)
            self.products.append(loss)
            if self.backward:
                self.phase("backward")
                root = scaler.scale(loss) if scaler is not None else loss
                self.enter_roots([root])
                root.backward()

    def with_cotangent(self, autocast: Any, mode: str) -> None:
        """The model's forward calls, then backward seeded with the recorded output gradients."""
        rec = self.inp.record
        pending = []
        for i, fw in enumerate(rec.forwards):
            self.phase("forward", i)
            args, kwargs = self.seed(fw.inputs, _batch_root(rec, False, i))
            with autocast:
                out = self.runner(*args, **kwargs)
            self.outs.append(tensor_health(tensor_leaves(out)))
            self.products.extend(tensor_leaves(out))
            if mode == "cotangent" and self.backward:
                pending.append((i, out, _to_device(fw.cotangent, self.device)))
        # backward after all forwards: each micro-batch's graph is independent
        for i, out, cot in pending:
            self.phase("backward", i)
            o_leaves = flatten_typed(out)[0]
            c_leaves = pytree.tree_leaves(to_typed(cot), is_leaf=lambda x: x is None)
            pairs = [(o, c) for o, c in zip(o_leaves, c_leaves) if isinstance(o, torch.Tensor) and isinstance(c, torch.Tensor) and o.requires_grad]
            self.cots.append(tensor_health([c for _, c in pairs]))
            if pairs:
                # The recorded cotangent of an output is the *total* gradient there. When one
                # output also feeds another inside the model, autograd would add that internal
                # path on top of the seed: pin each output's gradient to its recorded value.
                pins = [o.register_hook(lambda g, c=c: c) for o, c in pairs] if len(pairs) > 1 else []
                self.enter_roots([o for o, _ in pairs])
                try:
                    torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
                finally:
                    for h in pins:
                        h.remove()
        if mode == "forward-only":
            self.warnings.append("no cotangent and no loss function: only the forward pass was replayed (a Recorder given a loss "
                                 "function and record(batch) keeps no cotangent; Recorder(capture_cotangent=True) keeps it, for "
                                 "model-only replays such as --no-loss-fn)")


def _as_health(summary: Optional[dict]) -> Optional[Health]:
    """A module event's summary as a :class:`Health` (its finite min/max/mean are not kept)."""
    if summary is None:
        return None
    return Health(nan=summary["nan"], posinf=summary["posinf"], neginf=summary["neginf"], numel=summary["numel"], min=None, max=None,
                  mean=None, absmax=summary.get("absmax"), dtype=summary["dtype"], shape=summary["shape"])


def _set_modes(model: torch.nn.Module, rec: StepRecord) -> None:
    """Clear the gradients and give each module its recorded mode, exactly (``train()`` would recurse)."""
    for p in model.parameters():
        p.grad = None
    training = set(rec.training)
    for name, m in model.named_modules():
        m.training = name in training


def _mode_and_inputs(inp: StepInputs) -> tuple[str, list]:
    """The replay mode (``loss_fn``, ``cotangent`` or ``forward-only``) and the non-finite leaves
    of what the step feeds: its batches with a loss function, else its recorded forward inputs."""
    rec = inp.record
    if inp.uses_loss:
        return "loss_fn", [x for i, b in enumerate(rec.batches) for x in nonfinite_leaves(b, _batch_root(rec, True, i))]
    mode = "cotangent" if rec.forwards and all(fw.cotangent is not None for fw in rec.forwards) else "forward-only"
    return mode, [x for i, fw in enumerate(rec.forwards) for x in nonfinite_leaves(fw.inputs, _batch_root(rec, False, i))]


def _execute(run: "_Run", inp: StepInputs, mode: str, scaler: Any, autocast: Any, *, anomaly: bool, compiled: bool, cuda: bool,
             model_inputs: bool = False, deterministic: bool = True) -> None:
    """Run the step under its recorded RNG states and the monitors: forward with the loss
    function or the recorded cotangent, backward, and the scaler's unscale when the recorded
    gradients were unscaled. The monitors are closed and the RNG hook removed whatever happens.
    ``cuda``: the replay runs on a CUDA device (else the recorded CUDA generator states are left out).
    ``model_inputs``: the loss function's model calls get the recorded forward inputs."""
    rec, model = inp.record, run.model
    if rec.rng.torch_cuda and not cuda:
        run.warnings.append(
            "the step was recorded with CUDA generator states and this replay runs off CUDA: random numbers the step drew on the "
            "GPU, if any (dropout of a CUDA model), come from the CPU generator here, so values that depend on them differ from "
            "the recorded ones")
    rng = ReplayRNG(private=False if compiled else None)  # compiled: Dynamo does not trace under a dispatch mode
    hooks = _Both(run.runner.register_forward_pre_hook(_rng_restorer(rec, rng, cuda)))  # on a compiled wrapper: runs eagerly
    if model_inputs and mode == "loss_fn":
        hooks = _Both(*hooks.handles, run.runner.register_forward_pre_hook(_input_feeder(run, rec), with_kwargs=True))
    try:
        # the step's random draws come from its recorded states, and no other thread's generator
        # is consumed or rewound (ReplayRNG); the process's states are as before once it returns
        with rng, _deterministic(deterministic), _anomaly(anomaly), run.tracker, (run.opmon if run.opmon is not None else contextlib.nullcontext()):
            rng.load(_replay_state(rec.rng, cuda))
            if rng.shared:
                run.warnings.append(
                    "other threads were running, so the replay drew torch's random numbers from private generators set to the "
                    f"recorded states and left the process-wide {' and '.join(rng.untouched)} generators alone: draws the step "
                    "made from those (if any) are not reproduced")
            if mode == "loss_fn":
                run.with_loss(scaler, autocast)
            else:
                run.with_cotangent(autocast, mode)
            if scaler is not None and inp.grads_unscaled is not False and mode != "forward-only" and run.backward:
                # the recorded gradients were unscaled by the scaler: unscale the replayed ones the same way
                scaler.unscale_(torch.optim.SGD([p for p in model.parameters() if p.grad is not None] or [torch.zeros(1)], lr=0.0))
    finally:
        run.mon.close()
        hooks.remove()


class _Both:
    """Two hook handles removed as one."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_step(model: torch.nn.Module, inp: StepInputs, *, ops: bool = True, device: Optional[torch.device] = None, monitors: bool = True,
             runner: Optional[torch.nn.Module] = None, lean: bool = False, sources: bool = True,
             watch: Optional[frozenset] = None, settle: bool = False, backward: bool = True, model_inputs: bool = False,
             deterministic: bool = True) -> ReplayResult:
    """Re-execute one step on ``model``, whose weights and buffers must already hold the
    step-start state: restore the step's RNG states and module modes, run forward (and the loss,
    or the recorded cotangent) and backward under the monitors. Leaves the replayed gradients in
    ``.grad``. The step draws from its recorded RNG states through a
    :class:`~nanreplay.core.rng.ReplayRNG`: no generator another thread uses is consumed or
    rewound, and the process's RNG states are as they were once it returns.

    Args:
        ops: run the op monitor (births, provenance, taint; anomaly mode for backward source lines).
        monitors: run the module monitor (per-module health events); ``False`` with
            ``ops=False`` runs the step bare, e.g. under ``torch.compile``, where module hooks
            would break the graph.
        runner: what the step calls instead of ``model`` (the loss function gets it as its
            model): a ``torch.compile`` wrapper of ``model`` sharing its parameters. Modes,
            weights and gradients are still read from ``model``, under its own names. The step
            then draws from the process-wide generators (set, then put back): another thread
            drawing meanwhile would see them moved (the CLI's ``--compile`` runs alone).
        lean: only whether outputs, losses and gradients are finite matters (per-sample replays,
            searches): module events carry 0/1 flags instead of counts and no backward events.
        sources: with ``ops``, run under anomaly mode so backward births get their forward source
            line; ``False`` when only the births' signatures matter (a counterfactual replay),
            which skips anomaly mode's per-op stack capture.
        watch: with ``ops``, check only these aten ops (see
            :class:`~nanreplay.engine.monitors.OpMonitor`); ``result.reaching`` is then unknown.
        settle: with ``ops``, stop checking ops once the origin is settled in the forward pass
            (:meth:`~nanreplay.engine.monitors.OpMonitor.settle`): the first birth is in the
            forward pass or the loss and reaches the losses (or outputs) as the backward pass
            starts. The origin, its phase, place and evidence are those of a fully checked
            replay; ``result.births`` then lacks the backward births that follow it. About
            two thirds of a step's ops are backward ones.
        backward: ``False`` stops after the forward pass and the loss (no gradients; the
            outputs' and losses' health only), for the per-sample replays of a forward or loss
            birth: about a third of a step's time.
        model_inputs: with a loss function, the model's i-th forward call of the step gets the
            forward inputs the Recorder captured for it (``record.forwards[i].inputs``) in place
            of what the loss function passes it: the step as the model saw it when code between
            ``record(batch)`` and the model changed the batch (the loss function still supplies
            the rest, e.g. the targets).
        deterministic: run with deterministic algorithms (the default: replays compare); ``False``
            for a search replaying a recording that ran without them (``bisect --over config``).

    Raises:
        ReplayError: the step holds no batch and no forward call, or the loss function returned
            no tensor.
    """
    rec = inp.record
    if not rec.batches and not rec.forwards:
        raise ReplayError(
            f"step {rec.step} has no recorded batch or forward call; the recorder saw no grad-enabled forward "
            "of the model in that step. Call Recorder.record(batch) in the loop."
        )
    _set_modes(model, rec)
    weights = nonfinite_state(inp.state)
    mode, inputs = _mode_and_inputs(inp)
    dev = device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    scaler = replay_scaler(inp.scaler, dev)
    ac = rec.autocast
    autocast = torch.autocast(dev.type, dtype=getattr(torch, ac["dtype"])) if ac else contextlib.nullcontext()
    run = _Run(model, inp, ops, device, monitors=monitors, runner=runner, lean=lean and not ops, watch=watch, settle=settle,
               backward=backward)
    if rec.stale_inputs:
        run.warnings.append(
            f"step {rec.step}'s recorded inputs were modified in place after capture (a recycled input buffer): "
            "the replay feeds values the step did not see; record with Recorder(..., copy_batch=True)"
        )
    if run.opmon is not None:
        for n, p in model.named_parameters():
            run.opmon.facts.seed(p, "weights")
        for n, b in model.named_buffers():
            run.opmon.facts.seed(b, f"buffer:{n}")
    _execute(run, inp, mode, scaler, autocast, anomaly=ops and sources, compiled=runner is not None, cuda=dev.type == "cuda",
             model_inputs=model_inputs, deterministic=deterministic)
    live_grads = [p.grad for p in model.parameters() if p.grad is not None]
    reaching = run.opmon.taint_of(run.products + live_grads) if run.opmon is not None and watch is None else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return ReplayResult(mode, run.mon, run.opmon, run.losses, run.cots, inputs, weights, grads, run.outs, run.warnings,
                        loss_values=run.loss_values, reaching=reaching)


@contextlib.contextmanager
def preserve_live(model: torch.nn.Module) -> Iterator[None]:
    """Around an in-process replay: keep the live gradients, buffers and module modes; random
    draws made within come from a :class:`~nanreplay.core.rng.ReplayRNG` scope, so no generator
    the user's threads draw from is consumed or rewound."""
    grads = {p: p.grad for p in model.parameters()}
    bufs = {n: b.detach().clone() for n, b in model.named_buffers()}
    modes = {m: m.training for m in model.modules()}
    rng = ReplayRNG()
    rng.__enter__()
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
        rng.__exit__(None, None, None)
