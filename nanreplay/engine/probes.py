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
import os
import re
import sys
import sysconfig
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ..core.numerics import is_float

logger = logging.getLogger(__name__)

__all__ = ["user_frame_now", "user_frame_of_traceback", "current_node", "node_forward_op", "wider_recompute", "zero_counts", "nonfinite_rows"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nanreplay package
_STDLIB_DIRS = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p
)


def _is_library(filename: str) -> bool:
    if not filename or filename.startswith("<frozen"):
        return True
    f = os.path.abspath(filename)
    if f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR):
        return True
    return f.startswith(_STDLIB_DIRS) and "site-packages" not in f and "dist-packages" not in f


def _frame_dict(filename: str, line: int, function: str, code: Optional[str]) -> dict:
    return {"file": filename, "line": int(line), "function": function, "code": (code or "").strip() or None}


def user_frame_now() -> Optional[dict]:
    """The innermost frame of the current Python stack outside torch, nanreplay and the standard
    library, as ``{"file", "line", "function", "code"}``; ``None`` when every frame is library code."""
    import linecache

    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not _is_library(fn):
            return _frame_dict(fn, f.f_lineno, f.f_code.co_name, linecache.getline(fn, f.f_lineno))
        f = f.f_back
    return None


_TB_LINE = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?P<code>[^\n]*)')


def user_frame_of_traceback(tb: Optional[Sequence[str]]) -> Optional[dict]:
    """The innermost user frame of a forward stack recorded by anomaly mode
    (``node.metadata["traceback_"]``, a list of ``traceback.format_stack()`` strings)."""
    if not tb:
        return None
    for entry in reversed(list(tb)):
        m = _TB_LINE.match(entry)
        if m and not _is_library(m["file"]):
            return _frame_dict(m["file"], int(m["line"]), m["func"].strip(), m["code"])
    return None


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


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def wider_recompute(func: Callable, args: tuple, kwargs: dict, outs: Sequence[torch.Tensor]) -> Optional[dict]:
    """Recompute one op with its floating inputs cast to a wider dtype (float16/bfloat16 ->
    float32, float32 -> float64) and say whether the result is finite there. Only for ops that
    do not write into their inputs (the inputs must still be the ones the op saw).

    Returns:
        ``{"dtype": "float64", "finite": bool, "absmax": float | None}``, or ``None`` when the op
        cannot be recomputed (float64 already, an in-place op, a failure).
    """
    low = next((t.dtype for t in outs if t.dtype in _WIDER), None)
    if low is None:
        return None
    wide = _WIDER[low]

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in _WIDER and x.dtype.itemsize <= low.itemsize:
            return x.detach().to(wide)
        if isinstance(x, torch.dtype) and x in _WIDER and x.itemsize <= low.itemsize:
            return wide
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
    finite = all(bool(torch.isfinite(t).all()) for t in ts)
    fin = [t[torch.isfinite(t)] for t in ts]
    absmax = max((float(t.abs().max()) for t in fin if t.numel()), default=None)
    return {"dtype": str(wide).replace("torch.", ""), "finite": finite, "absmax": absmax}


def zero_counts(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Exact zeros in each floating input: the usual suspect of a domain error."""
    return [int((t.detach() == 0).sum()) for t in tensors if isinstance(t, torch.Tensor) and is_float(t)]


def nonfinite_rows(outs: Sequence[torch.Tensor], limit: int = 64) -> Optional[dict]:
    """Indices along dim 0 of the first output that hold a non-finite value, and that dim's size."""
    t = next((t for t in outs if is_float(t) and t.dim() >= 1), None)
    if t is None:
        return None
    bad = ~torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
    return {"size": int(t.shape[0]), "indices": [int(i) for i in bad.nonzero().flatten()[:limit].tolist()]}
