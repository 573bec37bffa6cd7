"""The self-contained HTML report (``nanreplay report``, ``nanreplay bisect --html``).

One file: the style, the plots (inline SVG drawn by :mod:`nanreplay.report.plots`) and the
diagnosis as JSON (``<script type="application/json" id="nanreplay-diagnosis">``) are all in it;
it loads nothing from the network and runs no script, so it opens offline in any browser and can
be attached to a bug report.

The functions take plain dicts, the diagnosis dict (``docs/report.md``), a bisect result
(``docs/bisect.md``) and the bundle's metadata (``Bundle.meta``), and return the page as a string.
They need matplotlib (the ``report`` extra) and raise :class:`~nanreplay.errors.MissingExtraError`
without it.
"""

from __future__ import annotations

import datetime
import json
import os
from html import escape
from typing import Any, Iterable, Optional, Sequence

from ..core.inert import inert
from ..core.results import BisectResult, ConfigDiff, DiagnosisDict, ForwardModule, TimelineStep
from ..core.settings import show_value
from .plots import COLORS, _num, bisect_steps_svg, modules_svg, require_matplotlib, samples_svg, timeline_svg, trials_svg, moves_svg
from .summary import difference_phrase, fix_sentence, verdict_phrase
from ..core.rollback import episode_phrase, restore_phrase, skip_phrase, span
from .text import fmt_health, fmt_indices

__all__ = ["render_html", "render_inline_html", "render_bisect_html", "render_diff_html", "diff_section", "environment_rows", "Markup", "esc", "h"]

_CSS = """
:root { --fg:#263238; --muted:#607d8b; --line:#e0e6ea; --bg:#fafbfc; --card:#fff; --bad:@NAN@; --ok:#2e7d32; --warn:#ef6c00; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; color:var(--fg); background:var(--bg); }
main { max-width: 1320px; margin: 0 auto; padding: 24px 28px 48px; }
header .tool { color:var(--muted); font-size:12px; letter-spacing:.04em; text-transform:uppercase; }
h1.sentence { font-size:20px; line-height:1.4; margin:6px 0 14px; font-weight:600; }
h2 { font-size:16px; margin:0 0 10px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:16px 18px; margin:16px 0; overflow-x:auto; }
.badges span { display:inline-block; border-radius:12px; padding:2px 10px; margin:0 6px 6px 0; font-size:12.5px; border:1px solid var(--line); background:#f5f7f8; }
.badges .bad { background:#ffebee; border-color:#ffcdd2; color:#b71c1c; }
.badges .ok { background:#e8f5e9; border-color:#c8e6c9; color:#1b5e20; }
.badges .warn { background:#fff3e0; border-color:#ffe0b2; color:#e65100; }
table { border-collapse:collapse; font-size:13px; }
td, th { text-align:left; padding:3px 12px 3px 0; vertical-align:top; border-bottom:1px solid #f0f3f5; }
th { color:var(--muted); font-weight:500; white-space:nowrap; }
table.kv th { width: 180px; }
.num { text-align:right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace; font-size:12.5px; }
pre.src { background:#263238; color:#eceff1; padding:6px 10px; border-radius:4px; margin:4px 0 0; white-space:pre-wrap; }
.phase { display:inline-block; min-width:74px; padding:0 8px; border-radius:10px; font-size:12px; text-align:center; color:#fff; background:var(--muted); }
.phase.forward { background:#1565c0; } .phase.backward { background:#6a1b9a; } .phase.loss { background:#ef6c00; }
.phase.input { background:#00838f; } .phase.optimizer { background:#2e7d32; } .phase.weights { background:#4e342e; }
.kind-NaN { color:var(--bad); font-weight:600; }
ol.chain li { margin-bottom:10px; }
ol.chain li.origin { border-left:3px solid var(--bad); padding-left:8px; }
.muted { color:var(--muted); }
svg.plot { display:block; max-width:100%; height:auto; margin:4px 0; }
.cols { display:grid; grid-template-columns: minmax(0, 1.25fr) minmax(0, 1fr); gap:16px; margin:16px 0; }
.cols section { margin:0; }
@media (max-width: 1000px) { .cols { grid-template-columns: 1fr; } }
#environment table.kv th { width:150px; }
#environment td { word-break: break-word; }
details summary { cursor:pointer; color:var(--muted); margin-top:6px; }
footer { color:var(--muted); font-size:12px; margin-top:24px; }
""".replace("@NAN@", COLORS["nan"])


class Markup(str):
    """HTML this module built: put into the page as it is. Every other value that reaches the
    page, a ``str`` from the diagnosis, a number, ``None``, is escaped by :func:`esc`: the page
    is built only by :func:`h` and :func:`join`, so escaping is the default and only this
    module's literal templates (and matplotlib's SVG, whose text it escapes) are markup."""

    __slots__ = ()

    def __add__(self, other: Any) -> "Markup":
        return Markup(str.__add__(self, esc(other)))

    def __radd__(self, other: Any) -> "Markup":
        return Markup(str.__add__(esc(other), self))


def esc(x: Any) -> Markup:
    """``x`` as HTML text: a :class:`Markup` unchanged, anything else ``str(x)`` escaped (``&``,
    ``<``, ``>``, both quotes) and its control characters shown as escapes (``\\r``, as on the
    terminal: :func:`~nanreplay.core.inert.inert`), ``None`` as ``-``. The one escaping path of
    the page."""
    if isinstance(x, Markup):
        return x
    return Markup(escape(inert("-" if x is None else x), quote=True))


def h(template: str, *args: Any) -> Markup:
    """``template.format(*args)`` with every argument passed through :func:`esc`. ``template``
    is a literal of this module (never data): ``h('<code>{}</code>', name)``."""
    return Markup(template.format(*(esc(a) for a in args)))


def join(parts: Iterable[Any], sep: str = "") -> Markup:
    """The parts (each escaped unless :class:`Markup`) joined by the literal ``sep``."""
    return Markup(sep.join(esc(p) for p in parts))


def _svg(svg: Optional[str]) -> Markup:
    """A plot of :mod:`nanreplay.report.plots` as markup: matplotlib writes the SVG and escapes
    every text and attribute in it (bundle strings reach it only as labels)."""
    if not svg:
        return Markup("")
    if not svg.startswith("<svg"):
        raise ValueError("expected an <svg> element from nanreplay.report.plots")
    return Markup(svg)


def _json_script(obj: Any, element_id: str) -> Markup:
    """``obj`` as inert JSON data in the page: ``<``, ``>`` and ``&`` written as ``\\u003c``,
    ``\\u003e``, ``\\u0026`` (still the same JSON), so no string can close the element or
    change how the parser reads it."""
    text = json.dumps(obj, default=str, allow_nan=False, indent=1)
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return h('<script type="application/json" id="{}">', element_id) + Markup(text) + Markup("</script>")


def _kv(rows: Iterable[tuple[str, Any]]) -> Markup:
    """A two-column table; values are escaped unless :class:`Markup`; empty values are skipped."""
    body = join(h("<tr><th>{}</th><td>{}</td></tr>", k, v) for k, v in rows if v not in (None, "", []))
    return h('<table class="kv">{}</table>', body)


def environment_rows(meta: Optional[dict], diag: Optional[DiagnosisDict] = None) -> list[tuple[str, str]]:
    """The bundle's environment as ``(label, value)`` rows: versions, devices and dtypes of the
    recorded parameters, the failing step's autocast, determinism flags, model and optimizer.

    Args:
        meta: ``Bundle.meta`` (``environment``, ``model``, ``steps``...); ``None`` gives ``[]``.
        diag: the diagnosis, for the device the replay ran on.
    """
    if not meta:
        return []
    env = meta.get("environment") or {}
    params = (meta.get("model") or {}).get("params") or {}
    dtypes: dict[str, int] = {}
    devices: dict[str, int] = {}
    for p in params.values():
        dtypes[p.get("dtype", "?")] = dtypes.get(p.get("dtype", "?"), 0) + 1
        devices[p.get("device", "?")] = devices.get(p.get("device", "?"), 0) + 1
    failing = meta.get("failing_step")
    step = next((s for s in meta.get("steps", []) if s.get("step") == failing), {})
    ac = step.get("autocast")
    det = env.get("determinism") or {}
    created = meta.get("created_unix")
    rows = [
        ("torch", env.get("torch")),
        ("python / numpy", f"{env.get('python')} / {env.get('numpy')}"),
        ("platform", env.get("platform")),
        ("CUDA", f"{env.get('cuda')} (available: {env.get('cuda_available')})" if env.get("cuda") or env.get("cuda_available") else "none"),
        ("recorded on", ", ".join(f"{d} ({n} tensors)" for d, n in devices.items())),
        ("replayed on", (diag or {}).get("device")),
        ("parameter dtypes", ", ".join(f"{d} ({n})" for d, n in dtypes.items())),
        ("autocast (failing step)", f"{ac.get('device_type')} {ac.get('dtype')}" if ac else "off"),
        ("determinism", ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in det.items())),
        ("threads", env.get("num_threads")),
        ("model", (meta.get("model") or {}).get("class")),
        ("model factory / loss fn", f"{meta.get('model_factory')} / {meta.get('loss_fn')}"),
        ("optimizer", (meta.get("optimizer") or {}).get("class")),
        ("written by", f"nanreplay {env.get('nanreplay')}" + (f", {datetime.datetime.fromtimestamp(created, datetime.timezone.utc):%Y-%m-%d %H:%M UTC}" if created else "")),
    ]
    return [(k, str(v)) for k, v in rows if v not in (None, "")]


_HEAD = Markup(
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
    # no network: no external resource can load even if a later edit adds one
    "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
)


def _page(title: str, body: Markup) -> str:
    return str(_HEAD + h("<title>{}</title><style>{}</style></head>\n<body><main>\n{}\n</main></body></html>\n", title, Markup(_CSS), body))


def _repro_class(verdict: str) -> str:
    return {"reproduced exactly": "ok", "reproduced": "warn"}.get(verdict, "bad")


def _source(src: Any) -> Markup:
    if not src or not isinstance(src, dict):
        return Markup("")
    return (h('<div><code>{}:{}</code> in <code>{}</code></div>', src.get("file"), src.get("line"), src.get("function"))
            + (h('<pre class="src">{}</pre>', src.get("code")) if src.get("code") else Markup("")))


def _births_html(diag: DiagnosisDict) -> Markup:
    """The births, forward and backward, in execution order; those of the causal chain first
    marked, the origin highlighted, with source line and code."""
    births = diag.get("births") or []
    chain_idx = {c.get("op_index") for c in diag.get("chain") or []}
    o = diag.get("origin") or {}
    if not births:
        return Markup('<p class="muted">The op monitor recorded no birth (it was off, or the origin is in the data, the weights or the optimizer update).</p>')
    items = [_birth_item(b, o, chain_idx) for b in births]
    return h('<ol class="chain">{}</ol>{}', join(items), _births_more(diag))


def _birth_item(b: dict, o: dict, chain_idx: set) -> Markup:
    """One birth as a list item: phase, op, where, output health, its place (origin, causal chain
    or after the origin), source and the extra evidence (:func:`_birth_extra`)."""
    cls = "origin" if b.get("op_index") is not None and b.get("op_index") == o.get("op_index") else ""
    kinds = "-"
    out = b.get("output") or {}
    if out:
        kinds = fmt_health(out)
    node = h(' <span class="muted">({}, backward of {})</span>', b["node"], b.get("forward_op")) if b.get("node") else Markup("")
    where = Markup("outside the model") if b.get("module") is None else h("in module <code>{}</code>", b["module"] or "(root)")
    tag = "origin" if cls else ("causal chain" if b.get("op_index") in chain_idx else "after the origin")
    extra = _birth_extra(b)
    return h('<li class="{}"><span class="phase {}">{}</span> op <code>{}</code> <span class="muted">{}</span>{} {}: output {} '
             '<span class="muted">[{}, op #{}]</span>{}{}</li>',
             cls, b.get("phase"), b.get("phase"), b.get("op"), b.get("aten"), node, where, kinds, tag, b.get("op_index"),
             _source(b.get("source")), h('<div class="muted">{}</div>', "; ".join(extra)) if extra else "")


def _birth_extra(b: dict) -> list[str]:
    """A birth's evidence: its recomputation in a wider dtype, exact zeros in its inputs, its
    non-finite rows of the batch."""
    wider = b.get("wider") or {}
    extra = []
    if wider:
        extra.append(f"recomputed in {wider.get('dtype')}: {'finite (an overflow)' if wider.get('finite') else 'non-finite too (a domain error)'}")
    zeros = b.get("input_zeros")
    if zeros and any(zeros):
        extra.append("exact zeros in its inputs: " + ", ".join(f"{z} in input {i}" for i, z in enumerate(zeros) if z))
    rows = b.get("rows") or {}
    if rows.get("indices"):
        per = rows.get("rows_per_sample")  # dimension 0 merges the batch: the indices are samples
        listed = fmt_indices(rows["indices"], rows.get("size"), rows.get("count"), unit="samples" if per else "rows")
        extra.append((f"{listed} non-finite" if listed.startswith("all ") else f"non-finite {listed}") + (f" ({per} rows each)" if per else ""))
    return extra


def _births_more(diag: DiagnosisDict) -> Markup:
    """What follows the births: how many ops only propagated, and the births the allowlist matched."""
    more = Markup("")
    if diag.get("propagated_ops"):
        more = h('<p class="muted">{} other op(s) only passed non-finite values on.</p>', diag["propagated_ops"])
    allowed = diag.get("allowed_births")
    if allowed:
        where = [f'{m.get("module") or "(root)"} ({", ".join(f"{op} x{k}" for op, k in m["allowed"].items())})'
                 for m in diag.get("forward_modules") or [] if m.get("allowed")]
        more += (h('<p class="muted">{} birth(s) matched the allowlist, legitimate -Inf masks, not the origin', allowed)
                 + (h(": in {}", "; ".join(dict.fromkeys(where))) if where else "") + Markup(".</p>")
                 + h("<details><summary>allowlist rules</summary><code>{}</code></details>", " ".join(map(str, diag.get("allowlist") or []))))
    return more


def _origin_rows(diag: DiagnosisDict) -> list[tuple[str, Any]]:
    o = diag.get("origin") or {}
    cls = diag.get("classification") or {}
    r = diag.get("reproduction") or {}
    evidence = cls.get("evidence") if cls else None
    rows = [
        ("phase", esc(diag.get("phase"))),
        ("module", "outside the model" if o.get("module") is None and o else ((o.get("module") or "(root module)") + (f" ({o['class']})" if o.get("class") else "")) if o else "-"),
        ("op", h("{}", o.get("aten") or o.get("op")) + (h(" {} {}", o.get("dtype"), o.get("shape")) if o.get("dtype") else "") if o.get("op") else ""),
        ("autograd node", o.get("node") or ""),
        ("source", _source(o.get("source"))),
        ("op health", f"inputs {fmt_health(o.get('inputs'))}; output {fmt_health(o.get('output'))}" if o.get("output") else ""),
        ("batch leaf", o.get("leaf") or ""),
        ("tensor", o.get("tensor") or ""),
        ("parameter", o.get("param") or ""),
        ("first non-finite gradient", o.get("first_nonfinite_gradient") or ""),
        ("cause", esc(diag.get("cause"))),
        ("verdict", h("<b>{}</b> ({})", cls.get("cause"), cls.get("detail"))
         + (h("<ul>{}</ul>", join(h("<li>{}</li>", x) for x in evidence)) if evidence else "") if cls else ""),
        ("fix", fix_sentence(diag) or ""),
        ("reproduction", h('{} <span class="muted">({}; replay mode {})</span>',
                           verdict_phrase(r), difference_phrase(r), diag.get("mode"))),
        ("", r.get("detail") or ""),
    ]
    return [(k, v) for k, v in rows if v]


def _timeline_rows(diag: DiagnosisDict, meta: Optional[dict]) -> list[TimelineStep]:
    """``timeline`` of the diagnosis, else rebuilt from the bundle's ``meta["steps"]`` (a stored
    diagnosis written before the key existed), else from ``history``."""
    if diag.get("timeline"):
        return list(diag["timeline"])
    step = diag.get("step")
    if meta and meta.get("steps"):
        return [{"step": s["step"], "loss": s.get("loss"), "grad_norm": s.get("grad_norm"), "lrs": s.get("lrs") or [], "failing": s["step"] == step}
                for s in meta["steps"] if step is None or s["step"] <= step]
    h = diag.get("history") or {}
    norms = dict((k, v) for k, v in h.get("grad_norms", []))
    lrs = dict((k, v) for k, v in h.get("lrs", []))
    steps = sorted(set(norms) | set(lrs) | ({step} if step is not None else set()))
    return [{"step": s, "loss": None, "grad_norm": norms.get(s), "lrs": [lrs[s]] if s in lrs else [], "failing": s == step} for s in steps]


def _timeline_table(rows: Sequence[dict]) -> Markup:
    body = join(
        h('<tr{}><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>',
          Markup(" class=kind-NaN") if r.get("failing") else "", r["step"], _fmt(r.get("loss")), _fmt(r.get("grad_norm")),
          ", ".join(_fmt(x) for x in r.get("lrs") or []))
        for r in rows
    )
    return h("<table><tr><th>step</th><th>loss</th><th>grad norm</th><th>learning rates</th></tr>{}</table>", body)


def _fmt(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "-" if x is None else str(x)
    return f"{v:.5g}"


def _plan_html(diag: DiagnosisDict) -> Optional[Markup]:
    """The rollback plan (``rollback``: restore point, batches to skip, the episode step by step,
    the states refused) and the loss scale (``loss_scale``) as a section, else ``None``."""
    plan = diag.get("rollback") or {}
    ls = diag.get("loss_scale")
    if plan.get("step") is None and not ls:
        return None
    body: list = []
    if plan.get("step") is not None:
        first, last = plan["first_abnormal_step"], plan["step"]
        jump = plan.get("lr_jump")
        body.append(_kv([
            ("restore", restore_phrase(plan)),
            ("skip", skip_phrase(first, last) + (f" ({len(plan.get('skip_steps') or [])} steps)" if last > first else "")),
            ("episode", episode_phrase(plan["episode"]) if plan.get("episode") else ""),
            ("learning rate", f"jumped to {jump['lr']:.4g} at step {jump['step']} (from {jump['previous']:.4g}): restart below it" if jump else ""),
            ("weights", "corrupted: they took an update with non-finite values" if plan.get("weights_corrupted") else ""),
            ("data position", plan.get("data_position")),
        ]))
        runs = (plan.get("episode") or {}).get("runs") or []
        if runs:
            rows = join(h('<tr><td class="num">{}</td><td>{}</td><td>{}</td></tr>', span(r["first"], r["last"]), r["nonfinite"], r["update"])
                        for r in runs)
            body.append(h("<table><tr><th>steps</th><th>non-finite</th><th>update</th></tr>{}</table>", rows))
        refused = plan.get("rejected") or []
        if refused:
            rows = join(h("<tr><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>", r.get("source"), r.get("step"),
                          r.get("path") or "", r.get("why")) for r in refused)
            body.append(h("<p>Not a restore point:</p><table><tr><th>state</th><th>step</th><th>path</th><th>why</th></tr>{}</table>", rows))
    if ls:
        hist = " \u2192 ".join(f"{_fmt(sc)} (step {st})" for st, sc in ls.get("history") or [])
        body.append(_kv([("loss scale", _fmt(ls.get("scale")) + (f", {_fmt(ls['scale_after'])} after the step" if ls.get("scale_after") is not None else "")),
                         ("scaler", ("skipped the step" + (f", {ls['consecutive_skips']} in a row" if ls.get("consecutive_skips") else ""))
                          if ls.get("skipped") else "did not skip the step"),
                         ("failure", ls.get("failure") or ""), ("scale history", hist)]))
    return h('<section id="rollback"><h2>Rollback plan and loss scale</h2>'
             '<p class="muted">What the Recorder knew when it wrote the bundle: the first abnormal step, every step and batch to skip, '
             "and the latest state known healthy (a snapshot it holds, or a checkpoint registered finite before the first "
             "non-finite update).</p>{}</section>", join(body))


def _module_table(mods: Sequence[ForwardModule]) -> Markup:
    body = []
    for m in mods:
        out, g = m.get("output") or {}, m.get("grad")
        allowed = ", ".join(f"{k} x{v}" for k, v in (m.get("allowed") or {}).items())
        body.append(h('<tr><td class="num">{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td class="num">{}</td><td>{}</td><td>{}</td></tr>',
                      m.get("index"), m.get("module") or "(root)", m.get("class"), m.get("role"), fmt_health(out), _fmt(out.get("absmax")),
                      fmt_health(g) if g else "-", allowed or ""))
    return h("<table><tr><th>#</th><th>module</th><th>class</th><th>role</th><th>output</th><th>max |finite|</th>"
             "<th>gradient at output</th><th>allowlisted births</th></tr>{}</table>", join(body))


def _samples_html(diag: DiagnosisDict, charted: bool = False) -> Markup:
    """The samples' verdict, in the same terms as the list it comes from (every sample, or the
    batch as a whole); ``charted``: the section's chart shows rows already (then its absence of a
    verdict is said as such, not as an absence of information)."""
    smp = diag.get("samples")
    size = (smp or {}).get("batch_size")
    parts = []
    if smp:
        if smp.get("batch_level"):
            why = smp.get("reason") or next(iter(smp.get("warnings") or []), None)
            verdict = "the failure belongs to the batch as a whole (or to the loss, or the weights), not to particular samples" + (f": {why}" if why else "")
        elif smp.get("indices"):
            verdict = fmt_indices(smp["indices"], size, smp.get("count"), unit="samples") + " carry the non-finite values"
        else:
            verdict = "no sample could be blamed"
        parts.append(_kv([("verdict", verdict), ("method", smp.get("method")), ("batch size", size),
                          ("micro-batch", smp.get("micro_batch")), ("replays", smp.get("runs"))]))
    for x in diag.get("nonfinite_inputs") or []:
        h_ = x.get("health") or {}
        parts.append(h("<p>non-finite input <code>{}</code>: {}, {}</p>", x.get("leaf"), fmt_health(h_),
                       fmt_indices(x.get("samples"), size or _leading(h_))))
    if parts:
        return join(parts)
    if charted:
        return Markup('<p class="muted">No samples were blamed (the per-sample analysis did not run, or found no sample); the chart '
                      "shows the rows each non-finite value occupies.</p>")
    return Markup('<p class="muted">No per-sample information (the replay ran with --no-samples, or the step has no batch).</p>')


def _leading(health: dict) -> Optional[int]:
    """Dimension 0 of a health record's shape, else ``None``."""
    shape = health.get("shape") if isinstance(health, dict) else None
    return shape[0] if shape else None


def render_html(diag: DiagnosisDict, *, meta: Optional[dict] = None, bundle_name: Optional[str] = None) -> str:
    """The HTML report of one diagnosis.

    Every value taken from ``diag`` and ``meta`` is escaped (:func:`esc`, through :func:`h`):
    a stored diagnosis is data from the bundle, and no string of it can add an element or an
    attribute to the page.

    Args:
        diag: the diagnosis dict (``nanreplay.replay()``, or a bundle's stored ``diagnosis``).
            Uses ``timeline``, ``forward_modules`` and ``batch_leaves`` when present, else falls
            back to ``meta["steps"]``, ``history`` and the ``health`` rows.
        meta: the bundle's metadata, for the environment and the ring buffer's steps.
        bundle_name: shown in the header (default: ``diag["bundle"]``).

    Returns:
        the page, one self-contained HTML document.

    Raises:
        MissingExtraError: matplotlib (the ``report`` extra) is not installed.
    """
    require_matplotlib()
    sections = _report_sections(diag, meta=meta, bundle_name=bundle_name)
    sections.append(
        h("<footer>Written by <code>nanreplay report</code>. The diagnosis is embedded below as JSON (fields in nanreplay's docs/report.md); "
          "this page loads nothing from the network.</footer>{}", _json_script(diag, "nanreplay-diagnosis"))
    )
    return _page(f"nanreplay: step {diag.get('step')}: {str(diag.get('summary', ''))[:80]}", join(sections, "\n"))


def render_inline_html(diag: DiagnosisDict, *, meta: Optional[dict] = None, bundle_name: Optional[str] = None) -> str:
    """The report of :func:`render_html` as a fragment for a notebook cell (``_repr_html_``): the
    same sections, without the page chrome (document head, footer, embedded JSON), inside one
    ``<div class="nanreplay-report">`` whose style applies to it alone (:func:`_scoped_css`).
    Every value is escaped as in :func:`render_html`.

    Raises:
        MissingExtraError: matplotlib (the ``report`` extra) is not installed.
    """
    require_matplotlib()
    sections = _report_sections(diag, meta=meta, bundle_name=bundle_name)
    return str(h('<div class="nanreplay-report"><style>{}</style>{}</div>', Markup(_scoped()), join(sections, "\n")))


def _scoped() -> str:
    """The page's own stylesheet (the literal ``_CSS``) scoped to the inline report's div."""
    return _scoped_css(_CSS, ".nanreplay-report")


def _scoped_css(css: str, scope: str) -> str:
    """``css`` with every selector under ``scope`` (``:root``, ``body`` and ``main`` become
    ``scope`` itself), so the inline report does not restyle the notebook around it; one level of
    ``@media`` nesting."""
    def selectors(sel: str) -> str:
        out = []
        for one in (x.strip() for x in sel.split(",")):
            out.append(scope if one in (":root", "body", "main") else f"{scope}, {scope} *" if one == "*" else f"{scope} {one}")
        return ", ".join(out)

    result, i = [], 0
    while (brace := css.find("{", i)) >= 0:
        head, depth, close = css[i:brace].strip(), 0, brace
        for close in range(brace, len(css)):  # the matching brace
            depth += {"{": 1, "}": -1}.get(css[close], 0)
            if depth == 0:
                break
        body = css[brace + 1:close]
        result.append(f"{head} {{ {_scoped_css(body, scope)} }}" if head.startswith("@media") else f"{selectors(head)} {{{body}}}")
        i = close + 1
    return "\n".join(result)


def _report_sections(diag: DiagnosisDict, *, meta: Optional[dict], bundle_name: Optional[str]) -> list[Markup]:
    """The sections of the report of ``diag``, header first: the page's body without its footer."""
    r = diag.get("reproduction") or {}
    cls = diag.get("classification") or {}
    name = bundle_name or (os.path.basename(str(diag["bundle"])) if diag.get("bundle") else "bundle")
    verdict = r.get("verdict", "")
    badges = join([
        h('<span class="bad">phase: {}</span>', diag.get("phase")),
        h('<span class="bad">cause: {} ({})</span>', cls.get("cause"), cls.get("detail")) if cls else "",
        h('<span class="{}">{}</span>', _repro_class(verdict), verdict_phrase(r)),
        h("<span>step {}</span>", diag.get("step")),
        h("<span>replay: {}{}</span>", diag.get("mode"), h(" on {}", diag["device"]) if diag.get("device") else ""),
    ])
    header = h('<header><div class="tool">nanreplay report &middot; {}</div><h1 class="sentence" id="summary">{}</h1>'
               '<div class="badges">{}</div></header>', name, diag.get("summary"), badges)
    sections = [header]
    top = h('<section id="origin"><h2>Where the non-finite value was born</h2>{}</section>', _kv(_origin_rows(diag)))
    env = environment_rows(meta, diag)
    if env:
        top += h('<section id="environment"><h2>Environment of the recording</h2>{}</section>', _kv(env))
    sections.append(h('<div class="cols">{}</div>', top))
    tl = _timeline_rows(diag, meta)
    if tl:
        sections.append(h(
            '<section id="timeline"><h2>Loss, grad norm and learning rate over the ring buffer</h2>'
            '<p class="muted">Recorded by the training loop before the failure; the dashed red line is the failing step, red crosses its non-finite values. '
            "An explosion shows as a grad norm climbing over several steps; a learning-rate spike as a jump in the bottom curve.</p>"
            "{}<details><summary>values</summary>{}</details></section>",
            _svg(timeline_svg(tl, history=diag.get("history"))), _timeline_table(tl)))
    plan = _plan_html(diag)
    if plan:
        sections.append(plan)
    mods = diag.get("forward_modules")
    partial = mods is None
    mods = mods if mods is not None else list(diag.get("health") or [])
    if mods or diag.get("loss"):
        losses = diag.get("loss") if diag.get("mode") == "loss_fn" else []
        sections.append(h(
            '<section id="modules"><h2>The forward pass, module by module</h2>'
            '<p class="muted">Modules in execution order (a parent completes after its children). Bars: the largest |value| of each module\'s finite '
            "outputs, log scale: values on their way out of range climb here. Cells: the share of NaN, +Inf and -Inf in each output and, "
            "in the backward pass, in the gradient at that output.</p>{}{}<details><summary>table</summary>{}</details></section>",
            h('<p class="muted">The stored diagnosis holds only the {} rows of the health table; run without --no-replay for every module.</p>', len(mods)) if partial else "",
            _svg(modules_svg(mods, origin=diag.get("origin"), phase=diag.get("phase", ""), loss=losses or [])),
            _module_table(mods)))
    sections.append(h('<section id="chain"><h2>Causal chain: where non-finite values were born, in execution order</h2>{}</section>', _births_html(diag)))
    chart = samples_svg(diag)
    sections.append(h('<section id="samples"><h2>Samples</h2>{}{}</section>', _svg(chart), _samples_html(diag, charted=bool(chart))))
    opt = diag.get("optimizer")
    if opt:
        sections.append(h('<section id="optimizer"><h2>Optimizer update</h2>{}</section>', _kv([
            ("class", opt.get("class")), ("non-finite", opt.get("nonfinite")), ("parameter", opt.get("param")), ("state key", opt.get("state_key")),
            ("detail", opt.get("detail")), ("hyperparameters", json.dumps(opt.get("hyperparameters"), default=str)),
        ])))
    if diag.get("warnings"):
        sections.append(h('<section id="warnings"><h2>Warnings</h2><ul>{}</ul></section>', join(h("<li>{}</li>", w) for w in diag["warnings"])))
    return sections


def render_bisect_html(res: BisectResult, *, meta: Optional[dict] = None) -> str:
    """The HTML page of a ``bisect`` result: the answer, the culprits, the replays tried
    (``trials``) and the search's details (steps timeline, weight movement). Every value is
    escaped (:func:`esc`).

    Args:
        res: the dict :func:`nanreplay.bisect` returns (``docs/bisect.md``).
        meta: the bundle's metadata, for the environment.

    Raises:
        MissingExtraError: matplotlib (the ``report`` extra) is not installed.
    """
    require_matplotlib()
    status = res.get("status", "")
    badges = join([
        h('<span class="{}">status: {}</span>', "ok" if status == "found" else "bad", status),
        h("<span>--over {}</span>", res.get("over")), h("<span>step {}</span>", res.get("step")),
        h("<span>{} of at most {} replays on {}</span>", res.get("replays"), res.get("max_replays"), res.get("device")),
    ])
    name = os.path.basename(str(res.get("bundle") or "bundle"))
    out = [h('<header><div class="tool">nanreplay bisect &middot; {}</div><h1 class="sentence" id="summary">{}</h1>'
             '<div class="badges">{}</div></header>', name, res.get("answer"), badges)]
    culprits = res.get("culprits") or []
    if culprits:
        keys = [k for k in culprits[0] if not isinstance(culprits[0][k], (dict, list))]
        rows = join(h("<tr>{}</tr>", join(h("<td>{}</td>", _fmt(c.get(k)) if isinstance(c.get(k), float) else c.get(k)) for k in keys)) for c in culprits)
        out.append(h('<section id="culprits"><h2>Culprit{}</h2><table><tr>{}</tr>{}</table></section>',
                     "s" if len(culprits) > 1 else "", join(h("<th>{}</th>", k) for k in keys), rows))
    trials = res.get("trials") or []
    if trials:
        rows = join(
            h('<tr><td class="num">{}</td><td>{}</td><td class="{}">{}</td><td class="num">{}</td><td class="num">{}</td></tr>',
              t.get("replay"), t.get("varied"), "kind-NaN" if t.get("nonfinite") else "", "non-finite" if t.get("nonfinite") else "finite",
              _fmt(t.get("loss")), _fmt(t.get("grad_norm")))
            for t in trials
        )
        out.append(h('<section id="trials"><h2>Replays tried</h2>{}'
                     "<table><tr><th>#</th><th>what the replay varied</th><th>result</th><th>loss</th><th>grad norm</th></tr>{}</table></section>",
                     _svg(trials_svg(trials)), rows))
    d = res.get("details") or {}
    if d.get("timeline") or d.get("walk"):  # --over steps; --over layers' walk to the first abnormal step
        out.append(h('<section id="steps"><h2>Replayed steps</h2>{}{}</section>',
                     h('<p class="muted">{}</p>', d.get("verification")) if d.get("verification") else "",
                     _svg(bisect_steps_svg(d.get("timeline") or d["walk"]))))
    if d.get("largest_moves"):
        out.append(h('<section id="moves"><h2>Weight movement by layer</h2>{}</section>',
                     _svg(moves_svg(d["largest_moves"], [c.get("layer") for c in culprits if "layer" in c]))))
    out.extend(_context_sections(d, meta))
    if res.get("warnings"):
        out.append(h('<section id="warnings"><h2>Warnings</h2><ul>{}</ul></section>', join(h("<li>{}</li>", w) for w in res["warnings"])))
    out.append(h("<details><summary>details (JSON)</summary><pre>{}</pre></details>", json.dumps(d, indent=1, default=str)))
    out.append(h("<footer>Written by <code>nanreplay bisect --html</code>; this page loads nothing from the network.</footer>{}", _json_script(res, "nanreplay-bisect")))
    return _page(f"nanreplay bisect: step {res.get('step')}: {status}", join(out, "\n"))


def _context_sections(details: dict, meta: Optional[dict]) -> list[Markup]:
    """The bisect page's context: what the two runs differ in (``--over config --against B``),
    then the environment of the recording."""
    out = [diff_section(details["diff"])] if isinstance(details.get("diff"), dict) else []
    env = environment_rows(meta)
    if env:
        out.append(h('<section id="environment"><h2>Environment of the recording</h2>{}</section>', _kv(env)))
    return out


def _diff_side(side: dict) -> str:
    if side.get("here"):
        return "this process"
    return f"{side.get('bundle')}" + (f" (failing step {side['step']})" if side.get("step") is not None else "")


def diff_section(diff: ConfigDiff) -> Markup:
    """The ``<section id="config-diff">`` of a :class:`~nanreplay.core.results.ConfigDiff`: the
    differences that can change numerics, most likely first, with why and whether ``bisect --over
    config`` can toggle them, then the others. Every value is escaped (:func:`esc`); needs no
    matplotlib."""
    differences = diff.get("differences") or []

    def rows(numerics: bool) -> Markup:
        return join(h('<tr><td class="num">{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class="muted">{}</td></tr>',
                      r.get("rank"), r.get("key"), show_value(r.get("a")), show_value(r.get("b")), r.get("category"),
                      "yes" if r.get("replayable") else "", r.get("why")) for r in differences if bool(r.get("numerics")) == numerics)

    head = "<tr><th>rank</th><th>setting</th><th>A</th><th>B</th><th>category</th><th>bisect can toggle</th><th>why it matters</th></tr>"
    n_num = sum(1 for r in differences if r.get("numerics"))
    body = h('<p>A: <code>{}</code><br>B: <code>{}</code></p>', _diff_side(diff.get("a") or {}), _diff_side(diff.get("b") or {}))
    body += h("<h3>{} difference(s) that can change numerics, most likely first</h3>", n_num)
    if n_num:
        body += h("<table>" + head + "{}</table>", rows(True))
    if len(differences) > n_num:
        body += h("<details><summary>{} other difference(s)</summary><table>" + head + "{}</table></details>", len(differences) - n_num, rows(False))
    body += h('<p class="muted">{} setting(s) the same; {} recorded in one bundle only.</p>', diff.get("same"), len(diff.get("unknown") or []))
    for n in diff.get("notes") or []:
        body += h('<p class="muted">{}</p>', n)
    return h('<section id="config-diff"><h2>What the runs differ in</h2>{}</section>', body)


def render_diff_html(diff: ConfigDiff) -> str:
    """The HTML page of ``nanreplay diff --html``: :func:`diff_section` and the difference as JSON
    (``<script type="application/json" id="nanreplay-diff">``); loads nothing from the network."""
    a, b = _diff_side(diff.get("a") or {}), _diff_side(diff.get("b") or {})
    n_num = sum(1 for r in diff.get("differences") or [] if r.get("numerics"))
    out = [h('<header><div class="tool">nanreplay diff</div><h1 class="sentence" id="summary">{} setting(s) that can change numerics differ</h1></header>', n_num),
           diff_section(diff),
           h("<footer>Written by <code>nanreplay diff --html</code>; this page loads nothing from the network.</footer>{}", _json_script(diff, "nanreplay-diff"))]
    return _page(f"nanreplay diff: {a} vs {b}", join(out, "\n"))
