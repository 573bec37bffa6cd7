"""What every search shares: one replay of a variation of the failing step (counted against the
budget, ticking the progress bar, logged in the result's ``trials``), its outcome, the result
dict, and the helpers that order layers and measure how far their weights moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Optional

import torch

from ..core.jsonable import fnum
from ..core.numerics import fused_norm
from ..engine.run import StepInputs, run_step
from ..engine.state import load_state
from ..errors import ReplayError
from ..format.bundle import Bundle
from ..format.records import Snapshot, StepRecord

__all__ = ["STATUSES", "BudgetExhausted", "Runner", "Outcome", "Search", "execution_order", "param_layers", "owner",
           "class_of", "owns_params", "movement", "held_snapshots", "short"]

#: ``found``: a culprit was named. ``not reproduced``: the unchanged replay of the failing step is
#: finite, so there is nothing to search. ``not in search space``: every variation the search can
#: make stays non-finite (e.g. the cause is not in the weights). ``incomplete``: ``max_replays``
#: ran out before the search finished; the partial answer is reported.
STATUSES = ("found", "not reproduced", "not in search space", "incomplete")


class BudgetExhausted(Exception):
    """Raised by :meth:`Search.replay` when ``max_replays`` replays have run; each search catches
    it and reports ``incomplete``."""


class Runner:
    """Counts replays, enforces the budget, ticks the progress callback once per replay and keeps
    the list of replays tried (the result's ``trials``)."""

    def __init__(self, max_replays: int, progress: Optional[Callable[[int], None]]) -> None:
        self.max_replays = max_replays
        self.count = 0
        self.progress = progress
        self.trials: list[dict] = []

    def tick(self) -> None:
        """Count one more replay, or raise :class:`BudgetExhausted` when none is left."""
        if self.count >= self.max_replays:
            raise BudgetExhausted
        self.count += 1
        if self.progress is not None:
            self.progress(1)


@dataclasses.dataclass
class Outcome:
    """One replay, reduced to what the searches need."""

    nonfinite: bool
    loss: Optional[float]          # the replayed loss when one scalar loss was computed
    loss_finite: bool
    grad_norm: Optional[float]     # the 2-norm over all replayed gradients (float32, as the recorder)
    grads: dict[str, torch.Tensor]


@dataclasses.dataclass
class Search:
    """What a search works on: the open bundle, the model it replays on (on ``device``), the
    failing step's record and pre-step ``state``, the replay budget, and the warnings it collects."""

    over: str
    bundle: Bundle
    model: torch.nn.Module
    loss_fn: Optional[Callable]
    device: torch.device
    runner: Runner
    failing: StepRecord
    state: Snapshot
    threshold: float = 10.0        # ``--over steps`` and the walk of ``--over layers``: a multiple of the median of earlier steps
    against: Optional[Bundle] = None  # ``--over config --against B``: the run whose settings the search moves towards
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> int:
        """The failing step."""
        return self.bundle.failing_step

    def replay(self, record: StepRecord, state: Snapshot, varied: str, **run: Any) -> Outcome:
        """Replay ``record`` on the model (weights already loaded; ``state`` is what the replay
        reports as step-start weights) and say whether it is non-finite by the recorder's own rule:
        a non-finite loss or grad norm, or a non-finite cotangent (or output, forward-only). One
        replay, logged in ``trials`` with ``varied``, what the search changed. ``run``: more
        arguments of :func:`~nanreplay.engine.run.run_step` (``deterministic``, a compiled
        ``runner`` with ``monitors=False``).

        Raises:
            BudgetExhausted: ``max_replays`` replays have already run.
        """
        self.runner.tick()
        res = run_step(self.model, StepInputs(record=record, state=state, recorded_grads={}, loss_fn=self.loss_fn), ops=False, device=self.device, **run)
        norm_t = fused_norm(list(res.grads.values()))
        gn = float(norm_t) if norm_t is not None else None
        losses = [h for h in res.losses if h is not None]
        loss_finite = all(h.finite for h in losses)
        out_bad = res.mode == "forward-only" and any(h is not None and not h.finite for h in res.outputs)
        cot_bad = any(h is not None and not h.finite for h in res.cotangents)
        loss = losses[0].mean if len(losses) == 1 and losses[0].finite else None
        bad = (gn is not None and not math.isfinite(gn)) or not loss_finite or out_bad or cot_bad
        self.runner.trials.append({"replay": self.runner.count, "varied": varied, "nonfinite": bad, "loss": fnum(loss), "grad_norm": fnum(gn)})
        return Outcome(nonfinite=bad, loss=loss, loss_finite=loss_finite, grad_norm=gn, grads=res.grads)

    def replay_as_recorded(self) -> tuple[Outcome, list[str]]:
        """The failing step with its recorded weights (one replay), and the FQNs of the modules in
        the order their forward started."""
        with execution_order(self.model) as order:
            load_state(self.model, self.state)
            out = self.replay(self.failing, self.state, f"step {self.step} as recorded")
        return out, order

    def result(self, status: str, answer: str, culprits: list, details: dict) -> dict:
        """The dict :func:`~nanreplay.search.api.bisect` returns (see its docstring)."""
        return {
            "over": self.over,
            "bundle": str(self.bundle.path),
            "step": self.step,
            "status": status,
            "answer": answer,
            "culprits": culprits,
            "replays": self.runner.count,
            "max_replays": self.runner.max_replays,
            "device": str(self.device),
            "details": details,
            "warnings": self.warnings,
            "trials": self.runner.trials,
        }

    def not_reproduced(self, how: str, details: dict) -> dict:
        """The result when the failing step replays finite ``how`` (e.g. "as recorded")."""
        return self.result("not reproduced", f"Step {self.step} replays finite {how}, so there is nothing to bisect; "
                           "run `nanreplay replay` to see why it does not reproduce.", [], details)

    def out_of_replays(self, details: dict, *, before: str = "", culprits: Optional[list] = None) -> dict:
        """The ``incomplete`` result: the budget ran out (``before`` what, e.g. " before reaching step 7")."""
        answer = f"The search ran out of replays (--max-replays {self.runner.max_replays}){before}; raise --max-replays."
        return self.result("incomplete", answer, culprits or [], details)


@contextlib.contextmanager
def execution_order(model: torch.nn.Module) -> Iterator[list[str]]:
    """Inside the block, the yielded list fills with the FQNs of ``model``'s modules in the order
    their forward starts (first call only); the hooks are removed on leaving it."""
    order: list[str] = []
    seen: set[str] = set()

    def pre(name: str) -> Callable[[torch.nn.Module, tuple], None]:
        def hook(mod: torch.nn.Module, args: tuple) -> None:
            if name not in seen:
                seen.add(name)
                order.append(name)
        return hook

    handles = [m.register_forward_pre_hook(pre(name)) for name, m in model.named_modules()]
    try:
        yield order
    finally:
        for h in handles:
            h.remove()


def owner(fqn: str) -> str:
    """The FQN of the module that owns parameter or buffer ``fqn`` (``""``: the root)."""
    return fqn.rpartition(".")[0]


def class_of(model: torch.nn.Module, fqn: str) -> str:
    return type(model.get_submodule(fqn)).__name__


def owns_params(m: torch.nn.Module) -> bool:
    """Whether ``m`` has parameters of its own (not counting its children's)."""
    return next(m.parameters(recurse=False), None) is not None


def param_layers(model: torch.nn.Module, order: list[str]) -> list[str]:
    """Modules that own parameters directly, in forward execution order (modules never called in
    the replay last, in definition order: their weights may still be used functionally)."""
    owners = [n for n, m in model.named_modules() if owns_params(m)]
    pos = {n: i for i, n in enumerate(order)}
    return sorted(owners, key=lambda n: (pos.get(n, len(pos)), owners.index(n)))


def held_snapshots(search: Search, upto: int) -> list[int]:
    """The steps up to ``upto`` whose snapshot (weights and optimizer state) the ring buffer holds,
    oldest first.

    Raises:
        ReplayError: there is none; the message says how to record them.
    """
    b = search.bundle
    held = sorted(int(s["step"]) for s in b.meta.get("steps", []) if s.get("snapshot"))
    usable = [s for s in held if s <= upto]
    if not usable:
        raise ReplayError(
            f"bisect --over {search.over} needs the weights and optimizer state of a step before the failing step "
            f"{b.failing_step}, kept in the ring buffer as a snapshot; {b.path} holds snapshots at steps {held or 'none'} "
            f"(ring buffer steps {b.steps}). Record with Recorder(..., snapshot_every=1) and a memory_budget of at "
            "least (capacity x (parameter bytes + optimizer state bytes)); see docs/bisect.md. Without snapshots, "
            "bisect can still run --over samples and --over precision on the failing step."
        )
    return usable


def movement(good: dict[str, torch.Tensor], bad: dict[str, torch.Tensor], names: list[str]) -> dict:
    """Weight movement between two states over the parameters ``names``: the 2-norm of the
    difference, its max abs, and the relative change ||bad - good|| / ||good||, computed in
    float64 over the finite differences; non-finite values in ``bad`` are counted."""
    sq = 0.0
    gsq = 0.0
    mx = 0.0
    nonfinite = 0
    for n in names:
        g, b_ = good[n].double(), bad[n].double()
        fin = torch.isfinite(b_)
        nonfinite += int((~fin).sum())
        d = (b_ - g)[fin]
        if d.numel():
            sq += float((d * d).sum())
            mx = max(mx, float(d.abs().max()))
        gsq += float((g[torch.isfinite(g)] ** 2).sum())
    norm = math.sqrt(sq)
    rel = norm / math.sqrt(gsq) if gsq > 0 else (math.inf if norm > 0 else 0.0)
    return {"diff_norm": fnum(norm), "max_abs_diff": fnum(mx), "relative_change": fnum(rel), "nonfinite_values": nonfinite}


def short(x: Any) -> str:
    """A number for a sentence, to 3 significant digits (strings such as ``"inf"`` as they are)."""
    return f"{x:.3g}" if isinstance(x, float) else str(x)
