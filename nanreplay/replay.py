"""The replay engine: re-execute one recorded step deterministically and find where the first
non-finite value was born.

Two monitors watch the replay:

* module hooks (``register_forward_pre_hook`` / ``register_forward_hook`` on every module) build
  the health table: each module's input and output health in execution order. A module is the
  *producer* when NaN appears in its output while none of its inputs holds NaN, or ±Inf appears
  while all its inputs are finite; modules that only pass a non-finite value on are *propagators*.
* an op monitor (a ``TorchDispatchMode`` with ``torch.utils.module_tracker.ModuleTracker`` for the
  module context) checks every aten op's floating outputs, in the forward pass, the loss and the
  backward pass, and names the first op where a non-finite value is born by the same rule.

The replay restores the step-start RNG states, weights and buffers, runs with deterministic
algorithms where torch offers them, and compares the gradients it gets with the recorded ones:
reproduction is verified, never assumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from .bundle import Bundle, BundleContent, Snapshot, StepRecord, fnum, open_bundle
from .errors import ModelMismatchError, ReplayError
from .health import Health, is_float, tensor_health
from .rng import RNGState
from .tree import flatten_typed, map_tensors, tensor_leaves, to_typed
from . import attribution
from .attribution import Allowlist

logger = logging.getLogger(__name__)

__all__ = ["replay", "replay_step", "diagnose_live", "import_callable", "ReplayResult", "VERDICTS"]

VERDICTS = ("reproduced exactly", "reproduced", "not reproduced")


# ---------------------------------------------------------------------------------------------
# importing user code named by path
# ---------------------------------------------------------------------------------------------
def import_callable(path: str) -> Callable:
    """Import ``"pkg.module:attr"`` or ``"/path/to/file.py:attr"`` (dotted attrs allowed).

    A file is imported under a private module name, so its ``if __name__ == "__main__":`` block
    does not run. This runs user code: replay only bundles whose model code you trust.

    Raises:
        ReplayError: malformed path, missing file or module, or missing attribute.
    """
    mod_name, sep, qual = path.rpartition(":")
    if not sep or not mod_name or not qual:
        raise ReplayError(f"expected an import path 'package.module:function' or 'file.py:function', got {path!r}")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            file = Path(mod_name)
            if not file.is_file():
                raise ReplayError(f"{path!r}: no file {file}; pass --model-factory / --loss-fn with a path that exists here")
            name = "nanreplay_user_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, file)
                if spec is None or spec.loader is None:
                    raise ReplayError(f"{path!r}: {file} is not an importable Python file")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                sys.path.insert(0, str(file.resolve().parent))
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
        else:
            module = importlib.import_module(mod_name)
        obj: Any = module
        for part in qual.split("."):
            obj = getattr(obj, part)
    except ReplayError:
        raise
    except Exception as e:
        raise ReplayError(f"could not import {path!r}: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ReplayError(f"{path!r} names a {type(obj).__name__}, expected a callable")
    return obj


# ---------------------------------------------------------------------------------------------
# monitors
# ---------------------------------------------------------------------------------------------
def _born(inputs: Optional[Health], output: Optional[Health]) -> bool:
    """The producer rule: NaN in the output with no NaN in the inputs, or ±Inf in the output
    with all inputs finite."""
    if output is None or output.finite:
        return False
    if inputs is None:
        return True
    if output.nan and not inputs.nan:
        return True
    return (output.posinf or output.neginf) > 0 and inputs.finite


def _any_nonfinite(ts: Sequence[torch.Tensor]) -> bool:
    fl = [t for t in ts if is_float(t) and t.numel()]
    if not fl:
        return False
    if len(fl) == 1:
        return not bool(torch.isfinite(fl[0]).all())
    return not bool(torch.stack([torch.isfinite(t).all() for t in fl]).all())


class ModuleMonitor:
    """Forward health of every module, in execution order (completion order of forwards), and
    backward events: the cotangent at each module's output and each parameter's gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.fqn = {id(m): n for n, m in model.named_modules()}
        self.events: list[dict] = []
        self._stack: list[Optional[Health]] = []
        self._handles: list[Any] = []
        self.phase = "forward"
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        for name, p in model.named_parameters():
            if p.requires_grad:
                owner = name.rpartition(".")[0]
                self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook(name, owner)))

    def _pre(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._stack.append(tensor_health(tensor_leaves((args, kwargs))))

    def _post(self, mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        h_in = self._stack.pop() if self._stack else None
        h_out = tensor_health(tensor_leaves(out))
        name = self.fqn.get(id(mod), "?")
        self.events.append(
            {"phase": self.phase, "module": name, "class": type(mod).__name__, "inputs": h_in, "output": h_out, "born": _born(h_in, h_out)}
        )
        for t in tensor_leaves(out):
            if t.requires_grad and is_float(t):
                t.register_hook(self._cot_hook(name, type(mod).__name__))

    def _cot_hook(self, name: str, cls: str) -> Callable:
        def hook(g: torch.Tensor) -> None:
            self.events.append({"phase": "backward", "kind": "output cotangent", "module": name, "class": cls, "output": tensor_health([g])})

        return hook

    def _param_hook(self, pname: str, owner: str) -> Callable:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self.events.append({"phase": "backward", "kind": "parameter gradient", "module": owner, "param": pname, "output": tensor_health([p.grad])})

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class OpMonitor(TorchDispatchMode):
    """Checks every aten op's floating outputs during replay. Records each *birth* (an op whose
    output holds a non-finite value its inputs did not explain, by the producer rule) with its
    phase, op name and innermost module FQN, plus a count of ops that propagated non-finite values.
    Technique: ``TorchDispatchMode`` sees functional ops and backward kernels alike, which module
    hooks miss; ``ModuleTracker`` supplies the module context in both passes."""

    def __init__(self, tracker: ModuleTracker, root_class: str, *, max_births: int = 32, allow: Optional[Allowlist] = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.root = root_class
        self.births: list[dict] = []
        self.allowed: list[dict] = []    # births matched by the allowlist (legitimate -Inf masks)
        self.propagated = 0
        self.max_births = max_births
        self.allow = allow if allow is not None else Allowlist()
        self.phase = "forward"
        self.index = 0
        self.micro_batch: Optional[int] = None  # which recorded batch / forward call is replaying

    def module(self) -> Optional[str]:
        """FQN of the innermost module running now; ``""`` for the root, ``None`` outside the model."""
        names = [p for p in self.tracker.parents if p != "Global"]
        if not names:
            return None
        inner = max(names, key=lambda n: n.count("."))
        head, _, rest = inner.partition(".")
        return rest if head == self.root else inner

    # ops whose output is uninitialised memory: never a birth, never checked
    _UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "empty_permuted"})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in self._UNINITIALISED:
            return func(*args, **kwargs)
        # in-place and out= ops overwrite an input: take the inputs' health before the op runs
        mutating = func._schema.is_mutable if hasattr(func, "_schema") else False
        h_in_before = tensor_health(tensor_leaves((args, kwargs))) if mutating else None
        out = func(*args, **kwargs)
        self.index += 1
        outs = tensor_leaves(out)
        if not outs or not _any_nonfinite(outs):
            return out
        h_in = h_in_before if mutating else tensor_health(tensor_leaves((args, kwargs)))
        h_out = tensor_health(outs)
        if _born(h_in, h_out):
            self._record_birth(func, name, args, kwargs, outs, h_in, h_out, mutating)
        else:
            self.propagated += 1
        return out

    def _phase_now(self, module: Optional[str]) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if self.phase == "backward" or self.tracker.is_bw:
            return "backward"
        return "loss" if (self.phase == "loss_fn" and module is None) else "forward"

    def _record_birth(self, func: Any, name: str, args: tuple, kwargs: dict, outs: list, h_in: Optional[Health], h_out: Health, mutating: bool) -> None:
        """Describe one birth: where (phase, module, source line, autograd node and its forward
        source), what (health, dtype, shape, non-finite rows) and why (wider-dtype recomputation,
        zeros in the inputs). Allowed births (legitimate -Inf masks) are kept apart."""
        module = self.module()
        phase = self._phase_now(module)
        rule = self.allow.match(module, name, h_out)
        if rule is not None:
            if len(self.allowed) < self.max_births:
                self.allowed.append({"phase": phase, "op": name, "module": module, "op_index": self.index, "rule": str(rule), "output": h_out})
            return
        if len(self.births) >= self.max_births:
            return
        b: dict = {"phase": phase, "op": name, "aten": str(func), "module": module, "op_index": self.index, "inputs": h_in, "output": h_out,
                   "micro_batch": self.micro_batch}
        if phase == "backward":
            node, fwd_src = attribution.current_node()
            b["node"] = node
            b["forward_op"] = attribution.node_forward_op(node)
            b["source"] = fwd_src
        else:
            b["node"] = None
            b["source"] = attribution.user_frame_now()
        b["wider"] = None if mutating else attribution.wider_recompute(func, args, kwargs, outs)
        b["input_zeros"] = attribution.zero_counts(tensor_leaves((args, kwargs)))
        b["rows"] = attribution.nonfinite_rows(outs)
        self.births.append(b)


# ---------------------------------------------------------------------------------------------
# running one step
# ---------------------------------------------------------------------------------------------
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


def load_state(model: torch.nn.Module, state: Snapshot, buffers: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Copy recorded weights and buffers into ``model`` in place.

    Raises:
        ModelMismatchError: missing/unexpected FQNs or a shape/dtype that differs.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(state.params) - set(params))
    unexpected = sorted(set(params) - set(state.params))
    problems = []
    if missing:
        problems.append(f"the bundle has parameters the model lacks: {missing[:8]}")
    if unexpected:
        problems.append(f"the model has parameters the bundle lacks: {unexpected[:8]}")
    for n, t in state.params.items():
        if n in params and (params[n].shape != t.shape or params[n].dtype != t.dtype):
            problems.append(f"{n}: bundle {tuple(t.shape)} {t.dtype}, model {tuple(params[n].shape)} {params[n].dtype}")
    if problems:
        raise ModelMismatchError(
            "the model does not match the bundle: " + "; ".join(problems[:10])
            + ". Pass --model-factory with the factory that built the recorded model."
        )
    with torch.no_grad():
        for n, t in state.params.items():
            params[n].copy_(t)
    load_buffers(model, buffers if buffers is not None else state.buffers)


def load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy recorded buffers (FQN -> tensor, e.g. a step's step-start BatchNorm running stats)
    into ``model``'s buffers in place. Names the model lacks, shapes that differ and tensors
    that already are the live buffer's storage are left alone."""
    live = dict(model.named_buffers())
    with torch.no_grad():
        for n, t in buffers.items():
            b = live.get(n)
            if b is not None and b.shape == t.shape and b.data_ptr() != t.data_ptr():
                b.copy_(t)


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
    from .amp import replay_scaler

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


# ---------------------------------------------------------------------------------------------
# verdict and diagnosis
# ---------------------------------------------------------------------------------------------
def compare_grads(recorded: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> dict:
    """Compare gradients: same non-finite positions (NaN, +Inf, -Inf) and the max abs
    difference of the finite values. Verdict: ``reproduced exactly`` (same pattern, finite values
    bit-equal), ``reproduced`` (the replay is non-finite where the recording was, within a max abs
    difference), ``not reproduced`` (the replay's gradients are finite, or differ in which
    parameters are non-finite)."""
    if not recorded:
        return {"verdict": "not reproduced", "max_abs_diff": None, "detail": "the bundle holds no recorded gradients to compare"}
    exact, max_diff, mismatched, missing = True, 0.0, [], []
    rec_bad, rep_bad = set(), set()
    for name, r in recorded.items():
        g = replayed.get(name)
        if g is None:
            missing.append(name)
            exact = False
            if is_float(r) and not bool(torch.isfinite(r).all()):
                rec_bad.add(name)  # a non-finite gradient the replay never produced is not reproduced
            continue
        r = r.to(g.device)
        if not is_float(r):
            continue
        if not torch.isfinite(r).all():
            rec_bad.add(name)
        if not torch.isfinite(g).all():
            rep_bad.add(name)
        same_pattern = (
            torch.equal(torch.isnan(r), torch.isnan(g)) and torch.equal(torch.isposinf(r), torch.isposinf(g)) and torch.equal(torch.isneginf(r), torch.isneginf(g))
        )
        fin = torch.isfinite(r) & torch.isfinite(g)
        d = float((r[fin].double() - g[fin].double()).abs().max()) if fin.any() else 0.0
        max_diff = max(max_diff, d)
        if not same_pattern:
            mismatched.append(name)
        if not same_pattern or d != 0.0:
            exact = False
    detail = []
    if missing:
        detail.append(f"{len(missing)} recorded gradient(s) absent in the replay, e.g. {missing[:3]}")
    if mismatched:
        detail.append(f"non-finite positions differ in {len(mismatched)} tensor(s), e.g. {mismatched[:3]}")
    if not rep_bad and rec_bad:
        verdict = "not reproduced"
        detail.insert(0, "the replayed gradients are all finite")
    elif rec_bad and not rec_bad <= rep_bad:
        verdict = "not reproduced"
        detail.insert(0, f"recorded non-finite gradients in {sorted(rec_bad - rep_bad)[:3]} are finite or absent in the replay")
    elif exact:
        verdict = "reproduced exactly"
    else:
        verdict = "reproduced"
    factor = None if exact or missing else common_factor(recorded, replayed)
    if factor is not None:
        # the loop rescaled every gradient between backward and optimizer.step()
        verdict = "reproduced"
        detail = [
            f"the recorded gradients are the replayed ones times one factor {_g(factor)}: the training loop rescaled "
            "them after backward (clip_grad_norm_, whose NaN or Inf total norm turns every gradient NaN; or a loss "
            "divided outside the loss function, e.g. for gradient accumulation)"
        ]
    out = {
        "verdict": verdict,
        "max_abs_diff": fnum(max_diff),
        "nonfinite_recorded": len(rec_bad),
        "nonfinite_replayed": len(rep_bad),
        "detail": "; ".join(detail),
    }
    if factor is not None:
        out["grad_factor"] = fnum(factor)
    return out


def _g(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else repr(x)


def common_factor(recorded: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> Optional[float]:
    """The one scalar ``c`` (not 1) with ``recorded == c * replayed`` for every gradient, within
    float32 rounding and with the same NaN/Inf pattern, or ``None``. ``c`` is NaN when every
    recorded value is NaN and the replay holds a non-finite value (``clip_grad_norm_`` with a
    NaN total norm), 0 for an Inf total norm. Needs two finite non-zero values to infer a finite
    ``c``; one tensor at a time, no copy of all gradients."""
    names = [n for n, r in recorded.items() if is_float(r)]
    if not names or any(n not in replayed for n in names):
        return None
    pairs = [(recorded[n].detach().to(replayed[n].device).double(), replayed[n].detach().double()) for n in names]
    c, best, usable = None, 0.0, 0
    for r, g in pairs:
        ok = torch.isfinite(r) & torch.isfinite(g) & (g != 0)
        usable += int(ok.sum())
        if ok.any():
            i = int(torch.where(ok, g.abs(), torch.zeros_like(g)).argmax())
            if abs(float(g.reshape(-1)[i])) > best:
                best, c = abs(float(g.reshape(-1)[i])), float(r.reshape(-1)[i] / g.reshape(-1)[i])
    if c is None:
        all_nan = all(bool(torch.isnan(r).all()) for r, _ in pairs)
        some_bad = any(not bool(torch.isfinite(g).all()) for _, g in pairs)
        return math.nan if all_nan and some_bad else None
    if usable < 2 or c == 1.0:
        return None
    for r, g in pairs:
        e = g * c
        if not (torch.equal(torch.isnan(r), torch.isnan(e)) and torch.equal(torch.isposinf(r), torch.isposinf(e)) and torch.equal(torch.isneginf(r), torch.isneginf(e))):
            return None
        fin = torch.isfinite(r)
        if fin.any() and float((r[fin] - e[fin]).abs().max()) > 4e-6 * float(r[fin].abs().max()) + 1e-30:
            return None
    return c


def _h(h: Optional[Health]) -> Optional[dict]:
    return h.to_json() if h is not None else None


def _event_json(e: dict) -> dict:
    return {k: (_h(v) if isinstance(v, Health) else v) for k, v in e.items()}


def _compare_loss(repro: dict, recorded: Optional[float], replayed: list[Optional[Health]]) -> None:
    """Fold the loss into the verdict: a recorded non-finite loss that replays finite (or the
    reverse) means the failure was not reproduced, whatever the gradients say."""
    hs = [h for h in replayed if h is not None]
    if recorded is None or not hs:
        return
    rec_bad = not math.isfinite(recorded)
    rep_bad = any(not h.finite for h in hs)
    repro["loss_recorded"] = fnum(recorded)
    if rec_bad != rep_bad:
        repro["verdict"] = "not reproduced"
        msg = f"recorded loss {recorded} but the replayed loss is {'non-finite' if rep_bad else 'finite'}"
        repro["detail"] = msg + ("; " + repro["detail"] if repro.get("detail") else "")


def diagnose(
    result: ReplayResult,
    *,
    step: int,
    recorded_grads: dict[str, torch.Tensor],
    recorded_loss: Optional[float] = None,
    table_rows: int = 8,
) -> dict:
    """Turn a replay into the diagnosis (a JSON-able dict; field names documented in
    ``docs/report.md``): ``phase`` of birth (``weights``, ``input``, ``forward``, ``loss``,
    ``backward``, or ``none``), ``origin`` (module FQN and class, op when known), the
    ``summary`` sentence, the ``health`` table around the origin and the ``reproduction`` verdict."""
    repro = compare_grads(recorded_grads, result.grads)
    _compare_loss(repro, recorded_loss, result.losses)
    fwd = [e for e in result.modules.events if e["phase"] == "forward"]
    bwd = [e for e in result.modules.events if e["phase"] == "backward"]
    births = result.ops.births if result.ops is not None else []
    origin: Optional[dict] = None
    phase = "none"
    cause = ""
    model_out_bad = any(h is not None and not h.finite for h in result.outputs)
    loss_bad = any(h is not None and not h.finite for h in result.losses)
    cot_bad = any(h is not None and not h.finite for h in result.cotangents)
    fwd_births = [b for b in births if b["phase"] == "forward"]

    def op_in(module: Optional[str], ph: str) -> Optional[dict]:
        for b in births:
            m = b["module"]
            if b["phase"] == ph and m is not None and (module is None or module == "" or m == module or m.startswith(module + ".")):
                return b
        return None

    if result.weights:
        w = result.weights[0]
        phase, cause = "weights", "the step-start weights were already non-finite (an earlier optimizer update corrupted them)"
        leaf = w["leaf"]
        fqn = leaf.split("'")[3] if leaf.count("'") >= 4 else leaf
        origin = {"module": fqn.rpartition(".")[0], "tensor": fqn, "kind": "producer"}
    elif any(x["health"].nan or x["health"].posinf for x in result.inputs):
        x = next(x for x in result.inputs if x["health"].nan or x["health"].posinf)
        phase, cause = "input", f"the recorded batch already holds {x['health'].kinds()} at {x['leaf']}"
        origin = {"module": None, "leaf": x["leaf"], "samples": x["samples"], "kind": "bad input data"}
    elif model_out_bad:
        prod = next((e for e in fwd if e["born"]), None)
        phase = "forward"
        if prod is not None:
            origin = {"module": prod["module"], "class": prod["class"], "kind": "producer"}
            op = op_in(prod["module"], "forward")
        else:
            op = fwd_births[0] if fwd_births else None
            origin = {"module": op["module"] if op else "", "class": None, "kind": "producer"}
        if op:
            origin["op"] = op["op"]
            origin["op_index"] = op["op_index"]
        cause = "a non-finite value is born in the forward pass"
    elif loss_bad or (result.mode == "cotangent" and cot_bad):
        phase = "loss"
        op = next((b for b in births if b["phase"] == "loss"), None) if result.mode == "loss_fn" else None
        origin = {"module": None, "class": None, "kind": "outside the model"}
        if op:
            origin["op"] = op["op"]
            origin["op_index"] = op["op_index"]
        cause = (
            "the model's forward pass is finite; the non-finite value is born outside the model, in the loss"
            + (" function" if result.mode == "loss_fn" else " (the recorded gradient w.r.t. the model output is non-finite)")
        )
    else:
        bop = next((b for b in births if b["phase"] == "backward"), None)
        first_bad = next((e for e in bwd if e["output"] is not None and not e["output"].finite), None)
        if bop is not None or first_bad is not None:
            phase = "backward"
            module = bop["module"] if bop is not None else first_bad["module"]
            cls = dict(result.modules.fqn_class).get(module) if hasattr(result.modules, "fqn_class") else None
            origin = {"module": module, "class": cls, "kind": "producer"}
            if bop is not None:
                origin["op"] = bop["op"]
                origin["op_index"] = bop["op_index"]
            cause = "the forward pass and the loss are finite; the non-finite value is born in the backward pass"
            if first_bad is not None:
                origin["first_nonfinite_gradient"] = first_bad.get("param") or f"cotangent at {first_bad['module'] or '(model output)'}"
    classes = {e["module"]: e["class"] for e in fwd}
    if origin is not None and origin.get("module") is not None and origin.get("class") is None:
        origin["class"] = classes.get(origin["module"])
    table = _table(fwd, origin, table_rows)
    diag = {
        "step": step,
        "phase": phase,
        "origin": origin,
        "cause": cause,
        "summary": "",
        "mode": result.mode,
        "reproduction": repro,
        "health": table,
        "births": [_event_json(b) for b in births[:16]],
        "propagated_ops": result.ops.propagated if result.ops is not None else None,
        "nonfinite_inputs": [_event_json(x) for x in result.inputs[:8]],
        "nonfinite_weights": [_event_json(x) for x in result.weights[:8]],
        "loss": [_h(h) for h in result.losses],
        "warnings": result.warnings,
    }
    diag["summary"] = attribution.summary_sentence(diag)
    return diag


def _table(fwd: list[dict], origin: Optional[dict], rows: int) -> list[dict]:
    """The first ``rows`` module events around the origin (or the first ones), as JSON."""
    idx = 0
    if origin and origin.get("module") is not None:
        idx = next((i for i, e in enumerate(fwd) if e["module"] == origin["module"]), 0)
    lo = max(0, idx - rows // 2)
    roles, born_before = [], []
    for e in fwd:  # forwards complete children first: a parent of an earlier producer only contains it
        if e["born"]:
            inside = any(m == e["module"] or m.startswith(e["module"] + ".") or e["module"] == "" for m in born_before)
            roles.append("contains producer" if inside else "producer")
            born_before.append(e["module"])
        else:
            roles.append("propagator" if e["output"] is not None and not e["output"].finite else "")
    out = []
    for i, e in enumerate(fwd[lo : lo + rows], start=lo):
        role = roles[i]
        out.append({"index": i, "module": e["module"], "class": e["class"], "role": role, "inputs": _h(e["inputs"]), "output": _h(e["output"])})
    return out


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _preserve_live(model: torch.nn.Module) -> Iterator[None]:
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


def replay_step(model: torch.nn.Module, inp: StepInputs, *, ops: bool = True, device: Optional[torch.device] = None, samples: bool = True) -> dict:
    """Replay one step on ``model`` (weights already loaded) and return the diagnosis dict, with
    the exact attribution of :func:`nanreplay.attribution.attribute` (source line, autograd node,
    causal chain, samples, optimizer update, cause verdict)."""
    result = run_step(model, inp, ops=ops, device=device)
    diag = diagnose(result, step=inp.record.step, recorded_grads=inp.recorded_grads, recorded_loss=inp.record.loss)
    return attribution.attribute(diag, result, model, inp, device=device, samples=samples)


def diagnose_live(recorder: Any, content: BundleContent) -> dict:
    """In-process diagnosis, run by the Recorder right after detection: replays the failing step
    on the live model (its weights are still the pre-step weights), then puts back the live
    gradients, buffers, module modes and RNG states, so training can continue unchanged."""
    rec = content.steps[-1]
    model = recorder.model
    inp = StepInputs(
        record=rec, state=content.state, recorded_grads=content.grads, loss_fn=recorder.loss_fn,
        scaler=content.state.extra.get("scaler"), grads_unscaled=(content.reason.get("scaler") or {}).get("grads_unscaled"),
        allow=Allowlist(recorder.config.allow_nonfinite), optimizer_info=content.optimizer_info,
        history=list(content.steps), reason=dict(content.reason),
    )
    recorder._replaying = True
    try:
        with _preserve_live(model):
            load_buffers(model, content.state.buffers)
            return replay_step(model, inp)
    finally:
        recorder._replaying = False


def replay(
    bundle: Union[str, Path, Bundle],
    *,
    model: Optional[torch.nn.Module] = None,
    model_factory: Union[str, Callable, None] = None,
    loss_fn: Union[str, Callable, None] = None,
    device: Union[str, torch.device, None] = None,
    ops: bool = True,
    use_loss_fn: bool = True,
    allow: Optional[Sequence[str]] = None,
    default_allow: bool = True,
    samples: bool = True,
) -> dict:
    """Replay a bundle's failing step and diagnose it.

    Args:
        bundle: a path or an open :class:`~nanreplay.bundle.Bundle`.
        model: a model of the recorded architecture; else ``model_factory`` (callable or import
            path), else the factory recorded in the bundle.
        loss_fn: ``loss_fn(model, batch) -> loss``; defaults to the recorded one. Without it (or
            with ``use_loss_fn=False``), the recorded cotangent drives the backward pass.
        device: where to replay (default: the recorded parameters' device when present here,
            else CPU).
        ops: run the op-level monitor (slower, names the aten op, the source line, the autograd
            node; runs under anomaly mode).
        allow: extra allowlist rules ``"MODULE:OP[:-inf]"`` for legitimate non-finite values, on
            top of those recorded in the bundle (``RecorderConfig.allow_nonfinite``).
        default_allow: keep the default rules (-Inf written by attention masking).
        samples: find the samples to blame by per-sample replay where the producer's output
            does not show them directly (extra forward/backward passes, see
            :func:`nanreplay.blame.samples_to_blame`).

    Returns:
        the diagnosis dict (see :func:`diagnose`), with ``bundle`` and ``device`` added.

    Raises:
        FileNotFoundError, BundleFormatError: unreadable bundle.
        ReplayError: no model could be built, or the loss function failed.
        ModelMismatchError: the model does not match the recorded one.
    """
    own = not isinstance(bundle, Bundle)
    b = open_bundle(bundle) if own else bundle
    try:
        if model is None:
            model = build_model(b, model_factory)
        lf = loss_fn if loss_fn is not None else (b.loss_fn if use_loss_fn else None)
        if isinstance(lf, str):
            lf = import_callable(lf)
        if not use_loss_fn:
            lf = None
        dev = torch.device(device) if device is not None else _recorded_device(b)
        model = model.to(dev)
        state = b.state()
        rec = b.step(b.failing_step)
        load_state(model, state)
        rules = list((b.meta.get("replay_options") or {}).get("allow_nonfinite", [])) + list(allow or [])
        history = [b.step(k) for k in b.steps if k <= b.failing_step]
        inp = StepInputs(
            record=rec, state=state, recorded_grads=b.grads(), loss_fn=lf, allow=Allowlist(rules, defaults=default_allow),
            optimizer_info=b.meta.get("optimizer"), history=history, reason=dict(b.meta.get("reason") or {}),
            scaler=state.extra.get("scaler"), grads_unscaled=((b.meta.get("reason") or {}).get("scaler") or {}).get("grads_unscaled"),
        )
        diag = replay_step(model, inp, ops=ops, device=dev, samples=samples)
        diag["bundle"] = str(b.path)
        diag["device"] = str(dev)
        return diag
    finally:
        if own:
            b.close()


def build_from_init(init: Any) -> torch.nn.Module:
    """Build a model from a bundle's ``model_init`` entry, ``{"class": "pkg.mod:Class",
    "kwargs": {...JSON...}}``: ``Class(**kwargs)``, the way Lightning's ``load_from_checkpoint``
    rebuilds a LightningModule from its saved hyperparameters.

    Raises:
        ReplayError: a malformed entry, a class that cannot be imported, or a constructor error.
    """
    if not isinstance(init, dict) or not isinstance(init.get("class"), str) or not isinstance(init.get("kwargs", {}), dict):
        raise ReplayError(f"the bundle's model_init is {init!r}; expected {{'class': 'pkg.mod:Class', 'kwargs': {{...}}}}: pass --model-factory")
    cls = import_callable(init["class"])
    try:
        model = cls(**init.get("kwargs", {}))
    except Exception as e:
        raise ReplayError(
            f"{init['class']}(**{init.get('kwargs')}) raised {type(e).__name__}: {e}; the recorded hyperparameters do not "
            "rebuild the model here: pass --model-factory"
        ) from e
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"{init['class']} built a {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_model(b: Bundle, model_factory: Union[str, Callable, None] = None) -> torch.nn.Module:
    """A fresh model of the recorded architecture from ``model_factory`` (a zero-argument callable
    or its import path), else from the factory recorded in the bundle ``b``, else from its
    ``model_init`` (class and JSON kwargs, see :func:`build_from_init`). Weights are not loaded.

    Raises:
        ReplayError: no factory recorded or given, the factory cannot be imported, raises, or
            returns something other than an ``nn.Module``.
    """
    factory = model_factory or b.model_factory
    if factory is None and b.meta.get("model_init"):
        return build_from_init(b.meta["model_init"])  # class + JSON hyperparameters (Lightning)
    if factory is None:
        raise ReplayError(
            f"{b.path} records no model factory; pass --model-factory module:function "
            "(a zero-argument function returning the model), or give Recorder(model_factory=...) when recording"
        )
    fn = import_callable(factory) if isinstance(factory, str) else factory
    try:
        model = fn()
    except Exception as e:
        raise ReplayError(f"the model factory {factory!r} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"the model factory {factory!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_optimizer(b: Bundle, model: torch.nn.Module, state: Optional[dict] = None) -> torch.optim.Optimizer:
    """Rebuild the recorded optimizer over ``model``'s parameters from the bundle's
    ``meta["optimizer"]`` and load ``state`` (an ``optimizer.state_dict()``, e.g. a snapshot's)
    when given; see :func:`optimizer_from_info`.

    Raises:
        ReplayError: the bundle records no optimizer class, or it cannot be imported or built.
        ModelMismatchError: a recorded parameter FQN is not in ``model``, or ``state`` does not
            fit the rebuilt param groups.
    """
    return optimizer_from_info(b.meta.get("optimizer") or {}, dict(model.named_parameters()), state, source=str(b.path))


def optimizer_from_info(
    info: dict, params: dict[str, torch.Tensor], state: Optional[dict] = None, *, source: str = "the bundle"
) -> torch.optim.Optimizer:
    """The recorded optimizer, rebuilt over ``params`` (FQN -> parameter) from a bundle's
    ``meta["optimizer"]`` (class import path, parameter FQNs of each param group, defaults).

    With ``state`` (an ``optimizer.state_dict()``), each group is built with its recorded
    hyperparameters, which also carries values a constructor would refuse (a NaN learning rate
    is exactly what the optimizer-update diagnosis replays), then the state is loaded. Without
    it, the recorded defaults are used.

    Raises:
        ReplayError: no optimizer class recorded, or it cannot be imported or built.
        ModelMismatchError: a recorded FQN is missing from ``params``, or ``state`` does not fit.
    """
    cls_path = info.get("class")
    if not cls_path:
        raise ReplayError(f"{source} records no optimizer class; record with a nanreplay.Recorder that saw the optimizer")
    cls = import_callable(cls_path)
    fqn_groups = info.get("param_groups_fqns", [])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]] if state is not None else [{} for _ in fqn_groups]
    if len(hyper) != len(fqn_groups):
        raise ModelMismatchError(f"{source}: the optimizer state has {len(hyper)} param groups, the recorded optimizer {len(fqn_groups)}")
    groups = []
    for fqns, h in zip(fqn_groups, hyper):
        missing = [f for f in fqns if f not in params]
        if missing:
            raise ModelMismatchError(
                f"the recorded optimizer holds parameters {missing[:5]} that the model lacks; "
                "pass --model-factory with the factory that built the recorded model"
            )
        groups.append({**h, "params": [params[f] for f in fqns]})
    defaults = dict(info.get("defaults") or {})
    lr_only = {"lr": float(defaults["lr"])} if isinstance(defaults.get("lr"), (int, float)) else {"lr": 1e-3}
    attempts = ([{}] if state is not None else []) + [defaults, lr_only]
    for i, kwargs in enumerate(attempts):
        try:
            opt = cls(groups, **kwargs)
            break
        except (TypeError, ValueError) as e:  # a default JSON could not carry (repr'd); the state fixes it
            if i == len(attempts) - 1:
                raise ReplayError(f"could not rebuild the optimizer {cls_path}: {type(e).__name__}: {e}") from e
            logger.info("rebuilding %s with %s failed (%s); trying the next way", cls_path, sorted(kwargs) or "its param groups", e)
    if state is not None:
        try:
            opt.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelMismatchError(f"the recorded optimizer state does not fit the rebuilt {cls_path}: {e}") from e
    return opt


def _recorded_device(b: Bundle) -> torch.device:
    devs = {v.get("device", "cpu") for v in b.meta.get("model", {}).get("params", {}).values()}
    dev = next(iter(devs), "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("the bundle was recorded on %s; replaying on the CPU (results may differ)", dev)
        return torch.device("cpu")
    return torch.device(dev)
