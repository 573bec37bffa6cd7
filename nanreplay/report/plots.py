"""The report's plots, drawn with matplotlib and returned as inline SVG strings.

matplotlib is an optional extra (``pip install 'nanreplay[report]'``): it is imported here, on
first use, never by ``import nanreplay`` or the other commands. Only its object-oriented API is
used (:class:`matplotlib.figure.Figure`, no ``pyplot``), so no GUI backend is ever selected and
nothing global changes in the caller's process.

Every function takes plain dicts (the diagnosis dict, a bisect result) and returns one
``<svg>...</svg>`` string whose ``width``/``height`` attributes are in ``pt`` (1 pt = 4/3 CSS px).
"""

from __future__ import annotations

import functools
import io
import math
import re
from typing import Any, Callable, Optional, Sequence

from ..core.jsonable import unfnum
from ..core.inert import inert
from ..errors import MissingExtraError

__all__ = ["require_matplotlib", "timeline_svg", "modules_svg", "samples_svg", "trials_svg", "bisect_steps_svg", "moves_svg", "COLORS"]

#: colours shared by the plots and the page's CSS
COLORS = {
    "nan": "#c62828", "posinf": "#ef6c00", "neginf": "#6a1b9a", "allowed": "#9e9e9e", "finite": "#78909c",
    "producer": "#c62828", "contains producer": "#ef9a9a", "propagator": "#ffb74d", "container": "#cfd8dc",
    "ok": "#a5d6a7", "grad": "#ad1457", "gradnorm": "#1565c0", "lr": "#2e7d32", "loss": "#37474f", "fail": "#c62828",
}

#: width of the plots in inches (1 in = 72 pt = 96 CSS px): 1152 px, the page's content width
WIDTH = 12.0


def require_matplotlib() -> Any:
    """Import matplotlib (the ``report`` extra) and return the module.

    Raises:
        MissingExtraError: matplotlib is not installed; the message names the extra to install.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (the OO API the plots use)
    except ImportError as e:
        raise MissingExtraError(
            "the HTML report draws its plots with matplotlib, which is not installed "
            f"(found: {e}). Install the report extra: pip install 'nanreplay[report]'",
            extra="report",
        ) from e
    return matplotlib


def _num(x: Any) -> Optional[float]:
    """A diagnosis number as a float (:func:`~nanreplay.core.jsonable.unfnum`); anything that is
    not a number a diagnosis writes (a bool, other text) is ``None``: a plot leaves it out."""
    if isinstance(x, bool):
        return None
    try:
        return unfnum(x)
    except (TypeError, ValueError):
        return None


def _plain_text(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Draw bundle strings as plain text: every string of the arguments (module names, layer
    names, phases) has its control characters shown as escapes (:func:`~nanreplay.core.inert.inert`)
    and its ``$`` escaped, so that a module named ``a$x^{$b`` shows as written instead of being
    parsed as mathtext (which raised ValueError). matplotlib's own labels (``10^{-2}`` ticks of a
    log scale) keep their mathtext."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*_labels(args), **_labels(kwargs))

    return wrapper


def _labels(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, str):
        return inert(obj).replace("$", "\\$")
    if depth > 200:
        return obj
    if isinstance(obj, dict):
        return {_labels(k, depth + 1): _labels(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_labels(v, depth + 1) for v in obj]
        return tuple(items) if type(obj) is tuple else items
    return obj


def _figure(w: float, h: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    return fig


def _svg(fig: Any, salt: str) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog). ``salt`` keeps the clip-path
    ids of several SVGs in one page distinct (matplotlib derives them from a hash)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"nanreplay-{salt}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    s = buf.getvalue()
    s = s[s.index("<svg"):]
    # one page holds several SVGs: prefix every id (and each reference to one) with the plot's name
    s = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{salt}-{m.group(1)}"', s)
    s = re.sub(r'url\(#([^)]+)\)', lambda m: f"url(#{salt}-{m.group(1)})", s)
    s = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{salt}-{m.group(1)}"', s)
    return s.replace("<svg ", f'<svg class="plot" data-plot="{salt}" role="img" ', 1)


def _style(ax: Any) -> None:
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.grid(True, which="major", color="#eceff1", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=8)


def _series_axis(ax: Any, steps: Sequence[int], vals: Sequence[Any], *, label: str, color: str, failing: Optional[int], log: str = "auto") -> None:
    """One curve over the steps: finite values as a line with markers, non-finite ones as
    labelled markers at the top of the axis. ``log``: ``"auto"`` (log scale when every finite value
    is > 0 and they span at least a factor 10), ``"positive"`` (whenever all are > 0) or ``"never"``."""
    from matplotlib.transforms import blended_transform_factory

    pts = [(s, _num(v)) for s, v in zip(steps, vals)]
    fin = [(s, v) for s, v in pts if v is not None and math.isfinite(v)]
    bad = [(s, v) for s, v in pts if v is not None and not math.isfinite(v)]
    if fin:
        ax.plot([s for s, _ in fin], [v for _, v in fin], marker="o", markersize=3.5, linewidth=1.6, color=color)
        vs = [v for _, v in fin]
        if log != "never" and min(vs) > 0 and (log == "positive" or max(vs) / min(vs) >= 10):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for s, v in bad:
        ax.scatter([s], [0.9], transform=trans, marker="X", s=60, color=COLORS["fail"], zorder=5, clip_on=False)
        ax.annotate("NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf"), (s, 0.9), xycoords=trans, xytext=(6, -3),
                    textcoords="offset points", color=COLORS["fail"], fontsize=8, fontweight="bold")
    if not fin and not bad:
        ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="#90a4ae", fontsize=9)
    if failing is not None:
        ax.axvline(failing, color=COLORS["fail"], linestyle="--", linewidth=1.1, alpha=0.8)
    ax.set_ylabel(label, fontsize=9)
    _style(ax)


@_plain_text
def timeline_svg(timeline: Sequence[dict], *, history: Optional[dict] = None) -> str:
    """Loss, grad norm and learning rates over the ring buffer's steps (log scales where the values
    allow), the failing step marked by a dashed red line and its non-finite values by red crosses.

    Args:
        timeline: the diagnosis' ``timeline`` (``step``, ``loss``, ``grad_norm``, ``lrs``, ``failing``).
        history: the diagnosis' ``history`` (``growth``, ``exploding``, ``lr_spike``), to annotate.
    """
    require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in timeline]
    failing = next((r["step"] for r in timeline if r.get("failing")), steps[-1] if steps else None)
    fig = _figure(WIDTH, 5.6)
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1.15, 1.15, 0.8], "hspace": 0.12})
    _series_axis(axes[0], steps, [r.get("loss") for r in timeline], label="loss", color=COLORS["loss"], failing=failing)
    _series_axis(axes[1], steps, [r.get("grad_norm") for r in timeline], label="grad norm", color=COLORS["gradnorm"], failing=failing)
    _lr_axis(axes[2], steps, timeline, failing)
    axes[2].set_xlabel("optimizer step (ring buffer)", fontsize=9)
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    if failing is not None:
        axes[0].annotate(f"failing step {failing}", (failing, 1.0), xycoords=("data", "axes fraction"), xytext=(-4, 2), textcoords="offset points",
                         ha="right", va="bottom", color=COLORS["fail"], fontsize=8)
    _history_notes(axes[1], axes[2], history or {})
    fig.subplots_adjust(left=0.08, right=0.98, top=0.95, bottom=0.1)
    fig.align_ylabels(axes)
    return _svg(fig, "timeline")


def _lr_axis(ax: Any, steps: Sequence[int], timeline: Sequence[dict], failing: Optional[int]) -> None:
    """The learning rates: one curve when every param group has the same rate, else one per group
    (at most 6, fading)."""
    groups = max((len(r.get("lrs") or []) for r in timeline), default=0)
    lr_rows = [[_num(x) for x in (r.get("lrs") or [])] for r in timeline]
    same = all(len(set(v for v in row if v is not None)) <= 1 for row in lr_rows)
    if groups <= 1 or same:
        _series_axis(ax, steps, [row[0] if row else None for row in lr_rows], label="learning rate", color=COLORS["lr"], failing=failing, log="positive")
    else:
        for g in range(min(groups, 6)):
            _series_axis(ax, steps, [row[g] if g < len(row) else None for row in lr_rows], label="learning rate", color=COLORS["lr"], failing=failing, log="positive")
            ax.lines[-1].set_alpha(1.0 - 0.12 * g)


def _history_notes(norm_ax: Any, lr_ax: Any, h: dict) -> None:
    """The diagnosis' ``history`` written on the grad norm axis (growth, an lr spike), the spike
    also circled on the learning rate axis."""
    notes = []
    if h.get("growth") is not None and _num(h["growth"]) is not None:
        notes.append(f"last finite grad norm = {_num(h['growth']):.3g} x median of the earlier ones" + (" (exploding)" if h.get("exploding") else ""))
    if h.get("lr_spike"):
        sp = h["lr_spike"]
        notes.append(f"lr spike at step {sp['step']}: {sp['lr']} (min {sp['min_lr']})")
        if _num(sp.get("lr")) is not None and math.isfinite(_num(sp["lr"])):
            lr_ax.scatter([sp["step"]], [_num(sp["lr"])], s=90, facecolors="none", edgecolors=COLORS["fail"], linewidths=1.5, zorder=6)
    if notes:
        norm_ax.text(0.01, 0.96, "; ".join(notes), transform=norm_ax.transAxes, fontsize=8, va="top", color="#37474f")


def _is_container(name: str, names: set[str]) -> bool:
    return name == "" or any(n.startswith(name + ".") for n in names)


def _fraction(h: Optional[dict], key: str) -> float:
    if not h or not h.get("numel"):
        return 0.0
    return h.get(key, 0) / h["numel"]


@_plain_text
def modules_svg(modules: Sequence[dict], *, origin: Optional[dict] = None, phase: str = "", loss: Sequence[Optional[dict]] = (),
                max_labels: int = 90) -> str:
    """The forward pass, module by module in execution order: a bar per module call with the
    max |value| of its finite outputs (log scale), coloured by role (producer, propagator), above a
    strip of cells with the NaN, +Inf and -Inf fraction of its output and of the gradient at its
    output in the backward pass. Allowlisted ``-Inf`` masks are hatched grey; the origin is marked.

    Args:
        modules: the diagnosis' ``forward_modules`` (or its ``health`` rows, which lack ``grad``).
        origin: the diagnosis' ``origin``; phase: its ``phase``.
        loss: the diagnosis' ``loss`` (health of each replayed loss), drawn as a last column.
    """
    require_matplotlib()
    from matplotlib.patches import Patch

    cols = _module_columns(modules, loss)
    n = len(cols)
    names = {m["module"] for m in modules if m.get("module") is not None}
    width = max(WIDTH, min(2.2 + 0.24 * n, 30.0))
    labels = [c.get("label") or _label(c) for c in cols]
    label_in = 0.25 + 0.058 * max((len(x) for x in labels), default=8)  # rotated 7 pt labels: ~0.058 in per character
    height = 4.4 + label_in
    fig = _figure(width, height)
    ax, strip = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.3, 1.0], "hspace": 0.06})
    _module_bars(ax, cols, names)
    _module_strip(strip, cols)
    step = max(1, math.ceil(n / max_labels))
    strip.set_xticks(list(range(n))[::step])
    strip.set_xticklabels(labels[::step], rotation=90, fontsize=7)
    for t, c in zip(strip.get_xticklabels(), cols[::step]):
        if not c.get("is_loss") and _is_container(c["module"], names):
            t.set_color("#90a4ae")
    target = _origin_column(cols, origin or {}, phase)
    if target is not None:
        ax.annotate(f"origin ({phase})" if phase else "origin", (target, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 14),
                    textcoords="offset points", ha="center", fontsize=8, fontweight="bold", color=COLORS["fail"],
                    arrowprops={"arrowstyle": "-|>", "color": COLORS["fail"], "lw": 1.2})
    legend = [Patch(color=COLORS["producer"], label="producer"), Patch(color=COLORS["propagator"], label="propagator"),
              Patch(color=COLORS["finite"], label="finite"), Patch(color=COLORS["container"], label="container (parent) module"),
              Patch(facecolor="white", edgecolor=COLORS["allowed"], hatch="////", label="allowlisted -Inf mask")]
    ax.legend(handles=legend, fontsize=7, ncol=5, loc="upper left", bbox_to_anchor=(0.0, 1.17), frameon=False)
    fig.subplots_adjust(left=1.75 / width, right=1 - 0.15 / width, top=1 - 0.55 / height, bottom=label_in / height)
    return _svg(fig, "modules")


def _module_columns(modules: Sequence[dict], loss: Sequence[Optional[dict]]) -> list[dict]:
    """One column per module call, then one per replayed loss (``is_loss``)."""
    cols = [dict(m) for m in modules]
    for i, h in enumerate(loss):
        if h is not None:
            cols.append({"module": None, "label": "(loss)" if len(loss) == 1 else f"(loss {i})", "class": "", "role": "", "output": h, "grad": None,
                         "allowed": {}, "is_loss": True})
    return cols


def _module_color(c: dict, names: set[str]) -> str:
    """A column's bar colour: its role, else a loss' (non-finite or not), else container or finite."""
    out = c.get("output") or {}
    role = c.get("role") or ""
    if role in ("producer", "contains producer", "propagator"):
        return COLORS[role]
    if c.get("is_loss"):
        return COLORS["nan"] if out.get("nan") or out.get("posinf") or out.get("neginf") else COLORS["loss"]
    return COLORS["container"] if _is_container(c["module"], names) else COLORS["finite"]


def _module_bars(ax: Any, cols: Sequence[dict], names: set[str]) -> None:
    """The upper axis: max |finite output value| per column on a log scale; a column with no
    finite value at all says so."""
    heights = []
    for c in cols:
        a = _num((c.get("output") or {}).get("absmax"))
        heights.append(a if a is not None and a > 0 else math.nan)
    colors = [_module_color(c, names) for c in cols]
    xs = list(range(len(cols)))
    ax.bar(xs, [h if not math.isnan(h) else 0 for h in heights], color=colors, width=0.78, edgecolor="none")
    finite_h = [h for h in heights if not math.isnan(h)]
    if finite_h:
        ax.set_yscale("log")
        lo, hi = min(finite_h), max(finite_h)
        ax.set_ylim(lo / 4, hi * 12)
    ax.set_ylabel("max |finite output value|", fontsize=9)
    for x, c in zip(xs, cols):  # a module whose output has no finite value at all
        out = c.get("output") or {}
        if out and _num(out.get("absmax")) is None and out.get("numel"):
            ax.annotate("no finite value", (x, 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, color=COLORS["nan"], ha="center", va="bottom")
    _style(ax)


def _grad_count(c: dict) -> int:
    return sum((c.get("grad") or {}).get(k, 0) for k in ("nan", "posinf", "neginf"))


def _cell_fraction(c: dict, key: str) -> float:
    """The non-finite fraction of a strip cell: of the output for ``nan``/``posinf``/``neginf``,
    of the gradient at the output (all three kinds) for ``grad``."""
    if key != "grad":
        return _fraction(c.get("output"), key)
    g = c.get("grad")
    return (_grad_count(c) / g["numel"]) if g and g.get("numel") else 0.0


def _module_strip(strip: Any, cols: Sequence[dict]) -> None:
    """The lower axis: NaN, +Inf, -Inf of the output and the non-finite fraction of the gradient
    at the output, one cell per column, with counts when there are few columns."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    n = len(cols)
    rows = [("output NaN", "nan", COLORS["nan"]), ("output +Inf", "posinf", COLORS["posinf"]), ("output -Inf", "neginf", COLORS["neginf"])]
    if any(c.get("grad") for c in cols):
        rows.append(("gradient at output: NaN/Inf", "grad", COLORS["grad"]))
    grid = [[to_rgba(color, 0.25 + 0.75 * f) if (f := _cell_fraction(c, key)) > 0 else to_rgba("#f5f7f8") for c in cols] for _, key, color in rows]
    strip.imshow(grid, aspect="auto", interpolation="nearest", extent=(-0.5, n - 0.5, len(rows) - 0.5, -0.5))
    for x, c in enumerate(cols):
        if c.get("allowed"):
            strip.add_patch(Rectangle((x - 0.5, 2 - 0.5), 1, 1, facecolor="none", edgecolor=COLORS["allowed"], hatch="////", linewidth=0.8))
        for y, (_, key, _) in enumerate(rows):
            cnt = _grad_count(c) if key == "grad" else (c.get("output") or {}).get(key, 0)
            if cnt and n <= 40:
                strip.text(x, y, _short(cnt), ha="center", va="center", fontsize=6.5, color="white")
    strip.set_yticks(range(len(rows)))
    strip.set_yticklabels([r[0] for r in rows], fontsize=8)
    strip.set_xlim(-0.5, n - 0.5)
    for s in strip.spines.values():
        s.set_visible(False)
    strip.tick_params(length=0)


def _origin_column(cols: Sequence[dict], o: dict, phase: str) -> Optional[int]:
    """The column the origin arrow points at: the loss for a loss-phase origin, else the origin's
    module (its producer call first)."""
    if phase in ("loss",) and any(c.get("is_loss") for c in cols):
        return next(i for i, c in enumerate(cols) if c.get("is_loss"))
    if o.get("module") is None:
        return None
    target = next((i for i, c in enumerate(cols) if c.get("module") == o["module"] and c.get("role") in ("producer", "contains producer")), None)
    if target is None:
        target = next((i for i, c in enumerate(cols) if c.get("module") == o["module"]), None)
    return target


def _label(c: dict) -> str:
    """``features.0 (Conv2d)``, the FQN's tail when long, for an x tick label."""
    name = c["module"] or "(root)"
    if len(name) > 36:
        name = "..." + name[-33:]
    full = f"{name} ({c['class']})" if c.get("class") else name
    return full if len(full) <= 44 else name


def _short(n: int) -> str:
    return str(n) if n < 1000 else (f"{n / 1000:.0f}k" if n < 10**6 else f"{n / 10**6:.0f}M")


@_plain_text
def samples_svg(diag: dict) -> Optional[str]:
    """Which rows of the batch carry non-finite values: one line per batch leaf (``batch_leaves``),
    per birth whose output has the batch's rows, and for the per-sample replay; one column per
    sample. ``None`` when the batch size is unknown."""
    require_matplotlib()
    from matplotlib.patches import Patch

    size = _batch_size(diag)
    if not size:
        return None
    rows = _sample_rows(diag, size)
    if not rows:
        return None
    fig = _figure(WIDTH, 1.3 + 0.34 * len(rows))
    ax = fig.subplots(1, 1)
    ax.imshow([r for _, r in rows], aspect="auto", interpolation="nearest", extent=(-0.5, size - 0.5, len(rows) - 0.5, -0.5))
    if size <= 64:
        for x in range(size + 1):
            ax.axvline(x - 0.5, color="white", linewidth=1.0)
    for y in range(len(rows) + 1):
        ax.axhline(y - 0.5, color="white", linewidth=2.0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r for r, _ in rows], fontsize=8)
    step = max(1, math.ceil(size / 32))
    ax.set_xticks(range(0, size, step))
    ax.tick_params(axis="x", labelsize=7, length=0)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("sample (row of the batch, dim 0)", fontsize=9)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.legend(handles=[Patch(color=COLORS["nan"], label="non-finite"), Patch(color=COLORS["ok"], label="finite"),
                       Patch(color="#eceff1", label="integer/bool leaf (cannot hold NaN), or dim 0 is not the batch")],
              fontsize=7, ncol=3, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    longest = max(len(r) for r, _ in rows)
    fig.subplots_adjust(left=min(0.5, 0.04 + 0.0068 * longest), right=0.99, top=1 - 0.45 / (1.3 + 0.34 * len(rows)), bottom=0.55 / (1.3 + 0.34 * len(rows)) + 0.05)
    return _svg(fig, "samples")


def _batch_size(diag: dict) -> Optional[int]:
    """The batch size: the per-sample analysis', else the largest dim 0 of the batch leaves."""
    size = (diag.get("samples") or {}).get("batch_size")
    if size is None:
        dims = [lf["shape"][0] for lf in diag.get("batch_leaves") or [] if lf.get("shape")]
        size = max(dims) if dims else None
    return size


def _sample_rows(diag: dict, size: int) -> list[tuple[str, list]]:
    """The lines of the samples plot, each a label and one RGBA cell per sample: the batch leaves,
    the births whose output has the batch's rows, the per-sample replay and the blamed samples."""
    from matplotlib.colors import to_rgba

    smp = diag.get("samples") or {}
    bad, ok, na, blamed = to_rgba(COLORS["nan"]), to_rgba(COLORS["ok"]), to_rgba("#eceff1"), to_rgba("#b71c1c")
    rows: list[tuple[str, list]] = []
    for lf in diag.get("batch_leaves") or []:
        shape = lf.get("shape") or []
        applies = lf.get("floating") and shape and shape[0] == size
        rows.append((f"{lf['leaf']}  {lf.get('dtype')} {shape}", [(bad if i in set(lf.get("rows") or []) else ok) if applies else na for i in range(size)]))
    rows += _birth_rows(diag, size, bad, ok)
    if smp.get("method") == "per-sample replay" or smp.get("batch_level"):
        idx = set(range(size)) if smp.get("batch_level") else set(smp.get("indices") or [])
        rows.append(("non-finite when replayed alone", [bad if i in idx else ok for i in range(size)]))
    if smp.get("indices"):
        idx = set(smp["indices"])
        rows.append(("blamed samples", [blamed if i in idx else ok for i in range(size)]))
    return rows


def _birth_rows(diag: dict, size: int, bad: tuple, ok: tuple) -> list[tuple[str, list]]:
    """A line per forward or loss birth whose output has the batch's rows: the rows it made non-finite."""
    rows = []
    for b in diag.get("births") or []:
        r = b.get("rows") or {}
        if r.get("size") == size and b.get("phase") != "backward":
            idx = set(r.get("indices") or [])
            cut = isinstance(r.get("count"), int) and r["count"] > len(idx)  # the birth lists only its first non-finite rows
            rows.append((f"{b['phase']} op {b['op']} output" + (f" in {b['module']}" if b.get("module") else "")
                         + (f" (first {len(idx)} of {r['count']} rows)" if cut else ""), [bad if i in idx else ok for i in range(size)]))
    return rows


@_plain_text
def trials_svg(trials: Sequence[dict]) -> str:
    """The replays a bisect search ran, in order: a red cell for a non-finite replay, green for a
    finite one (from the result's ``trials``)."""
    require_matplotlib()
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    n = len(trials)
    fig = _figure(WIDTH, 1.7)
    ax = fig.subplots(1, 1)
    ax.imshow([[to_rgba(COLORS["nan"] if t.get("nonfinite") else COLORS["ok"]) for t in trials]], aspect="auto", interpolation="nearest",
              extent=(0.5, n + 0.5, 0.5, -0.5))
    for x in range(n + 1):
        ax.axvline(x + 0.5, color="white", linewidth=1.5)
    ax.set_yticks([])
    ax.set_xticks(range(1, n + 1, max(1, math.ceil(n / 40))))
    ax.tick_params(labelsize=7, length=0)
    ax.set_xlabel("replay", fontsize=9)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.legend(handles=[Patch(color=COLORS["nan"], label="non-finite"), Patch(color=COLORS["ok"], label="finite")], fontsize=7, ncol=2,
              loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    fig.subplots_adjust(left=0.03, right=0.99, top=0.72, bottom=0.32)
    return _svg(fig, "trials")


@_plain_text
def bisect_steps_svg(timeline: Sequence[dict]) -> str:
    """``bisect --over steps``: replayed and recorded loss, grad norm and update norm per step."""
    require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in timeline]
    fig = _figure(WIDTH, 5.0)
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw={"hspace": 0.12})
    for ax, key, rec, label, color in ((axes[0], "loss", "recorded_loss", "loss", COLORS["loss"]),
                                       (axes[1], "grad_norm", "recorded_grad_norm", "grad norm", COLORS["gradnorm"]),
                                       (axes[2], "update_norm", None, "update norm", COLORS["lr"])):
        _series_axis(ax, steps, [r.get(key) for r in timeline], label=label, color=color, failing=None)
        if rec:
            pts = [(s, _num(r.get(rec))) for s, r in zip(steps, timeline)]
            pts = [(s, v) for s, v in pts if v is not None and math.isfinite(v)]
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], linestyle=":", marker="s", markersize=3, color="#90a4ae", label="recorded")
                ax.legend(fontsize=7, frameon=False, loc="upper left", labels=["replayed", "recorded"])
        for r in timeline:
            if r.get("anomalies"):
                ax.axvspan(r["step"] - 0.4, r["step"] + 0.4, color=COLORS["fail"], alpha=0.12)
    axes[2].set_xlabel("step", fontsize=9)
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.subplots_adjust(left=0.1, right=0.98, top=0.97, bottom=0.1)
    return _svg(fig, "bisect-steps")


@_plain_text
def moves_svg(moves: Sequence[dict], culprits: Sequence[str]) -> str:
    """``bisect --over layers``: the layers whose weights moved most (relative change, log
    scale), the culprits in red."""
    require_matplotlib()

    rows = [(m.get("layer") or "(root)", _num(m.get("relative_change"))) for m in moves]
    fig = _figure(WIDTH, 0.8 + 0.32 * max(1, len(rows)))
    ax = fig.subplots(1, 1)
    ys = list(range(len(rows)))
    vals = [v if v is not None and math.isfinite(v) and v > 0 else 0 for _, v in rows]
    cul = set(c or "(root)" for c in culprits)
    ax.barh(ys, vals, color=[COLORS["fail"] if name in cul else COLORS["finite"] for name, _ in rows])
    if any(v > 0 for v in vals):
        ax.set_xscale("log")
    ax.set_yticks(ys)
    ax.set_yticklabels([name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("relative weight change between the good snapshot and the failing step", fontsize=9)
    _style(ax)
    fig.subplots_adjust(left=0.25, right=0.98, top=0.95, bottom=0.5 / (0.8 + 0.32 * max(1, len(rows))) + 0.08)
    return _svg(fig, "moves")
