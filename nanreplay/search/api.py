"""``nanreplay bisect``: search for the cause of a non-finite step by replaying variations of it.

A NaN gradient is often the late symptom of something earlier. Each search replays the failing
step (or the steps before it) from a bundle, changing one thing at a time, and reports the
smallest change that still makes the step non-finite:

* ``layers``: between the weights of an earlier finite step (a snapshot in the ring buffer) and
  the failing step's pre-step weights, find the smallest set of layers whose change alone makes
  the failing step's batch non-finite. Search: delta debugging, ``ddmin`` (Zeller and
  Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", IEEE TSE 28(2), 2002) over the
  layers in forward execution order, so a single culprit costs about ``2 * log2(layers)`` replays.
* ``precision``: for a model run in float16 / bfloat16 (a half model, or autocast in the loss
  function), binary search over a growing prefix of layers, in execution order, run in float32,
  for the first layer that has to run in float32 for the step to become finite.
* ``steps``: from the oldest snapshot in the ring buffer, replay every recorded step (batch, RNG
  states, learning rates, optimizer update) and report the first step that leaves the healthy
  range, verifying the replayed losses and grad norms against the recorded ones on the way.
* ``samples``: ``ddmin`` over the samples of the failing batch for the smallest subset that is
  still non-finite, and the samples whose removal alone makes the step finite.

Every search counts its replays and stops at ``max_replays``. The bundle is opened read-only and
never modified. See ``docs/bisect.md`` for what each search needs from the recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence, TypeVar, Union

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.jsonable import fnum
from ..format.bundle import Bundle, open_bundle
from ..format.records import ForwardRecord, Snapshot, StepRecord
from ..errors import ReplayError
from ..core.numerics import fused_norm, is_float
from ..diagnosis.blame import batch_coupled, take_rows
from ..core.tree import flatten_typed, map_tensors
from ..core.callables import import_callable
from ..engine.run import StepInputs, run_step
from ..engine.state import build_model, build_optimizer, load_state, recorded_device
from ..engine.gate import bundle_types, recorded_callable, require_trust
from ..format.bundle import Types

logger = logging.getLogger(__name__)

__all__ = ["bisect", "ddmin", "SEARCHES", "STATUSES"]

SEARCHES = ("layers", "precision", "steps", "samples")

#: ``found``: a culprit was named. ``not reproduced``: the unchanged replay of the failing step is
#: finite, so there is nothing to search. ``not in search space``: every variation the search can
#: make stays non-finite (e.g. the cause is not in the weights). ``incomplete``: ``max_replays``
#: ran out before the search finished; the partial answer is reported.
STATUSES = ("found", "not reproduced", "not in search space", "incomplete")

T = TypeVar("T", bound=Hashable)

_REDUCED = (torch.float16, torch.bfloat16)


class _BudgetExhausted(Exception):
    """Raised inside a search when ``max_replays`` replays have run."""


class _Runner:
    """Counts replays, enforces the budget and ticks the progress callback once per replay."""

    def __init__(self, max_replays: int, progress: Optional[Callable[[int], None]]) -> None:
        self.max_replays = max_replays
        self.count = 0
        self.progress = progress

    def tick(self) -> None:
        if self.count >= self.max_replays:
            raise _BudgetExhausted
        self.count += 1
        if self.progress is not None:
            self.progress(1)


# ---------------------------------------------------------------------------------------------
# delta debugging
# ---------------------------------------------------------------------------------------------
def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """The 1-minimal failing subset of ``items`` by delta debugging (Zeller and Hildebrandt,
    "Simplifying and Isolating Failure-Inducing Input", IEEE TSE 28(2), 2002).

    Args:
        items: the full configuration, which must fail (``fails(list(items))`` is True). Order is
            kept: chunks are contiguous, so a single culprit is found in about
            ``2 * log2(len(items))`` calls.
        fails: ``fails(subset) -> bool``, True when the subset alone still shows the failure.
            Results are cached by subset, so no subset is tested twice. An exception propagates
            (callers use it to stop at a replay budget).

    Returns:
        a failing subset, in the order of ``items``, from which no single element can be removed
        (1-minimal), when ``fails`` is monotone; in general a small failing subset.

    Example::

        >>> ddmin(list(range(32)), lambda s: 19 in s)
        [19]
    """
    cache: dict[frozenset, bool] = {}

    def test(sub: list[T]) -> bool:
        key = frozenset(sub)
        if key not in cache:
            cache[key] = bool(fails(sub))
        return cache[key]

    c = list(items)
    n = 2
    while len(c) >= 2:
        size = len(c)
        bounds = [round(i * size / n) for i in range(n + 1)]
        chunks = [c[bounds[i] : bounds[i + 1]] for i in range(n) if bounds[i] < bounds[i + 1]]
        reduced = False
        for ch in chunks:  # reduce to a subset
            if test(ch):
                c, n, reduced = ch, 2, True
                break
        if not reduced and len(chunks) > 2:  # reduce to a complement
            for i in range(len(chunks)):
                comp = [x for j, ch in enumerate(chunks) if j != i for x in ch]
                if test(comp):
                    c, n, reduced = comp, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(c):
                break
            n = min(2 * n, len(c))
    return c


# ---------------------------------------------------------------------------------------------
# shared machinery
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Ctx:
    bundle: Bundle
    model: torch.nn.Module
    loss_fn: Optional[Callable]
    device: torch.device
    runner: _Runner
    failing: StepRecord
    state: Snapshot
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Outcome:
    """One replay, reduced to what the searches need."""

    nonfinite: bool
    loss: Optional[float]          # the replayed loss when one scalar loss was computed
    loss_finite: bool
    grad_norm: Optional[float]     # the 2-norm over all replayed gradients (float32, as the recorder)
    grads: dict[str, torch.Tensor]


def _replay(ctx: _Ctx, record: StepRecord, state: Snapshot) -> _Outcome:
    """Replay ``record`` on ``ctx.model`` (weights already loaded) and say whether it is non-finite
    by the recorder's own rule: a non-finite loss or a non-finite grad norm. One replay."""
    ctx.runner.tick()
    res = run_step(ctx.model, StepInputs(record=record, state=state, recorded_grads={}, loss_fn=ctx.loss_fn), ops=False, device=ctx.device)
    norm_t = fused_norm(list(res.grads.values()))
    gn = float(norm_t) if norm_t is not None else None
    losses = [h for h in res.losses if h is not None]
    loss_finite = all(h.finite for h in losses)
    out_bad = res.mode == "forward-only" and any(h is not None and not h.finite for h in res.outputs)
    cot_bad = any(h is not None and not h.finite for h in res.cotangents)
    loss = losses[0].mean if len(losses) == 1 and losses[0].finite else None
    bad = (gn is not None and not math.isfinite(gn)) or not loss_finite or out_bad or cot_bad
    return _Outcome(nonfinite=bad, loss=loss, loss_finite=loss_finite, grad_norm=gn, grads=res.grads)


def _execution_order(model: torch.nn.Module) -> tuple[list[str], Callable[[], None]]:
    """Record the FQNs of modules in the order their forward starts (first call only). Returns the
    list (filled during the next replay) and a function removing the hooks."""
    order: list[str] = []
    seen: set[str] = set()
    handles = []
    for name, m in model.named_modules():

        def pre(mod: torch.nn.Module, args: tuple, name: str = name) -> None:
            if name not in seen:
                seen.add(name)
                order.append(name)

        handles.append(m.register_forward_pre_hook(pre))

    def remove() -> None:
        for h in handles:
            h.remove()

    return order, remove


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _class_of(model: torch.nn.Module, fqn: str) -> str:
    return type(model.get_submodule(fqn)).__name__


def _param_layers(model: torch.nn.Module, order: list[str]) -> list[str]:
    """Modules that own parameters directly, in forward execution order (modules never called in
    the replay last, in definition order: their weights may still be used functionally)."""
    owners = [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    pos = {n: i for i, n in enumerate(order)}
    return sorted(owners, key=lambda n: (pos.get(n, len(pos)), owners.index(n)))


def _load(ctx: _Ctx, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> Snapshot:
    snap = Snapshot(params=params, buffers=buffers)
    load_state(ctx.model, snap)
    return snap


def _result(over: str, ctx: _Ctx, status: str, answer: str, culprits: list, details: dict) -> dict:
    return {
        "over": over,
        "bundle": str(ctx.bundle.path),
        "step": ctx.bundle.failing_step,
        "status": status,
        "answer": answer,
        "culprits": culprits,
        "replays": ctx.runner.count,
        "max_replays": ctx.runner.max_replays,
        "device": str(ctx.device),
        "details": details,
        "warnings": ctx.warnings,
    }


def _snapshot_steps(b: Bundle) -> list[int]:
    return sorted(int(s["step"]) for s in b.meta.get("steps", []) if s.get("snapshot"))


def _no_snapshot_message(b: Bundle, over: str, held: list[int]) -> str:
    return (
        f"bisect --over {over} needs the weights and optimizer state of a step before the failing step "
        f"{b.failing_step}, kept in the ring buffer as a snapshot; {b.path} holds snapshots at steps {held or 'none'} "
        f"(ring buffer steps {b.steps}). Record with Recorder(..., snapshot_every=1) and a memory_budget of at "
        "least (capacity x (parameter bytes + optimizer state bytes)); see docs/bisect.md. Without snapshots, "
        "bisect can still run --over samples and --over precision on the failing step."
    )


def _movement(good: dict[str, torch.Tensor], bad: dict[str, torch.Tensor], names: list[str]) -> dict:
    """Weight movement between two states over the parameters ``names``: the 2-norm of the
    difference, its max abs, and the relative change ||bad - good|| / ||good||, computed in
    float64 over the finite differences; non-finite values in ``bad`` are counted."""
    sq = 0.0
    gsq = 0.0
    mx = 0.0
    nonfinite = 0
    for n in names:
        g, b_ = good[n].double(), bad[n].double()
        fin = torch.isfinite(b_)
        nonfinite += int((~fin).sum())
        d = (b_ - g)[fin]
        if d.numel():
            sq += float((d * d).sum())
            mx = max(mx, float(d.abs().max()))
        gsq += float((g[torch.isfinite(g)] ** 2).sum())
    norm = math.sqrt(sq)
    rel = norm / math.sqrt(gsq) if gsq > 0 else (math.inf if norm > 0 else 0.0)
    return {"diff_norm": fnum(norm), "max_abs_diff": fnum(mx), "relative_change": fnum(rel), "nonfinite_values": nonfinite}


# ---------------------------------------------------------------------------------------------
# --over layers
# ---------------------------------------------------------------------------------------------
def _bisect_layers(ctx: _Ctx) -> dict:
    b, model, F = ctx.bundle, ctx.model, ctx.bundle.failing_step
    bad_state = ctx.state
    held = _snapshot_steps(b)
    earlier = [s for s in held if s < F]
    if not earlier:
        raise ReplayError(_no_snapshot_message(b, "layers", held))
    # 1. the failing step as recorded: it must be non-finite, and it gives the execution order
    order, remove = _execution_order(model)
    try:
        load_state(model, bad_state)
        out = _replay(ctx, ctx.failing, bad_state)
    finally:
        remove()
    layers = _param_layers(model, order)
    if not out.nonfinite:
        return _result("layers", ctx, "not reproduced", f"Step {F} replays finite with its recorded weights, so there is nothing to bisect; run `nanreplay replay` to see why it does not reproduce.", [], {"layers": len(layers)})
    # 2. the newest snapshot under which the failing batch is finite is the baseline
    good_step, good = None, None
    tried = []
    for s in reversed(earlier):
        snap = b.step(s).snapshot
        assert snap is not None
        load_state(model, snap)
        o = _replay(ctx, ctx.failing, snap)
        tried.append({"step": s, "nonfinite": o.nonfinite})
        if not o.nonfinite:
            good_step, good = s, snap
            break
        if ctx.runner.count >= ctx.runner.max_replays:
            break
    if good is None:
        oldest = tried[-1]["step"]
        return _result(
            "layers",
            ctx,
            "not in search space",
            f"Step {F} is non-finite even with every layer at the weights of step {oldest}"
            f"{' (the oldest snapshot held)' if oldest == earlier[0] else ''}: the cause is not in the weights; "
            "look at the data (--over samples) or the numerics (--over precision).",
            [],
            {"snapshots_tried": tried, "layers": layers},
        )
    params_of = {L: [n for n in bad_state.params if _owner(n) == L] for L in layers}
    bufs_of = {L: [n for n in bad_state.buffers if _owner(n) == L] for L in layers}

    def mixed(changed: list[str]) -> tuple[dict, dict]:
        ch = set(changed)
        p = {n: (bad_state.params[n] if _owner(n) in ch else good.params[n]) for n in bad_state.params}
        bf = dict(bad_state.buffers)
        for L in layers:
            if L not in ch:
                for n in bufs_of[L]:
                    if n in good.buffers:
                        bf[n] = good.buffers[n]
        return p, bf

    def fails(changed: list[str]) -> bool:
        p, bf = mixed(changed)
        snap = _load(ctx, p, bf)
        return _replay(ctx, ctx.failing, snap).nonfinite

    status = "found"
    try:
        culprits = ddmin(layers, fails)
    except _BudgetExhausted:
        culprits, status = layers, "incomplete"
    movement = {L: _movement(good.params, bad_state.params, params_of[L]) for L in layers}
    rows = [{"layer": L, "class": _class_of(model, L), "index": layers.index(L), **movement[L]} for L in culprits]
    ranked = sorted(layers, key=lambda L: -float(movement[L]["relative_change"]))[:8]
    details = {
        "good_step": good_step,
        "bad_step": F,
        "snapshots_tried": tried,
        "layers": len(layers),
        "execution_order": layers,
        "largest_moves": [{"layer": L, "class": _class_of(model, L), **movement[L]} for L in ranked],
    }
    if status == "incomplete":
        answer = f"The search ran out of replays (--max-replays {ctx.runner.max_replays}) before isolating the layers; raise --max-replays."
        return _result("layers", ctx, status, answer, rows, details)
    first = rows[0]
    names = ", ".join(f"{r['layer'] or '(root)'} ({r['class']})" for r in rows)
    answer = (
        f"Step {F} becomes non-finite when {'layer' if len(rows) == 1 else f'these {len(rows)} layers together:'} {names} "
        f"{'takes its' if len(rows) == 1 else 'take their'} step-{F} weights instead of step-{good_step}'s; "
        f"the first, {first['layer'] or '(root)'}, moved by {_g(first['diff_norm'])} (max |change| {_g(first['max_abs_diff'])}, "
        f"relative change {_g(first['relative_change'])})."
    )
    return _result("layers", ctx, status, answer, rows, details)


def _g(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


# ---------------------------------------------------------------------------------------------
# --over precision
# ---------------------------------------------------------------------------------------------
def _float_leaves_to(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


class _Magnitude(TorchDispatchMode):
    """Largest and smallest non-zero finite |value| of every floating op output computed while
    ``active`` is set (the forward pass of one layer, its children included)."""

    def __init__(self, limit: float = math.inf) -> None:
        super().__init__()
        self.limit = limit
        self.first_over: Optional[str] = None   # first op whose output exceeds ``limit``
        self.active = 0
        self.absmax = 0.0
        self.absmin_nonzero = math.inf
        self.op_of_max: Optional[str] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    a = t.detach().abs()
                    a = a[torch.isfinite(a)]
                    if a.numel():
                        m = float(a.max())
                        if m > self.limit and self.first_over is None:
                            self.first_over = func.overloadpacket.__name__
                        if m > self.absmax:
                            self.absmax, self.op_of_max = m, func.overloadpacket.__name__
                        nz = a[a > 0]
                        if nz.numel():
                            self.absmin_nonzero = min(self.absmin_nonzero, float(nz.min()))
        return out


def _bisect_precision(ctx: _Ctx) -> dict:
    model, F, state = ctx.model, ctx.bundle.failing_step, ctx.state
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.params.values() if t.is_floating_point()})
    reduced = [getattr(torch, d) for d in dtypes if getattr(torch, d) in _REDUCED]
    low = reduced[0] if reduced else None
    ac = ctx.failing.autocast  # recorded per step: {"device_type", "dtype"} or None
    if low is None and ac and getattr(torch, ac.get("dtype", ""), None) in _REDUCED:
        low = getattr(torch, ac["dtype"])  # float32 weights under a recorded float16/bfloat16 autocast
    elif low is None:
        ctx.warnings.append(
            f"the recorded parameters are {', '.join(dtypes)} and the bundle records no float16/bfloat16 autocast for step "
            f"{F}: the search assumes autocast runs inside the loss function, and runs each upcast layer with autocast disabled"
        )
    # baseline: the step as recorded, also giving the execution order and the output dtypes
    order, remove = _execution_order(model)
    out_dtypes: list[Optional[torch.dtype]] = []

    def grab(mod: torch.nn.Module, args: tuple, out: Any) -> None:
        out_dtypes[:] = [t.dtype if isinstance(t, torch.Tensor) else None for t in flatten_typed(out)[0]]

    h = model.register_forward_hook(grab)
    try:
        load_state(model, state)
        base = _replay(ctx, ctx.failing, state)
    finally:
        remove()
        h.remove()
    if not base.nonfinite:
        return _result("precision", ctx, "not reproduced", f"Step {F} replays finite as recorded, so there is nothing to bisect; run `nanreplay replay` to see why it does not reproduce.", [], {})
    mods = dict(model.named_modules())
    units = [n for n in order if n and (not any(True for _ in mods[n].children()) or next(mods[n].parameters(recurse=False), None) is not None)]
    if not units:
        units = [n for n in order]
    dev_type = ctx.device.type

    def run(k: int, magnitude_of: Optional[str] = None) -> tuple[bool, Optional[_Magnitude]]:
        up = set(units[:k])
        for n, p in model.named_parameters():
            p.data = state.params[n].to(ctx.device).clone()
        for n, bf in model.named_buffers():
            if n in state.buffers:
                bf.data = state.buffers[n].to(ctx.device).clone()
        handles = []
        ctxs: list[Any] = []
        for n in units:
            m = mods[n]
            if n in up:
                for p in m.parameters(recurse=False):
                    if p.is_floating_point():
                        p.data = p.data.float()
                for bf in m.buffers(recurse=False):
                    if bf.is_floating_point():
                        bf.data = bf.data.float()

                def pre_up(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
                    ac = torch.autocast(dev_type, enabled=False)
                    ac.__enter__()
                    ctxs.append(ac)
                    return _float_leaves_to((args, kwargs), torch.float32)

                def post_up(mod: torch.nn.Module, args: tuple, out: Any) -> None:
                    if ctxs:
                        ctxs.pop().__exit__(None, None, None)

                handles.append(m.register_forward_pre_hook(pre_up, with_kwargs=True))
                handles.append(m.register_forward_hook(post_up))
            else:
                own = [p.dtype for p in m.parameters(recurse=False) if p.is_floating_point()]
                if own:

                    def pre_low(mod: torch.nn.Module, args: tuple, kwargs: dict, dt: torch.dtype = own[0]) -> tuple:
                        return _float_leaves_to((args, kwargs), dt)

                    handles.append(m.register_forward_pre_hook(pre_low, with_kwargs=True))
        if up:  # the model's outputs keep their recorded dtypes (the cotangent and loss expect them)

            def post_root(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
                leaves, spec = pytree.tree_flatten(out)
                if len(leaves) != len(out_dtypes):
                    return None
                return pytree.tree_unflatten(
                    [x.to(d) if isinstance(x, torch.Tensor) and d is not None and x.is_floating_point() and x.dtype != d else x for x, d in zip(leaves, out_dtypes)], spec
                )

            handles.append(model.register_forward_hook(post_root))
        mag = None
        if magnitude_of is not None:
            mag = _Magnitude(torch.finfo(low).max if low is not None else math.inf)
            target = mods[magnitude_of]

            def on(mod: torch.nn.Module, args: tuple) -> None:
                mag.active += 1

            def off(mod: torch.nn.Module, args: tuple, out: Any) -> None:
                mag.active -= 1

            handles.append(target.register_forward_pre_hook(on))
            handles.append(target.register_forward_hook(off))
        try:
            with (mag if mag is not None else contextlib.nullcontext()):
                o = _replay(ctx, ctx.failing, state)
        finally:
            while ctxs:
                ctxs.pop().__exit__(None, None, None)
            for hd in handles:
                hd.remove()
        return o.nonfinite, mag

    n = len(units)
    details: dict[str, Any] = {"dtypes": dtypes, "units": n, "execution_order": units}
    try:
        all_bad, _ = run(n)
        if all_bad:
            return _result(
                "precision",
                ctx,
                "not in search space",
                f"Step {F} stays non-finite with every layer in float32: the failure is not a precision problem; "
                "look at the weights (--over layers) or the data (--over samples).",
                [],
                details,
            )
        lo, hi = 0, n  # run(lo) non-finite, run(hi) finite
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if run(mid)[0]:
                lo = mid
            else:
                hi = mid
        layer = units[hi - 1]
        _, mag = run(hi, magnitude_of=layer)
    except _BudgetExhausted:
        return _result("precision", ctx, "incomplete", f"The search ran out of replays (--max-replays {ctx.runner.max_replays}); raise --max-replays.", [], details)
    assert mag is not None
    fi = torch.finfo(low) if low is not None else None
    row: dict[str, Any] = {
        "layer": layer,
        "class": type(mods[layer]).__name__,
        "index": hi - 1,
        "absmax_fp32": fnum(mag.absmax),
        "op_of_absmax": mag.op_of_max,
        "first_op_over_range": mag.first_over,
        "absmin_nonzero_fp32": fnum(mag.absmin_nonzero) if math.isfinite(mag.absmin_nonzero) else None,
        "dtype": str(low).replace("torch.", "") if low is not None else None,
        "dtype_max": fi.max if fi else None,
        "dtype_tiny": fi.tiny if fi else None,
    }
    if fi is not None and mag.absmax > fi.max:
        why = (f"in float32 it computes |values| up to {mag.absmax:.4g} (op {mag.op_of_max}), above {row['dtype']}'s largest finite value "
               f"{fi.max:.4g}; the first op past that range is {mag.first_over}")
        row["overflow"] = True
    elif fi is not None:
        why = f"its float32 values stay within {row['dtype']}'s range (|max| {mag.absmax:.4g} <= {fi.max:.4g}), so precision or underflow (smallest non-zero |value| {_g(row['absmin_nonzero_fp32'])}, {row['dtype']} tiny {fi.tiny:.3g}) is the cause"
        row["overflow"] = False
    else:
        why = f"in float32 it computes |values| up to {mag.absmax:.4g} (op {mag.op_of_max})"
    answer = f"Step {F} becomes finite once the first {hi} layer(s) in execution order run in float32; the first that must is {layer} ({row['class']}): {why}."
    return _result("precision", ctx, "found", answer, [row], details)


# ---------------------------------------------------------------------------------------------
# --over steps
# ---------------------------------------------------------------------------------------------
def _close(a: Optional[float], b: Optional[float], rtol: float = 1e-4) -> Optional[bool]:
    if a is None or b is None:
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-12


def _bisect_steps(ctx: _Ctx, threshold: float, min_history: int = 2) -> dict:
    b, model, F = ctx.bundle, ctx.model, ctx.bundle.failing_step
    held = _snapshot_steps(b)
    start_candidates = [s for s in held if s <= F]
    if not start_candidates:
        raise ReplayError(_no_snapshot_message(b, "steps", held))
    start = start_candidates[0]
    steps = [s for s in b.steps if start <= s <= F]
    gaps = [s for s in range(start, F + 1) if s not in steps]
    if gaps:
        raise ReplayError(f"{b.path}: the ring buffer misses steps {gaps[:8]} between the snapshot at step {start} and the failing step {F}; bisect --over steps needs every step in between")
    snap = b.step(start).snapshot
    assert snap is not None
    load_state(model, snap)
    opt = build_optimizer(b, model, snap.optimizer)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    layers = sorted({_owner(n) for n in names}, key=lambda L: names.index(next(n for n in names if _owner(n) == L)))
    timeline: list[dict] = []
    first_bad: Optional[dict] = None
    first_mismatch: Optional[int] = None
    grad_hist: list[float] = []
    upd_hist: list[float] = []
    status = "found"
    try:
        for s in steps:
            rec = b.step(s)
            cur = Snapshot(params={n: p.detach() for n, p in params.items()}, buffers=dict(model.named_buffers()))
            o = _replay(ctx, rec, cur)
            row: dict[str, Any] = {"step": s, "lrs": [fnum(x) for x in rec.lrs], "loss": fnum(o.loss), "grad_norm": fnum(o.grad_norm),
                                   "recorded_loss": fnum(rec.loss), "recorded_grad_norm": fnum(rec.grad_norm)}
            # the optimizer consumed gradients of the recorded norm: a smaller recorded norm means the
            # loop rescaled them between backward and optimizer.step() (clip_grad_norm_); do the same
            clipped = (
                not o.nonfinite and o.grad_norm is not None and rec.grad_norm is not None and math.isfinite(rec.grad_norm)
                and o.grad_norm > 0 and rec.grad_norm < o.grad_norm * (1 - 1e-4)
            )
            if clipped:
                scale = rec.grad_norm / o.grad_norm
                grads = [p.grad for p in params.values() if p.grad is not None]
                torch._foreach_mul_(grads, scale)
                row["clipped_to"] = fnum(rec.grad_norm)
            checks = [c for c in (True if clipped else _close(o.grad_norm, rec.grad_norm), _close(o.loss, rec.loss) if o.loss is not None else None) if c is not None]
            row["matches_recording"] = all(checks) if checks else None
            if checks and not all(checks) and first_mismatch is None:
                first_mismatch = s
            reasons = []
            if o.nonfinite:
                reasons.append("non-finite " + ("loss" if not o.loss_finite else "gradients"))
            elif o.grad_norm is not None and len(grad_hist) >= min_history:
                med = statistics.median(grad_hist)
                if med > 0 and o.grad_norm > threshold * med:
                    reasons.append(f"grad norm {o.grad_norm:.4g} is {o.grad_norm / med:.3g}x the median {med:.4g} of the earlier steps")
            if not o.nonfinite and s < F:
                before = {n: p.detach().clone() for n, p in params.items()}
                for g, lr in zip(opt.param_groups, rec.lrs):
                    if lr is not None:
                        g["lr"] = lr
                opt.step()
                per = {L: _movement(before, {n: p.detach() for n, p in params.items()}, [n for n in names if _owner(n) == L]) for L in layers}
                upd = math.sqrt(sum(float(v["diff_norm"]) ** 2 for v in per.values() if not isinstance(v["diff_norm"], str)))
                bad_w = sum(v["nonfinite_values"] for v in per.values())
                top = max(layers, key=lambda L: float(per[L]["relative_change"]))
                row.update({"update_norm": fnum(upd), "largest_relative_update": {"layer": top, **per[top]}})
                if bad_w:
                    reasons.append(f"the optimizer update made {bad_w} weight value(s) non-finite")
                elif len(upd_hist) >= min_history:
                    med = statistics.median(upd_hist)
                    if med > 0 and upd > threshold * med:
                        reasons.append(f"the optimizer update norm {upd:.4g} is {upd / med:.3g}x the median {med:.4g} of the earlier steps; the largest relative change is in {top or '(root)'} ({float(per[top]['relative_change']):.3g})")
                upd_hist.append(upd)
            if o.grad_norm is not None and math.isfinite(o.grad_norm):
                grad_hist.append(o.grad_norm)
            row["anomalies"] = reasons
            timeline.append(row)
            if reasons and first_bad is None:
                first_bad = row
            if o.nonfinite:
                break
            for p in params.values():
                p.grad = None
    except _BudgetExhausted:
        status = "incomplete"
    details = {"start_step": start, "threshold": threshold, "timeline": timeline, "first_mismatch": first_mismatch}
    if first_mismatch is None:
        verify = f"the replayed losses and grad norms match the recording for steps {start}..{timeline[-1]['step'] if timeline else start}"
    else:
        verify = f"the replay matches the recording up to step {first_mismatch - 1} and differs from step {first_mismatch} on (results after that are less reliable)"
    n_clip = sum(1 for r in timeline if "clipped_to" in r)
    if n_clip:
        verify += f" ({n_clip} step(s) had smaller recorded grad norms, as after clip_grad_norm_: the replay rescaled its gradients to the recorded norm before the update)"
    details["verification"] = verify
    if first_bad is None:
        if status == "incomplete":
            return _result("steps", ctx, status, f"The search ran out of replays (--max-replays {ctx.runner.max_replays}) before reaching step {F}; raise --max-replays.", [], details)
        return _result("steps", ctx, "not reproduced", f"Replaying steps {start}..{F} from the snapshot at step {start} stays in the healthy range; {verify}.", [], details)
    s = first_bad["step"]
    answer = f"Step {s} is the first to leave the healthy range: {'; '.join(first_bad['anomalies'])}; {verify}."
    return _result("steps", ctx, status, answer, [first_bad], details)


# ---------------------------------------------------------------------------------------------
# --over samples
# ---------------------------------------------------------------------------------------------
def _batch_size(tree: Any) -> Optional[int]:
    """The most common dim-0 size among the tensor leaves with at least one dimension."""
    sizes = Counter(t.shape[0] for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() >= 1)
    return sizes.most_common(1)[0][0] if sizes else None


def _bisect_samples(ctx: _Ctx) -> dict:
    model, F, state, rec = ctx.model, ctx.bundle.failing_step, ctx.state, ctx.failing
    use_loss = ctx.loss_fn is not None and bool(rec.batches)
    parts = rec.batches if use_loss else [fw.inputs for fw in rec.forwards]
    if not parts:
        raise ReplayError(f"step {F} holds no recorded batch or forward inputs; bisect --over samples has nothing to slice. Call Recorder.record(batch) in the loop.")
    sizes = [_batch_size(p) for p in parts]
    if any(s is None for s in sizes):
        raise ReplayError(f"step {F}: a recorded batch has no tensor with a batch dimension (dim 0); bisect --over samples cannot split it")
    # samples are (micro-batch, row) pairs, so gradient accumulation is covered
    samples = [(j, i) for j, s in enumerate(sizes) for i in range(s)]
    coupled = batch_coupled(model, rec)
    if coupled:
        ctx.warnings.append(
            f"batch-coupled layers in training mode ({', '.join(coupled[:4])}{'...' if len(coupled) > 4 else ''}): a sample's output depends "
            "on the other samples in its batch, so a subset can behave differently from the whole batch"
        )

    if not use_loss:
        bad_rows = sorted({i for j, fw in enumerate(rec.forwards) if fw.cotangent is not None
                           for t in pytree.tree_leaves(fw.cotangent) if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == sizes[j] and is_float(t)
                           for i in (~torch.isfinite(t.reshape(t.shape[0], -1))).any(1).nonzero().flatten().tolist()})
        if bad_rows:
            ctx.warnings.append(
                f"no loss function: the backward pass is driven by the recorded cotangent, which is already non-finite for samples "
                f"{bad_rows[:16]}{'...' if len(bad_rows) > 16 else ''}, so any subset holding them stays non-finite; pass --loss-fn for a faithful search"
            )

    def record_for(sub: list[tuple[int, int]]) -> StepRecord:
        by = {j: [i for jj, i in sub if jj == j] for j in range(len(parts))}
        keep = [j for j in range(len(parts)) if by[j]]
        if use_loss:
            return dataclasses.replace(rec, batches=[take_rows(parts[j], by[j], sizes[j]) for j in keep])
        fws = [
            ForwardRecord(inputs=take_rows(rec.forwards[j].inputs, by[j], sizes[j]),
                          cotangent=take_rows(rec.forwards[j].cotangent, by[j], sizes[j]) if rec.forwards[j].cotangent is not None else None)
            for j in keep
        ]
        return dataclasses.replace(rec, forwards=fws)

    def fails(sub: list[tuple[int, int]]) -> bool:
        load_state(model, state)
        try:
            return _replay(ctx, record_for(sub), state).nonfinite
        except _BudgetExhausted:
            raise
        except Exception as e:  # e.g. BatchNorm refusing one sample: unresolved, treated as not failing
            logger.info("bisect samples: a subset of %d sample(s) could not be replayed (%s: %s)", len(sub), type(e).__name__, e)
            return False

    def label(x: tuple[int, int]) -> Any:
        return x[1] if len(parts) == 1 else list(x)

    status = "found"
    load_state(model, state)
    if not fails(samples):
        return _result("samples", ctx, "not reproduced", f"Step {F} replays finite with its whole batch, so there is nothing to bisect; run `nanreplay replay` to see why it does not reproduce.", [], {"samples": len(samples)})
    try:
        culprit = ddmin(samples, fails)
    except _BudgetExhausted:
        culprit, status = samples, "incomplete"
    necessary: list[Any] = []
    if status == "found":
        try:
            for x in culprit:
                rest = [y for y in samples if y != x]
                if rest and not fails(rest):
                    necessary.append(label(x))
        except _BudgetExhausted:
            status = "incomplete"
    details = {"samples": len(samples), "micro_batches": len(parts), "batch_sizes": sizes, "minimal_failing_subset": [label(x) for x in culprit],
               "removal_makes_finite": necessary, "mode": "loss_fn" if use_loss else "cotangent"}
    if status == "incomplete" and len(culprit) == len(samples):
        return _result("samples", ctx, status, f"The search ran out of replays (--max-replays {ctx.runner.max_replays}); raise --max-replays.", [], details)
    if status == "found" and not necessary and len(culprit) == 1 and len(samples) > 1:
        # a lone failing sample with no necessary one: check whether any sample fails alone,
        # in which case the failure belongs to the batch (or the loss, or the weights), not to samples
        others = [y for y in samples if y != culprit[0]]
        probe = [others[k * (len(others) - 1) // 3] for k in range(4)] if len(others) > 4 else others
        probe = list(dict.fromkeys(probe))
        try:
            alone = [y for y in probe if fails([y])]
        except _BudgetExhausted:
            alone = []
        details["other_samples_failing_alone"] = [label(y) for y in alone]
        details["other_samples_probed"] = [label(y) for y in probe]
        if alone and len(alone) == len(probe):
            answer = (
                f"Step {F} is non-finite with any single sample: {len(alone) + 1} of {len(alone) + 1} samples tested fail on their own, "
                "so the cause is not in particular samples; look at the loss, the weights or the batch as a whole (nanreplay replay)."
            )
            return _result("samples", ctx, "not in search space", answer, [], details)
    subset = ", ".join(str(label(x)) for x in culprit)
    answer = f"Step {F} stays non-finite with only sample{'s' if len(culprit) > 1 else ''} {subset} of its {len(samples)}"
    if necessary:
        answer += f"; removing sample{'s' if len(necessary) > 1 else ''} {', '.join(map(str, necessary))} alone makes it finite."
    else:
        answer += "; no single sample's removal makes the whole batch finite (several samples fail on their own)."
    culprits = [{"sample": label(x), "removal_makes_finite": label(x) in necessary} for x in culprit]
    return _result("samples", ctx, status, answer, culprits, details)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def bisect(
    bundle: Union[str, Path, Bundle],
    *,
    over: str = "layers",
    model: Optional[torch.nn.Module] = None,
    model_factory: Union[str, Callable, None] = None,
    loss_fn: Union[str, Callable, None] = None,
    device: Union[str, torch.device, None] = None,
    max_replays: int = 64,
    threshold: float = 10.0,
    progress: Optional[Callable[[int], None]] = None,
    trust: bool = False,
    batch_types: Types = None,
) -> dict:
    """Search a bundle for the cause of its non-finite step by replaying variations of it.

    Code the bundle names runs only when it is trusted (or ``trust=True``); otherwise pass your
    own ``model`` / ``model_factory``, ``loss_fn`` and ``batch_types`` (see
    :func:`nanreplay.diagnosis.api.replay` and ``docs/security.md``).

    Args:
        bundle: a bundle path or an open :class:`~nanreplay.format.bundle.Bundle`; read, never written.
        over: ``"layers"`` (which layers' weight change makes the step non-finite; needs a
            snapshot of an earlier step), ``"precision"`` (first layer that must run in float32),
            ``"steps"`` (first step leaving the healthy range; needs a snapshot), or
            ``"samples"`` (smallest non-finite subset of the batch). See the module docstring.
        model: a model of the recorded architecture (its weights are overwritten); else built with
            ``model_factory`` (callable or ``"module:function"``), else the recorded factory.
        loss_fn: ``loss_fn(model, batch) -> loss``; default the recorded one; without one, the
            recorded cotangent drives the backward pass.
        device: where to replay (default: the recorded device when present, else CPU).
        max_replays: the most replays (forward + backward runs) the search may use (>= 1).
        threshold: ``steps`` only: a step whose grad norm or optimizer update norm exceeds
            ``threshold`` x the median of the earlier replayed steps' leaves the healthy range.
        progress: called with ``1`` after each replay (the CLI's progress bar).
        trust: trust this bundle for this call (run the code it names).
        batch_types: dataclass types / namedtuple classes to rebuild typed batch nodes as.

    Returns:
        a JSON-able dict: ``over``, ``bundle``, ``step`` (failing step), ``status`` (one of
        :data:`STATUSES`), ``answer`` (one sentence), ``culprits`` (list of dicts: layers with
        weight movement, the precision layer with magnitudes vs ``torch.finfo``, the first
        anomalous step, or samples), ``replays``, ``max_replays``, ``device``, ``details``,
        ``warnings``.

    Raises:
        ValueError: unknown ``over``, ``max_replays`` < 1 or ``threshold`` <= 1.
        FileNotFoundError, BundleFormatError: unreadable bundle.
        UntrustedBundleError: the bundle is not trusted and names code the search would run.
        ReplayError: the search needs what the bundle lacks (a snapshot, a batch), or no model
            could be built. ModelMismatchError: the model does not fit the bundle.
    """
    if over not in SEARCHES:
        raise ValueError(f"over must be one of {SEARCHES}, got {over!r}")
    if max_replays < 1:
        raise ValueError(f"max_replays must be >= 1, got {max_replays}")
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1 (a multiple of the median of earlier steps), got {threshold}")
    own = not isinstance(bundle, Bundle)
    b = open_bundle(bundle, trust=trust) if own else bundle.view(trust=trust)
    try:
        # --- trust rule (nanreplay.engine.gate): refuse before anything the bundle names is imported ---
        require_trust(b, model=model is not None or model_factory is not None, loss=loss_fn is not None,
                      types=batch_types, optimizer=over == "steps")
        b = b.view(types=bundle_types(b, batch_types))
        # --- end of the trust rule ---
        m = model if model is not None else build_model(b, model_factory)
        lf = loss_fn if loss_fn is not None else b.loss_fn
        if isinstance(lf, str):
            lf = import_callable(lf) if loss_fn is not None else recorded_callable(b, "loss function", lf)
        dev = torch.device(device) if device is not None else recorded_device(b)
        m = m.to(dev)
        ctx = _Ctx(bundle=b, model=m, loss_fn=lf, device=dev, runner=_Runner(max_replays, progress), failing=b.step(b.failing_step), state=b.state())
        if over == "layers":
            out = _bisect_layers(ctx)
        elif over == "precision":
            out = _bisect_precision(ctx)
        elif over == "steps":
            out = _bisect_steps(ctx, threshold)
        else:
            out = _bisect_samples(ctx)
        for w in out["warnings"]:
            logger.warning("bisect: %s", w)
        return out
    finally:
        if own:
            b.close()
