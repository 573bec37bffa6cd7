"""``bisect --over precision``: the first layer that has to run in float32 for the step to be finite.

For a model run in float16 / bfloat16 (a half model, or autocast, recorded per step or inside the
loss function), binary search over a growing prefix of layers, in execution order, run in float32
(:class:`Upcast`); the layer found is then replayed once more to measure the magnitudes it
computes in float32 against ``torch.finfo`` of the reduced dtype. Units are the leaf modules and
the modules that own parameters. The search assumes the answer is monotone in the prefix (more
float32 never hurts).

Needs the failing step only. Replays: ``2 + ceil(log2(units)) + 1``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.jsonable import fnum
from ..core.tree import flatten_typed, map_tensors
from ..engine.state import load_state
from .common import BudgetExhausted, Outcome, Search, owns_params, short

__all__ = ["bisect_precision", "Upcast"]

_REDUCED = (torch.float16, torch.bfloat16)


def bisect_precision(search: Search) -> dict:
    """Run the search; the culprit is the layer with the magnitudes it computes in float32."""
    low, dtypes = _reduced_dtype(search)
    with _output_dtypes(search.model) as out_dtypes:
        base, order = search.replay_as_recorded()
    if not base.nonfinite:
        return search.not_reproduced("as recorded", {})
    units = _units(search.model, order)
    prefix = _Prefix(search, units, out_dtypes)
    n = len(units)
    details: dict[str, Any] = {"dtypes": dtypes, "units": n, "execution_order": units}
    try:
        if prefix.fails(n):
            answer = (f"Step {search.step} stays non-finite with every layer in float32: the failure is not a precision problem; "
                      "look at the weights (--over layers) or the data (--over samples).")
            return search.result("not in search space", answer, [], details)
        lo, hi = 0, n  # prefix.fails(lo), not prefix.fails(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if prefix.fails(mid) else (lo, mid)
        mag = prefix.measure(hi, torch.finfo(low).max if low is not None else math.inf)
    except BudgetExhausted:
        return search.out_of_replays(details)
    row, why = _culprit(search.model, units[hi - 1], hi - 1, mag, low)
    answer = (f"Step {search.step} becomes finite once the first {hi} layer(s) in execution order run in float32; "
              f"the first that must is {row['layer']} ({row['class']}): {why}.")
    return search.result("found", answer, [row], details)


def _reduced_dtype(search: Search) -> tuple[Optional[torch.dtype], list[str]]:
    """The reduced dtype the step ran in (of the recorded parameters, else of the recorded
    autocast), or ``None`` with a warning; and the recorded parameters' floating dtype names."""
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in search.state.params.values() if t.is_floating_point()})
    reduced = [getattr(torch, d) for d in dtypes if getattr(torch, d) in _REDUCED]
    if reduced:
        return reduced[0], dtypes
    ac = search.failing.autocast  # recorded per step: {"device_type", "dtype"} or None
    if ac and getattr(torch, ac.get("dtype", ""), None) in _REDUCED:
        return getattr(torch, ac["dtype"]), dtypes  # float32 weights under a recorded float16/bfloat16 autocast
    search.warnings.append(
        f"the recorded parameters are {', '.join(dtypes)} and the bundle records no float16/bfloat16 autocast for step "
        f"{search.step}: the search assumes autocast runs inside the loss function, and runs each upcast layer with autocast disabled"
    )
    return None, dtypes


def _units(model: torch.nn.Module, order: list[str]) -> list[str]:
    """The modules the search upcasts, in execution order: leaves and modules owning parameters
    (every module called, the root included, when there is none)."""
    mods = dict(model.named_modules())
    units = [n for n in order if n and (not any(True for _ in mods[n].children()) or owns_params(mods[n]))]
    return units or list(order)


@contextlib.contextmanager
def _output_dtypes(model: torch.nn.Module) -> Iterator[list[Optional[torch.dtype]]]:
    """Inside the block, the yielded list holds the dtypes of the model's last output leaves."""
    dtypes: list[Optional[torch.dtype]] = []

    def grab(mod: torch.nn.Module, args: tuple, out: Any) -> None:
        dtypes[:] = [t.dtype if isinstance(t, torch.Tensor) else None for t in flatten_typed(out)[0]]

    handle = model.register_forward_hook(grab)
    try:
        yield dtypes
    finally:
        handle.remove()


def _float_leaves_to(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


class Upcast:
    """Inside a ``with`` block, the first ``k`` of ``units`` run in float32.

    An upcast unit's own floating parameters and buffers become float32 copies, its floating
    inputs are cast to float32, and autocast is disabled for its forward: entered by a forward
    pre-hook and exited by a forward hook that runs even when the forward raises. A unit that
    stays low casts its floating inputs to its own parameters' dtype. With any unit upcast, the
    model's outputs are cast back to ``out_dtypes`` (the recorded cotangent and the loss expect
    them). Leaving the block exits any autocast context still open, removes every hook and gives
    the parameters and buffers their own tensors back (their values unchanged).

    Args:
        model: the model, step-start weights loaded.
        units: module FQNs in execution order.
        k: how many of ``units``, from the first, run in float32.
        device_type: the device type whose autocast is disabled inside upcast units.
        out_dtypes: the dtypes of the model's output leaves as recorded (``None``: not a tensor).
    """

    def __init__(self, model: torch.nn.Module, units: list[str], k: int, device_type: str, out_dtypes: list[Optional[torch.dtype]]) -> None:
        self.model, self.units, self.k = model, units, k
        self.device_type = device_type
        self.out_dtypes = out_dtypes
        self._hooks: list[Any] = []
        self._own_data: list[tuple[torch.Tensor, torch.Tensor]] = []              # (parameter or buffer, its own data)
        self._autocasts: list[tuple[torch.nn.Module, torch.autocast]] = []       # open, innermost last

    def __enter__(self) -> "Upcast":
        mods = dict(self.model.named_modules())
        try:
            for i, name in enumerate(self.units):
                if i < self.k:
                    self._upcast(mods[name])
                else:
                    self._keep_low(mods[name])
            if self.k:
                self._hooks.append(self.model.register_forward_hook(self._recorded_output_dtypes))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._autocasts:
            self._autocasts.pop()[1].__exit__(None, None, None)
        while self._hooks:
            self._hooks.pop().remove()
        while self._own_data:
            t, data = self._own_data.pop()
            t.data = data
            if isinstance(t, torch.nn.Parameter) and t.grad is not None and t.grad.dtype != data.dtype:
                t.grad = None  # a float32 gradient of the replay (kept in the outcome) would not fit

    def _upcast(self, m: torch.nn.Module) -> None:
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if t.is_floating_point():
                self._own_data.append((t, t.data))
                t.data = t.data.float()
        self._hooks.append(m.register_forward_pre_hook(self._enter_fp32, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._leave_fp32, always_call=True))

    def _keep_low(self, m: torch.nn.Module) -> None:
        own = [p.dtype for p in m.parameters(recurse=False) if p.is_floating_point()]
        if own:
            self._hooks.append(m.register_forward_pre_hook(_cast_inputs(own[0]), with_kwargs=True))

    def _enter_fp32(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        ac = torch.autocast(self.device_type, enabled=False)
        ac.__enter__()
        self._autocasts.append((mod, ac))
        return _float_leaves_to((args, kwargs), torch.float32)

    def _leave_fp32(self, mod: torch.nn.Module, args: tuple, out: Any) -> None:
        if self._autocasts and self._autocasts[-1][0] is mod:  # not when a pre-hook raised before _enter_fp32
            self._autocasts.pop()[1].__exit__(None, None, None)

    def _recorded_output_dtypes(self, mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        leaves, spec = pytree.tree_flatten(out)
        if len(leaves) != len(self.out_dtypes):
            return None
        return pytree.tree_unflatten(
            [x.to(d) if isinstance(x, torch.Tensor) and d is not None and x.is_floating_point() and x.dtype != d else x
             for x, d in zip(leaves, self.out_dtypes)], spec
        )


def _cast_inputs(dtype: torch.dtype) -> Callable[[torch.nn.Module, tuple, dict], tuple]:
    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        return _float_leaves_to((args, kwargs), dtype)
    return hook


class _Magnitude(TorchDispatchMode):
    """Largest and smallest non-zero finite |value| of every floating op output computed while
    ``active`` is set (the forward pass of one layer, its children included)."""

    def __init__(self, limit: float = math.inf) -> None:
        super().__init__()
        self.limit = limit
        self.first_over: Optional[str] = None   # first op whose output exceeds ``limit``
        self.active = 0
        self.absmax = 0.0
        self.absmin_nonzero = math.inf
        self.op_of_max: Optional[str] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    self._see(func.overloadpacket.__name__, t.detach().abs())
        return out

    def _see(self, op: str, a: torch.Tensor) -> None:
        a = a[torch.isfinite(a)]
        if not a.numel():
            return
        m = float(a.max())
        if m > self.limit and self.first_over is None:
            self.first_over = op
        if m > self.absmax:
            self.absmax, self.op_of_max = m, op
        nz = a[a > 0]
        if nz.numel():
            self.absmin_nonzero = min(self.absmin_nonzero, float(nz.min()))

    @contextlib.contextmanager
    def watching(self, layer: torch.nn.Module) -> Iterator["_Magnitude"]:
        """Inside the block, measure the ops of ``layer``'s forward."""

        def on(mod: torch.nn.Module, args: tuple) -> None:
            self.active += 1

        def off(mod: torch.nn.Module, args: tuple, out: Any) -> None:
            self.active -= 1

        hooks = [layer.register_forward_pre_hook(on), layer.register_forward_hook(off, always_call=True)]
        try:
            with self:
                yield self
        finally:
            for h in hooks:
                h.remove()


class _Prefix:
    """Replays of the failing step with a prefix of the units in float32."""

    def __init__(self, search: Search, units: list[str], out_dtypes: list[Optional[torch.dtype]]) -> None:
        self.search, self.units, self.out_dtypes = search, units, out_dtypes

    def fails(self, k: int) -> bool:
        """Whether the step stays non-finite with the first ``k`` units in float32. One replay."""
        with self._upcast(k):
            return self._replay(k, "").nonfinite

    def measure(self, k: int, limit: float) -> _Magnitude:
        """The magnitudes the ``k``-th unit computes with the first ``k`` units in float32. One replay."""
        layer = self.search.model.get_submodule(self.units[k - 1])
        with self._upcast(k), _Magnitude(limit).watching(layer) as mag:
            self._replay(k, ", measuring magnitudes")
        return mag

    def _upcast(self, k: int) -> Upcast:
        load_state(self.search.model, self.search.state)
        return Upcast(self.search.model, self.units, k, self.search.device.type, self.out_dtypes)

    def _replay(self, k: int, note: str) -> Outcome:
        varied = f"the first {k} of {len(self.units)} layers in float32" + (f" ({self.units[k - 1]} last)" if k else "") + note
        return self.search.replay(self.search.failing, self.search.state, varied)


def _culprit(model: torch.nn.Module, layer: str, index: int, mag: _Magnitude, low: Optional[torch.dtype]) -> tuple[dict, str]:
    """The culprit row (magnitudes in float32 against ``torch.finfo(low)``) and why it must run in float32."""
    fi = torch.finfo(low) if low is not None else None
    row: dict[str, Any] = {
        "layer": layer,
        "class": type(model.get_submodule(layer)).__name__,
        "index": index,
        "absmax_fp32": fnum(mag.absmax),
        "op_of_absmax": mag.op_of_max,
        "first_op_over_range": mag.first_over,
        "absmin_nonzero_fp32": fnum(mag.absmin_nonzero) if math.isfinite(mag.absmin_nonzero) else None,
        "dtype": str(low).replace("torch.", "") if low is not None else None,
        "dtype_max": fi.max if fi else None,
        "dtype_tiny": fi.tiny if fi else None,
    }
    if fi is None:
        return row, f"in float32 it computes |values| up to {mag.absmax:.4g} (op {mag.op_of_max})"
    row["overflow"] = mag.absmax > fi.max
    if row["overflow"]:
        return row, (f"in float32 it computes |values| up to {mag.absmax:.4g} (op {mag.op_of_max}), above {row['dtype']}'s largest finite value "
                     f"{fi.max:.4g}; the first op past that range is {mag.first_over}")
    return row, (f"its float32 values stay within {row['dtype']}'s range (|max| {mag.absmax:.4g} <= {fi.max:.4g}), so precision or underflow "
                 f"(smallest non-zero |value| {short(row['absmin_nonzero_fp32'])}, {row['dtype']} tiny {fi.tiny:.3g}) is the cause")
