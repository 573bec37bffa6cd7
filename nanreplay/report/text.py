"""Text rendering of a diagnosis (the ``nanreplay replay`` report). The library never prints:
these functions return strings, and the CLI owns the terminal."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["render_report", "fmt_health"]


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.4g}"


def fmt_health(h: Optional[dict]) -> str:
    """``finite`` or ``3 NaN, 1 +Inf of 4096`` for a Health dict; ``-`` when absent."""
    if not h:
        return "-"
    bad = [f"{h[k]} {lbl}" for k, lbl in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")) if h.get(k)]
    return (", ".join(bad) + f" of {h['numel']}") if bad else "finite"


def _origin_details(o: dict) -> list[str]:
    """Source line, autograd node, dtype/shape, health and optimizer fields of the origin."""
    out = []
    src = o.get("source")
    if src:
        out.append(f"  source:        {src['file']}:{src['line']} in {src['function']}" + (f": {src['code']}" if src.get("code") else ""))
    if o.get("node"):
        out.append(f"  autograd node: {o['node']} (backward of forward op {o.get('forward_op')})")
    if o.get("aten"):
        out.append(f"  aten op:       {o['aten']}  {o.get('dtype')} {o.get('shape')}")
    if o.get("inputs") or o.get("output"):
        out.append(f"  op health:     inputs {fmt_health(o.get('inputs'))}; output {fmt_health(o.get('output'))}")
    for k in ("param", "state_key", "optimizer"):
        if o.get(k):
            out.append(f"  {k.replace('_', ' ') + ':':<15}{o[k]}")
    return out


def render_report(diag: dict, *, rows: int = 8) -> str:
    """The human-readable replay report: one actionable sentence first, then the origin, the
    reproduction verdict, and the health table of the modules around the origin."""
    lines = [diag.get("summary", ""), ""]
    o = diag.get("origin") or {}
    lines.append(f"  step:          {diag.get('step')}")
    lines.append(f"  phase:         {diag.get('phase')}")
    if o:
        where = o.get("module")
        lines.append(
            "  origin:        "
            + ("outside the model" if where is None and o.get("kind") == "outside the model" else (where or "(root module)") if where is not None else (o.get("leaf") or "-"))
            + (f" ({o['class']})" if o.get("class") else "")
            + (f", op {o['op']}" if o.get("op") else "")
        )
        for k in ("first_nonfinite_gradient", "tensor", "samples"):
            if o.get(k) not in (None, []):
                lines.append(f"  {k.replace('_', ' ')+':':<15}{o[k]}")
        lines.extend(_origin_details(o))
    cls = diag.get("classification")
    if cls:
        lines.append(f"  verdict:       {cls['cause']} ({cls['detail']})")
        for e in cls.get("evidence", []):
            lines.append(f"                 - {e}")
    if diag.get("cause"):
        lines.append(f"  cause:         {diag['cause']}")
    chain = diag.get("chain") or []
    if len(chain) > 1:
        lines.append("  causal chain (execution order):")
        for i, c in enumerate(chain, 1):
            src = c.get("source")
            lines.append(
                f"    {i}. {c['kinds']} in {c['phase']} op {c['op']}" + (f" ({c['node']})" if c.get("node") else "")
                + (f" in module {c['module'] or '(root)'}" if c.get("module") is not None else "")
                + (f" at {src['file']}:{src['line']}" if src else "")
            )
    r = diag.get("reproduction") or {}
    lines.append(f"  reproduction:  {r.get('verdict')} (max abs difference of finite gradient values: {_num(r.get('max_abs_diff'))})")
    if r.get("detail"):
        lines.append(f"                 {r['detail']}")
    lines.append(f"  replay mode:   {diag.get('mode')}" + (f" on {diag['device']}" if diag.get("device") else ""))
    for w in diag.get("warnings", []):
        lines.append(f"  warning:       {w}")
    births = diag.get("births") or []
    if births:
        lines.append("")
        lines.append("  first non-finite values born (op level, in execution order):")
        for b in births[:rows]:
            lines.append(
                f"    {b['phase']:<9} {b['op']:<28} module {b['module'] if b['module'] is not None else '(outside the model)'!s:<24} output {fmt_health(b.get('output'))}"
            )
    table = diag.get("health") or []
    if table:
        lines.append("")
        lines.append("  forward health by module (execution order):")
        lines.append(f"    {'#':>3}  {'module':<28} {'class':<18} {'role':<17} {'inputs':<10} {'output':<24} {'max |finite|':>12}")
        for e in table[:rows]:
            out = e.get("output") or {}
            lines.append(
                f"    {e['index']:>3}  {(e['module'] or '(root)'):<28.28} {e['class']:<18.18} {e['role']:<17} "
                f"{('finite' if e.get('inputs_finite') else 'non-finite'):<10} {fmt_health(out):<24.24} {_num(out.get('absmax')):>12}"
            )
    return "\n".join(lines)
