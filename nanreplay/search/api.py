"""``nanreplay bisect``: search for the cause of a non-finite step by replaying variations of it.

A NaN gradient is often the late symptom of something earlier. Each search replays the failing
step (or the steps before it) from a bundle, changing one thing at a time, and reports the
smallest change that still makes the step non-finite. One module per search:

* :mod:`~nanreplay.search.layers`: the layers whose weight change since a finite snapshot makes
  the step non-finite (delta debugging, :mod:`~nanreplay.search.ddmin`);
* :mod:`~nanreplay.search.precision`: the first layer that has to run in float32;
* :mod:`~nanreplay.search.steps`: the first replayed step that leaves the healthy range;
* :mod:`~nanreplay.search.samples`: the smallest non-finite subset of the failing batch;
* :mod:`~nanreplay.search.config`: the recorded setting (autocast dtype, TF32, matmul precision,
  attention kernel, compile backend and mode, fused optimizer...) whose change makes the step
  finite, optionally moving towards another run's settings (``against``).

What they share (the replay, its budget and progress, the result dict) is in
:mod:`~nanreplay.search.common`. Every search counts its replays and stops at ``max_replays``.
The bundle is opened read-only and never modified. See ``docs/bisect.md`` for what each search
needs from the recorder.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ..core.quiet import quietly
from ..core.results import BisectResult
from ..engine.sandbox import SandboxLimits, conforming, sandbox_plan
from ..engine.state import ReplayRequest, opened_subject
from ..format.bundle import Bundle, Types, open_bundle
from .common import STATUSES, Runner, Search
from .config import bisect_config
from .ddmin import ddmin
from .layers import bisect_layers
from .precision import bisect_precision
from .samples import bisect_samples
from .steps import bisect_steps

logger = logging.getLogger(__name__)

__all__ = ["bisect", "ddmin", "SEARCHES", "STATUSES"]

#: ``over`` -> the search; each takes a :class:`~nanreplay.search.common.Search` and returns the result dict.
_SEARCH: dict[str, Callable[[Search], dict]] = {
    "layers": bisect_layers,
    "precision": bisect_precision,
    "steps": bisect_steps,
    "samples": bisect_samples,
    "config": bisect_config,
}

SEARCHES = tuple(_SEARCH)


@quietly
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
    sandbox: Optional[SandboxLimits] = None,
    against: Union[str, Path, Bundle, None] = None,
) -> BisectResult:
    """Search a bundle for the cause of its non-finite step by replaying variations of it.

    Code the bundle names runs only when it is trusted (or ``trust=True``); otherwise pass your
    own ``model`` / ``model_factory``, ``loss_fn`` and ``batch_types`` (see
    :func:`nanreplay.diagnosis.api.replay` and ``docs/security.md``).

    Args:
        bundle: a bundle path or an open :class:`~nanreplay.format.bundle.Bundle`; read, never written.
        over: ``"layers"`` (which layers' weight change makes the step non-finite; needs a
            snapshot of an earlier step; when the steps search's walk finds an abnormal step
            before the failing one, the layer corrupted there and where it spread, see
            :mod:`~nanreplay.search.window`), ``"precision"`` (first layer that must run in float32),
            ``"steps"`` (first step leaving the healthy range; needs a snapshot), or
            ``"samples"`` (smallest non-finite subset of the batch), or ``"config"`` (the recorded
            setting whose change makes the step finite). See each search's module.
        model: a model of the recorded architecture (its weights are overwritten); else built with
            ``model_factory`` (callable or ``"module:function"``), else the program embedded in the
            bundle, else the recorded factory (:func:`nanreplay.engine.state.replay_subject`).
        loss_fn: ``loss_fn(model, batch) -> loss``; default the recorded one; without one, the
            recorded cotangent drives the backward pass.
        device: where to replay (default: the recorded device when present, else CPU).
        max_replays: the most replays (forward + backward runs) the search may use (>= 1).
        threshold: ``steps`` (and the walk of ``layers``): a step whose grad norm or optimizer
            update norm exceeds ``threshold`` x the median of the earlier replayed steps' leaves
            the healthy range; ``layers`` also judges its window's replays and each layer's
            movement against it (:mod:`~nanreplay.search.window`).
        progress: called with ``1`` after each replay (the CLI's progress bar).
        trust: trust this bundle for this call (run the code it names).
        batch_types: dataclass types / namedtuple classes to rebuild typed batch nodes as.
        sandbox: the sandbox's limits (:class:`~nanreplay.engine.sandbox.SandboxLimits`): the
            embedded program of an untrusted bundle searches inside it, on the CPU, as for
            :func:`nanreplay.replay`.
        against: ``over="config"`` only: another run's bundle (a path or an open bundle; only its
            metadata is read, nothing it names runs): the search changes the settings the two runs
            differ in to that run's values, instead of to their conservative values.

    Returns:
        a JSON-able dict: ``over``, ``bundle``, ``step`` (failing step), ``status`` (one of
        :data:`STATUSES`), ``answer`` (one sentence), ``culprits`` (list of dicts: layers with
        weight movement, the precision layer with magnitudes vs ``torch.finfo``, the first
        anomalous step, or samples), ``replays``, ``max_replays``, ``device``, ``details``,
        ``warnings``, ``trials`` (one dict per replay in order: ``replay``, ``varied`` (what the
        search changed), ``nonfinite``, ``loss``, ``grad_norm``); ``--over layers`` around a first
        abnormal step adds ``window`` (:class:`~nanreplay.core.results.BisectWindow`:
        ``first_abnormal_step``, ``good_step``, ``bad_step``, ``corrupted``, ``spread_to``, ...).

    Raises:
        ValueError: unknown ``over``, ``max_replays`` < 1, ``threshold`` <= 1, or ``against`` with
            another ``over`` than ``"config"``.
        FileNotFoundError, BundleFormatError: unreadable bundle.
        UntrustedBundleError: the bundle is not trusted and names code the search would run.
        ReplayError: the search needs what the bundle lacks (a snapshot, a batch), or no model
            could be built. ModelMismatchError: the model does not fit the bundle.
    """
    if over not in _SEARCH:
        raise ValueError(f"over must be one of {SEARCHES}, got {over!r}")
    if max_replays < 1:
        raise ValueError(f"max_replays must be >= 1, got {max_replays}")
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1 (a multiple of the median of earlier steps), got {threshold}")
    if against is not None and over != "config":
        raise ValueError(f"against (another run's bundle) goes with over='config', not over={over!r}")
    request = ReplayRequest(model=model, model_factory=model_factory, loss_fn=loss_fn, device=device, trust=trust, batch_types=batch_types)
    with sandbox_plan(bundle, request, optimizer=over == "steps") as (b, plan), contextlib.ExitStack() as stack:
        # the other run's bundle: only its metadata is read (nothing it names runs), before any child
        other = None if against is None else against if isinstance(against, Bundle) else stack.enter_context(open_bundle(against))
        if plan is None:
            return _bisect(b, request, over=over, max_replays=max_replays, threshold=threshold, progress=progress, against=other)
        out, _ = plan.run(lambda req, relay: _bisect(b, req, over=over, max_replays=max_replays, threshold=threshold, progress=relay,
                                                     against=other),
                          progress=progress, limits=sandbox)
        return conforming(out, "bisect", plan.path)


def _bisect(bundle: Union[str, Path, Bundle], request: ReplayRequest, *, over: str, max_replays: int, threshold: float,
            progress: Optional[Callable[[int], None]], against: Optional[Bundle] = None) -> BisectResult:
    """The body of :func:`bisect`: in this process, or in the sandbox's child."""
    with opened_subject(bundle, request, optimizer=over == "steps") as (b, subject, dev):
        other = against
        search = Search(over=over, bundle=b, model=subject.model, loss_fn=subject.loss_fn, device=dev, runner=Runner(max_replays, progress),
                        failing=b.step(b.failing_step), state=b.state(), threshold=threshold, against=other)
        search.warnings.extend(subject.notes)
        out = _SEARCH[over](search)
        out["model_source"] = subject.source
        for w in out["warnings"]:  # the result carries them; the CLI prints them once (-v logs them too)
            logger.info("bisect: %s", w)
        return out
