"""Replaying a step under ``torch.compile`` beside the eager replay: does the non-finite value
appear only in compiled code (a known class of bugs: fused kernels, reordered reductions,
lower-precision intermediates, a compiler bug)?

Both replays run bare (no module or op monitor: hooks inside the compiled region would break the
graph and change what is compiled), from the same step-start weights and buffers, the same
batch (or forward inputs and cotangents) and the same RNG states, with the same deterministic
settings. Only the module the step calls differs: the model itself, or ``torch.compile(model,
backend=...)`` sharing its parameters. A program embedded in the bundle with its loss
(:mod:`nanreplay.engine.program`) runs its forward inside the loss, so there the loss function is
compiled (``target`` says which).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from ..core.numerics import any_nonfinite
from ..core.state import load_buffers
from .compare import compare_grads
from .deadline import replay_error
from .program import ProgramModel, program_loss
from .run import ReplayResult, StepInputs, run_step

logger = logging.getLogger(__name__)

__all__ = ["compile_check", "DEFAULT_BACKEND"]

#: the backend ``torch.compile`` uses by default
DEFAULT_BACKEND = "inductor"


def _nonfinite_parts(result: ReplayResult) -> tuple[list[str], str]:
    """What a replay produced that is non-finite (``["loss", "outputs", "gradients"]``, a subset)
    and the kinds seen (``"NaN"``, ``"NaN and +Inf"``, ...; ``""`` when all are finite)."""
    parts = []
    if any(h is not None and not h.finite for h in result.losses):
        parts.append("loss")
    if any(h is not None and not h.finite for h in result.outputs):
        parts.append("outputs")
    bad_grads = [g for g in result.grads.values() if any_nonfinite(g)]
    if bad_grads:
        parts.append("gradients")
    healths = [h for h in list(result.losses) + list(result.outputs) if h is not None]
    nan = any(h.nan for h in healths) or any(bool(torch.isnan(g).any()) for g in bad_grads)
    posinf = any(h.posinf for h in healths) or any(bool(torch.isposinf(g).any()) for g in bad_grads)
    neginf = any(h.neginf for h in healths) or any(bool(torch.isneginf(g).any()) for g in bad_grads)
    kinds = " and ".join(n for n, on in (("NaN", nan), ("+Inf", posinf), ("-Inf", neginf)) if on)
    return parts, kinds


def compile_check(model: torch.nn.Module, inp: StepInputs, *, backend: str = DEFAULT_BACKEND, device: Optional[torch.device] = None) -> dict:
    """Replay the step of ``inp`` twice on ``model`` (step-start weights loaded): eagerly, then
    under ``torch.compile(model, backend=backend)``, and say which is non-finite.

    Args:
        model: the replay model; its weights must hold the step-start state. Its buffers are put
            back to the step-start state after each replay; its ``.grad`` holds the compiled
            replay's gradients afterwards.
        inp: the step (batch or forward inputs and cotangents, RNG states, loss function).
        backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).
        device: where the replay runs.

    Returns:
        The diagnosis' ``compile`` entry (``docs/report.md``)::

            {"backend": "inductor", "target": "model", "eager": False, "compiled": True, "only_under_compile": True,
             "eager_nonfinite": [], "compiled_nonfinite": ["loss", "gradients"], "eager_kinds": None, "compiled_kinds": "NaN",
             "compiled_reproduction": "reproduced exactly", "max_abs_diff": 0.0, "error": None}

        ``eager`` / ``compiled``: whether that replay's loss, outputs or gradients hold a
        non-finite value (``compiled`` is ``None`` when compiling failed: ``error`` says why);
        ``compiled_reproduction``: the compiled replay's gradients against the recorded ones;
        ``max_abs_diff``: the largest difference of the finite gradient values of the two replays;
        ``target``: what was compiled, ``"model"``, or ``"loss function"`` for an embedded
        program exported with its loss.

    Raises:
        ReplayError: the step cannot be replayed at all (the eager replay fails the same way).
    """
    eager = run_step(model, inp, ops=False, device=device, monitors=False)
    load_buffers(model, inp.state.buffers)
    e_parts, e_kinds = _nonfinite_parts(eager)
    program = isinstance(model, ProgramModel) and inp.loss_fn is program_loss
    out: dict[str, Any] = {"backend": backend, "target": "loss function" if program else "model", "eager": bool(e_parts), "compiled": None, "only_under_compile": False,
                           "eager_nonfinite": e_parts, "compiled_nonfinite": None, "eager_kinds": e_kinds or None, "compiled_kinds": None,
                           "compiled_reproduction": None, "max_abs_diff": None, "error": None}
    try:
        if program:
            res = run_step(model, dataclasses.replace(inp, loss_fn=torch.compile(program_loss, backend=backend)), ops=False, device=device,
                           monitors=False)
        else:
            res = run_step(model, inp, ops=False, device=device, monitors=False, runner=torch.compile(model, backend=backend))
    except Exception as e:  # noqa: BLE001 - a backend that cannot compile this model is a finding, not a crash
        replay_error(e)  # the deadline goes through
        logger.info("nanreplay: the compiled replay (backend %s) failed", backend, exc_info=True)
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        return out
    finally:
        load_buffers(model, inp.state.buffers)
    c_parts, c_kinds = _nonfinite_parts(res)
    out.update(compiled=bool(c_parts), only_under_compile=bool(c_parts) and not e_parts, compiled_nonfinite=c_parts,
               compiled_kinds=c_kinds or None, max_abs_diff=compare_grads(eager.grads, res.grads).get("max_abs_diff"))
    if inp.recorded_grads:
        out["compiled_reproduction"] = compare_grads(inp.recorded_grads, res.grads)["verdict"]
    return out
