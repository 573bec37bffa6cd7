"""``bisect --over config``: the recorded setting whose change makes the failing step finite.

The failing step is replayed under the recording's own configuration (the settings a replay can
set, :data:`nanreplay.engine.settings.TOGGLES`: autocast dtype, float32 matmul precision, TF32,
reduced-precision reductions, attention kernels, deterministic algorithms, cuDNN flags,
``torch.compile`` backend, mode and options, the optimizer's fused / foreach kernels) and then
with some of them changed. The candidates are, without ``--against``, the settings whose recorded
value is not the conservative one (float32 math, no TF32, eager, the math attention kernel,
deterministic kernels, the unfused optimizer), each changed to it; with ``--against B``, the
settings the two runs differ in (:func:`nanreplay.core.settings.diff_settings`), each changed to
B's value. Settings that do nothing on the replay's device (the TF32 flags on a CPU) and, unless
the recorded failure is the optimizer update's, the optimizer's kernels are left out, and said so.

The search is adaptive group testing by binary splitting (Hwang, "A method for detecting all
defective members in a population by group testing", JASA 67, 1972): the candidates, most
numerics-relevant first (:data:`nanreplay.core.settings.SETTINGS`), are halved; the first half is
changed; when the step is then finite the culprit is in it, else in the second half. One culprit
among ``n`` costs at most ``1 + ceil(log2(n)) + 1`` replays (the replay as recorded, the halvings,
and, when the last halving was a "no", the culprit changed alone). When the culprit alone does not
make the step finite (two settings only fail together), delta debugging
(:func:`~nanreplay.search.ddmin.ddmin`) over every candidate finds the smallest set.

What no replay can change (a library version, the number of ranks, the reduce dtype, an
environment variable) is listed, with ``--against``, as the differences left for
``nanreplay diff``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch

from ..core.numerics import any_nonfinite
from ..core.settings import SETTINGS, UNSET, diff_settings, rule_for, settings_of, show_value
from ..engine.compiled import compiled_replay
from ..engine.settings import AUTOCAST_OFF, NO_REFERENCE, Variant, process_flags, toggle_for, variant
from ..engine.state import load_state, optimizer_from_info
from .common import BudgetExhausted, Search
from .ddmin import ddmin

__all__ = ["bisect_config", "Candidate"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A setting the search may change: its key, the recorded value and the value tried."""

    key: str
    recorded: Any
    to: Any

    def words(self) -> str:
        return f"{self.key} {_show(self.key, self.recorded)} -> {_show(self.key, self.to)}"

    def row(self) -> dict:
        rule = rule_for(self.key)
        return {"setting": self.key, "category": rule.category, "recorded": self.recorded, "changed_to": self.to, "why": rule.why}


def _show(key: str, v: Any) -> str:
    if key == "autocast" and v == AUTOCAST_OFF:
        return "off (float32)"
    return show_value(v)


@dataclasses.dataclass
class _Plan:
    base: dict[str, Any]                  # the recorded configuration every replay starts from
    candidates: list[Candidate]
    left_out: list[dict]                  # settings a replay could change but the search does not, with why
    cannot: list[dict]                    # --against: differences no replay can make
    compile_state: Optional[dict]
    update: bool                          # the recorded failure is the optimizer update's: replay it too


def bisect_config(search: Search) -> dict:
    """Run the search; the culprit is the setting (or smallest set of settings) whose change makes
    the failing step finite."""
    plan = _plan(search)
    trials = _Trials(search, plan)
    details: dict[str, Any] = {
        "against": str(search.against.path) if search.against is not None else None,
        "candidates": [c.row() for c in plan.candidates], "left_out": plan.left_out, "cannot_toggle": plan.cannot,
        "recorded": dict(plan.base), "replays_update": plan.update,
    }
    if search.against is not None:
        details["diff"] = trials.diff
    try:
        if not trials.fails([], "the recorded configuration"):
            return search.not_reproduced("under its recorded configuration", details)
        if not plan.candidates:
            return search.result("not in search space", _nothing_to_change(search, plan), [], details)
        found, how = _find(trials, plan.candidates)
    except BudgetExhausted:
        return search.out_of_replays(details)
    details["strategy"] = how
    if found is None:
        return search.result("not in search space", _stays_nonfinite(search, plan), [], details)
    return search.result("found", _answer(search, plan, found), [c.row() for c in found], details)


def _find(trials: "_Trials", cands: list[Candidate]) -> tuple[Optional[list[Candidate]], str]:
    """Binary splitting for one culprit (see the module docstring), then, when that culprit alone
    does not make the step finite, delta debugging over every candidate; ``(None, how)`` when even
    every candidate changed together leaves the step non-finite."""
    group, proven = list(cands), False
    while len(group) > 1:
        half = group[: len(group) // 2]
        if trials.fixes(half):
            group, proven = half, True
        else:
            group, proven = group[len(group) // 2:], False
    if proven or trials.fixes(group):
        return group, "binary splitting"
    if len(cands) == 1 or not trials.fixes(cands):
        return None, "binary splitting"
    return ddmin(cands, trials.fixes), "delta debugging"


class _Trials:
    """Replays of the failing step under the recorded configuration with some candidates changed,
    each set replayed at most once."""

    def __init__(self, search: Search, plan: _Plan) -> None:
        self.search, self.plan = search, plan
        self.cache: dict[frozenset, bool] = {}
        self.diff = diff_settings(search.bundle.meta, search.against.meta, a_name=str(search.bundle.path),
                                  b_name=str(search.against.path)) if search.against is not None else None

    def fixes(self, changed: list[Candidate]) -> bool:
        """Whether the step is finite with ``changed`` set to their new values. One replay (or none, cached)."""
        return not self.fails(changed, ", ".join(c.words() for c in changed))

    def fails(self, changed: list[Candidate], varied: str) -> bool:
        key = frozenset(c.key for c in changed)
        if key not in self.cache:
            values = {**self.plan.base, **{c.key: c.to for c in changed}}
            self.cache[key] = self._replay(variant(self.search.failing, values, self.plan.compile_state, self.search.device), varied)
        return self.cache[key]

    def _replay(self, v: Variant, varied: str) -> bool:
        s = self.search
        load_state(s.model, s.state)
        with process_flags(v.process):
            if v.compile is not None:
                settings, modules = v.compile
                with compiled_replay(s.model, settings, modules):
                    out = s.replay(v.record, s.state, varied, deterministic=v.deterministic, monitors=False, runner=s.model)
            else:
                out = s.replay(v.record, s.state, varied, deterministic=v.deterministic)
            bad = out.nonfinite
            if not bad and self.plan.update:
                bad = self._update_nonfinite(v)
                s.runner.trials[-1].update({"nonfinite": bad, "update_nonfinite": bad})
        return bad

    def _update_nonfinite(self, v: Variant) -> bool:
        """The optimizer update after the replayed backward pass, rebuilt from the bundle with the
        variant's ``fused`` / ``foreach`` and the step's recorded learning rates, on a copy of the
        optimizer state: whether it leaves a weight or a state tensor non-finite."""
        s = self.search
        params = dict(s.model.named_parameters())
        opt = optimizer_from_info(s.bundle.meta.get("optimizer") or {}, params, copy.deepcopy(s.state.optimizer),
                                  source=str(s.bundle.path), trusted=s.bundle.trusted)
        for g, lr in zip(opt.param_groups, s.failing.lrs):
            g.update({k: val for k, val in v.optimizer.items() if k in g})
            if lr is not None:  # as the step ran: a non-finite learning rate is a cause the update must show
                g["lr"] = lr
        with torch.no_grad():
            opt.step()
        state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return any_nonfinite(p.detach() for p in params.values()) or any_nonfinite(state)


def _plan(search: Search) -> _Plan:
    """The recorded configuration and the candidates (see the module docstring)."""
    meta = search.bundle.meta
    update = bool((meta.get("reason") or {}).get("nonfinite_update"))
    base = _recorded(search, settings_of(meta).values)
    compile_state = meta.get("compile")
    cannot: list[dict] = []
    left_out: list[dict] = []
    if search.against is None:
        wanted = _towards_conservative(base)
    else:
        theirs = search.against.meta
        if not (compile_state or {}).get("compiled") and (theirs.get("compile") or {}).get("compiled"):
            compile_state = theirs["compile"]  # compiling a step the recording ran eagerly: the other run's way
        wanted = _towards_other(meta, theirs, left_out, cannot)
    cands = []
    # most numerics-relevant first; the optimizer's kernels first of all when the failure is the update's
    for key, value, to in sorted(wanted, key=lambda w: (not (update and w[0].startswith("optimizer.")), *_order(w[0]))):
        why = _left_out_why(search, key, update)
        if why:
            left_out.append({"setting": key, "value": value, "why": why})
        else:
            cands.append(Candidate(key, value, to))
    _warn(search, left_out, cannot)
    return _Plan(base, cands, left_out, cannot, compile_state, update)


def _recorded(search: Search, mine: dict[str, Any]) -> dict[str, Any]:
    """The recorded settings a replay can set (a value a toggle refuses is left out, and said so);
    a compiled recording whose backend cannot run is replayed eagerly."""
    base: dict[str, Any] = {}
    for key, value in mine.items():
        t = toggle_for(key)
        if t is not None and t.accepts(value):
            base[key] = value
        elif t is not None:
            search.warnings.append(f"the recorded {key} = {show_value(value)} is not one a replay may set; the replays run without it")
    if mine.get("compile.compiled") and "compile.backend" not in base:
        base = {k: v for k, v in base.items() if not k.startswith("compile.")}
    return base


def _towards_conservative(base: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, conservative value)`` of each recorded setting not at its conservative
    value. ``None`` is torch's default (an inductor mode, foreach): no candidate; an optimizer
    kernel flag only when it was on."""
    out = []
    for k, v in base.items():
        ref = toggle_for(k).reference  # type: ignore[union-attr]
        if ref is not NO_REFERENCE and v is not None and v != ref and not (k.startswith("optimizer.") and v is not True):
            out.append((k, v, ref))
    return out


def _towards_other(meta: dict, theirs: dict, left_out: list[dict], cannot: list[dict]) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, the other run's value)`` of each difference a replay can set; the
    numerics-relevant differences no replay can make go to ``cannot``, values a toggle refuses to
    ``left_out``."""
    out = []
    for row in diff_settings(meta, theirs)["differences"]:
        t = toggle_for(row["key"])
        if t is None or not row["replayable"]:
            if row["numerics"]:
                cannot.append({"setting": row["key"], "a": row["a"], "b": row["b"], "why": "a replay cannot change it: compare the runs with nanreplay diff"})
        elif not t.accepts(row["b"]) or (row["a"] != UNSET and not t.accepts(row["a"])):
            left_out.append({"setting": row["key"], "value": row["b"], "why": "the other run's value is not one a replay may set"})
        else:
            out.append((row["key"], row["a"], row["b"]))
    return out


def _left_out_why(search: Search, key: str, update: bool) -> Optional[str]:
    """Why a setting is not a candidate on this replay, or ``None`` when it is."""
    t = toggle_for(key)
    assert t is not None
    if search.device.type not in t.devices:
        return f"it changes nothing on {search.device.type}; replay on {'/'.join(sorted(t.devices))} (--device) to test it"
    if t.scope == "update" and not update:
        return f"only the optimizer update depends on it, and step {search.step}'s failure comes before the update"
    return None


def _warn(search: Search, left_out: list[dict], cannot: list[dict]) -> None:
    elsewhere = [r["setting"] for r in left_out if "changes nothing on" in r["why"]]
    if elsewhere:
        search.warnings.append(f"the replays run on {search.device.type}, where {len(elsewhere)} recorded setting(s) change nothing "
                               f"({', '.join(elsewhere[:6])}{', ...' if len(elsewhere) > 6 else ''}): not toggled; replay with --device cuda to test them")
    if cannot:
        search.warnings.append(f"the runs differ in {len(cannot)} numerics-relevant setting(s) no replay can change "
                               f"({', '.join(r['setting'] for r in cannot[:6])}{', ...' if len(cannot) > 6 else ''}): nanreplay diff lists them")


def _order(key: str) -> tuple[int, int, str]:
    rule = rule_for(key)
    return rule.rank, SETTINGS.index(rule), key


def _against(search: Search) -> str:
    return f" (the value in {search.against.path.name})" if search.against is not None else ""


def _answer(search: Search, plan: _Plan, found: list[Candidate]) -> str:
    if len(found) == 1:
        c = found[0]
        head = (f"Step {search.step} becomes finite when {c.key} changes from {_show(c.key, c.recorded)} to {_show(c.key, c.to)}"
                f"{_against(search)}, every other setting as recorded: {rule_for(c.key).why}.")
    else:
        head = (f"Step {search.step} becomes finite only when these settings change together{_against(search)}: "
                + "; ".join(c.words() for c in found) + ".")
    return head + _cannot_tail(plan)


def _cannot_tail(plan: _Plan) -> str:
    if not plan.cannot:
        return ""
    shown = ", ".join(f"{r['setting']} ({show_value(r['a'])} vs {show_value(r['b'])})" for r in plan.cannot[:4])
    more = f" and {len(plan.cannot) - 4} more" if len(plan.cannot) > 4 else ""
    return f" The runs also differ in what no replay can change: {shown}{more}; nanreplay diff lists them."


def _nothing_to_change(search: Search, plan: _Plan) -> str:
    if search.against is not None:
        head = f"Step {search.step}: the two runs differ in no setting a replay can change on {search.device.type}."
    else:
        head = (f"Step {search.step} ran with every setting a replay can change on {search.device.type} already at its conservative value "
                "(float32 math, no TF32, eager, deterministic kernels): the configuration a replay can change is not the cause.")
    return head + (_cannot_tail(plan) or " Compare it with a healthy run: nanreplay diff A B, or bisect --over config --against B.")


def _stays_nonfinite(search: Search, plan: _Plan) -> str:
    to = "the other run's values" if search.against is not None else "their conservative values"
    return (f"Step {search.step} stays non-finite with every candidate setting changed to {to} "
            f"({', '.join(c.key for c in plan.candidates)}): the configuration a replay can change is not the cause."
            + (_cannot_tail(plan) or " Look at the data (--over samples) or the weights (--over layers)."))
