"""Text rendering of a diagnosis (the ``nanreplay replay`` report). The library never prints:
these functions return strings, and the CLI owns the terminal."""

from __future__ import annotations

import shlex
from typing import Any, Callable, Optional

from ..core.inert import inert_tree
from ..core.rollback import episode_phrase, restore_phrase, skip_phrase
from ..core.results import CompileCheck, ConfigDiff, DiagnosisDict, Health, Origin
from ..core.settings import show_value
from .summary import culprit_phrase, difference_phrase, fix_sentence, number_text as _num

__all__ = ["render_report", "render_diff", "fmt_health", "fmt_indices", "styler"]

#: the colour of each reproduction verdict
_VERDICT_COLOR = {"reproduced exactly": "green", "reproduced": "yellow", "not reproduced": "red"}


def styler(color: bool) -> Callable[..., str]:
    """``style(text, **click_style_kwargs)``: ``click.style`` when ``color`` is true, else the
    text unchanged. Styles only wrap text, so a styled report with its ANSI codes removed is
    exactly the plain one (pad before styling to keep columns aligned)."""
    if not color:
        return lambda text, **_: text
    import click

    def style(text: str, **kw: Any) -> str:
        kw = {k: v for k, v in kw.items() if v not in (None, False)}
        return click.style(text, **kw) if kw else text

    return style


_PHASE_COLOR = {"forward": "blue", "backward": "magenta", "loss": "yellow", "input": "cyan", "optimizer": "green", "weights": "red"}
_ROLE_COLOR = {"producer": "red", "contains producer": "red", "propagator": "yellow"}


def _hst(text: str, st: Callable[..., str]) -> str:
    """A (padded) health string, red when it counts non-finite values (``finite`` stays plain)."""
    return text if text.strip() in ("finite", "-") else st(text, fg="red")


def fmt_health(h: Optional[Health]) -> str:
    """``finite`` or ``3 NaN, 1 +Inf of 4096`` for a Health dict; ``-`` when absent."""
    if not h:
        return "-"
    bad = [f"{h[k]} {lbl}" for k, lbl in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")) if h.get(k)]
    return (", ".join(bad) + f" of {h['numel']}") if bad else "finite"


def fmt_indices(indices: Any, size: Optional[int] = None, count: Optional[int] = None, unit: str = "rows") -> str:
    """Row (or sample) indices as the reports show them, never silently cut: ``all 32 rows`` when
    every one of ``size`` is listed or counted, else ``rows [0..15, 20] of 32`` (runs of three or
    more as ``a..b``), with ``and N more`` when ``count`` says the list holds only the first ones."""
    idx = sorted({int(i) for i in indices or [] if isinstance(i, (int, float)) and not isinstance(i, bool)})
    total = max(int(count), len(idx)) if isinstance(count, int) else len(idx)
    if size and total >= size:
        return f"all {size} {unit}"
    runs: list[str] = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        runs += [f"{idx[i]}..{idx[j]}"] if j - i >= 2 else [str(v) for v in idx[i:j + 1]]
        i = j + 1
    more = f" and {total - len(idx)} more" if total > len(idx) else ""
    return f"{unit} [{', '.join(runs)}{more}]" + (f" of {size}" if size else "")


def _origin_details(o: Origin, st: Callable[..., str]) -> list[str]:
    """Source line, autograd node, dtype/shape, health and optimizer fields of the origin."""
    out = []
    src = o.get("source")
    if src:
        out.append(f"  source:        {st(src['file'] + ':' + str(src['line']), fg='cyan')} in {src['function']}" + (f": {st(src['code'], bold=True)}" if src.get("code") else ""))
    if o.get("node"):
        out.append(f"  autograd node: {o['node']} (backward of forward op {o.get('forward_op')})")
    if o.get("aten"):
        out.append(f"  aten op:       {o['aten']}  {o.get('dtype')} {o.get('shape')}")
    if o.get("inputs") or o.get("output"):
        out.append(f"  op health:     inputs {_hst(fmt_health(o.get('inputs')), st)}; output {_hst(fmt_health(o.get('output')), st)}")
    for k in ("param", "state_key", "optimizer"):
        if o.get(k):
            out.append(f"  {k.replace('_', ' ') + ':':<15}{o[k]}")
    return out


def _compile_line(c: CompileCheck, st: Callable[..., str]) -> str:
    """``eager finite; compiled (backend inductor) NaN in loss and gradients: only under compile``."""
    def said(bad: Optional[bool], parts: Optional[list], kinds: Optional[str]) -> str:
        if bad is None:
            return st("failed: " + str(c.get("error")), fg="yellow")
        return st(f"{kinds or 'non-finite'} in {' and '.join(parts or [])}", fg="red") if bad else "finite"

    out = (f"eager {said(c.get('eager'), c.get('eager_nonfinite'), c.get('eager_kinds'))}; compiled (backend {c.get('backend')}) "
           f"{said(c.get('compiled'), c.get('compiled_nonfinite'), c.get('compiled_kinds'))}")
    if c.get("only_under_compile"):
        out += st(": only under compile", fg="red", bold=True)
    if c.get("compiled_reproduction"):
        out += f"; compiled replay vs recording: {c['compiled_reproduction']}"
    if c.get("max_abs_diff") is not None:
        out += f"; max |eager - compiled| gradient {_num(c['max_abs_diff'])}"
    return out


def _compiled_lines(c: CompileCheck, diag: DiagnosisDict, st: Callable[..., str]) -> list[str]:
    """The comparison's columns, the compiler stage, and the op found inside the compiled region
    with its source line and samples."""
    out = []
    rows = c.get("backends") or []
    if len(rows) > 1 or c.get("stage"):
        cols = ", ".join(f"{r['backend']} " + ("failed" if r.get("compiled") is None else
                                                 f"{r.get('kinds') or 'non-finite'}" if r.get("compiled") else "finite") for r in rows)
        stage = f": {st(str(c['stage']), bold=True)} ({c.get('stage_detail')})" if c.get("stage") else ""
        out.append(f"  compiler:      by backend: {cols}{stage}")
    cul = c.get("culprit")
    if cul:
        smp = diag.get("samples") or {}
        rows_said = "every sample" if smp.get("batch_level") else (f"samples {smp['indices']}" if smp.get("indices") else "")
        out.append(f"  compiled op:   {st(culprit_phrase(c), fg='red')}" + (f"; {rows_said}" if rows_said else ""))
        src = cul.get("source")
        if src:
            out.append(f"                 {st(str(src['file']) + ':' + str(src['line']), fg='cyan')} in {src.get('function')}"
                       + (f": {st(src['code'], bold=True)}" if src.get("code") else ""))
    elif c.get("localize_error"):
        out.append(f"  compiled op:   not found ({c['localize_error']})")
    return out


def render_report(diag: DiagnosisDict, *, rows: int = 8, color: bool = False) -> str:
    """The human-readable replay report: one actionable sentence first, then the origin, the
    reproduction verdict, and the health table of the modules around the origin.

    Args:
        diag: the diagnosis dict (``docs/report.md``).
        rows: rows of the health table and of the births list.
        color: add ANSI styles (bold sentence, coloured verdicts, NaN/Inf counts and roles); the
            text without them is exactly the ``color=False`` report.

    Every string of ``diag`` is made inert first (:func:`nanreplay.core.inert.inert`): control
    characters from a bundle, newlines included, show as escapes (``\\x1b``, ``\\r``, ``\\n``)
    instead of acting on the terminal or forging a line of the report.
    """
    diag = inert_tree(diag, one_line=True)
    st = styler(color)
    lines = [st(diag.get("summary", ""), bold=True), ""]
    lines.append(f"  step:          {diag.get('step')}")
    lines.append(f"  phase:         {st(str(diag.get('phase')), fg='red' if diag.get('phase') != 'none' else None, bold=True)}")
    lines.extend(_origin_lines(diag, st))
    cls = diag.get("classification")
    if cls:
        lines.append(f"  verdict:       {st(cls['cause'], fg='red', bold=True)} ({cls['detail']})")
        for e in cls.get("evidence", []):
            lines.append(f"                 - {e}")
        fix = fix_sentence(diag)
        if fix:
            verified = (cls.get("fix") or {}).get("verified")
            lines.append(f"  fix:           {st(fix, fg={True: 'green', False: 'yellow'}.get(verified), bold=verified is True)}")
    if diag.get("cause"):
        lines.append(f"  cause:         {diag['cause']}")
    lines.extend(_chain_lines(diag.get("chain") or []))
    r = diag.get("reproduction") or {}
    lines.append(f"  reproduction:  {st(str(r.get('verdict')), fg=_VERDICT_COLOR.get(r.get('verdict')), bold=True)}"
                 + (f" from {r['replayed_from']}" if r.get("replayed_from") else "") + f" ({difference_phrase(r, _num)})")
    if r.get("detail"):
        lines.append(f"                 {r['detail']}")
    lines.append(f"  replay mode:   {diag.get('mode')}" + (f" on {diag['device']}" if diag.get("device") else ""))
    if diag.get("model_source"):
        lines.append(f"  model:         {diag['model_source']}")
    if diag.get("compile"):
        lines.append(f"  torch.compile: {_compile_line(diag['compile'], st)}")
        lines.extend(_compiled_lines(diag["compile"], diag, st))
    lines.extend(_plan_lines(diag))
    for w in diag.get("warnings", []):
        lines.append(f"  {st('warning:', fg='yellow')}       {w}")
    lines.extend(_births_lines(diag.get("births") or [], rows, st))
    lines.extend(_health_lines(diag.get("health") or [], rows, st))
    return "\n".join(lines)


def _plan_lines(diag: DiagnosisDict) -> list[str]:
    """The rollback plan (restore point, batches to skip, the episode, states refused) and the loss
    scale, one line each (``docs/report.md``, ``rollback`` and ``loss_scale``)."""
    out = []
    plan = diag.get("rollback") or {}
    if plan.get("step") is not None:
        first, last = plan["first_abnormal_step"], plan["step"]
        out.append(f"  rollback:      {restore_phrase(plan)}, skip {skip_phrase(first, last)}")
        if plan.get("episode"):
            out.append(f"  episode:       {episode_phrase(plan['episode'])}")
        jump = plan.get("lr_jump")
        if jump:
            out.append(f"  lr jump:       {jump['previous']:.4g} -> {jump['lr']:.4g} at step {jump['step']}: restart below it")
        for r in plan.get("rejected") or []:
            out.append(f"  not restored:  {r['source']} of step {r['step']}" + (f" ({r['path']})" if r.get("path") else "") + f": {r['why']}")
    ls = diag.get("loss_scale")
    if ls:
        hist = " -> ".join(f"{_num(sc)} (step {stp})" for stp, sc in ls.get("history") or [])
        out.append(f"  loss scale:    {_num(ls.get('scale'))}" + (f" ({_num(ls['scale_after'])} after the step)" if ls.get("scale_after") is not None else "")
                   + (f"; failure: {ls['failure']}" if ls.get("failure") else "") + (f"; history {hist}" if hist else ""))
    return out


def _origin_lines(diag: dict, st: Callable[..., str]) -> list[str]:
    """The origin: where, its gradient, tensor and samples (every one, or the whole batch), its details."""
    o = diag.get("origin") or {}
    if not o:
        return []
    where = o.get("module")
    lines = ["  origin:        " + st(((where or "(root module)") if where is not None else o.get("leaf") or o.get("tensor")
                                    or ("outside the model" if diag.get("phase") in ("forward", "loss", "backward") else "-"))
                                   + (f" ({o['class']})" if o.get("class") else "") + (f", op {o['op']}" if o.get("op") else ""), bold=True)]
    for k, label in (("first_nonfinite_gradient", "first non-finite gradient:"), ("tensor", "tensor:"), ("samples", "samples:")):
        if o.get(k) not in (None, []):
            lines.append(f"  {label:<14} {o[k]}")  # a label longer than the column still gets its space
    smp = diag.get("samples") or {}
    if smp.get("batch_level"):
        lines.append(f"  samples:       the whole batch of {smp.get('batch_size')}" + (f" ({smp['reason']})" if smp.get("reason") else ""))
    return lines + _origin_details(o, st)


def _chain_lines(chain: list) -> list[str]:
    """The causal chain, numbered, when it has more than one link."""
    if len(chain) <= 1:
        return []
    lines = ["  causal chain (execution order):"]
    for i, c in enumerate(chain, 1):
        src = c.get("source")
        lines.append(
            f"    {i}. {c['kinds']} in {c['phase']} op {c['op']}" + (f" ({c['node']})" if c.get("node") else "")
            + (f" in module {c['module'] or '(root)'}" if c.get("module") is not None else "")
            + (f" at {src['file']}:{src['line']}" if src else "")
        )
    return lines


def _births_lines(births: list, rows: int, st: Callable[..., str]) -> list[str]:
    """The first ``rows`` births, one line each (phase, op, module, output health)."""
    if not births:
        return []
    lines = ["", st("  first non-finite values born (op level, in execution order):", bold=True)]
    for b in births[:rows]:
        phase = st(f"{b['phase']:<9}", fg=_PHASE_COLOR.get(b["phase"]))
        module = "(outside the model)" if b["module"] is None else b["module"]
        lines.append(f"    {phase} {b['op']:<28} module {module!s:<24} output {_hst(fmt_health(b.get('output')), st)}")
    return lines


def _health_lines(table: list, rows: int, st: Callable[..., str]) -> list[str]:
    """The forward health table: its first ``rows`` module calls, in execution order."""
    if not table:
        return []
    lines = ["", st("  forward health by module (execution order):", bold=True),
             st(f"    {'#':>3}  {'module':<28} {'class':<18} {'role':<17} {'inputs':<10} {'output':<24} {'max |finite|':>12}", dim=True)]
    for e in table[:rows]:
        out = e.get("output") or {}
        role = st(f"{e['role']:<17}", fg=_ROLE_COLOR.get(e["role"]), bold=e["role"] == "producer")
        h_in = _hst(f"{('finite' if e.get('inputs_finite') else 'non-finite'):<10}", st)
        h_out = _hst(f"{fmt_health(out):<24.24}", st)
        lines.append(
            f"    {e['index']:>3}  {(e['module'] or '(root)'):<28.28} {e['class']:<18.18} {role} {h_in} {h_out} {_num(out.get('absmax')):>12}"
        )
    return lines


def _side_name(side: dict) -> str:
    if side.get("here"):
        return "this process"
    return f"{side.get('bundle')}" + (f" (failing step {side['step']})" if side.get("step") is not None else "")


def render_diff(diff: ConfigDiff, *, color: bool = False, rows: int = 40) -> str:
    """The text of ``nanreplay diff``: the two sides, then the differences that can change
    numerics, most likely first (``rank``, :data:`nanreplay.core.settings.SETTINGS`) with why,
    then the others, the count of equal settings and of those only one side records, and the
    next command. Every string from a bundle is made inert (``core.inert``); at most ``rows`` of
    each group are shown (the JSON has them all)."""
    st = styler(color)
    d = inert_tree(diff, one_line=True)
    a, b = d["a"], d["b"]
    out = [f"A: {st(_side_name(a), bold=True)}", f"B: {st(_side_name(b), bold=True)}"]
    numerics = [r for r in d["differences"] if r["numerics"]]
    other = [r for r in d["differences"] if not r["numerics"]]
    out.append("")
    if not d["differences"]:
        out.append(st("No recorded setting differs.", bold=True))
    else:
        out.append(st(f"{len(numerics)} difference(s) that can change numerics, most likely first" + (":" if numerics else "."), bold=True))
    width = max([len(r["key"]) for r in numerics[:rows]] + [7])
    vw = max([len(show_value(r[k])) for r in numerics[:rows] for k in ("a", "b")] + [4])
    vw = min(vw, 40)
    if numerics:
        out.append(f"  {'rank':<5} {'setting':<{width}}  {'A':<{vw}}  {'B':<{vw}}  category")
    for r in numerics[:rows]:
        tag = "  [bisect --over config can toggle it]" if r["replayable"] else ""
        key = f"{r['key']:<{width}}"
        out.append(f"  {r['rank']:<5} {st(key, fg='red' if r['rank'] <= 2 else None)}  "
                   f"{show_value(r['a'])[:vw]:<{vw}}  {show_value(r['b'])[:vw]:<{vw}}  {r['category']}{tag}")
        out.append(f"  {'':<5} {st(r['why'], fg='bright_black')}")
    if len(numerics) > rows:
        out.append(f"  ... and {len(numerics) - rows} more (--json lists them all)")
    if other:
        out.append("")
        out.append(f"{len(other)} other difference(s), which do not change numerics:")
        for r in other[:rows]:
            out.append(f"  {r['key']}: {show_value(r['a'])} vs {show_value(r['b'])}")
        if len(other) > rows:
            out.append(f"  ... and {len(other) - rows} more")
    out.append("")
    unknown = d["unknown"]
    out.append(f"{d['same']} setting(s) the same" + (f"; {len(unknown)} recorded in one bundle only (an older writer): "
                                                      + ", ".join(u["key"] for u in unknown[:8]) + (", ..." if len(unknown) > 8 else "") if unknown else "") + ".")
    for n in d["notes"]:
        out.append(f"note: {n}")
    if any(r["replayable"] for r in numerics) and not b.get("here"):
        out.append(f"next: nanreplay bisect {shlex.quote(a['bundle'])} --over config --against {shlex.quote(b['bundle'])}  "
                   "(replays A's failing step with the settings a replay can change set to B's values)")
    return "\n".join(out)
