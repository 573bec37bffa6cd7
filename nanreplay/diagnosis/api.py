"""The diagnosis entry points: :func:`replay` (a bundle file, in a new process) and
:func:`diagnose_live` (the recorder's in-process diagnosis right after detection)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.allowlist import Allowlist
from ..core.callables import import_callable
from ..core.state import load_buffers
from ..engine.run import StepInputs, preserve_live, run_step
from ..engine.gate import bundle_types, live_optimizer_info, recorded_callable, require_trust, resolved_optimizer_info
from ..engine.state import build_model, load_state, recorded_device
from ..format.bundle import Bundle, Types, open_bundle
from ..format.records import BundleContent
from .attribution import attribute
from .origin import diagnose

logger = logging.getLogger(__name__)

__all__ = ["replay", "replay_step", "diagnose_live"]


#: ``progress(message)``: told what the diagnosis is doing, for work that takes more than a moment
Progress = Callable[[str], None]


def _silent(message: str) -> None:
    return None


def replay_step(model: torch.nn.Module, inp: StepInputs, *, ops: bool = True, device: Optional[torch.device] = None, samples: bool = True,
                progress: Optional[Progress] = None) -> dict:
    """Replay one step on ``model`` (weights already loaded) and return the diagnosis dict, with
    the exact attribution of :func:`nanreplay.diagnosis.attribution.attribute` (source line, autograd node,
    causal chain, samples, optimizer update, cause verdict)."""
    say = progress or _silent
    say(f"replaying step {inp.record.step}" + (" under the op monitor" if ops else ""))
    result = run_step(model, inp, ops=ops, device=device)
    diag = diagnose(result, step=inp.record.step, recorded_grads=inp.recorded_grads, recorded_loss=inp.record.loss)
    return attribute(diag, result, model, inp, device=device, samples=samples, progress=say)


def diagnose_live(model: torch.nn.Module, content: BundleContent, *, loss_fn: Optional[Callable] = None, allow: Sequence[Any] = (),
                  progress: Optional[Progress] = None) -> dict:
    """In-process diagnosis, run by the Recorder right after detection: replays the failing step
    (``content.steps[-1]``) on the live ``model``, whose weights are still the pre-step weights,
    then puts back the live gradients, buffers, module modes and RNG states, so training can
    continue unchanged. The caller keeps its own hooks quiet meanwhile.

    Args:
        model: the live model (the one the recorder hooks, unwrapped from DDP).
        content: the bundle content about to be written.
        loss_fn: ``loss_fn(model, batch) -> loss``, or ``None`` to drive backward with the
            recorded cotangent.
        allow: extra allowlist rules (``RecorderConfig.allow_nonfinite``).
        progress: told what the diagnosis is doing.
    """
    rec = content.steps[-1]
    # trust rule: the optimizer class is the live optimizer's own (code this process runs)
    optimizer_info = live_optimizer_info(content.optimizer_info)
    inp = StepInputs(
        record=rec, state=content.state, recorded_grads=content.grads, loss_fn=loss_fn,
        scaler=content.state.extra.get("scaler"), grads_unscaled=(content.reason.get("scaler") or {}).get("grads_unscaled"),
        allow=Allowlist(allow), optimizer_info=optimizer_info,
        history=list(content.steps), reason=dict(content.reason),
    )
    with preserve_live(model):
        load_buffers(model, content.state.buffers)
        return replay_step(model, inp, progress=progress)


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
    progress: Optional[Progress] = None,
    trust: bool = False,
    batch_types: Types = None,
) -> dict:
    """Replay a bundle's failing step and diagnose it.

    Code the bundle names (its model factory or ``model_init`` class, loss function, optimizer
    class outside ``torch.optim``, batch types) runs only when the bundle is trusted: written by
    this user's Recorder on this machine, trusted with :func:`nanreplay.trust_bundle`, or
    ``trust=True``. Otherwise pass your own ``model`` / ``model_factory``, ``loss_fn`` (or
    ``use_loss_fn=False``) and ``batch_types``; see ``docs/security.md``.

    Args:
        bundle: a path or an open :class:`~nanreplay.format.bundle.Bundle`.
        model: a model of the recorded architecture; else ``model_factory`` (callable or import
            path), else the factory recorded in the bundle (trusted bundles only).
        loss_fn: ``loss_fn(model, batch) -> loss``; defaults to the recorded one (trusted bundles
            only). Without it (or with ``use_loss_fn=False``), the recorded cotangent drives the
            backward pass.
        device: where to replay (default: the recorded parameters' device when present here,
            else CPU).
        ops: run the op-level monitor (slower, names the aten op, the source line, the autograd
            node; runs under anomaly mode).
        allow: extra allowlist rules ``"MODULE:OP[:-inf]"`` for legitimate non-finite values, on
            top of those recorded in the bundle (``RecorderConfig.allow_nonfinite``).
        default_allow: keep the default rules (-Inf written by attention masking).
        samples: find the samples to blame by per-sample replay where the producer's output
            does not show them directly (extra forward/backward passes, see
            :func:`nanreplay.diagnosis.blame.samples_to_blame`).
        progress: ``progress(message)`` is told what the replay is doing (rebuilding the model,
            replaying the step, each per-sample replay), for a status line.
        trust: trust this bundle for this call (run the code it names); review
            ``nanreplay inspect`` first.
        batch_types: dataclass types / namedtuple classes (or ``{"module:QualName": cls}``) to
            rebuild the recorded typed batch nodes as; a trusted bundle's own are imported.

    Returns:
        the diagnosis dict (see :func:`diagnose`), with ``bundle`` and ``device`` added.

    Raises:
        FileNotFoundError, BundleFormatError: unreadable bundle.
        UntrustedBundleError: the bundle is not trusted and names code this call would run
            (nothing was run; the message lists it).
        ReplayError: no model could be built, or the loss function failed.
        ModelMismatchError: the model does not match the recorded one.
    """
    say = progress or _silent
    own = not isinstance(bundle, Bundle)
    b = open_bundle(bundle, trust=trust) if own else bundle.view(trust=trust)
    try:
        # --- trust rule (nanreplay.engine.gate): refuse before anything the bundle names is imported ---
        require_trust(b, model=model is not None or model_factory is not None,
                      loss=loss_fn is not None or not use_loss_fn, types=batch_types)
        b = b.view(types=bundle_types(b, batch_types))
        # --- end of the trust rule ---
        if model is None:
            say("rebuilding the model")
            model = build_model(b, model_factory)
        lf = loss_fn if loss_fn is not None else (b.loss_fn if use_loss_fn else None)
        if isinstance(lf, str):
            lf = import_callable(lf) if loss_fn is not None else recorded_callable(b, "loss function", lf)
        if not use_loss_fn:
            lf = None
        dev = torch.device(device) if device is not None else recorded_device(b)
        model = model.to(dev)
        state = b.state()
        rec = b.step(b.failing_step)
        load_state(model, state)
        rules = list((b.meta.get("replay_options") or {}).get("allow_nonfinite", [])) + list(allow or [])
        history = [b.step(k) for k in b.steps if k <= b.failing_step]
        inp = StepInputs(
            record=rec, state=state, recorded_grads=b.grads(), loss_fn=lf, allow=Allowlist(rules, defaults=default_allow),
            optimizer_info=resolved_optimizer_info(b), history=history, reason=dict(b.meta.get("reason") or {}),
            scaler=state.extra.get("scaler"), grads_unscaled=((b.meta.get("reason") or {}).get("scaler") or {}).get("grads_unscaled"),
        )
        diag = replay_step(model, inp, ops=ops, device=dev, samples=samples, progress=say)
        diag["bundle"] = str(b.path)
        diag["device"] = str(dev)
        return diag
    finally:
        if own:
            b.close()
