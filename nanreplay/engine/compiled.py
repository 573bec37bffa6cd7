"""Replaying a step under ``torch.compile`` beside the eager replay: does the non-finite value
appear only in compiled code (a known class of bugs: fused kernels, reordered reductions,
lower-precision intermediates, a compiler bug)?

Both replays run bare (no module or op monitor: hooks inside the compiled region would break the
graph and change what is compiled), from the same step-start weights and buffers, the same
batch (or forward inputs and cotangents) and the same RNG states, with the same deterministic
settings. Only the module the step calls differs: the model itself, or ``torch.compile(model,
backend=...)`` sharing its parameters. A program embedded in the bundle with its loss
(:mod:`nanreplay.engine.program`) runs its forward inside the loss, so there the loss function is
compiled (``target`` says which). Replayed as a recording ran (``meta["compile"]``,
:func:`recorded_compile`), the recorded backend, inductor mode and compiled submodules are used;
a backend a bundle names runs only when it is one of :data:`BUNDLE_BACKENDS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Optional, Sequence

import torch

from ..core.numerics import any_nonfinite
from ..core.rng import without_private_generators
from ..core.state import load_buffers
from .compare import compare_grads
from .deadline import replay_error
from .program import ProgramModel, program_loss
from .run import ReplayResult, StepInputs, run_step

logger = logging.getLogger(__name__)

__all__ = ["compile_check", "recorded_compile", "eager_modules", "DEFAULT_BACKEND", "BUNDLE_BACKENDS", "MODES"]

#: the backend ``torch.compile`` uses by default
DEFAULT_BACKEND = "inductor"

#: the backends a replay runs because a bundle names them (``meta["compile"]``): torch's own.
#: A bundle is data: a backend name outside this list (a third-party backend registered by an
#: entry point, a callable's import path) is reported, never looked up; ``--compile-backend``
#: runs it when the user names it.
BUNDLE_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition", "eager", "cudagraphs")

#: the inductor modes a bundle may name
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def recorded_compile(state: Optional[dict]) -> tuple[Optional[dict], Optional[str]]:
    """How to replay compiled the way a recording ran, from its ``meta["compile"]``.

    Returns:
        ``(options, None)`` with ``options = {"backend", "mode", "modules"}`` for
        :func:`compile_check`; ``(None, why)`` when the recording was compiled but its backend
        is not one a bundle may name (:data:`BUNDLE_BACKENDS`); ``(None, None)`` when it was
        not compiled (or the bundle does not say).
    """
    if not isinstance(state, dict) or not state.get("compiled"):
        return None, None
    backend = state.get("backend") or DEFAULT_BACKEND
    if backend not in BUNDLE_BACKENDS:
        return None, (f"the recording compiled with backend {str(backend)[:200]!r}, not one a bundle may name ({', '.join(BUNDLE_BACKENDS)}); "
                      "replay it compiled with --compile --compile-backend NAME")
    mode = state.get("mode") if backend == "inductor" and state.get("mode") in MODES else None
    modules = [m for m in state.get("modules") or [] if isinstance(m, str)]
    return {"backend": backend, "mode": mode, "modules": modules}, None


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


def _submodules(model: torch.nn.Module, modules: Sequence[str]) -> Optional[list[torch.nn.Module]]:
    """The submodules of ``model`` at ``modules`` (FQNs), or ``None`` when the whole model is to
    be compiled: ``""`` among them, none given, or one that this model lacks (an embedded
    program has no submodules)."""
    if not modules or "" in modules or isinstance(model, ProgramModel):
        return None
    try:
        return [model.get_submodule(m) for m in modules]
    except AttributeError:
        return None


@contextlib.contextmanager
def _compiled_submodules(subs: list[torch.nn.Module], backend: str, mode: Optional[str]) -> Iterator[None]:
    """Each of ``subs`` compiled as ``module.compile()`` does, for the block; put back after."""
    saved = [(m, m.__dict__.get("_compiled_call_impl")) for m in subs]
    try:
        for m in subs:
            m._compiled_call_impl = torch.compile(m._call_impl, backend=backend, mode=mode)
        yield
    finally:
        for m, old in saved:
            m._compiled_call_impl = old


@contextlib.contextmanager
def eager_modules(model: torch.nn.Module) -> Iterator[None]:
    """Every module of ``model`` compiled with ``module.compile()`` runs eagerly for the block
    (its ``_compiled_call_impl`` set aside, put back after): a replay is eager unless it says
    otherwise (the live model of an in-process diagnosis, a factory that compiles its model)."""
    saved = [(m, m.__dict__["_compiled_call_impl"]) for m in model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
    try:
        for m, _ in saved:
            m._compiled_call_impl = None
        yield
    finally:
        for m, impl in saved:
            m._compiled_call_impl = impl


def _compiled_replay(model: torch.nn.Module, inp: StepInputs, *, program: bool, subs: Optional[list[torch.nn.Module]], backend: str,
                     mode: Optional[str], device: Optional[torch.device]) -> ReplayResult:
    """The step replayed bare with the loss function (an embedded program), the submodules
    ``subs`` or the whole model compiled."""
    if program:
        return run_step(model, dataclasses.replace(inp, loss_fn=torch.compile(program_loss, backend=backend, mode=mode)), ops=False,
                        device=device, monitors=False)
    if subs:
        with _compiled_submodules(subs, backend, mode):
            return run_step(model, inp, ops=False, device=device, monitors=False, runner=model)
    return run_step(model, inp, ops=False, device=device, monitors=False, runner=torch.compile(model, backend=backend, mode=mode))


def compile_check(model: torch.nn.Module, inp: StepInputs, *, backend: str = DEFAULT_BACKEND, mode: Optional[str] = None,
                  modules: Sequence[str] = (), device: Optional[torch.device] = None) -> dict:
    """Replay the step of ``inp`` twice on ``model`` (step-start weights loaded): eagerly, then
    under ``torch.compile(model, backend=backend, mode=mode)``, and say which is non-finite.

    Args:
        model: the replay model; its weights must hold the step-start state. Its buffers are put
            back to the step-start state after each replay; its ``.grad`` holds the compiled
            replay's gradients afterwards.
        inp: the step (batch or forward inputs and cotangents, RNG states, loss function).
        backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).
        mode: the inductor mode (``"max-autotune"``, ...; ``None``: the default).
        modules: FQNs of the submodules to compile instead of the whole model, as the recording
            did (``meta["compile"]["modules"]``); the whole model when empty, when ``""`` is
            among them or when the model lacks one.
        device: where the replay runs.

    Returns:
        The diagnosis' ``compile`` entry (``docs/report.md``)::

            {"backend": "inductor", "target": "model", "eager": False, "compiled": True, "only_under_compile": True,
             "eager_nonfinite": [], "compiled_nonfinite": ["loss", "gradients"], "eager_kinds": None, "compiled_kinds": "NaN",
             "compiled_reproduction": "reproduced exactly", "max_abs_diff": 0.0, "error": None, "mode": None, "automatic": False}

        ``eager`` / ``compiled``: whether that replay's loss, outputs or gradients hold a
        non-finite value (``compiled`` is ``None`` when compiling failed: ``error`` says why);
        ``compiled_reproduction``: the compiled replay's gradients against the recorded ones;
        ``max_abs_diff``: the largest difference of the finite gradient values of the two replays;
        ``target``: what was compiled, ``"model"``, ``"modules a, b"`` (``modules``), or
        ``"loss function"`` for an embedded program exported with its loss; ``mode``: the
        inductor mode, or ``None``; ``automatic``: run by the diagnosis because the recording ran
        compiled (:mod:`nanreplay.diagnosis.compiled`), not asked for.

    Raises:
        ReplayError: the step cannot be replayed at all (the eager replay fails the same way).
    """
    eager = run_step(model, inp, ops=False, device=device, monitors=False)
    load_buffers(model, inp.state.buffers)
    e_parts, e_kinds = _nonfinite_parts(eager)
    program = isinstance(model, ProgramModel) and inp.loss_fn is program_loss
    subs = None if program else _submodules(model, modules)
    target = "loss function" if program else ("modules " + ", ".join(modules) if subs else "model")
    out: dict[str, Any] = {"backend": backend, "target": target, "eager": bool(e_parts), "compiled": None, "only_under_compile": False,
                           "eager_nonfinite": e_parts, "compiled_nonfinite": None, "eager_kinds": e_kinds or None, "compiled_kinds": None,
                           "compiled_reproduction": None, "max_abs_diff": None, "error": None, "mode": mode, "automatic": False}
    try:
        with without_private_generators() as bare:
            if not bare:
                raise RuntimeError("a Python dispatch mode is active around the replay: Dynamo does not trace under one, "
                                   "so the compiled replay would run eagerly")
            res = _compiled_replay(model, inp, program=program, subs=subs, backend=backend, mode=mode, device=device)
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
