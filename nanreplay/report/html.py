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

from .plots import COLORS, _num, bisect_steps_svg, modules_svg, require_matplotlib, samples_svg, timeline_svg, trials_svg, moves_svg
from .summary import verdict_phrase
from .text import fmt_health

__all__ = ["render_html", "render_bisect_html", "environment_rows"]

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


def _e(x: Any) -> str:
    return escape("-" if x is None else str(x))


def _json_script(obj: Any, element_id: str) -> str:
    """``obj`` as inert JSON data in the page (``</`` escaped so no tag can close early)."""
    text = json.dumps(obj, default=str, allow_nan=False, indent=1).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _kv(rows: Iterable[tuple[str, Any]], *, raw: bool = False) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v if raw else _e(v)}</td></tr>" for k, v in rows if v not in (None, "", []))
    return f'<table class="kv">{body}</table>'


def environment_rows(meta: Optional[dict], diag: Optional[dict] = None) -> list[tuple[str, str]]:
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


def _page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        # no network: no external resource can load even if a later edit adds one
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n<body><main>\n{body}\n</main></body></html>\n"
    )


def _repro_class(verdict: str) -> str:
    return {"reproduced exactly": "ok", "reproduced": "warn"}.get(verdict, "bad")


def _source(src: Optional[dict]) -> str:
    if not src:
        return ""
    return (f'<div><code>{_e(src.get("file"))}:{_e(src.get("line"))}</code> in <code>{_e(src.get("function"))}</code></div>'
            + (f'<pre class="src">{_e(src.get("code"))}</pre>' if src.get("code") else ""))


def _births_html(diag: dict) -> str:
    """The births, forward and backward, in execution order; those of the causal chain first
    marked, the origin highlighted, with source line and code."""
    births = diag.get("births") or []
    chain_idx = {c.get("op_index") for c in diag.get("chain") or []}
    o = diag.get("origin") or {}
    if not births:
        return '<p class="muted">The op monitor recorded no birth (it was off, or the origin is in the data, the weights or the optimizer update).</p>'
    items = []
    for b in births:
        cls = "origin" if b.get("op_index") is not None and b.get("op_index") == o.get("op_index") else ""
        kinds = "-"
        out = b.get("output") or {}
        if out:
            kinds = fmt_health(out)
        node = f' <span class="muted">({_e(b["node"])}, backward of {_e(b.get("forward_op"))})</span>' if b.get("node") else ""
        where = "outside the model" if b.get("module") is None else f'in module <code>{_e(b["module"] or "(root)")}</code>'
        tag = "origin" if cls else ("causal chain" if b.get("op_index") in chain_idx else "after the origin")
        wider = b.get("wider") or {}
        extra = []
        if wider:
            extra.append(f"recomputed in {_e(wider.get('dtype'))}: {'finite (an overflow)' if wider.get('finite') else 'non-finite too (a domain error)'}")
        zeros = b.get("input_zeros")
        if zeros and any(zeros):
            extra.append("exact zeros in its inputs: " + ", ".join(f"{z} in input {i}" for i, z in enumerate(zeros) if z))
        rows = b.get("rows") or {}
        if rows.get("indices"):
            extra.append(f"non-finite rows {rows['indices'][:16]} of {rows.get('size')}")
        items.append(
            f'<li class="{cls}"><span class="phase {_e(b.get("phase"))}">{_e(b.get("phase"))}</span> '
            f'op <code>{_e(b.get("op"))}</code> <span class="muted">{_e(b.get("aten"))}</span>{node} {where}: output {_e(kinds)} '
            f'<span class="muted">[{tag}, op #{_e(b.get("op_index"))}]</span>'
            + _source(b.get("source"))
            + (f'<div class="muted">{_e("; ".join(extra))}</div>' if extra else "")
            + "</li>"
        )
    more = ""
    if diag.get("propagated_ops"):
        more = f'<p class="muted">{diag["propagated_ops"]} other op(s) only passed non-finite values on.</p>'
    allowed = diag.get("allowed_births")
    if allowed:
        where = [f'{m.get("module") or "(root)"} ({", ".join(f"{op} x{k}" for op, k in m["allowed"].items())})' for m in diag.get("forward_modules") or [] if m.get("allowed")]
        more += (f'<p class="muted">{allowed} birth(s) matched the allowlist, legitimate -Inf masks, not the origin'
                 + (f': in {_e("; ".join(dict.fromkeys(where)))}' if where else "") + ".</p>"
                 + f'<details><summary>allowlist rules</summary><code>{_e(" ".join(diag.get("allowlist") or []))}</code></details>')
    return f'<ol class="chain">{"".join(items)}</ol>{more}'


def _origin_rows(diag: dict) -> list[tuple[str, str]]:
    o = diag.get("origin") or {}
    cls = diag.get("classification") or {}
    r = diag.get("reproduction") or {}
    rows = [
        ("phase", _e(diag.get("phase"))),
        ("module", "outside the model" if o.get("module") is None and o else _e((o.get("module") or "(root module)") + (f" ({o['class']})" if o.get("class") else "")) if o else "-"),
        ("op", _e(o.get("aten") or o.get("op")) + (f" {_e(o.get('dtype'))} {_e(o.get('shape'))}" if o.get("dtype") else "") if o.get("op") else ""),
        ("autograd node", _e(o.get("node")) if o.get("node") else ""),
        ("source", _source(o.get("source"))),
        ("op health", f"inputs {_e(fmt_health(o.get('inputs')))}; output {_e(fmt_health(o.get('output')))}" if o.get("output") else ""),
        ("batch leaf", _e(o.get("leaf")) if o.get("leaf") else ""),
        ("tensor", _e(o.get("tensor")) if o.get("tensor") else ""),
        ("parameter", _e(o.get("param")) if o.get("param") else ""),
        ("first non-finite gradient", _e(o.get("first_nonfinite_gradient")) if o.get("first_nonfinite_gradient") else ""),
        ("cause", _e(diag.get("cause"))),
        ("verdict", f"<b>{_e(cls.get('cause'))}</b> ({_e(cls.get('detail'))})" + ("<ul>" + "".join(f"<li>{_e(x)}</li>" for x in cls.get("evidence", [])) + "</ul>" if cls.get("evidence") else "") if cls else ""),
        ("reproduction", _e(verdict_phrase(r)) + (f' <span class="muted">(max abs difference of finite gradient values: {_e(r.get("max_abs_diff"))}; replay mode {_e(diag.get("mode"))})</span>')),
        ("", _e(r.get("detail")) if r.get("detail") else ""),
    ]
    return [(k, v) for k, v in rows if v]


def _timeline_rows(diag: dict, meta: Optional[dict]) -> list[dict]:
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


def _timeline_table(rows: Sequence[dict]) -> str:
    body = "".join(
        f'<tr{" class=kind-NaN" if r.get("failing") else ""}><td class="num">{_e(r["step"])}</td><td class="num">{_e(_fmt(r.get("loss")))}</td>'
        f'<td class="num">{_e(_fmt(r.get("grad_norm")))}</td><td>{_e(", ".join(_fmt(x) for x in r.get("lrs") or []))}</td></tr>'
        for r in rows
    )
    return f"<table><tr><th>step</th><th>loss</th><th>grad norm</th><th>learning rates</th></tr>{body}</table>"


def _fmt(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "-" if x is None else str(x)
    return f"{v:.5g}"


def _module_table(mods: Sequence[dict]) -> str:
    body = []
    for m in mods:
        out, g = m.get("output") or {}, m.get("grad")
        allowed = ", ".join(f"{k} x{v}" for k, v in (m.get("allowed") or {}).items())
        body.append(
            f'<tr><td class="num">{_e(m.get("index"))}</td><td><code>{_e(m.get("module") or "(root)")}</code></td><td>{_e(m.get("class"))}</td>'
            f'<td>{_e(m.get("role"))}</td><td>{_e(fmt_health(out))}</td><td class="num">{_e(_fmt(out.get("absmax")))}</td>'
            f'<td>{_e(fmt_health(g) if g else "-")}</td><td>{_e(allowed or "")}</td></tr>'
        )
    return ("<table><tr><th>#</th><th>module</th><th>class</th><th>role</th><th>output</th><th>max |finite|</th>"
            f"<th>gradient at output</th><th>allowlisted births</th></tr>{''.join(body)}</table>")


def _samples_html(diag: dict) -> str:
    smp = diag.get("samples")
    parts = []
    if smp:
        if smp.get("batch_level"):
            why = smp.get("reason") or next(iter(smp.get("warnings") or []), None)
            verdict = "the failure belongs to the batch as a whole (or to the loss, or the weights), not to particular samples" + (f": {why}" if why else "")
        elif smp.get("indices"):
            verdict = f"samples {smp['indices']} carry the non-finite values"
        else:
            verdict = "no sample could be blamed"
        parts.append(_kv([("verdict", verdict), ("method", smp.get("method")), ("batch size", smp.get("batch_size")),
                          ("micro-batch", smp.get("micro_batch")), ("replays", smp.get("runs"))]))
    for x in diag.get("nonfinite_inputs") or []:
        parts.append(f'<p>non-finite input <code>{_e(x.get("leaf"))}</code>: {_e(fmt_health(x.get("health")))}, rows {_e(x.get("samples"))}</p>')
    return "".join(parts) or '<p class="muted">No per-sample information (the replay ran with --no-samples, or the step has no batch).</p>'


def render_html(diag: dict, *, meta: Optional[dict] = None, bundle_name: Optional[str] = None) -> str:
    """The HTML report of one diagnosis.

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
    r = diag.get("reproduction") or {}
    cls = diag.get("classification") or {}
    name = bundle_name or (os.path.basename(diag["bundle"]) if diag.get("bundle") else "bundle")
    verdict = r.get("verdict", "")
    badges = [
        f'<span class="bad">phase: {_e(diag.get("phase"))}</span>',
        f'<span class="bad">cause: {_e(cls.get("cause"))} ({_e(cls.get("detail"))})</span>' if cls else "",
        f'<span class="{_repro_class(verdict)}">{_e(verdict_phrase(r))}</span>',
        f'<span>step {_e(diag.get("step"))}</span>',
        f'<span>replay: {_e(diag.get("mode"))}' + (f' on {_e(diag["device"])}' if diag.get("device") else "") + "</span>",
    ]
    header = (f'<header><div class="tool">nanreplay report &middot; {_e(name)}</div><h1 class="sentence" id="summary">{_e(diag.get("summary"))}</h1>'
              f'<div class="badges">{"".join(badges)}</div></header>')
    sections = [header]
    top = f'<section id="origin"><h2>Where the non-finite value was born</h2>{_kv(_origin_rows(diag), raw=True)}</section>'
    env = environment_rows(meta, diag)
    if env:
        top += f'<section id="environment"><h2>Environment of the recording</h2>{_kv(env)}</section>'
    sections.append(f'<div class="cols">{top}</div>')
    tl = _timeline_rows(diag, meta)
    if tl:
        sections.append(
            '<section id="timeline"><h2>Loss, grad norm and learning rate over the ring buffer</h2>'
            '<p class="muted">Recorded by the training loop before the failure; the dashed red line is the failing step, red crosses its non-finite values. '
            "An explosion shows as a grad norm climbing over several steps; a learning-rate spike as a jump in the bottom curve.</p>"
            + timeline_svg(tl, history=diag.get("history"))
            + f"<details><summary>values</summary>{_timeline_table(tl)}</details></section>"
        )
    mods = diag.get("forward_modules")
    partial = mods is None
    mods = mods if mods is not None else list(diag.get("health") or [])
    if mods or diag.get("loss"):
        losses = diag.get("loss") if diag.get("mode") == "loss_fn" else []
        sections.append(
            '<section id="modules"><h2>The forward pass, module by module</h2>'
            '<p class="muted">Modules in execution order (a parent completes after its children). Bars: the largest |value| of each module\'s finite '
            "outputs, log scale: values on their way out of range climb here. Cells: the share of NaN, +Inf and -Inf in each output and, "
            "in the backward pass, in the gradient at that output.</p>"
            + (f'<p class="muted">The stored diagnosis holds only the {len(mods)} rows of the health table; run without --no-replay for every module.</p>' if partial else "")
            + modules_svg(mods, origin=diag.get("origin"), phase=diag.get("phase", ""), loss=losses or [])
            + f"<details><summary>table</summary>{_module_table(mods)}</details></section>"
        )
    sections.append(f'<section id="chain"><h2>Causal chain: where non-finite values were born, in execution order</h2>{_births_html(diag)}</section>')
    svg = samples_svg(diag)
    sections.append(f'<section id="samples"><h2>Samples</h2>{svg or ""}{_samples_html(diag)}</section>')
    opt = diag.get("optimizer")
    if opt:
        sections.append('<section id="optimizer"><h2>Optimizer update</h2>' + _kv([
            ("class", opt.get("class")), ("non-finite", opt.get("nonfinite")), ("parameter", opt.get("param")), ("state key", opt.get("state_key")),
            ("detail", opt.get("detail")), ("hyperparameters", json.dumps(opt.get("hyperparameters"), default=str)),
        ]) + "</section>")
    if diag.get("warnings"):
        sections.append('<section id="warnings"><h2>Warnings</h2><ul>' + "".join(f"<li>{_e(w)}</li>" for w in diag["warnings"]) + "</ul></section>")
    sections.append(
        '<footer>Written by <code>nanreplay report</code>. The diagnosis is embedded below as JSON (fields in nanreplay\'s docs/report.md); '
        "this page loads nothing from the network.</footer>" + _json_script(diag, "nanreplay-diagnosis")
    )
    return _page(f"nanreplay: step {diag.get('step')}: {diag.get('summary', '')[:80]}", "\n".join(sections))


def render_bisect_html(res: dict, *, meta: Optional[dict] = None) -> str:
    """The HTML page of a ``bisect`` result: the answer, the culprits, the replays tried
    (``trials``) and the search's details (steps timeline, weight movement).

    Args:
        res: the dict :func:`nanreplay.bisect` returns (``docs/bisect.md``).
        meta: the bundle's metadata, for the environment.

    Raises:
        MissingExtraError: matplotlib (the ``report`` extra) is not installed.
    """
    require_matplotlib()
    status = res.get("status", "")
    badges = [
        f'<span class="{"ok" if status == "found" else "bad"}">status: {_e(status)}</span>',
        f'<span>--over {_e(res.get("over"))}</span>', f'<span>step {_e(res.get("step"))}</span>',
        f'<span>{_e(res.get("replays"))} of at most {_e(res.get("max_replays"))} replays on {_e(res.get("device"))}</span>',
    ]
    name = os.path.basename(res.get("bundle") or "bundle")
    out = [f'<header><div class="tool">nanreplay bisect &middot; {_e(name)}</div><h1 class="sentence" id="summary">{_e(res.get("answer"))}</h1>'
           f'<div class="badges">{"".join(badges)}</div></header>']
    culprits = res.get("culprits") or []
    if culprits:
        keys = [k for k in culprits[0] if not isinstance(culprits[0][k], (dict, list))]
        rows = "".join("<tr>" + "".join(f"<td>{_e(_fmt(c.get(k)) if isinstance(c.get(k), float) else c.get(k))}</td>" for k in keys) + "</tr>" for c in culprits)
        out.append(f'<section id="culprits"><h2>Culprit{"s" if len(culprits) > 1 else ""}</h2><table><tr>{"".join(f"<th>{_e(k)}</th>" for k in keys)}</tr>{rows}</table></section>')
    trials = res.get("trials") or []
    if trials:
        rows = "".join(
            f'<tr><td class="num">{_e(t.get("replay"))}</td><td>{_e(t.get("varied"))}</td>'
            f'<td class="{"kind-NaN" if t.get("nonfinite") else ""}">{"non-finite" if t.get("nonfinite") else "finite"}</td>'
            f'<td class="num">{_e(_fmt(t.get("loss")))}</td><td class="num">{_e(_fmt(t.get("grad_norm")))}</td></tr>'
            for t in trials
        )
        out.append('<section id="trials"><h2>Replays tried</h2>' + trials_svg(trials)
                   + f"<table><tr><th>#</th><th>what the replay varied</th><th>result</th><th>loss</th><th>grad norm</th></tr>{rows}</table></section>")
    d = res.get("details") or {}
    if d.get("timeline"):
        out.append('<section id="steps"><h2>Replayed steps</h2>'
                   + (f'<p class="muted">{_e(d.get("verification"))}</p>' if d.get("verification") else "")
                   + bisect_steps_svg(d["timeline"]) + "</section>")
    if d.get("largest_moves"):
        out.append('<section id="moves"><h2>Weight movement by layer</h2>'
                   + moves_svg(d["largest_moves"], [c.get("layer") for c in culprits if "layer" in c]) + "</section>")
    env = environment_rows(meta)
    if env:
        out.append(f'<section id="environment"><h2>Environment of the recording</h2>{_kv(env)}</section>')
    if res.get("warnings"):
        out.append('<section id="warnings"><h2>Warnings</h2><ul>' + "".join(f"<li>{_e(w)}</li>" for w in res["warnings"]) + "</ul></section>")
    out.append("<details><summary>details (JSON)</summary><pre>" + _e(json.dumps(d, indent=1, default=str)) + "</pre></details>")
    out.append('<footer>Written by <code>nanreplay bisect --html</code>; this page loads nothing from the network.</footer>' + _json_script(res, "nanreplay-bisect"))
    return _page(f"nanreplay bisect: step {res.get('step')}: {status}", "\n".join(out))
