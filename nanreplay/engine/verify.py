"""Is an exported program faithful to the step it was exported from? One replay of the failing
step on the loaded program, compared with the recorded gradients (:mod:`nanreplay.engine.compare`).
The Recorder drops a program that fails it, and says why in the bundle."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..core.digest import grad_absmax, is_digest
from ..core.rng import ReplayRNG
from .compare import compare_grads
from .program import _first_line, load_program, program_loss
from .run import StepInputs, run_step

__all__ = ["verify_program"]


def verify_program(meta: dict, tensors: dict[str, torch.Tensor], content: Any, loss_fn: Optional[Callable], *,
                   strict: bool = False, rtol: float = 1e-4, private: Optional[bool] = None) -> Optional[str]:
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
    set and put back, for a caller that knows no other thread draws meanwhile)."""
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
            inp = StepInputs(record=content.steps[-1], state=state, recorded_grads=content.grads, loss_fn=lf, scaler=state.extra.get("scaler"),
                             grads_unscaled=(content.reason.get("scaler") or {}).get("grads_unscaled"))
            res = run_step(pm, inp, ops=False, monitors=False)  # only the gradients matter: no module monitor
    except Exception as e:  # noqa: BLE001 - an unfaithful program is dropped, never raised into training
        return f"the exported program could not replay the step ({type(e).__name__}: {_first_line(e)})"
    verdict = compare_grads(content.grads, res.grads)
    if verdict["verdict"] == "not reproduced":
        return (f"the exported program does not reproduce the step's gradients ({verdict.get('detail')}); a custom "
                "torch.autograd.Function's backward, for one, is not part of an exported program")
    if strict and verdict["verdict"] != "reproduced exactly":
        lost = [n for n, r in content.grads.items() if res.grads.get(n) is None
                and (r.nonzero > 0 if is_digest(r) else r.is_floating_point() and bool(r.ne(0).any()))]
        if lost:  # e.g. a custom autograd.Function whose backward the program lacks: no gradient reaches these
            return (f"the exported program gives no gradient to {len(lost)} parameter(s) the step gave one, e.g. {lost[:3]}; a custom "
                    "torch.autograd.Function's backward, for one, is not part of an exported program")
        scale = max((grad_absmax(g) for g in content.grads.values() if is_digest(g) or g.is_floating_point()), default=0.0)
        diff = verdict.get("max_abs_diff")
        if diff is None or not diff <= rtol * scale:
            return f"the exported program's gradients differ from the step's by up to {diff} (largest gradient {scale:.3g})"
    return None
