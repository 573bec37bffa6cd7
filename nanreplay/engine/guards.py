"""What depends on data, checked while an untrusted program runs: layer 2 of its defence.

The verifier (:mod:`nanreplay.engine.bounds`) proves every size, stride and storage of a program
before it runs, on fake tensors; what it cannot see are the *values* of index tensors, and many C++
kernels trust them: ``ctc_loss`` with a target of 2**40 reads far outside its input (a crash),
``embedding_bag`` with a negative offset reads before its buffer. So while an untrusted program
runs, a ``TorchDispatchMode`` (:class:`IndexGuard`) looks up every aten op in one table,
:data:`INDEX_CHECKS` (op -> which arguments are indices or lengths, and the range each addresses),
and checks those values before the kernel runs: one vectorised ``aminmax`` per index tensor (a
``diff`` for offsets, a ``sum`` for lengths), on the tensor's own device. A value out of range
raises :class:`~nanreplay.engine.program_check.ProgramRefused` (CLI exit 5) naming the node, the
op, the argument and the range; the message gives the smallest and largest value found, never the
tensor's bytes, and the kernel never runs.

The table is keyed by the ops the dispatch mode sees: composite ops (``cross_entropy_loss``,
``embedding_bag``, ``one_hot``, ``take_along_dim``, ``ctc_loss``) reach it as the kernels they
call (``nll_loss_forward``, ``_embedding_bag``, ``scatter_``, ``gather``, ``_ctc_loss``). An op whose
output size depends on values (``bincount``, ``repeat_interleave`` with a tensor of repeats) has
no size the verifier can bound, so an untrusted program using one is refused before it runs; its
row here checks the values that index (non-negative counts) as a second wall. The ranges
are the kernels' own: where a kernel accepts a negative index (``take``, ``index``, ``index_put``,
``index_fill``), so does the guard. Backward kernels reuse the forward's checked index tensors
(autograd refuses a saved tensor modified in place), so only the forward runs under the guard.

The user's own code paths never run under it: a replay of a trusted bundle, or with the user's
model, has no guard (and no cost).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from .bounds import op_arguments
from .deadline import check_deadline
from .program_check import ProgramRefused

__all__ = ["IndexGuard", "INDEX_CHECKS", "Within"]


def _size(arg: str, dim: Optional[str] = None, *, fixed: Optional[int] = None, last: bool = False) -> Callable[[dict], int]:
    """The extent addressed: ``a[arg].size(a[dim])`` (or dimension ``fixed``, the last one with
    ``last``), or its ``numel()`` when neither is given."""
    def size(a: dict) -> int:
        t = a[arg]
        if dim is not None:
            return t.size(a[dim]) if t.dim() else 1
        if last:
            return t.size(-1) if t.dim() else 1
        if fixed is not None:
            return t.size(fixed) if t.dim() > fixed else t.size(0) if t.dim() else 1
        return t.numel()
    return size


def _classes(a: dict) -> int:
    """The class count of an ``nll_loss`` input: dimension 1 of ``[N, C, ...]``, 0 of ``[C]``."""
    x = a["self"]
    return x.size(1) if x.dim() >= 2 else x.size(0) if x.dim() else 1


def _minmax(t: torch.Tensor) -> Optional[tuple[int, int]]:
    if t.numel() == 0 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        return None
    lo, hi = torch.aminmax(t.detach())
    return int(lo), int(hi)


@dataclass(frozen=True)
class Within:
    """The values of index tensor ``arg`` address ``size(args)`` positions: each must be in
    ``[0, size)``, or ``[-size, size)`` with ``negative``; ``ignore(args)`` names a value that means
    "skip this one" (``ignore_index``); ``low`` lowers the floor (``-1`` ends a multilabel target)."""

    arg: str
    size: Callable[[dict], int]
    negative: bool = False
    ignore: Optional[Callable[[dict], Optional[int]]] = None
    low: int = 0

    def __call__(self, a: dict) -> Optional[str]:
        t = a.get(self.arg)
        if not isinstance(t, torch.Tensor):
            return None
        ignore = self.ignore(a) if self.ignore is not None else None
        if ignore is not None and t.numel():
            t = t[t != ignore]
        mm = _minmax(t)
        if mm is None:
            return None
        n = self.size(a)
        lo_ok = -n if self.negative else self.low
        if mm[0] < lo_ok or mm[1] >= n:
            skip = f" (except {ignore}, ignored)" if ignore is not None else ""
            return f"indexes with {self.arg!r} values from {mm[0]:,} to {mm[1]:,}{skip}, outside [{lo_ok:,}, {n:,})"
        return None


def _index_list(a: dict) -> Optional[str]:
    """``index.Tensor`` / ``index_put``: each integer index tensor addresses the dimension it
    stands for (a boolean mask stands for as many dimensions as it has, and must match them);
    negative values count from the end."""
    x, d = a["self"], 0
    for k, idx in enumerate(a.get("indices") or []):
        if idx is None:
            d += 1
            continue
        if idx.dtype in (torch.bool, torch.uint8):
            if list(idx.shape) != list(x.shape[d:d + idx.dim()]):
                return f"masks dimensions {d}.. of a {list(x.shape)} tensor with a {list(idx.shape)} mask (indices[{k}])"
            d += idx.dim()
            continue
        if d >= x.dim():
            return f"indexes dimension {d} of a {x.dim()}-dimensional tensor (indices[{k}])"
        mm = _minmax(idx)
        n = x.size(d)
        if mm is not None and (mm[0] < -n or mm[1] >= n):
            return f"indexes dimension {d} (size {n:,}) with indices[{k}] values from {mm[0]:,} to {mm[1]:,}, outside [{-n:,}, {n:,})"
        d += 1
    return None


def _bag_offsets(a: dict) -> Optional[str]:
    """``embedding_bag``'s offsets: 1-D, non-decreasing, within ``[0, len(indices)]`` (bags of a
    1-D index list; 2-D indices are fixed-size bags and take no offsets)."""
    off, idx = a.get("offsets"), a.get("indices")
    if not isinstance(off, torch.Tensor) or not isinstance(idx, torch.Tensor) or idx.dim() != 1 or off.numel() == 0:
        return None
    if off.dim() != 1:
        return f"takes {off.dim()}-dimensional offsets, expected 1"
    mm = _minmax(off)
    n = idx.numel()
    if mm is not None and (mm[0] < 0 or mm[1] > n):
        return f"takes 'offsets' from {mm[0]:,} to {mm[1]:,}, outside [0, {n:,}] (the bags of {n:,} indices)"
    if off.numel() > 1 and int(torch.diff(off.detach()).min()) < 0:
        return "takes 'offsets' that decrease (each bag must start where the one before it started or later)"
    return None


def _ints(x: Any) -> Optional[list[int]]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.detach().reshape(-1).tolist()] if x.numel() <= 1 << 16 else None
    if isinstance(x, (list, tuple)):
        return [int(v) for v in x]
    return None


def _ctc_lengths(a: dict) -> Optional[str]:
    """``_ctc_loss``'s lengths: one input length per batch entry within ``[0, T]``, one target
    length per batch entry, non-negative, within the targets (each row of 2-D targets, or all of
    1-D concatenated ones); ``blank`` a class."""
    lp, targets = a["log_probs"], a["targets"]
    t_max, batch, classes = lp.size(0), (lp.size(1) if lp.dim() == 3 else 1), lp.size(-1)
    blank = int(a.get("blank", 0))
    if not 0 <= blank < classes:
        return f"takes blank={blank:,}, not a class of [0, {classes:,})"
    il, tl = _ints(a.get("input_lengths")), _ints(a.get("target_lengths"))
    if il is None or tl is None:
        return "takes more than 65,536 lengths"
    if len(il) != batch or len(tl) != batch:
        return f"takes {len(il):,} input and {len(tl):,} target lengths for a batch of {batch:,}"
    if il and (min(il) < 0 or max(il) > t_max):
        return f"takes 'input_lengths' from {min(il):,} to {max(il):,}, outside [0, {t_max:,}]"
    room = targets.size(1) if targets.dim() == 2 else targets.numel()
    if tl and (min(tl) < 0 or (max(tl) if targets.dim() == 2 else sum(tl)) > room):
        what = "each" if targets.dim() == 2 else "together"
        return f"takes 'target_lengths' from {min(tl):,} to {max(tl):,} ({what} at most {room:,}, the targets' length)"
    return None


def _not_negative(arg: str) -> Callable[[dict], Optional[str]]:
    def check(a: dict) -> Optional[str]:
        t = a.get(arg)
        mm = _minmax(t) if isinstance(t, torch.Tensor) else None
        if mm is not None and mm[0] < 0:
            return f"takes {arg!r} values from {mm[0]:,}, negative"
        return None
    return check


_DIM_SELF = _size("self", "dim")
_IGNORE = lambda a: a.get("ignore_index")  # noqa: E731

#: aten op (overload packet name, as a dispatch mode sees it) -> the checks of its index and length
#: arguments, each ``(args by schema name) -> None or what is wrong``. Every op of the allowlist
#: (:mod:`nanreplay.engine.opset`) that takes an index or length tensor reaches one of these rows,
#: itself or through the kernel it calls: ``cross_entropy_loss``, ``nll_loss``, ``nll_loss_nd`` and
#: ``nll_loss2d`` reach ``nll_loss_forward`` / ``nll_loss2d_forward``; ``embedding_bag``
#: ``_embedding_bag`` (``_embedding_bag_forward_only`` without grad); ``take_along_dim`` and
#: ``one_hot`` reach ``gather`` and ``scatter_``; ``ctc_loss`` ``_ctc_loss``;
#: ``multilabel_margin_loss`` its ``_forward``; ``repeat_interleave.self_Tensor`` ``repeat_interleave``
#: (``tests/engine/test_guards.py`` checks each way, and that no row is dead).
INDEX_CHECKS: dict[str, tuple[Callable[[dict], Optional[str]], ...]] = {
    "embedding": (Within("indices", _size("weight", fixed=0)),),
    **dict.fromkeys(("_embedding_bag", "_embedding_bag_forward_only"), (Within("indices", _size("weight", fixed=0)), _bag_offsets)),
    "index_select": (Within("index", _DIM_SELF),),
    "gather": (Within("index", _DIM_SELF),),
    **dict.fromkeys(("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce"), (Within("index", _DIM_SELF),)),
    **dict.fromkeys(("index_add", "index_add_", "index_copy", "index_copy_"), (Within("index", _DIM_SELF),)),
    **dict.fromkeys(("index_fill", "index_fill_"), (Within("index", _DIM_SELF, negative=True),)),
    "take": (Within("index", _size("self"), negative=True),),
    **dict.fromkeys(("index", "index_put", "index_put_"), (_index_list,)),
    **dict.fromkeys(("nll_loss_forward", "nll_loss2d_forward"), (Within("target", _classes, ignore=_IGNORE),)),
    "multi_margin_loss": (Within("target", _size("self", last=True)),),
    "multilabel_margin_loss_forward": (Within("target", _size("self", last=True), low=-1),),
    "_ctc_loss": (Within("targets", _size("log_probs", last=True)), _ctc_lengths),
    "bincount": (_not_negative("self"),),
    "repeat_interleave": (_not_negative("repeats"),),
    "searchsorted": (Within("sorter", _size("sorted_sequence", last=True)),),
}


def _node_name() -> str:
    import torch.fx.traceback as fx_traceback

    src = (fx_traceback.get_current_meta() or {}).get("from_node") or []
    return getattr(src[-1], "name", "?") if src else "?"


@functools.lru_cache(maxsize=None)
def _mode_class() -> type:
    """The dispatch mode, defined once (torch is imported lazily by this module's users)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _IndexMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            check_deadline()
            checks = INDEX_CHECKS.get(func.overloadpacket.__name__)
            if checks:
                _check(func, checks, args, kwargs)
            return func(*args, **kwargs)

    return _IndexMode


class IndexGuard:
    """A context manager: while it is active (in the thread that entered it), every aten op in
    :data:`INDEX_CHECKS` has its index values checked before its kernel runs, and the replay's
    time limit (:mod:`nanreplay.engine.deadline`) is checked at every op. It also turns on
    torch's deterministic algorithms (``warn_only``) with ``fill_uninitialized_memory``, so that no
    allocation hands the program the heap's old bytes (``empty`` gives NaN), and restores both.

    Raises (while active):
        ProgramRefused: an index or length out of the range it addresses (the kernel did not run).
    """

    def __enter__(self) -> "IndexGuard":
        import torch.utils.deterministic as det

        # no uninitialized memory reaches the program: under deterministic algorithms torch fills every
        # fresh allocation (empty, and the outputs a kernel leaves partly unwritten) with NaN or the
        # largest integer instead of the heap's old bytes (torch.utils.deterministic.fill_uninitialized_memory)
        self._saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                       det.fill_uninitialized_memory)
        if not self._saved[0]:
            torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = True
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
        self._mode = _mode_class()()
        self._mode.__enter__()
        return self

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The guard off for the block when its mode is the innermost dispatch mode (taken off
        the stack, put back after): around a compiled part of the program, which Dynamo would
        otherwise run eagerly (it does not trace under a dispatch mode). Layer 1's proof still
        covers that part; the sandbox (layer 3) contains it. Another mode above it stays, and so
        does the guard."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

        if _get_current_dispatch_mode() is not self._mode:
            yield
            return
        with _pop_mode_temporarily():
            yield

    def __exit__(self, *exc: object) -> None:
        import torch.utils.deterministic as det

        self._mode.__exit__(*exc)
        self._warnings.__exit__(*exc)
        enabled, warn_only, fill = self._saved
        if not enabled:
            torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = fill


def _check(func: Any, checks: tuple, args: tuple, kwargs: dict) -> None:
    a = op_arguments(func, args, kwargs)
    for check in checks:
        problem = check(a)
        if problem:
            raise ProgramRefused(
                f"the embedded program's node {_node_name()!r} ({func}) {problem}: its kernel would read or write outside its "
                "tensors, so nanreplay stopped the replay before it ran (docs/security.md). Replay with your own model code: "
                "model_factory='module:function'"
            ).with_cli_fix("model_factory='module:function'", "--model-factory module:function")
