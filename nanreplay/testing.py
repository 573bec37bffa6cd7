"""A regression test from a bundle: the recorded failing step, replayed on the code as it is now.

Once a NaN is fixed, the bundle that caught it is the test that keeps it fixed::

    from nanreplay.testing import assert_replays_finite

    def test_step_3_stays_finite():
        assert_replays_finite("nanreplay_bundles/nanreplay-step3.h5", model_factory="model:fixed")

``nanreplay check BUNDLE --model-factory mod:fixed`` is the same check from the shell (exit 0:
finite now, 3: still non-finite).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from .core.allowlist import Allowlist
from .core.numerics import any_nonfinite, kinds
from .engine.run import StepInputs, run_step
from .core.jsonable import unfnum
from .engine.sandbox import SandboxLimits, conforming, sandbox_plan
from .engine.state import ReplayRequest, load_state, opened_subject
from .format.bundle import Bundle

__all__ = ["check_finite", "assert_replays_finite"]


def check_finite(bundle: Union[str, Path, Bundle], *, model: Optional[torch.nn.Module] = None, model_factory: Union[str, Callable, None] = None,
                 loss_fn: Union[str, Callable, None] = None, device: Union[str, torch.device, None] = None, trust: bool = False,
                 import_script: bool = False, sandbox: Optional[SandboxLimits] = None) -> dict:
    """Replay the bundle's failing step once, bare (no monitors), with the recorded weights,
    batch and RNG states, on ``model`` / ``model_factory`` (the fixed code; default: the
    recorded model under the trust rule of :func:`nanreplay.replay`).

    An untrusted bundle's embedded program replays in the sandbox (``sandbox``: its limits), as
    for :func:`nanreplay.replay`.

    Returns:
        ``{"step", "finite" (bool), "loss" (float or None: the first replayed loss),
        "nonfinite" (which of ``loss``, ``outputs``, ``gradients`` are not finite)}``.
    """
    request = ReplayRequest(model=model, model_factory=model_factory, loss_fn=loss_fn, use_loss_fn=True, device=device, trust=trust,
                            import_script=import_script)
    with sandbox_plan(bundle, request) as (b, plan):
        if plan is None:
            return _check(b, request)
        out, _ = plan.run(lambda req, relay: _check(b, req), limits=sandbox)
    out = conforming(out, _CHECK_SCHEMA, plan.path)
    out["loss"] = unfnum(out["loss"])  # "nan" / "inf" as JSON carries them, a float again
    return out


_FLOAT = {"anyOf": [{"type": "number"}, {"enum": ["nan", "inf", "-inf"]}, {"type": "null"}]}
#: the result of :func:`check_finite`, as a sandboxed replay sends it
_CHECK_SCHEMA = {"type": "object", "required": ["step", "finite", "loss", "nonfinite", "kinds"], "additionalProperties": False,
                 "properties": {"step": {"type": "integer"}, "finite": {"type": "boolean"}, "loss": _FLOAT,
                                "nonfinite": {"type": "array", "items": {"enum": ["loss", "outputs", "gradients"]}},
                                "kinds": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}


def _check(bundle: Union[str, Path, Bundle], request: ReplayRequest) -> dict:
    """The body of :func:`check_finite`: in this process, or in the sandbox's child."""
    with opened_subject(bundle, request) as (b, subject, dev):
        state = b.state()
        load_state(subject.model, state)
        reason = dict(b.meta.get("reason") or {})
        inp = StepInputs(record=b.step(b.failing_step), state=state, recorded_grads={}, loss_fn=subject.loss_fn, allow=Allowlist([]),
                         scaler=state.extra.get("scaler"), grads_unscaled=(reason.get("scaler") or {}).get("grads_unscaled"), reason=reason)
        res = run_step(subject.model, dataclasses.replace(inp), ops=False, device=dev)
        bad = [name for name, hs in (("loss", res.losses), ("outputs", res.outputs)) if any(h is not None and not h.finite for h in hs)]
        if any_nonfinite(res.grads.values()):
            bad.append("gradients")
        loss = res.loss_values[0] if res.loss_values else None
        return {"step": b.failing_step, "finite": not bad, "loss": loss, "nonfinite": bad,
                "kinds": kinds(res.losses[0]) if res.losses and res.losses[0] is not None else None}


def assert_replays_finite(bundle: Union[str, Path, Bundle], **options: Any) -> dict:
    """Assert that the bundle's failing step now replays finite (options as :func:`check_finite`).

    Raises:
        AssertionError: naming the step and what is still non-finite, e.g.
            ``step 3 still replays non-finite (loss, gradients): the fix does not hold``.
    """
    out = check_finite(bundle, **options)
    if not out["finite"]:
        raise AssertionError(f"step {out['step']} of {bundle} still replays non-finite ({', '.join(out['nonfinite'])}): the fix does not hold; "
                             "nanreplay replay BUNDLE --model-factory ... names where the NaN is born now")
    return out
