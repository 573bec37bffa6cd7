"""``bisect --over layers``: which layers' weight change makes the step go wrong.

When the NaN comes steps after the corruption, by the failing step every layer has moved and any
one alone is enough, so the search first finds where the corruption began: the steps search's
walk (:func:`~nanreplay.search.steps.first_abnormal`) finds the first abnormal step before the
failing one, and the search runs in the :mod:`~nanreplay.search.window` around it, between the
last healthy state and the first abnormal one: the smallest set of layers whose change alone makes
the batch after it leave the healthy range (non-finite, or a grad norm ``threshold`` x that of the
healthy weights). The result then says which layers' weights were already abnormal at the first
abnormal step and which the corruption spread to by the failing step.

When the walk finds no abnormal step before the failing one (or cannot walk: a gap in the ring
buffer, an optimizer it cannot rebuild), the search runs between the weights of an earlier finite
step and the failing step's pre-step weights: the smallest set of layers whose change alone makes
the failing step's batch non-finite. Its baseline is the newest snapshot under which the failing
batch replays finite (older snapshots are tried when the newest already holds blown-up weights).

Layers are the modules that own parameters, in forward execution order; a layer's own buffers
move with it. The search is delta debugging (:func:`~nanreplay.search.ddmin.ddmin`) over the
layers, so a single culprit costs about ``2 * log2(layers)`` replays, plus one for the step as
recorded, one per step walked, and two for the window's ends (or one per snapshot tried).

Needs a snapshot of a step before the failing one (``Recorder(snapshot_every=...)``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

from ..engine.state import load_state
from ..errors import ModelMismatchError, ReplayError, UntrustedBundleError
from ..format.records import Snapshot, scalar_history_records
from .common import BudgetExhausted, Search, class_of, held_snapshots, movement, owner, param_layers, short
from .ddmin import ddmin
from .steps import Walk, first_abnormal
from .window import Window, abnormal_layers, judge, window_from

__all__ = ["bisect_layers"]


def bisect_layers(search: Search) -> dict:
    """Run the search; the result's culprits are the layers with their weight movement."""
    F = search.step
    earlier = held_snapshots(search, F - 1)
    out, order = search.replay_as_recorded()
    layers = param_layers(search.model, order)
    if not out.nonfinite:
        return search.not_reproduced("with its recorded weights", {"layers": len(layers)})
    try:
        # leave replays for the window's two ends and ddmin over the layers (one culprit)
        walk: Optional[Walk] = first_abnormal(search, reserve=2 + 2 * math.ceil(math.log2(max(len(layers), 2))))
    except BudgetExhausted:
        return search.out_of_replays({"layers": layers}, before=f" before finding the first abnormal step before step {F}")
    except (ReplayError, ModelMismatchError, UntrustedBundleError) as e:
        search.warnings.append(f"could not walk the steps before step {F} to find the first abnormal one ({e}); "
                               "searched between the newest finite snapshot and the failing step instead")
        walk = None
    win = window_from(search, walk) if walk is not None else None
    if walk is not None and win is not None:
        res = _search_window(search, layers, walk, win)
        if res is not None:
            return res
    return _search_failing(search, layers, earlier)


def _search_failing(search: Search, layers: list[str], earlier: list[int]) -> dict:
    """The search between a finite snapshot and the failing step's pre-step weights."""
    F = search.step
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


def _search_window(search: Search, layers: list[str], walk: Walk, win: Window) -> Optional[dict]:
    """The search between the window's good and bad states on its probe batch (module docstring);
    ``None`` when the bad state does not make the probe batch abnormal (the caller falls back)."""
    if win.good is None or win.good_step is None:
        return _no_healthy_snapshot(search, layers, walk, win)
    G, B, P, thr = win.good_step, win.bad_step, win.probe_step, search.threshold
    base: dict[str, Any] = {"good_step": G, "bad_step": B, "probe_step": P, "first_abnormal": win.first_abnormal, "walk": walk.timeline,
                            "layers": len(layers), "execution_order": layers}
    try:
        load_state(search.model, win.good)
        ref = search.replay(win.probe, win.good, f"step {P}'s batch, every layer at step {G}'s weights (the last healthy state)")
        if ref.nonfinite:
            answer = (f"Step {P}'s batch is non-finite even with every layer at step {G}'s weights, the last healthy state "
                      f"before the first abnormal step {win.step}: the cause is not in the weights; look at the data of step {P}.")
            return search.result("not in search space", answer, [], base)
        load_state(search.model, win.bad)
        full = search.replay(win.probe, win.bad, f"step {P}'s batch, every layer at step {B}'s weights (the first abnormal state)")
    except BudgetExhausted:
        return search.out_of_replays(base, before=" before testing the first abnormal step's weights")
    why = judge(full, ref, thr)
    data_why = walk.grad_anomalies(ref, ref.grad_norm) if win.kind == "step" else []
    if why is None and data_why:
        return _in_the_data(search, layers, walk, win, data_why, base)
    if why is None:
        search.warnings.append(
            f"the steps search's first abnormal step is {win.step} ({'; '.join(win.first_abnormal['anomalies'])}), but step {P}'s batch "
            f"stays in the healthy range with step {B}'s weights next to step {G}'s; searched between the newest finite snapshot "
            f"and the failing step {search.step} instead")
        return None
    reasons: dict[frozenset, str] = {}

    def fails(changed: list[str]) -> bool:
        snap = _mixed(win.bad, win.good, layers, changed)
        load_state(search.model, snap)
        varied = (f"step {P}'s batch, {len(changed)} of {len(layers)} layers at step {B}'s weights, the others at step {G}'s: "
                  + ", ".join(L or "(root)" for L in changed[:6]) + (", ..." if len(changed) > 6 else ""))
        r = judge(search.replay(win.probe, snap, varied), ref, thr)
        if r is not None:
            reasons[frozenset(changed)] = r
        return r is not None

    try:
        culprits, status = ddmin(layers, fails), "found"
    except BudgetExhausted:
        culprits, status = layers, "incomplete"
    return _report_window(search, status, culprits, layers, walk, win, reasons.get(frozenset(culprits), why), base)


def _report_window(search: Search, status: str, culprits: list[str], layers: list[str], walk: Walk, win: Window, why: str, base: dict) -> dict:
    """The result of the window search: the culprits with their movement from the good to the bad
    state, the layers already abnormal at the first abnormal step and those the corruption spread to."""
    F, model, thr = search.step, search.model, search.threshold
    assert win.good is not None and win.good_step is not None
    G, B, A = win.good_step, win.bad_step, win.step
    at_first = abnormal_layers(win.good, win.bad, B - G, layers, walk, thr)
    at_failing = abnormal_layers(win.good, search.state, F - G, layers, walk, thr)
    corrupted = [L for L in layers if at_first[L]["abnormal"]]
    spread = [L for L in layers if at_failing[L]["abnormal"] and not at_first[L]["abnormal"] and L not in culprits]
    keys = ("diff_norm", "max_abs_diff", "relative_change", "nonfinite_values")
    rows = [{"layer": L, "class": class_of(model, L), "index": layers.index(L), **{k: at_first[L][k] for k in keys}} for L in culprits]
    ranked = sorted(layers, key=lambda L: -float(at_first[L]["relative_change"]))[:8]
    details = {
        **base,
        "largest_moves": [{"layer": L, "class": class_of(model, L), **{k: at_first[L][k] for k in keys}} for L in ranked],
        "at_first_abnormal": [{"layer": L, **at_first[L]} for L in layers],
        "at_failing": [{"layer": L, **at_failing[L]} for L in layers],
    }
    window = {"first_abnormal_step": A, "anomalies": list(win.first_abnormal.get("anomalies", [])), "good_step": G, "bad_step": B,
              "probe_step": win.probe_step, "failing_step": F, "corrupted": corrupted, "spread_to": spread}
    if status == "incomplete":
        res = search.out_of_replays(details, before=" before isolating the layers", culprits=rows)
        res["window"] = window
        return res
    first = rows[0]
    names = ", ".join(f"{r['layer'] or '(root)'} ({r['class']})" for r in rows)
    one = len(rows) == 1
    answer = (
        f"Step {F} becomes non-finite {F - A} step(s) after {'layer' if one else f'these {len(rows)} layers together,'} {names}"
        f"{'' if one else ','} {'was' if one else 'were'} corrupted at step {A} "
        f"({'' if win.kind == 'update' else f'the replay of step {A}: '}{'; '.join(win.first_abnormal.get('anomalies', []))}): "
        f"with only {'its' if one else 'their'} step-{B} weights (the others at step {G}'s), step {win.probe_step}'s batch already "
        f"leaves the healthy range ({why}); {first['layer'] or '(root)'} moved by {short(first['diff_norm'])} "
        f"(max |change| {short(first['max_abs_diff'])}, relative change {short(first['relative_change'])}). "
        + _spread_sentence(F, spread, [L for L in corrupted if L not in culprits])
    )
    res = search.result(status, answer, rows, details)
    res["window"] = window
    return res


def _in_the_data(search: Search, layers: list[str], walk: Walk, win: Window, why: list[str], base: dict) -> dict:
    """The result when the first abnormal step's batch is abnormal on the last healthy weights too,
    and no worse on its own: the trouble began with that batch, which then spread into the weights."""
    F, A = search.step, win.step
    assert win.good is not None and win.good_step is not None
    at_failing = abnormal_layers(win.good, search.state, F - win.good_step, layers, walk, search.threshold)
    spread = [L for L in layers if at_failing[L]["abnormal"]]
    answer = (
        f"Step {A}, the first abnormal step, leaves the healthy range even with every layer at step {win.good_step}'s weights, "
        f"the last healthy state ({'; '.join(why)}), and no further with its own: the trouble began with the data of step {A}, "
        f"not with a layer's weights; look at step {A}'s batch. " + _spread_sentence(F, spread, []).replace(" other layer(s)", " layer(s)")
    )
    res = search.result("not in search space", answer, [], {**base, "at_failing": [{"layer": L, **at_failing[L]} for L in layers]})
    res["window"] = {"first_abnormal_step": A, "anomalies": list(win.first_abnormal.get("anomalies", [])), "good_step": win.good_step,
                     "bad_step": win.bad_step, "probe_step": win.probe_step, "failing_step": F, "corrupted": [], "spread_to": spread}
    return res


def _spread_sentence(F: int, spread: list[str], also: list[str]) -> str:
    """What the corruption did between the first abnormal step and the failing step, in words."""
    names = lambda ls: ", ".join(L or "(root)" for L in ls[:8]) + (f" and {len(ls) - 8} more" if len(ls) > 8 else "")  # noqa: E731
    out = (f"By step {F} the corruption had spread to {len(spread)} other layer(s): {names(spread)}." if spread
           else f"By step {F} no other layer's weights had left their healthy range.")
    if also:
        out += f" Also abnormal at the first abnormal step, though not needed for it: {names(also)}."
    return out


def _no_healthy_snapshot(search: Search, layers: list[str], walk: Walk, win: Window) -> dict:
    """The result when the oldest step walked is already abnormal: there is no healthy state to compare with."""
    A, F = win.step, search.step
    onset = _history_onset(search)
    where = (f"; the scalar history shows the grad norm leaving the healthy range at step {onset}" if onset is not None and onset < A else "")
    answer = (
        f"No healthy snapshot: step {A}, the oldest step whose weights the ring buffer holds, is already out of the healthy range "
        f"({'; '.join(win.first_abnormal.get('anomalies', []))}){where}, so the corruption began before it and the first corrupted "
        f"layer cannot be named from this bundle. Keep a snapshot from before it: a larger capacity (and memory_budget) with "
        "snapshot_every, or restore the rollback plan's healthy snapshot and record again."
    )
    res = search.result("not in search space", answer, [], {"first_abnormal": win.first_abnormal, "walk": walk.timeline,
                                                              "layers": len(layers), "execution_order": layers, "history_onset": onset})
    res["window"] = {"first_abnormal_step": A, "anomalies": list(win.first_abnormal.get("anomalies", [])), "good_step": None,
                     "bad_step": win.bad_step, "probe_step": win.probe_step, "failing_step": F, "corrupted": [], "spread_to": [],
                     "history_onset": onset}
    return res


def _history_onset(search: Search, min_history: int = 2) -> Optional[int]:
    """The first step of the bundle's scalar history whose grad norm exceeds ``threshold`` x the
    median of the earlier steps' (or is non-finite), else ``None``."""
    hist: list[float] = []
    for r in scalar_history_records(search.bundle.meta.get("scalar_history")):
        g = r.grad_norm
        if g is None:
            continue
        if not math.isfinite(g) or (len(hist) >= min_history and statistics.median(hist) > 0 and g > search.threshold * statistics.median(hist)):
            return r.step
        hist.append(g)
    return None
