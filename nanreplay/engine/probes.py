"""Evidence observed at the moment an op gives birth to a non-finite value, while its inputs,
the Python stack and the autograd node are still there. The op monitor calls these once per
birth, never per op.

Techniques and where they come from:

* forward source lines: the Python stack at dispatch time (``sys._getframe``), innermost frame
  outside torch, nanreplay and the standard library;
* backward source lines: autograd anomaly mode (``torch.autograd.set_detect_anomaly``) stores the
  forward stack of every autograd node in ``node.metadata["traceback_"]``;
  ``torch._C._current_autograd_node()`` names the node whose backward kernel is running;
* overflow vs domain: the op is recomputed on its inputs in a wider dtype (float16/bfloat16 ->
  float32, float32 -> float64): finite there means the value only left the dtype's range.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import sysconfig
import traceback
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ..core.numerics import all_finite_flag, any_nonfinite, is_float

logger = logging.getLogger(__name__)

__all__ = ["user_frame_now", "user_frame_of_exception", "user_frame_of_traceback", "user_frames_only", "current_node", "node_forward_op", "node_method_of", "custom_function_on_stack", "wider_recompute", "nonfinite_rows",
           "calling_module", "operands"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nanreplay package
_STDLIB_DIRS = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p
)


#: torch's and nanreplay's files as installed in any environment (a bundle's stack traces were
#: recorded where they were installed elsewhere)
_INSTALLED_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:torch|nanreplay|torchgen|functorch)[/\\]")


def _is_library(filename: str) -> bool:
    if not filename or filename.startswith("<frozen"):
        return True
    f = os.path.abspath(filename)
    if f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR) or _INSTALLED_LIBRARY.search(f):
        return True
    return f.startswith(_STDLIB_DIRS) and "site-packages" not in f and "dist-packages" not in f


def _is_own(filename: str) -> bool:
    return bool(filename) and os.path.abspath(filename).startswith(_OWN_DIR)


def _user_frames(start: Any) -> Iterator[Any]:
    """The frames of user code from ``start`` outward, up to the replay's own driver: nanreplay's
    innermost frames (the monitor that calls this) are skipped, and the first nanreplay frame met
    after torch's (the replay running the user's code) ends the walk, so the command line or test
    runner that started the replay is never taken for the user's code."""
    f, outside = start, False
    while f is not None:
        fn = f.f_code.co_filename
        own = _is_own(fn)
        if own and outside:
            return
        outside = outside or not own
        if not _is_library(fn):
            yield f
        f = f.f_back


def _frame_dict(filename: str, line: int, function: str, code: Optional[str]) -> dict:
    return {"file": filename, "line": int(line), "function": function, "code": (code or "").strip() or None}


def user_frame_now() -> Optional[dict]:
    """The innermost frame of the current Python stack outside torch, nanreplay and the standard
    library, as ``{"file", "line", "function", "code"}``; ``None`` when every frame is library code."""
    import linecache

    for f in _user_frames(sys._getframe(1)):
        fn = f.f_code.co_filename
        return _frame_dict(fn, f.f_lineno, f.f_code.co_name, linecache.getline(fn, f.f_lineno))
    return _fx_node_frame()


def _fx_node_frame() -> Optional[dict]:
    """The user frame recorded for the FX node running now (an embedded program replayed by
    ``torch.fx.Interpreter``: the Python stack holds only the interpreter, the node keeps the
    original ``stack_trace``)."""
    try:
        from torch.fx.traceback import get_current_meta

        trace = (get_current_meta() or {}).get("stack_trace")
    except Exception:  # noqa: BLE001 - no FX node running, or an older torch
        return None
    if not trace:
        return None
    entries = re.findall(r'File "[^"]+", line \d+, in [^\n]+\n[^\n]*', trace)
    return user_frame_of_traceback(entries)


_TB_LINE = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?P<code>[^\n]*)')


def user_frame_of_exception(e: BaseException) -> Optional[dict]:
    """The innermost user frame (outside torch, nanreplay and the standard library) of the
    traceback ``e`` was raised through, as ``{"file", "line", "function", "code"}``, else ``None``:
    the line of the user's code that led to the error (a failed ``torch.export`` trace)."""
    found = None
    for fs in traceback.extract_tb(e.__traceback__):
        if not _is_library(fs.filename):
            found = _frame_dict(fs.filename, fs.lineno or 0, fs.name, fs.line)
    return found


def user_frame_of_traceback(tb: Optional[Sequence[str]]) -> Optional[dict]:
    """The innermost user frame of a forward stack recorded by anomaly mode
    (``node.metadata["traceback_"]``, a list of ``traceback.format_stack()`` strings; in a replay
    of an embedded program, the FX node's recorded ``stack_trace``)."""
    if not tb:
        return None
    for entry in reversed(list(tb)):  # an entry may hold several frames (an FX node's stack_trace)
        for m in reversed(list(_TB_LINE.finditer(entry))):
            if not _is_library(m["file"]):
                return _frame_dict(m["file"], int(m["line"]), m["func"].strip(), m["code"])
    return None


def user_frames_only(trace: str) -> str:
    """A stack trace (``traceback.format_list`` text, an FX node's ``stack_trace``) cut to its
    user frames, judged where it is called: the recording environment knows which files are
    torch's, nanreplay's and the standard library's, a replay elsewhere may not. ``""`` when no
    frame is the user's."""
    return "".join(f'  File "{m["file"]}", line {m["line"]}, in {m["func"].strip()}\n    {m["code"].strip()}\n'
                   for m in _TB_LINE.finditer(trace or "") if not _is_library(m["file"]))


def current_node() -> tuple[Optional[str], Optional[dict]]:
    """(name, forward user frame) of the autograd node whose backward kernel runs now."""
    try:
        node = torch._C._current_autograd_node()
    except (AttributeError, RuntimeError):
        return None, None
    if node is None:
        return None, None
    try:
        tb = node.metadata.get("traceback_")
    except (AttributeError, RuntimeError):
        tb = None
    return node.name(), user_frame_of_traceback(tb)


def node_forward_op(node: Optional[str]) -> Optional[str]:
    """The forward op of an autograd node name: ``SqrtBackward0`` -> ``sqrt``,
    ``LogSoftmaxBackward0`` -> ``log_softmax``, ``torch::autograd::AccumulateGrad`` -> ``None``."""
    if not node or "::" in node:
        return None
    base = re.sub(r"Backward\d*$", "", node)
    if base == node or not base:
        return None
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64,
          torch.complex32: torch.complex64, torch.complex64: torch.complex128}


def _precision(dtype: torch.dtype) -> int:
    """Bytes of one real component: complex64 counts as float32 (4)."""
    return dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize


def wider_recompute(func: Callable, args: tuple, kwargs: dict, outs: Sequence[torch.Tensor]) -> Optional[dict]:
    """Recompute one op with its floating and complex inputs cast to a wider dtype
    (float16/bfloat16 -> float32, float32 -> float64, complex64 -> complex128) and say whether the
    result is finite there. Only for ops that do not write into their inputs (the inputs must
    still be the ones the op saw). Inputs no wider than the output's precision are widened, each
    within its kind (a float32 operand of a complex64 op becomes float64).

    Returns:
        ``{"dtype": "float64", "finite": bool, "absmax": float | None}`` (``dtype``: the widened
        output's; ``absmax`` of the finite values, of the magnitude for complex), or ``None`` when
        the op cannot be recomputed (float64/complex128 already, an in-place op, a failure).
    """
    low = next((t.dtype for t in outs if t.dtype in _WIDER), None)
    if low is None:
        return None
    bits = _precision(low)

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in _WIDER and _precision(x.dtype) <= bits:
            return x.detach().to(_WIDER[x.dtype])
        if isinstance(x, torch.dtype) and x in _WIDER and _precision(x) <= bits:
            return _WIDER[x]
        return x

    try:
        with torch.no_grad():
            res = func(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
    except Exception as e:  # some ops insist on their dtype; the evidence is then simply absent
        logger.debug("nanreplay: wider recomputation of %s failed: %s", func, e)
        return None
    ts = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor) and is_float(t)]
    if not ts:
        return None
    finite = not any_nonfinite(ts)
    fin = [t[torch.isfinite(t)] for t in ts]
    absmax = max((float(t.abs().max()) for t in fin if t.numel()), default=None)
    return {"dtype": str(ts[0].dtype).replace("torch.", ""), "finite": finite, "absmax": absmax}


def nonfinite_rows(outs: Sequence[torch.Tensor], batch: Optional[int], per_sample: Optional[int] = None, limit: int = 64, *,
                   nan_only: bool = False) -> Optional[dict]:
    """The batch rows of the first floating output that hold a non-finite value: along its first
    dimension of length ``batch`` (the replayed micro-batch's size), else along dimension 0.
    ``per_sample``: dimension 0 merges the batch with the dimensions after it, ``per_sample``
    rows per sample (``[B * T, d]``): its non-finite rows are given as the samples they belong to
    (whatever length the other dimensions have).
    ``nan_only``: the rows holding NaN (a NaN born of inputs that already held Inf: the Inf is
    theirs, carried on, and only the NaN rows are born here).
    Returns ``{"size", "dim", "count", "indices"}`` (``count`` non-finite rows; ``indices`` all of
    them along the batch dimension, whose size bounds the list, else the first ``limit``), plus
    ``rows_per_sample`` with ``per_sample``."""
    t = next((t for t in outs if is_float(t) and t.dim() >= 1), None)
    if t is None:
        return None
    merged = bool(per_sample and batch and t.shape[0] == batch * per_sample)  # row r of dim 0 is in sample r // per_sample
    dim = 0 if merged else (next((d for d, n in enumerate(t.shape) if n == batch), 0) if batch is not None else 0)
    size = batch if merged else int(t.shape[dim])
    rows = t.detach().movedim(dim, 0).reshape(size, -1)
    bad = torch.isnan(rows).any(dim=1) if nan_only else ~torch.isfinite(rows).all(dim=1)
    keep = None if size == batch else limit  # the samples are never cut; rows of another dimension may be many
    out = {"size": size, "dim": dim, "count": int(bad.sum()), "indices": [int(i) for i in bad.nonzero().flatten()[:keep].tolist()]}
    return dict(out, rows_per_sample=per_sample) if merged else out


def calling_module(module_ids: dict[int, str], depth: int = 40, *, outside_forward: bool = False) -> Optional[str]:
    """FQN of the innermost model module whose *method* is on the Python stack now (``self`` of a
    user-code frame is a module of the model), e.g. ``""`` for ``model.compute_loss(...)`` called
    from the loss function (or a LightningModule's ``training_step``); ``None`` when no frame
    belongs to one. ``module_ids``: ``id(module) -> FQN``. ``outside_forward``: ``None`` as
    well when a model module's ``forward`` is on the stack (the op runs inside the model's
    forward call, where the module stack names the module)."""
    found = None
    for i, f in enumerate(_user_frames(sys._getframe(1))):
        if i >= depth:
            break
        if "self" in f.f_code.co_varnames[:1]:
            name = module_ids.get(id(f.f_locals.get("self")))
            if name is None:
                continue
            if outside_forward and f.f_code.co_name == "forward":
                return None
            if found is None:
                found = name
                if not outside_forward:
                    return found
    return found


def custom_function_on_stack(depth: int = 200) -> Optional[type]:
    """The ``torch.autograd.Function`` subclass whose ``forward`` is on the Python stack now
    (its first argument, ``ctx``, is the Function's context), innermost first; ``None`` when
    none is. A program traced through one holds its forward's ops, not its ``backward``."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        if f.f_code.co_name == "forward" and f.f_code.co_varnames[:1] == ("ctx",):
            ctx = f.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.FunctionCtx):
                return getattr(type(ctx), "_forward_cls", None)
        f = f.f_back
    return None


def node_method_of(table: Optional[dict]) -> Optional[str]:
    """In a replay of an embedded program, the model module whose method (not ``forward``) ran
    the FX node running now, from the program's ``method_of`` table (its stack trace -> FQN,
    recorded at export, where the Python frames were live: see
    :func:`nanreplay.engine.program.export_program`); ``None`` outside one or without a table."""
    if not table:
        return None
    try:
        from torch.fx.traceback import get_current_meta

        trace = (get_current_meta() or {}).get("stack_trace")
    except Exception:  # noqa: BLE001 - no FX node running, or an older torch
        return None
    found = table.get(trace) if isinstance(trace, str) else None
    return found if isinstance(found, str) else None


def _schema_names(func: Any, args: tuple, kwargs: dict) -> tuple[list[Optional[str]], dict[str, Any]]:
    """Names of the op's positional args (from its schema) and its non-tensor arguments by name."""
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    pos = [names[i] if i < len(names) else None for i in range(len(args))]
    scalars: dict[str, Any] = {}
    for n, v in list(zip(pos, args)) + list(kwargs.items()):
        if n is None or isinstance(v, torch.Tensor):
            continue
        if v is None or isinstance(v, (bool, int, str)):
            scalars[n] = v
        elif isinstance(v, float):
            scalars[n] = v if math.isfinite(v) else repr(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, bool)) for x in v) and len(v) <= 16:
            scalars[n] = list(v)
    return pos, scalars


def _operand(t: torch.Tensor, name: Optional[str], prov: frozenset, producer: str, masked_by: frozenset,
             row_groups: Optional[tuple[int, int]] = None, born_at: Optional[torch.Tensor] = None) -> dict:
    d = t.detach()
    out: dict[str, Any] = {"name": name, "shape": list(d.shape), "dtype": str(d.dtype).replace("torch.", ""), "numel": d.numel(),
                           "prov": sorted(prov), "producer": producer}
    if masked_by:
        out["masked_by"] = sorted(masked_by)
    if row_groups is not None:
        out["merged_rows"] = list(row_groups)
    if d.numel() == 0:
        return out
    if born_at is not None:
        out.update(_where_born(d, born_at))
    if d.is_complex():
        mag = d.abs()
        out["zeros"] = int((mag == 0).sum())
        out["nonfinite"] = int((~torch.isfinite(d)).sum())
        return out
    if d.is_floating_point():
        out.update(_float_counts(d))
        return out
    if d.dtype == torch.bool:
        out["true"] = int(d.sum())
        return out
    vals = torch.unique(d)
    out["distinct"] = [int(x) for x in vals[:9].tolist()] if vals.numel() <= 8 else None
    out["min"], out["max"] = int(d.min()), int(d.max())
    out["zeros"], out["negatives"] = int(torch.count_nonzero(d == 0)), int(torch.count_nonzero(d < 0))  # an integer divisor (a count) at 0
    return out


def _where_born(d: torch.Tensor, born_at: torch.Tensor) -> dict:
    """Zeros and negatives of the operand ``d`` at the positions where the op's output is
    non-finite (``born_at``, a boolean mask of the output's shape; ``d`` broadcast to it), as
    ``zeros_where_born`` and ``negatives_where_born``: which operand's values sit where the op
    left its domain (the divisor's zero, not the numerator's). ``{}`` for a complex or boolean
    operand, or one that does not broadcast to the output."""
    if d.is_complex() or d.dtype == torch.bool:
        return {}
    try:
        if torch.broadcast_shapes(d.shape, born_at.shape) != born_at.shape:
            return {}
    except RuntimeError:
        return {}
    e = d.expand(born_at.shape)
    return {"zeros_where_born": int(torch.count_nonzero((e == 0) & born_at)), "negatives_where_born": int(torch.count_nonzero((e < 0) & born_at))}


def _float_counts(d: torch.Tensor) -> dict:
    """Zeros, negatives, NaN, +Inf and -Inf counts of a floating tensor and its finite values'
    range (``min``, ``max``, ``absmin_nonzero``; absent when none is finite). Counts by
    ``count_nonzero``, and a finite tensor (one ``aminmax``) skips the non-finite masks and the
    copy of its finite values: 0.09 s instead of 0.5 s for summing boolean masks, for a
    [512, 16384] float32 operand (a language model's log-probabilities) on this machine's CPU."""
    out = {"zeros": int(torch.count_nonzero(d == 0)), "negatives": int(torch.count_nonzero(d < 0))}
    if bool(all_finite_flag(d)):
        out.update(nan=0, posinf=0, neginf=0)
        v = d
    else:
        out.update(nan=int(torch.count_nonzero(torch.isnan(d))), posinf=int(torch.count_nonzero(torch.isposinf(d))),
                   neginf=int(torch.count_nonzero(torch.isneginf(d))))
        v = d[torch.isfinite(d)]
        if not v.numel():
            return out
    lo, hi = torch.aminmax(v)
    mag = v.abs()
    smallest = float(torch.where(mag == 0, torch.full_like(mag, math.inf), mag).min())
    out.update(min=float(lo), max=float(hi), absmin_nonzero=smallest if math.isfinite(smallest) else None)
    return out


def _masked_rows(t: torch.Tensor, dim: int) -> Optional[dict]:
    """Slices of ``t`` along ``dim`` that are entirely -Inf (every position masked), by row of dim 0."""
    if not t.is_floating_point() or t.dim() == 0 or t.numel() == 0:
        return None
    full = torch.isneginf(t.detach()).all(dim=dim)
    n = int(full.sum())
    if not n:
        return {"count": 0, "of": full.numel()}
    rows = sorted({int(i) for i in full.reshape(full.shape[0], -1).any(dim=1).nonzero().flatten().tolist()}) if full.dim() else []
    return {"count": n, "of": full.numel(), "rows": rows[:64], "rows_of": int(full.shape[0]) if full.dim() else 1}


def operands(func: Any, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor],
             facts: Sequence[tuple[frozenset, str, frozenset, Optional[tuple[int, int]]]], output: Optional[torch.Tensor] = None) -> dict:
    """What an op's inputs held when it gave birth to a non-finite value: for each tensor input,
    its shape, dtype, counts of zeros / negatives / non-finite values, finite range, provenance
    (``prov``: ``batch:<path>``, ``weights``, ``buffer:<fqn>``, ``const``, ``rng``), the op that
    produced it (``producer``), where allowlisted masks wrote -Inf into it the provenance of what
    placed them (``masked_by``: the mask), where a reshape merged leading dimensions into its
    dimension 0 its ``merged_rows`` ``[n, k]`` (the op monitor's ``row_groups``), and, for small
    integer tensors, its distinct values; the op's non-tensor arguments by schema name
    (``scalars``: ``dim``, ``correction``, ``ignore_index``...); and for softmax-like ops the rows
    whose every position is -Inf (``masked_rows``). With ``output`` (the op's first output), each
    operand that broadcasts to it also counts its zeros and negatives where the output is
    non-finite (``zeros_where_born``, ``negatives_where_born``)."""
    pos, scalars = _schema_names(func, args, kwargs)
    names: list[Optional[str]] = []
    for n, a in zip(pos, args):  # which schema name each tensor input came from (lists of tensors share one)
        if isinstance(a, torch.Tensor):
            names.append(n)
        elif isinstance(a, (list, tuple)):
            names.extend(n for x in a if isinstance(x, torch.Tensor))
    names.extend(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    names += [None] * (len(tensors) - len(names))
    born_at = ~torch.isfinite(output.detach()) if isinstance(output, torch.Tensor) and (output.is_floating_point() or output.is_complex()) else None
    ops = [_operand(t, n, p, prod, mb, rg, born_at) for t, n, (p, prod, mb, rg) in zip(tensors, names, facts)]
    out: dict[str, Any] = {"tensors": ops, "scalars": scalars}
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name.lstrip("_").rstrip("_") in ("softmax", "log_softmax", "safe_softmax") and tensors and isinstance(scalars.get("dim"), int):
        out["masked_rows"] = _masked_rows(tensors[0], scalars["dim"])
    return out
