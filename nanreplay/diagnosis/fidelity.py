"""The verdict ladder of a step the replay does not reproduce: a device fault is a claim with its
evidence, never what is left when nothing else was found.

The recording holds non-finite gradients (or a non-finite loss), the replay of the step is
finite and names no birth. Two answers are possible (``fidelity.verdict``):

* ``device fault`` (cause ``transient``: a suspected silent data corruption), only when every
  rung of :data:`RUNGS` holds: the same code ran (versions, device type, the recorded loss
  function and model code, the compile state as recorded), the recording holds what the replay
  needs (its batch, this rank's own gradients), the replays of the step agree bit for bit with
  each other, they reproduce what the recording kept up to a point (the logged loss, the
  gradients the backward pass produced before), and the recording departs from there in a few
  elements (a fault, not code that ran over every gradient). The first recorded quantity that
  differs is named: which parameter's gradient, or the loss.
* ``not reproduced`` (cause ``unknown``, or ``nondeterminism`` when the replays disagree on
  finiteness): each rung that does not hold adds a :data:`DIFFERENCES` row, what differs between
  recording and replay and what to record or do to reproduce it.

The rungs read only what the diagnosis already computed: its monitored replay and the repeats it
runs anyway (:class:`StepReplays`), the recorded loss and gradients or their digests
(:mod:`nanreplay.core.digest`), the bundle's environment and compile state, and where the replay's
model and loss function came from (``StepInputs.setup``).

Technique: Megatron-LM's RerunStateMachine reruns the step before it calls a fault transient,
and torchtitan's SDC check compares the signatures of repeated runs; here the replays'
gradient digests are those signatures, and the recording's own digests say where it departs.
msprobe's op-level check (the op recomputed on the CPU from its recorded inputs) needs an op's
inputs, which the recording does not keep inside the step: it is not one of these rungs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..core.digest import GradDigest, digest_of, grads_nonfinite, is_digest
from ..core.numerics import as_real, is_float
from ..core.results import Difference, Fidelity, RecordedQuantity
from ..engine.compare import compare_outside
from ..engine.run import ReplayResult, StepInputs
from .compiled import compile_facts

__all__ = ["StepReplays", "DIFFERENCES", "RUNGS", "LOCAL_ELEMENTS", "assess", "recorded_nonfinite"]

#: at most this many recorded non-finite elements the replays hold finite make a local departure
#: (a flipped bit touches one element; code over the gradients, every one it touches: a row, a tensor)
LOCAL_ELEMENTS = 4

#: what can differ between the recording and the replay: kind -> what to record or do to reproduce it
DIFFERENCES: dict[str, str] = {
    "versions": "replay with the recorded versions (nanreplay inspect BUNDLE shows them)",
    "device": "replay on the recorded device type (nanreplay replay --device cuda): kernels differ between devices",
    "model code": "replay with the recorded model (the program embedded in the bundle, or its factory): drop --model-factory",
    "loss function": "replay with the recorded loss function: drop --loss-fn",
    "program vs factory": ("replay with the recorded factory (nanreplay replay --model-factory MODULE:FN, or the in-process "
                           "diagnosis): torch.export fixes Python control flow to the step it traced"),
    "compiled graph": ("replay the compiled graph as recorded (nanreplay replay --compile) and compare its gradients with the "
                       "recording; an eager replay cannot match compiled kernels bit for bit"),
    "inputs not recorded": "record the loss function (Recorder(loss_fn=...)) with record(batch), or capture_cotangent=True",
    "stale inputs": "record with Recorder(copy_batch=True): a recycled input buffer was overwritten after capture",
    "origin detection off": ("keep origin detection on (Recorder(origin_hook=True); it registers no comm hook, so yours runs "
                             "unchanged): this rank's own gradients are then recorded"),
    "reduced gradients": ("train with DistributedDataParallel(gradient_as_bucket_view=False) and DDP's C++ reducer: the bundle then "
                          "holds this rank's own gradients, not the reduced ones"),
    "another rank": "replay the origin rank's bundle: this rank's non-finite values came through the gradient all-reduce",
    "replays not repeated": "replay with the op monitor and counterfactuals on (drop --no-ops): they repeat the step",
    "nondeterministic kernels": ("torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA) in training "
                                 "and replay, then record again"),
    "forward pass": ("look for state the model or the loss function reads outside its parameters, buffers and batch (a global, a "
                     "Python attribute changed per step); if there is none, replay the step on this device and on another"),
    "nothing reproduced": "log the loss (Recorder.log_loss(loss)): a replay then shows it reproduced the forward pass",
    "spread": ("run the code that changes the gradients after backward inside the loss function, or call check_step() before it, "
               "so that the recording holds what the replay computes"),
}


@dataclass
class StepReplays:
    """The replays of the step the ladder compares: the diagnosis' monitored replay first, then
    the repeats. Each is kept as its gradient digests, its losses and whether it was finite;
    ``grads`` holds the first replay's gradients and ``order`` the parameters in the order that
    replay produced their gradients (the backward pass' order). ``compiled``: the replays ran the
    recording's compiled graph as recorded (a compiled replay's evidence: the difference
    ``compiled graph`` then does not apply)."""

    compiled: bool = False
    digests: list[dict[str, GradDigest]] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    finite: list[bool] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def add(self, result: ReplayResult) -> None:
        """Keep one replay (its gradients as digests; the first one's gradients as they are)."""
        if not self.digests:
            self.grads = dict(result.grads)
            seen = [e["param"] for e in result.modules.events if e.get("kind") == "parameter gradient" and e.get("param")]
            self.order = list(dict.fromkeys(seen + [n for n in reversed(list(result.grads))]))
        self.digests.append({n: digest_of(g) for n, g in result.grads.items() if is_float(g)})
        self.losses.append(list(result.loss_values))
        self.finite.append(not result.products_nonfinite())

    @property
    def count(self) -> int:
        return len(self.digests)


@dataclass
class _Ladder:
    """What the rungs read, and what they find."""

    inp: StepInputs
    replays: StepReplays
    compiled: Optional[dict]
    differences: list[Difference] = field(default_factory=list)
    compared: list[RecordedQuantity] = field(default_factory=list)
    first: Optional[RecordedQuantity] = None
    outside: dict[str, Any] = field(default_factory=dict)   # parameter -> compare_outside result
    agree: Optional[bool] = None  # the replays are bit-equal to each other (None: fewer than two)

    def differ(self, kind: str, detail: str) -> bool:
        self.differences.append({"kind": kind, "detail": detail, "record": DIFFERENCES[kind]})
        return False


def _same_code(c: _Ladder) -> bool:
    """The replay ran the recorded code: the same versions and device type, the recorded model and
    loss function (or the live ones, in process), the compile state as recorded."""
    setup = c.inp.setup or {}
    ok = True
    env, now = setup.get("recorded_environment") or {}, setup.get("environment") or {}
    changed = [f"{k} {env[k]} when recorded, {now.get(k)} now" for k in ("torch", "python", "nanreplay", "cuda")
               if k in env and k in now and env[k] != now[k]]
    if changed:
        ok = c.differ("versions", "; ".join(changed))
    if setup.get("recorded_device") and setup.get("device") and setup["recorded_device"] != setup["device"]:
        ok = c.differ("device", f"recorded on {setup['recorded_device']}, replayed on {setup['device']}")
    if setup.get("model") == "given":
        ok = c.differ("model code", f"the replay ran {setup.get('model_source') or 'a model the caller gave'}, not the recorded one")
    if setup.get("loss") == "given":
        ok = c.differ("loss function", "the replay ran a loss function the caller gave, not the recorded one")
    state = c.inp.compile_state
    if isinstance(state, dict) and state.get("compiled") and not c.replays.compiled:
        comp = c.compiled or {}
        seen = ("; the step replayed compiled as recorded is " + ("finite" if comp.get("compiled") is False else "non-finite")
                if comp.get("compiled") is not None else "; no compiled replay of the step ran")
        ok = c.differ("compiled graph", f"{compile_facts(state)}; the replays compared here ran eagerly{seen}")
    return ok


def _inputs_recorded(c: _Ladder) -> bool:
    """The recording holds what the replay needs: the step's batch or cotangent, unchanged since
    capture, and this rank's own gradients."""
    rec, ok = c.inp.record, True
    if not c.inp.uses_loss and not (rec.forwards and all(fw.cotangent is not None for fw in rec.forwards)):
        ok = c.differ("inputs not recorded", "neither the loss function with its batch nor the cotangent at the model's output is "
                      "recorded: only the forward pass was replayed")
    if rec.stale_inputs:
        ok = c.differ("stale inputs", "the recorded inputs were modified in place after capture: the replay fed other values")
    d = (c.inp.reason or {}).get("distributed") or {}
    if d.get("world_size", 1) > 1:
        # how the rank's own values were seen (capture.ddp.RankContext.detection; older bundles: origin_method only)
        det = d.get("detection") or {}
        if det:
            unhooked_shards = d.get("grads") == "sharded" and bool(det.get("why_off") or not det.get("on"))
        else:
            unhooked_shards = d.get("grads") == "sharded" and not str(d.get("origin_method") or "").startswith(("reduce-scatter hook", "local check"))
        if d.get("grads") == "reduced" or unhooked_shards:
            label = "origin detection off" if (det and not det.get("on")) or unhooked_shards or not det else "reduced gradients"
            ok = c.differ(label, f"rank {d.get('rank')} of {d.get('world_size')} recorded its gradients after the "
                          f"{'reduce-scatter' if unhooked_shards else 'all-reduce'} ({d.get('origin_method') or 'no origin hook'}): "
                          "they sum every rank's, the replay computes this rank's own")
        if d.get("origin_ranks") and d.get("rank") not in d["origin_ranks"]:
            ok = c.differ("another rank", f"rank(s) {d['origin_ranks']} were non-finite before the gradient all-reduce, "
                          f"not rank {d.get('rank')}")
    return ok


def _replays_agree(c: _Ladder) -> bool:
    """At least two replays of the step, finite, bit-equal to each other (gradients and losses)."""
    r = c.replays
    if r.count < 2:
        return c.differ("replays not repeated", f"{r.count} replay of the step: whether replays agree was not checked")
    first = r.digests[0]
    differ = [i for i in range(1, r.count) if not _same_replay(first, r.digests[i], r.losses[0], r.losses[i])]
    c.agree = not differ
    if differ:
        params = sorted({n for i in differ for n, d in r.digests[i].items() if n not in first or not d.same_values(first[n])})
        return c.differ("nondeterministic kernels", f"{len(differ)} of {r.count - 1} repeat replays differ bit for bit from the first "
                        f"(rate {len(differ) / (r.count - 1):.2f}; gradients of {len(params)} parameter(s), e.g. {params[:3]})")
    return all(r.finite)


def _same_replay(a: dict[str, GradDigest], b: dict[str, GradDigest], la: list[float], lb: list[float]) -> bool:
    same_loss = len(la) == len(lb) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(la, lb))
    return same_loss and a.keys() == b.keys() and all(a[n].same_values(b[n]) for n in a)


def _reproduces_until(c: _Ladder) -> bool:
    """The replay reproduces what the recording kept, bit for bit, up to a point, and the
    recording departs from there: the logged loss first, then the gradients in the order the
    backward pass produced them. Holds when a quantity before the first difference agrees."""
    c.compared = _loss_quantities(c) + _grad_quantities(c)
    c.first = next((q for q in c.compared if q["agrees"] is False), None)
    if c.first is None:
        return c.differ("nothing reproduced", "no recorded quantity departs from the replays: the recording keeps neither the "
                        "gradients nor a loss that shows where they differ")
    before = c.compared[:c.compared.index(c.first)]
    if any(q["agrees"] for q in before):
        return True
    if c.first["quantity"] == "loss":
        if (c.inp.setup or {}).get("model") == "program":
            c.differ("program vs factory", "the replay ran the program embedded in the bundle, not the model's Python code: a branch "
                     "the Python code takes at this step may differ from the one the program traced")
        return c.differ("forward pass", f"the recorded loss differs from the replays' ({c.first['detail']}), which agree with each "
                        "other: the forward pass or the loss computed something else in training")
    return c.differ("nothing reproduced", f"the first recorded quantity, {c.first['name']}'s gradient, already differs and no loss "
                    "was logged: nothing shows the replay reproduced the forward pass")


def _loss_quantities(c: _Ladder) -> list[RecordedQuantity]:
    """The logged loss against the first replay's (its last micro-batch's, or their sum or mean)."""
    recorded = c.inp.record.loss
    if recorded is None:
        return [{"quantity": "loss", "name": "the step", "agrees": None, "detail": "not logged (Recorder.log_loss)"}]
    if not c.replays.losses or not c.replays.losses[0]:
        return [{"quantity": "loss", "name": "the step", "agrees": None, "detail": "not replayed (no loss function)"}]
    vals = c.replays.losses[0]
    total = math.fsum(vals) if all(math.isfinite(v) for v in vals) else sum(vals)
    candidates = [vals[-1], total, total / len(vals)]
    same = any(v == recorded or (math.isnan(v) and math.isnan(recorded)) for v in candidates)
    name = "the step" if len(vals) == 1 else f"micro-batches 0-{len(vals) - 1}"
    detail = f"recorded {recorded!r}, replayed {vals[-1]!r}" + ("" if len(vals) == 1 else f" (last micro-batch; sum {total!r})")
    return [{"quantity": "loss", "name": name, "agrees": same, "detail": detail}]


def _grad_quantities(c: _Ladder) -> list[RecordedQuantity]:
    recorded, replayed = c.inp.recorded_grads, c.replays.grads
    out: list[RecordedQuantity] = []
    for name in [n for n in c.replays.order if n in recorded] + [n for n in recorded if n not in c.replays.order]:
        r, g = recorded[name], replayed.get(name)
        if g is None or not (is_digest(r) or is_float(r)):
            if g is None and grads_nonfinite([r]):
                out.append({"quantity": "gradient", "name": name, "agrees": False, "detail": "non-finite in the recording, absent in the replay"})
            continue
        res = c.outside[name] = compare_outside(r, g)
        if res.bit_equal and res.recorded_nonfinite == 0:
            out.append({"quantity": "gradient", "name": name, "agrees": True, "detail": "bit-equal"})
            continue
        detail = (_departure(r, g, res.recorded_nonfinite) + "; every other element bit-equal" if res.bit_equal
                  else "finite values differ" + (f", and {res.recorded_nonfinite} element(s) non-finite in the recording" if res.recorded_nonfinite else ""))
        out.append({"quantity": "gradient", "name": name, "agrees": False, "detail": detail})
    return out


def _departure(r: Any, g: torch.Tensor, n: int) -> str:
    """Where a recorded gradient holds NaN/Inf the replay does not: the elements (the first 4),
    what the recording and the replay hold there."""
    where = _where(r)
    flat = as_real(g.detach()).reshape(-1).cpu()
    idx = where.nonzero().flatten()[:4].tolist() if where is not None else []
    shape = list(as_real(g.detach()).shape)
    at = ", ".join(f"{list(_unravel(i, shape))} (replayed {float(flat[i]):.6g})" for i in idx)
    kinds = _kinds(r)
    return f"{kinds} at {n} element(s) in the recording: {at}" + (" ..." if n > len(idx) else "")


def _where(r: Any) -> Optional[torch.Tensor]:
    """The elements a recorded gradient (tensor or digest) holds NaN/Inf at: a flat CPU bool tensor
    of its real view, or ``None`` when there are none."""
    if is_digest(r):
        return r.nonfinite_positions()
    bad = (~torch.isfinite(as_real(r.detach()))).reshape(-1).cpu()
    return bad if bool(bad.any()) else None


def _structured(r: Any) -> bool:
    """Whether a recorded gradient's non-finite elements fill a whole row (its last dimension)
    or the whole tensor: the shape code leaves (a row divided by a zero count), not a fault's."""
    where = _where(r)
    if where is None or int(where.sum()) < 2:
        return False
    if int(where.sum()) == where.numel():
        return True
    last = (list(r.shape) if is_digest(r) else list(as_real(r.detach()).shape))[-1:]
    return bool(last and last[0] > 1 and where.reshape(-1, last[0]).all(dim=1).any())


def _unravel(i: int, shape: list[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(i % s)
        i //= s
    return tuple(reversed(out))


def _kinds(r: Any) -> str:
    if is_digest(r):
        names = [k for k, n in (("NaN", r.nan), ("+Inf", r.posinf), ("-Inf", r.neginf)) if n]
    else:
        x = as_real(r.detach())
        names = [k for k, t in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)) if bool(t(x).any())]
    return " and ".join(names) or "non-finite values"


def _local(c: _Ladder) -> bool:
    """The recording departs in a few elements it holds non-finite, every other element of every
    gradient bit-equal to the replays: a fault touches a few elements; code that ran on the
    gradients after backward (a hook, a rescaling, a manual all-reduce) touches every one it
    changes."""
    if c.first is None or c.first["quantity"] != "gradient":
        return False  # the rung below already said what differs
    bad = {n: o for n, o in c.outside.items() if not (o.bit_equal and o.recorded_nonfinite == 0)}
    elements = sum(o.recorded_nonfinite for o in bad.values())
    rows = [n for n in bad if _structured(c.inp.recorded_grads[n])]
    if all(o.bit_equal for o in bad.values()) and 0 < elements <= LOCAL_ELEMENTS and not rows:
        return True
    return c.differ("spread", f"the recording departs from the replays in {len(bad)} gradient(s) ({elements} element(s) non-finite in "
                    "the recording" + ("" if all(o.bit_equal for o in bad.values()) else ", and finite values that differ")
                    + (f"; whole rows or tensors of {rows[:3]}" if rows else "") + f", e.g. {sorted(bad)[:3]}): more than a "
                    "fault in a few elements")


Rung = tuple[str, Callable[[_Ladder], bool]]

#: the verdict ladder, in order; ``device fault`` only when every rung holds
RUNGS: tuple[Rung, ...] = (
    ("the same code ran", _same_code),
    ("the recording holds the step's inputs and this rank's own gradients", _inputs_recorded),
    ("the replays agree bit for bit", _replays_agree),
    ("the replays reproduce the recording up to a point", _reproduces_until),
    ("the recording departs in a few elements", _local),
)


def assess(inp: StepInputs, replays: StepReplays, compiled: Optional[dict] = None) -> Fidelity:
    """Climb :data:`RUNGS` for a step whose replays are finite while the recording is not.

    Args:
        inp: the step (its recorded loss and gradients or their digests, ``setup``, ``reason``).
        replays: the step's replays (:class:`StepReplays`), the monitored one first.
        compiled: the compile check, when a compiled replay ran.

    Returns:
        the ``fidelity`` entry (``docs/report.md``): the verdict, each rung and whether it holds,
        the recorded quantities compared in execution order, the first that differs, and the
        differences with what to record to reproduce the step.
    """
    c = _Ladder(inp, replays, compiled)
    rungs = [{"rung": name, "holds": bool(check(c))} for name, check in RUNGS]
    return {
        "verdict": "device fault" if all(r["holds"] for r in rungs) else "not reproduced",
        "rungs": rungs,  # type: ignore[typeddict-item]
        "replays": replays.count,
        "finite_replays": sum(replays.finite),
        "agree_bitwise": c.agree,
        "compared": c.compared,
        "first_difference": c.first,
        "differences": c.differences,
    }


def recorded_nonfinite(inp: StepInputs) -> bool:
    """Whether the recording holds a non-finite gradient or loss (what the ladder explains)."""
    loss = inp.record.loss
    return grads_nonfinite(inp.recorded_grads) or (loss is not None and not math.isfinite(loss))

