"""``bisect --over layers``: which layers' weight change makes the failing step non-finite.

Between the weights of an earlier finite step (a snapshot in the ring buffer) and the failing
step's pre-step weights, find the smallest set of layers whose change alone makes the failing
step's batch non-finite. Layers are the modules that own parameters, in forward execution order;
a layer's own buffers move with it. The baseline is the newest snapshot under which the failing
batch replays finite (older snapshots are tried when the newest already holds blown-up weights).
The search is delta debugging (:func:`~nanreplay.search.ddmin.ddmin`) over the layers, so a
single culprit costs about ``2 * log2(layers)`` replays, plus one for the step as recorded and one
per snapshot tried.

Needs a snapshot of a step before the failing one (``Recorder(snapshot_every=...)``).
"""

from __future__ import annotations

from typing import Optional

from ..engine.state import load_state
from ..format.records import Snapshot
from .common import BudgetExhausted, Search, class_of, held_snapshots, movement, owner, param_layers, short
from .ddmin import ddmin

__all__ = ["bisect_layers"]


def bisect_layers(search: Search) -> dict:
    """Run the search; the result's culprits are the layers with their weight movement."""
    F = search.step
    earlier = held_snapshots(search, F - 1)
    out, order = search.replay_as_recorded()
    layers = param_layers(search.model, order)
    if not out.nonfinite:
        return search.not_reproduced("with its recorded weights", {"layers": len(layers)})
    good_step, good, tried = _finite_baseline(search, earlier)
    if good_step is None or good is None:
        if len(tried) < len(earlier):  # the budget ran out before every snapshot was tried
            return search.out_of_replays({"snapshots_tried": tried, "layers": layers}, before=f" before finding a snapshot under which step {F} replays finite")
        return _not_in_the_weights(search, tried, layers)

    def fails(changed: list[str]) -> bool:
        snap = _mixed(search.state, good, layers, changed)
        load_state(search.model, snap)
        varied = (f"{len(changed)} of {len(layers)} layers at step {F}'s weights, the others at step {good_step}'s: "
                  + ", ".join(L or "(root)" for L in changed[:6]) + (", ..." if len(changed) > 6 else ""))
        return search.replay(search.failing, snap, varied).nonfinite

    try:
        culprits, status = ddmin(layers, fails), "found"
    except BudgetExhausted:
        culprits, status = layers, "incomplete"
    return _report(search, status, culprits, layers, good_step, good, tried)


def _finite_baseline(search: Search, earlier: list[int]) -> tuple[Optional[int], Optional[Snapshot], list[dict]]:
    """The newest snapshot among ``earlier`` under which the failing step's batch replays finite
    (step, snapshot), or ``(None, None)`` when none does or the budget ran out first; and the
    snapshots tried (``step``, ``nonfinite``), newest first."""
    tried: list[dict] = []
    try:
        for s in reversed(earlier):
            snap = search.bundle.step(s).snapshot
            assert snap is not None
            load_state(search.model, snap)
            o = search.replay(search.failing, snap, f"every layer at step {s}'s weights")
            tried.append({"step": s, "nonfinite": o.nonfinite})
            if not o.nonfinite:
                return s, snap, tried
    except BudgetExhausted:
        pass
    return None, None, tried


def _mixed(bad: Snapshot, good: Snapshot, layers: list[str], changed: list[str]) -> Snapshot:
    """The failing step's weights for the layers ``changed``, the good snapshot's for the others;
    a layer's own buffers move with it, other buffers keep the failing step's values."""
    ch, kept = set(changed), set(layers) - set(changed)
    params = {n: (t if owner(n) in ch else good.params[n]) for n, t in bad.params.items()}
    buffers = {n: (good.buffers[n] if owner(n) in kept and n in good.buffers else t) for n, t in bad.buffers.items()}
    return Snapshot(params=params, buffers=buffers)


def _not_in_the_weights(search: Search, tried: list[dict], layers: list[str]) -> dict:
    """The result when every snapshot held was tried and the step stays non-finite under each."""
    answer = (
        f"Step {search.step} is non-finite even with every layer at the weights of step {tried[-1]['step']} "
        "(the oldest snapshot held): the cause is not in the weights; "
        "look at the data (--over samples) or the numerics (--over precision)."
    )
    return search.result("not in search space", answer, [], {"snapshots_tried": tried, "layers": layers})


def _report(search: Search, status: str, culprits: list[str], layers: list[str], good_step: int, good: Snapshot, tried: list[dict]) -> dict:
    """The result: the culprit layers with how far their weights moved between the two steps."""
    F, model, bad = search.step, search.model, search.state
    moved = {L: movement(good.params, bad.params, [n for n in bad.params if owner(n) == L]) for L in layers}
    rows = [{"layer": L, "class": class_of(model, L), "index": layers.index(L), **moved[L]} for L in culprits]
    ranked = sorted(layers, key=lambda L: -float(moved[L]["relative_change"]))[:8]
    details = {
        "good_step": good_step,
        "bad_step": F,
        "snapshots_tried": tried,
        "layers": len(layers),
        "execution_order": layers,
        "largest_moves": [{"layer": L, "class": class_of(model, L), **moved[L]} for L in ranked],
    }
    if status == "incomplete":
        return search.out_of_replays(details, before=" before isolating the layers", culprits=rows)
    first = rows[0]
    names = ", ".join(f"{r['layer'] or '(root)'} ({r['class']})" for r in rows)
    answer = (
        f"Step {F} becomes non-finite when {'layer' if len(rows) == 1 else f'these {len(rows)} layers together:'} {names} "
        f"{'takes its' if len(rows) == 1 else 'take their'} step-{F} weights instead of step-{good_step}'s; "
        f"the first, {first['layer'] or '(root)'}, moved by {short(first['diff_norm'])} (max |change| {short(first['max_abs_diff'])}, "
        f"relative change {short(first['relative_change'])})."
    )
    return search.result(status, answer, rows, details)
