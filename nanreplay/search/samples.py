"""``bisect --over samples``: the smallest subset of the failing batch that stays non-finite.

Delta debugging (:func:`~nanreplay.search.ddmin.ddmin`) over the samples of the failing batch for
the smallest subset that is still non-finite, then, for each sample of that subset, whether its
removal alone makes the step finite. Samples are (micro-batch, row) pairs, so gradient
accumulation is covered; every tensor of a batch is cut along its batch dimension
(:mod:`nanreplay.core.batch`). Without a loss function the model's recorded forward inputs and
cotangents are cut instead. A subset that cannot be replayed (BatchNorm refusing one sample)
counts as not failing. When one sample is left and no removal helps, a few other samples are
replayed alone: when they all fail too, the cause is the batch as a whole, not a sample.

Needs the failing step only. Replays: 1 + ddmin + one per sample of the minimal subset (+ up to 4).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..core.batch import batch_coupled, batch_size, rows_of, take_rows
from ..core.numerics import is_float
from ..engine.state import load_state
from ..errors import ReplayError
from ..format.records import StepRecord
from .common import BudgetExhausted, Search
from .ddmin import ddmin

logger = logging.getLogger(__name__)

__all__ = ["bisect_samples"]

Sample = tuple[int, int]  # (micro-batch, row)
Fails = Callable[[list[Sample]], bool]


def bisect_samples(search: Search) -> dict:
    """Run the search; the culprits are the samples of the minimal subset, each saying whether
    its removal alone makes the step finite."""
    batch = _Batch(search)
    search.warnings.extend(_warnings(search, batch))
    samples = batch.samples

    def fails(sub: list[Sample]) -> bool:
        load_state(search.model, search.state)
        varied = f"{len(sub)} of {len(samples)} samples: " + ", ".join(str(batch.label(x)) for x in sub[:8]) + (", ..." if len(sub) > 8 else "")
        try:
            return search.replay(batch.record_for(sub), search.state, varied).nonfinite
        except BudgetExhausted:
            raise
        except Exception as e:  # e.g. BatchNorm refusing one sample: unresolved, treated as not failing
            logger.info("bisect samples: a subset of %d sample(s) could not be replayed (%s: %s)", len(sub), type(e).__name__, e)
            return False

    if not fails(samples):
        return search.not_reproduced("with its whole batch", {"samples": len(samples)})
    culprit, necessary, status = _minimize(batch, fails)
    details = {"samples": len(samples), "micro_batches": len(batch.parts), "batch_sizes": batch.sizes, "minimal_failing_subset": batch.labels(culprit),
               "removal_makes_finite": necessary, "mode": "loss_fn" if batch.use_loss else "cotangent"}
    if status == "incomplete" and len(culprit) == len(samples):
        return search.out_of_replays(details)
    if status == "found" and not necessary and len(culprit) == 1 and len(samples) > 1:
        alone, probe = _probe_alone(batch, culprit[0], fails)
        details["other_samples_failing_alone"], details["other_samples_probed"] = batch.labels(alone), batch.labels(probe)
        if alone and len(alone) == len(probe):  # the failure belongs to the batch (or the loss, or the weights)
            answer = (f"Step {search.step} is non-finite with any single sample: {len(alone) + 1} of {len(alone) + 1} samples tested fail "
                      "on their own, so the cause is not in particular samples; look at the loss, the weights or the batch as a whole (nanreplay replay).")
            return search.result("not in search space", answer, [], details)
    subset = ", ".join(str(batch.label(x)) for x in culprit)
    answer = f"Step {search.step} stays non-finite with only sample{'s' if len(culprit) > 1 else ''} {subset} of its {len(samples)}"
    if necessary:
        answer += f"; removing sample{'s' if len(necessary) > 1 else ''} {', '.join(map(str, necessary))} alone makes it finite."
    else:
        answer += "; no single sample's removal makes the whole batch finite (several samples fail on their own)."
    culprits = [{"sample": batch.label(x), "removal_makes_finite": batch.label(x) in necessary} for x in culprit]
    return search.result(status, answer, culprits, details)


class _Batch:
    """The failing step's batch as samples: with a loss function, its recorded batches (one per
    micro-batch); without, the model's recorded forward inputs and cotangents.

    Raises:
        ReplayError: nothing recorded to slice, or a part with no batch dimension.
    """

    def __init__(self, search: Search) -> None:
        rec = self.rec = search.failing
        self.use_loss = search.loss_fn is not None and bool(rec.batches)
        self.parts = rec.batches if self.use_loss else [fw.inputs for fw in rec.forwards]
        if not self.parts:
            raise ReplayError(f"step {search.step} holds no recorded batch or forward inputs; bisect --over samples has nothing to slice. Call Recorder.record(batch) in the loop.")
        sizes = [batch_size(p) for p in self.parts]
        if any(s is None for s in sizes):
            raise ReplayError(f"step {search.step}: a recorded batch has no tensor with a batch dimension (dim 0); bisect --over samples cannot split it")
        self.sizes: list[int] = [int(s) for s in sizes if s is not None]
        self.samples: list[Sample] = [(j, i) for j, s in enumerate(self.sizes) for i in range(s)]

    def label(self, x: Sample) -> Any:
        """How the result names a sample: its row, or ``[micro-batch, row]`` with several."""
        return x[1] if len(self.parts) == 1 else list(x)

    def labels(self, xs: list[Sample]) -> list:
        return [self.label(x) for x in xs]

    def record_for(self, sub: list[Sample]) -> StepRecord:
        """The failing step's record cut to the samples ``sub``."""
        rec, sizes = self.rec, self.sizes
        by = {j: [i for jj, i in sub if jj == j] for j in range(len(self.parts))}
        keep = [j for j in range(len(self.parts)) if by[j]]
        if self.use_loss:
            return dataclasses.replace(rec, batches=[take_rows(self.parts[j], by[j], sizes[j]) for j in keep])
        fws = [
            dataclasses.replace(rec.forwards[j], inputs=take_rows(rec.forwards[j].inputs, by[j], sizes[j]),
                                cotangent=take_rows(rec.forwards[j].cotangent, by[j], sizes[j]) if rec.forwards[j].cotangent is not None else None)
            for j in keep
        ]
        return dataclasses.replace(rec, forwards=fws)

    def nonfinite_cotangent_rows(self) -> list[int]:
        """The rows whose recorded cotangent is already non-finite (cotangent mode)."""
        return sorted({i for j, fw in enumerate(self.rec.forwards) if fw.cotangent is not None
                       for t in pytree.tree_leaves(fw.cotangent) if isinstance(t, torch.Tensor) and t.dim() >= 1 and is_float(t)
                       for i in (rows_of(~torch.isfinite(t), self.sizes[j]) or [])})


def _warnings(search: Search, batch: _Batch) -> list[str]:
    """What makes a subset behave differently from the whole batch: batch-coupled layers, and a
    recorded cotangent that is already non-finite for some rows."""
    out = []
    coupled = batch_coupled(search.model, batch.rec.training)
    if coupled:
        out.append(
            f"batch-coupled layers in training mode ({', '.join(coupled[:4])}{'...' if len(coupled) > 4 else ''}): a sample's output depends "
            "on the other samples in its batch, so a subset can behave differently from the whole batch"
        )
    bad_rows = [] if batch.use_loss else batch.nonfinite_cotangent_rows()
    if bad_rows:
        out.append(
            f"no loss function: the backward pass is driven by the recorded cotangent, which is already non-finite for samples "
            f"{bad_rows[:16]}{'...' if len(bad_rows) > 16 else ''}, so any subset holding them stays non-finite; pass --loss-fn for a faithful search"
        )
    return out


def _minimize(batch: _Batch, fails: Fails) -> tuple[list[Sample], list, str]:
    """The minimal failing subset (ddmin), the labels of its samples whose removal alone makes the
    step finite, and the status (``found`` or ``incomplete``)."""
    samples = batch.samples
    try:
        culprit = ddmin(samples, fails)
    except BudgetExhausted:
        return samples, [], "incomplete"
    necessary: list[Any] = []
    try:
        for x in culprit:
            rest = [y for y in samples if y != x]
            if rest and not fails(rest):
                necessary.append(batch.label(x))
    except BudgetExhausted:
        return culprit, necessary, "incomplete"
    return culprit, necessary, "found"


def _probe_alone(batch: _Batch, culprit: Sample, fails: Fails) -> tuple[list[Sample], list[Sample]]:
    """A lone failing sample whose removal does not help: replay up to 4 other samples alone.
    Returns those that fail alone (none when the budget runs out) and those probed."""
    others = [y for y in batch.samples if y != culprit]
    probe = [others[k * (len(others) - 1) // 3] for k in range(4)] if len(others) > 4 else others
    probe = list(dict.fromkeys(probe))
    try:
        return [y for y in probe if fails([y])], probe
    except BudgetExhausted:
        return [], probe
