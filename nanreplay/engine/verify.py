"""Is an exported program faithful to the step it was exported from? One replay of the failing
step on the loaded program, compared with the recorded gradients (:mod:`nanreplay.engine.compare`).
Where the recording itself does not reproduce (a transient or device fault, random draws made on
a device the replay lacks), the program is compared with an eager replay of the same step on the
live model instead (:func:`eager_grads`): a program is faithful to the model's code, not to what
the hardware did once. The Recorder drops a program that fails, and says why in the bundle."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..core.digest import grad_absmax, is_digest
from ..core.rng import ReplayRNG
from ..core.state import load_buffers
from .compare import compare_grads
from .compiled import eager_modules
from .program import _first_line, load_program, program_loss
from .run import StepInputs, preserve_live, run_step

__all__ = ["verify_program", "eager_grads", "NOT_REPRODUCED", "RTOL"]

#: how :func:`verify_program`'s answer begins when the program's replay does not reproduce the
#: recorded gradients (the caller may then compare it with an eager replay: :func:`eager_grads`)
NOT_REPRODUCED = "the exported program does not reproduce the step's gradients"
#: the largest difference of finite gradients a strict comparison allows, times the largest gradient
RTOL = 1e-4


def _inputs(content: Any, loss_fn: Optional[Callable]) -> StepInputs:
    return StepInputs(record=content.steps[-1], state=content.state, recorded_grads=content.grads, loss_fn=loss_fn,
                      scaler=content.state.extra.get("scaler"), grads_unscaled=(content.reason.get("scaler") or {}).get("grads_unscaled"))


def eager_grads(model: torch.nn.Module, content: Any, loss_fn: Optional[Callable]) -> dict[str, torch.Tensor]:
    """The gradients of one bare eager replay of ``content``'s failing step on the live ``model``
    (its weights the step's pre-step weights, as at the dump), by FQN: copies, on the
    parameters' devices and dtypes. The live gradients, buffers, module modes and RNG states are
    put back (:func:`~nanreplay.engine.run.preserve_live`). Cost: one forward and backward pass.

    Raises:
        Exception: whatever the replay raises (the caller drops the program)."""
    with preserve_live(model), eager_modules(model):
        load_buffers(model, content.state.buffers)
        res = run_step(model, _inputs(content, loss_fn), ops=False, monitors=False)
    return dict(res.grads)


def verify_program(meta: dict, tensors: dict[str, torch.Tensor], content: Any, loss_fn: Optional[Callable], *,
                   strict: bool = False, rtol: float = RTOL, private: Optional[bool] = None,
                   reference: Optional[dict[str, torch.Tensor]] = None) -> Optional[str]:
    """Replay the failing step of ``content`` (a :class:`~nanreplay.format.records.BundleContent`)
    on the program it was exported to, and say why the program is unfaithful (its gradients do not
    reproduce the recorded ones, e.g. a custom ``torch.autograd.Function`` whose backward is not
    part of an exported program), or ``None`` when it reproduces them. Touches no live tensor:
    weights are read, buffers copied, and random draws come from a
    :class:`~nanreplay.core.rng.ReplayRNG` (no other thread's generator consumed or rewound).

    ``strict``: also call the program unfaithful when a nonzero recorded gradient is absent in its
    replay, or the finite gradients differ by more than ``rtol`` times the largest recorded one (for a finite step, where the non-finite pattern
    alone says nothing: :mod:`nanreplay.capture.program_cache` verifies at the first finite step).
    ``private``: :class:`~nanreplay.core.rng.ReplayRNG`'s (``False``: the process-wide generators,
    set and put back, for a caller that knows no other thread draws meanwhile).
    ``reference``: gradients to compare with instead of the recorded ones (:func:`eager_grads`,
    where the recording did not reproduce), strictly (as ``strict``)."""
    state = content.state

    def get(key: str) -> torch.Tensor:
        if key.startswith("state/params/"):
            return state.params[key[len("state/params/"):]].detach()
        if key.startswith("state/buffers/"):
            return state.buffers[key[len("state/buffers/"):]].detach().clone()
        return tensors[key]

    try:
        with ReplayRNG(private=private):
            pm = load_program(meta, get, trusted=True)  # this process exported it: no verifier, no guard
            lf = program_loss if pm.kind == "loss" else loss_fn
            res = run_step(pm, _inputs(content, lf), ops=False, monitors=False)  # only the gradients matter: no module monitor
    except Exception as e:  # noqa: BLE001 - an unfaithful program is dropped, never raised into training
        return f"the exported program could not replay the step ({type(e).__name__}: {_first_line(e)})"
    if reference is not None:
        return _judge(reference, res.grads, True, rtol, "an eager replay of the step")
    return _judge(content.grads, res.grads, strict, rtol, "the step")


def _judge(expected: dict, grads: dict[str, torch.Tensor], strict: bool, rtol: float, of: str) -> Optional[str]:
    """Why the program's replayed ``grads`` are not ``expected``, the gradients ``of`` the step
    (recorded gradients or digests) or of an eager replay of it, or ``None``."""
    verdict = compare_grads(expected, grads)
    if verdict["verdict"] == "not reproduced":  # of="the step": NOT_REPRODUCED
        return (f"the exported program does not reproduce {of}'s gradients ({verdict.get('detail')}); a custom "
                "torch.autograd.Function's backward, for one, is not part of an exported program")
    if strict and verdict["verdict"] != "reproduced exactly":
        lost = [n for n, r in expected.items() if grads.get(n) is None
                and (r.nonzero > 0 if is_digest(r) else r.is_floating_point() and bool(r.ne(0).any()))]
        if lost:  # e.g. a custom autograd.Function whose backward the program lacks: no gradient reaches these
            return (f"the exported program gives no gradient to {len(lost)} parameter(s) {of} gave one, e.g. {lost[:3]}; a custom "
                    "torch.autograd.Function's backward, for one, is not part of an exported program")
        scale = max((grad_absmax(g) for g in expected.values() if is_digest(g) or g.is_floating_point()), default=0.0)
        diff = verdict.get("max_abs_diff")
        if diff is None or not diff <= rtol * scale:
            return f"the exported program's gradients differ from {of}'s by up to {diff} (largest gradient {scale:.3g})"
    return None
