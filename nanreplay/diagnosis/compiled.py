"""The step replayed under ``torch.compile`` as the recording compiled it, and what the diagnosis
reads of it: the ``compile`` entry (:func:`nanreplay.engine.compiled.compile_check`), the
``compiler`` verdict's detail and evidence, the samples a compiled culprit names, and the facts
a not-reproduced verdict rests on (issue 19, check 1b of "not reproduced").

Two ways in. Asked (``replay(..., compile=True or a backend)``, ``nanreplay replay --compile``,
``--compile-backend NAME``: :func:`compile_requested`): the recording's backend, mode, options
and compiled modules when the bundle says the recording ran compiled, else inductor; a backend
named adds a column to the comparison, it does not replace the recording's. On its own
(:func:`replay_as_recorded`): the eager replay does not reproduce a step the recording ran
compiled. Either way the entry says whether it replayed the recording's compile state
(``replayed_as_recorded``) and what differs (``differs``), for the verdict: a compiled replay
that is finite is "not reproduced" with those differences, never evidence of a device fault
(:func:`compile_agrees`).

The order of the not-reproduced checks (``docs/report.md``): the recorded forward inputs, then
this, then repeats on the same device (nondeterminism), then a float64 reference. The compile
state comes from the bundle (``meta["compile"]``, written by :mod:`nanreplay.capture.compiled`);
its backend runs only when it is one a bundle may name
(:data:`nanreplay.engine.compiled.BUNDLE_BACKENDS`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.digest import grads_nonfinite
from ..core.state import load_buffers
from ..engine.compiled import DEFAULT_BACKEND, compile_check, recorded_compile
from ..engine.deadline import replay_error
from ..engine.run import StepInputs

logger = logging.getLogger(__name__)

__all__ = ["replay_as_recorded", "compile_requested", "compile_facts", "compile_evidence", "compile_agrees", "compiler_verdict",
           "compiled_samples"]

#: how the samples of a compiled culprit are found (``samples.method``)
SAMPLES_METHOD = "non-finite rows of the compiled op's output"


def compile_facts(state: Optional[dict]) -> str:
    """What the bundle says of the recording's compile state, in words."""
    if not isinstance(state, dict):
        return "the bundle does not say whether the model ran under torch.compile (written before nanreplay recorded it)"
    if not state.get("compiled"):
        return "the model ran eagerly (not under torch.compile) when the step was recorded"
    mods = [m or "the model" for m in state.get("modules") or []]
    opts = state.get("options") or {}
    return (f"the model ran under torch.compile (backend {state.get('backend')}" + (f", mode {state['mode']}" if state.get("mode") else "")
            + (f", options {', '.join(f'{k}={v}' for k, v in list(opts.items())[:6])}" if opts else "")
            + (f", dynamic={state['dynamic']}" if isinstance(state.get("dynamic"), bool) else "")
            + (", fullgraph=True" if state.get("fullgraph") is True else "")
            + (f"; compiled: {', '.join(mods[:8])}" + (f" and {len(mods) - 8} more" if len(mods) > 8 else "") if mods else "") + ")")


def _columns(compiled: dict) -> str:
    """``aot_eager finite, inductor NaN in loss and gradients``: every compiled replay of the
    comparison, in the compiler's pipeline order."""
    said = []
    for row in compiled.get("backends") or []:
        if row.get("compiled") is None:
            said.append(f"{row['backend']} failed ({row.get('error')})")
        elif row.get("compiled"):
            said.append(f"{row['backend']} {row.get('kinds') or 'non-finite'} in {' and '.join(row.get('nonfinite') or [])}")
        else:
            said.append(f"{row['backend']} finite")
    return ", ".join(said)


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _operands_phrase(c: dict) -> str:
    """Each operand's compiled and eager value at the culprit's first non-finite position."""
    said = []
    for o in c.get("operands") or []:
        if o.get("compiled") is None:
            continue
        name = o["node"] + ("" if o["node"].startswith(o["op"]) else f" ({o['op']})")
        said.append(f"its operand {name} is {_num(o['compiled'])}" + (f" compiled, {_num(o['eager'])} eagerly" if o.get("eager") is not None else ""))
    return ("at its first non-finite element " + "; ".join(said)) if said else ""


def compiler_verdict(f: Any) -> tuple[str, list[str]]:
    """The ``compiler`` cause's detail and evidence, from ``f.compiled`` (``f``: the
    :class:`~nanreplay.diagnosis.classify.Features`)."""
    c = f.compiled or {}
    cul = c.get("culprit")
    ev = [f"the step replayed eagerly is finite; under torch.compile, by backend: {_columns(c)}"]
    if c.get("stage"):
        ev.append(f"the first compiler stage whose replay is non-finite: {c['stage']} ({c.get('stage_detail')}, backend {c.get('stage_backend')})")
    if c.get("compiled_reproduction"):
        ev.append(f"the compiled replay against the recorded gradients: {c['compiled_reproduction']}")
    if c.get("automatic"):
        ev.append(f"{compile_facts(f.compile_state)}: the eager replay did not reproduce the step, so it was replayed compiled the same way")
    if cul:
        how = (f"compiling parts of the {cul.get('graph')} graph ({cul.get('compilations')} compilations) and comparing each with the "
               "same part run eagerly" if cul.get("stage") == "code generation" else
               f"running the captured {cul.get('graph')} graph node by node")
        ev.append(f"found by {how}: node {cul.get('node')} ({cul.get('aten')}) is the first whose value is non-finite")
    elif c.get("localize_error"):
        ev.append(f"the compiled region was not searched to the op: {c['localize_error']}")
    ev.extend(c.get("differs") or [])
    if not cul:
        return ("the non-finite value appears only in compiled code: a compiler bug or a numerics difference of the compiled "
                f"kernels (fusion, reordered reductions, lower-precision intermediates), from {c.get('stage') or 'an unknown stage'}"), ev
    op, kinds, ops = cul.get("op"), cul.get("kinds") or "a non-finite value", _operands_phrase(cul)
    if cul.get("stage") == "code generation":
        return (f"the compiled kernel of {op} gives {kinds} where the same graph run with eager kernels is finite"
                + (f" ({ops})" if ops else "") + ": fused, reordered or lower-precision arithmetic rounds its operands differently, "
                "onto the op's singular point"), ev
    return (f"{op} gives {kinds} in the graph the compiler captured ({c.get('stage_detail')}), run with eager kernels: the captured "
            "graph computes what the eager code does not (a decomposition, a functionalized op, or code that runs only while "
            "tracing)"), ev


def compiled_samples(compiled: Optional[dict], batch: Optional[int]) -> Optional[dict]:
    """The samples a compiled culprit names (``diagnosis.samples``): the non-finite rows of its
    output along the batch dimension of ``batch`` rows; ``None`` without a culprit or where its
    output has no such dimension."""
    c = (compiled or {}).get("culprit") or {}
    rows = c.get("samples")
    if not rows or batch is None or rows.get("size") != batch:
        return None
    out = {"indices": list(rows.get("indices") or []), "count": int(rows.get("count") or 0), "batch_size": batch, "method": SAMPLES_METHOD,
           "batch_level": False, "warnings": []}
    if (c.get("calls") or 1) > 1:  # the graph ran once per micro-batch: the call the rows come from
        out["micro_batch"] = c.get("call")
    if batch > 1 and out["count"] == batch:
        out.update(indices=[], batch_level=True, reason="every sample's row of the compiled op's output is non-finite")
    return out


def compile_evidence(state: Optional[dict], compiled: Optional[dict]) -> str:
    """The not-reproduced verdicts' line on the compile check: what the bundle says and what the
    compiled replay (when one ran) showed."""
    facts = compile_facts(state)
    if compiled is None:
        if isinstance(state, dict) and state.get("compiled"):
            return f"{facts}; no compiled replay of the step ran"
        return facts + ("" if isinstance(state, dict) else ": nanreplay replay --compile checks the compiled step")
    how = f"backend {compiled.get('backend')}" + (f", mode {compiled['mode']}" if compiled.get("mode") else "")
    if compiled.get("compiled") is None:
        return f"{facts}; the step could not be replayed compiled ({how}): {compiled.get('error')}"
    said = "finite too" if not compiled.get("compiled") else f"non-finite ({', '.join(compiled.get('compiled_nonfinite') or [])})"
    differs = compiled.get("differs") or []
    return (f"{facts}; the step replayed under torch.compile ({how}, {compiled.get('target')}) is {said}"
            + (f"; what differs from the recording: {'; '.join(differs)}" if differs else ""))


def compile_agrees(state: Optional[dict], compiled: Optional[dict]) -> bool:
    """Whether the compile check leaves room for a device verdict: only when the recording ran
    eagerly (or the bundle does not say). A recording that ran compiled and a compiled replay
    that is finite is "not reproduced" with what differs between the recorded and the replayed
    compiled code (``compile["differs"]``: the kernels inductor chose, options, dynamic shapes),
    never a hardware fault on that alone."""
    return not (isinstance(state, dict) and state.get("compiled"))


def _differs(state: Optional[dict], opts: Optional[dict], entry: dict) -> tuple[Optional[bool], list[str]]:
    """Whether ``entry``'s main replay compiled what the recording compiled, the way it did
    (``None``: the bundle does not say how it ran), and what differs (in words)."""
    if not isinstance(state, dict):
        return None, ["the bundle does not say whether or how the recording compiled the model (written before nanreplay recorded it)"]
    if not state.get("compiled"):
        return False, ["the recording ran eagerly: the compiled replays are a comparison, not the recorded code"]
    if opts is None or entry.get("backend") != opts["backend"]:
        return False, [f"the main compiled replay used backend {entry.get('backend')}, the recording {state.get('backend')}"]
    out = []
    if opts.get("skipped_options"):
        out.append(f"the recording's inductor options {', '.join(opts['skipped_options'][:8])} were not replayed (a bundle may not set them)")
    want = [m for m in opts.get("modules") or [] if m]
    if want and "" not in (opts.get("modules") or []) and entry.get("target") == "model":
        out.append(f"the recording compiled modules {', '.join(want[:8])}, which the replay model lacks: its whole forward was compiled")
    faithful = not out
    if entry.get("compiled") is False:
        out.append("the step replayed compiled" + (" as recorded" if faithful else "") + " is finite: the recorded kernels may still "
                   "differ (autotuning choices, a recompilation for dynamic shapes, another device or torch version)")
    return faithful, out


def _run(model: torch.nn.Module, inp: StepInputs, opts: dict, also: Sequence[str], device: Optional[torch.device]) -> dict:
    try:
        return compile_check(model, inp, backend=opts["backend"], mode=opts.get("mode"), modules=opts.get("modules") or (),
                             options=opts.get("options"), dynamic=opts.get("dynamic"), fullgraph=bool(opts.get("fullgraph")),
                             also=also, device=device)
    finally:
        load_buffers(model, inp.state.buffers)


def compile_requested(model: torch.nn.Module, inp: StepInputs, compile: Union[bool, str, Sequence[str]], device: Optional[torch.device],
                      say: Callable[[str], None]) -> dict:
    """The compile check a user asked for (``replay(..., compile=...)``): ``True`` for the
    recording's compile state (else inductor), a backend name or a list of them to add columns.
    The main backend is the recording's when the bundle names one it may, else the first backend
    named, else inductor."""
    named = [compile] if isinstance(compile, str) else [] if isinstance(compile, bool) else [b for b in compile if isinstance(b, str)]
    recorded, _ = recorded_compile(inp.compile_state)
    opts = recorded or {"backend": named[0] if named else DEFAULT_BACKEND, "modules": []}
    also = [b for b in named if b != opts["backend"]]
    backends = ", ".join(dict.fromkeys([opts["backend"], "aot_eager", *also]))
    say(f"replaying step {inp.record.step} eagerly and under torch.compile (backends {backends})")
    res = _run(model, inp, opts, also, device)
    res["replayed_as_recorded"], res["differs"] = _differs(inp.compile_state, recorded, res)
    return res


def replay_as_recorded(f: Any, repro: dict, model: torch.nn.Module, inp: StepInputs, device: Optional[torch.device],
                       say: Callable[[str], None]) -> None:
    """``f``: the :class:`~nanreplay.diagnosis.classify.Features` of the step (this module is
    imported by ``classify``, so it is not named here). No birth, recorded gradients non-finite,
    the eager replay finite, and the recording compiled: replay the step compiled as recorded
    (backend, mode, options, modules) into ``f.compiled`` (the ``compile`` entry; ``automatic``
    true). A backend the bundle may not name, or a replay that raised, leaves ``f.compiled`` as
    it was and says why in ``f.evidence`` / ``f.errors``."""
    if f.compiled is not None or f.phase != "none" or repro.get("verdict") != "not reproduced" or not grads_nonfinite(inp.recorded_grads):
        return
    opts, refused = recorded_compile(inp.compile_state)
    if refused:
        f.evidence.append(refused)
        return
    if opts is None:
        return
    say(f"the eager replay is finite and the recording ran compiled: replaying step {inp.record.step} under torch.compile "
        f"(backend {opts['backend']}{', mode ' + opts['mode'] if opts['mode'] else ''}) beside aot_eager")
    try:
        res = _run(model, inp, opts, (), device)
    except Exception as e:
        f.errors.append({"replay": "compiled", "error": replay_error(e)})
        return
    res["automatic"] = True
    res["replayed_as_recorded"], res["differs"] = _differs(inp.compile_state, opts, res)
    f.compiled = res
