"""The recording ran under ``torch.compile`` and the eager replay does not reproduce it: replay
the step compiled the way training ran (issue 19, check 1b of "not reproduced").

The order of the not-reproduced checks (``docs/report.md``): the recorded forward inputs, then
this, then the verdict ladder (:mod:`nanreplay.diagnosis.fidelity`: repeats on the same device
compared bit for bit with each other and with the recording; a recording that ran compiled is its
difference ``compiled graph`` until a compiled replay's evidence stands in for the eager one). The compile
state comes from the bundle (``meta["compile"]``, written by :mod:`nanreplay.capture.compiled`);
its backend runs only when it is one a bundle may name
(:data:`nanreplay.engine.compiled.BUNDLE_BACKENDS`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ..core.digest import grads_nonfinite
from ..core.state import load_buffers
from ..engine.compiled import compile_check, recorded_compile
from ..engine.deadline import replay_error
from ..engine.run import StepInputs

logger = logging.getLogger(__name__)

__all__ = ["replay_as_recorded", "compile_facts", "compile_evidence"]


def compile_facts(state: Optional[dict]) -> str:
    """What the bundle says of the recording's compile state, in words."""
    if not isinstance(state, dict):
        return "the bundle does not say whether the model ran under torch.compile (written before nanreplay recorded it)"
    if not state.get("compiled"):
        return "the model ran eagerly (not under torch.compile) when the step was recorded"
    mods = [m or "the model" for m in state.get("modules") or []]
    return (f"the model ran under torch.compile (backend {state.get('backend')}" + (f", mode {state['mode']}" if state.get("mode") else "")
            + (f"; compiled: {', '.join(mods[:8])}" + (f" and {len(mods) - 8} more" if len(mods) > 8 else "") if mods else "") + ")")


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
    return f"{facts}; the step replayed under torch.compile ({how}, {compiled.get('target')}) is {said}"


def replay_as_recorded(f: Any, repro: dict, model: torch.nn.Module, inp: StepInputs, device: Optional[torch.device],
                       say: Callable[[str], None]) -> None:
    """``f``: the :class:`~nanreplay.diagnosis.classify.Features` of the step (this module is
    imported by ``classify``, so it is not named here). No birth, recorded gradients non-finite,
    the eager replay finite, and the recording
    compiled: replay the step compiled as recorded (backend, mode, modules) into ``f.compiled``
    (the ``compile`` entry; ``automatic`` true). A backend the bundle may not name, or a replay
    that raised, leaves ``f.compiled`` as it was and says why in ``f.evidence`` / ``f.errors``."""
    if f.compiled is not None or f.phase != "none" or repro.get("verdict") != "not reproduced" or not grads_nonfinite(inp.recorded_grads):
        return
    opts, refused = recorded_compile(inp.compile_state)
    if refused:
        f.evidence.append(refused)
        return
    if opts is None:
        return
    say(f"the eager replay is finite and the recording ran compiled: replaying step {inp.record.step} under torch.compile "
        f"(backend {opts['backend']}{', mode ' + opts['mode'] if opts['mode'] else ''})")
    try:
        res = compile_check(model, inp, backend=opts["backend"], mode=opts["mode"], modules=opts["modules"], device=device)
    except Exception as e:
        f.errors.append({"replay": "compiled", "error": replay_error(e)})
        return
    finally:
        load_buffers(model, inp.state.buffers)
    res["automatic"] = True
    f.compiled = res
