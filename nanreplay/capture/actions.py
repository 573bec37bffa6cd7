"""What the Recorder does on a non-finite step, once the bundle is written: a table.

``ACTIONS`` maps the ``action`` option to an :class:`Action`, one row each:

======== ================ ============================ =========================================
name     dumps            pre-step state               then
======== ================ ============================ =========================================
raise    every time       put back                     raise :class:`NonFiniteGradientError`
skip     first in a run   put back                     drop the gradients; raise past
                                                       ``max_consecutive`` skips in a row
warn     every time       kept (the step proceeds)     log a warning
======== ================ ============================ =========================================

(``max_dumps`` bounds the dumps of every row.) An action sees an :class:`Incident` (the step,
the message, the bundle, the diagnosis) and the :class:`Actions` state that lasts across steps
(consecutive skips). A new action is a new :class:`Action` subclass and one more row.

``SPIKE_ACTIONS`` maps the ``on_spike`` option to an :class:`Action` in the same way; a spike is a
*finite* step whose loss or grad norm left its running band (:mod:`nanreplay.capture.early`), so
nothing is put back (``restores`` is ``False`` for every row) and the incident carries the spike
rows and the rollback plan:

======== ================================== ==============================================
name     dumps                              then
======== ================================== ==============================================
warn     never                              one log line per episode
dump     first step of an episode           ``nanreplay-spike-step<N>`` bundle, log, go on
skip     never                              drop the step's gradients, log once per episode
raise    never                              raise :class:`~nanreplay.errors.SpikeError`
======== ================================== ==============================================
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..core.rollback import plan_phrase
from ..errors import NonFiniteGradientError, SpikeError

logger = logging.getLogger(__name__)

__all__ = ["ACTIONS", "SPIKE_ACTIONS", "Action", "Actions", "Incident"]


@dataclass
class Incident:
    """One non-finite step, as an action sees it.

    Attributes:
        step: the step's index. message: what was found, where the bundle is, what the diagnosis
            said. bundle: the bundle written for it, else ``None``. diagnosis: its diagnosis, else
            ``None``. update: found after the update (``check_update``); the pre-step state is
            then already back (or, for an action that keeps the step, the update is).
    """

    step: int
    message: str
    bundle: Optional[Path] = None
    diagnosis: Optional[dict] = None
    update: bool = False
    spikes: Optional[list] = None
    rollback: Optional[dict] = None
    new_episode: bool = True


class Action:
    """One row of :data:`ACTIONS`.

    Attributes:
        restores: the pre-step weights, optimizer state and buffers are put back before the action
            runs (``False``: the step, or the update, is kept).
        reads_every_step: a spike action that reads the incident's message and rollback plan at
            every step of an episode, not only at its first (``SpikeRaise``); for the others a
            later step of an episode gets an :class:`Incident` without them.
    """

    restores = True
    reads_every_step = False

    def dumps(self, state: "Actions") -> bool:
        """Whether this incident gets a bundle (``max_dumps`` permitting)."""
        return True

    def __call__(self, state: "Actions", incident: Incident) -> None:
        raise NotImplementedError


class Raise(Action):
    """Raise :class:`NonFiniteGradientError` from ``optimizer.step()`` (or ``check_step()``)."""

    def __call__(self, state: "Actions", incident: Incident) -> None:
        tail = "; the pre-step weights and optimizer state were restored" if incident.update else ""
        raise NonFiniteGradientError(incident.message + tail, step=incident.step, diagnosis=incident.diagnosis,
                                     bundle_path=str(incident.bundle) if incident.bundle else None)


class Skip(Action):
    """Drop the step's gradients (the optimizer then leaves weights and state alone); raise after
    ``max_consecutive`` skipped steps in a row. Only the first of a run is dumped."""

    def dumps(self, state: "Actions") -> bool:
        return state.skipped == 0

    def __call__(self, state: "Actions", incident: Incident) -> None:
        if incident.update:  # the update is already undone
            logger.warning("nanreplay: %s; the update was undone (action='skip')", incident.message)
            return
        state.skipped += 1
        if state.skipped > state.max_consecutive:
            plan = state.final_plan() if state.final_plan is not None else None
            raise NonFiniteGradientError(
                f"{incident.message}; {state.skipped} consecutive steps skipped, more than max_consecutive="
                f"{state.max_consecutive}: training is not recovering" + (f"; rollback plan: {plan_phrase(plan)}" if plan else ""),
                step=incident.step,
                bundle_path=str(state.dump.bundles[0]) if state.dump.bundles else None,
                diagnosis=state.dump.last_diagnosis,
                rollback=plan,
            )
        logger.warning("nanreplay: %s; skipping this optimizer step (%d in a row)", incident.message, state.skipped)
        state.drop_gradients()


class Warn(Action):
    """Log a warning and let the step (or the update) proceed."""

    restores = False

    def __call__(self, state: "Actions", incident: Incident) -> None:
        kept = "the update is kept" if incident.update else "the step proceeds"
        logger.warning("nanreplay: %s; %s (action='warn')", incident.message, kept)


#: the ``action`` option -> what happens on a non-finite step
ACTIONS: dict[str, Action] = {"raise": Raise(), "skip": Skip(), "warn": Warn()}


class SpikeWarn(Action):
    """Log one warning per episode (the step, the signal, how far out, the rollback plan)."""

    restores = False

    def dumps(self, state: "Actions") -> bool:
        return False

    def __call__(self, state: "Actions", incident: Incident) -> None:
        if incident.new_episode:
            logger.warning("nanreplay: %s (training goes on; further spikes of this episode are listed in Recorder.spikes)",
                           incident.message)


class SpikeDump(SpikeWarn):
    """Write a ``nanreplay-spike-step<N>`` bundle at the first step of an episode (the ring
    buffer, the step's pre-step state and gradients, the scalar history), log, go on."""

    def dumps(self, state: "Actions") -> bool:
        return True


class SpikeSkip(Action):
    """Drop the spike step's gradients (as ``action="skip"`` does) and go on; one log line per episode."""

    restores = False

    def dumps(self, state: "Actions") -> bool:
        return False

    def __call__(self, state: "Actions", incident: Incident) -> None:
        if incident.new_episode:
            logger.warning("nanreplay: %s; skipping this optimizer step (on_spike='skip'; every spike step of the episode is "
                           "skipped)", incident.message)
        state.drop_gradients()


class SpikeRaise(Action):
    """Raise :class:`~nanreplay.errors.SpikeError` before the step's update."""

    restores = False
    reads_every_step = True

    def dumps(self, state: "Actions") -> bool:
        return False

    def __call__(self, state: "Actions", incident: Incident) -> None:
        raise SpikeError(incident.message + " (on_spike='raise'; pass on_spike='warn' to only log it)", step=incident.step,
                         spikes=incident.spikes or [], rollback=incident.rollback)


#: the ``on_spike`` option -> what happens on a spike (a finite step out of its band)
SPIKE_ACTIONS: dict[str, Action] = {"warn": SpikeWarn(), "dump": SpikeDump(), "skip": SpikeSkip(), "raise": SpikeRaise()}


class Actions:
    """The chosen action and the state actions keep across steps.

    Args:
        name: a key of :data:`ACTIONS`. optimizer: the optimizer whose gradients ``skip`` drops.
        dump: the Recorder's :class:`~nanreplay.capture.dump.Dump` (bundles and diagnosis so far).
        max_consecutive: skipped steps in a row before ``skip`` raises.
        param_fqn: ``id(param) -> FQN``, to name parameters a skip did not leave alone.

    Attributes:
        skipped: consecutive skipped steps.
        final_plan: ``final_plan()`` returns the rollback plan of the episode (bringing the
            bundle's up to date) when ``skip`` gives up; set by the Recorder
            (:meth:`nanreplay.capture.early.SpikeWatch.final_plan`), else ``None``.
    """

    def __init__(self, name: str, optimizer: torch.optim.Optimizer, *, dump: Any, max_consecutive: int,
                 param_fqn: dict[int, str]) -> None:
        self.action = ACTIONS[name]
        self.optimizer, self.dump, self.max_consecutive, self._param_fqn = optimizer, dump, max_consecutive, param_fqn
        self.skipped = 0
        self.final_plan: Optional[Callable[[], Optional[dict]]] = None
        self._versions: list[tuple[torch.Tensor, int]] = []  # a skipped step's params and their versions

    @property
    def restores(self) -> bool:
        return self.action.restores

    @property
    def raises(self) -> bool:
        """Whether the next non-finite step raises (``action="raise"``, or a skip past
        ``max_consecutive``): under torch.distributed the origin rank then writes torchrun's error file."""
        return isinstance(self.action, Raise) or (isinstance(self.action, Skip) and self.skipped + 1 > self.max_consecutive)

    def dumps(self) -> bool:
        """Whether a non-finite step now gets a bundle (``max_dumps`` permitting)."""
        return self.action.dumps(self)

    def finite(self) -> None:
        """A finite step: a run of skipped steps is over."""
        self.skipped = 0

    def __call__(self, incident: Incident) -> None:
        self.action(self, incident)

    def action_for(self, action: Action, incident: Incident) -> None:
        """Run another row (a :data:`SPIKE_ACTIONS` row) with this state."""
        action(self, incident)

    def drop_gradients(self) -> None:
        """Set every ``.grad`` to ``None`` so the optimizer leaves weights and state untouched,
        noting the parameters' versions for :meth:`verify_skip`."""
        self._versions = [(p, p._version) for g in self.optimizer.param_groups for p in g["params"]]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def verify_skip(self, step: int) -> None:
        """After a skipped step: the version counters prove the optimizer left every parameter
        alone. Torch's optimizers skip parameters whose ``.grad`` is ``None``; one that updates
        parameters regardless (weight decay on every parameter, a custom rule) is named."""
        if not self._versions:
            return
        changed = [self._param_fqn.get(id(p), "?") for p, v in self._versions if p._version != v]
        self._versions = []
        if changed:
            logger.warning(
                "nanreplay: action='skip' dropped the gradients of step %d, but %s changed %d parameter(s) anyway "
                "(e.g. %s): this optimizer updates parameters without gradients, so the skip did not leave the "
                "weights as they were; use action='raise' with it",
                step, type(self.optimizer).__name__, len(changed), changed[:3],
            )
