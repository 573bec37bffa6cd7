"""Counterfactual replays that touch one aten op call: find the call that gave birth to a
non-finite value, capture its inputs (and, for a birth in its backward, the gradient flowing into
it), or replay the step with that one call rewritten (the verification of a proposed fix,
:mod:`nanreplay.diagnosis.fix`).

A call is addressed as ``(name, occurrence)``: the ``occurrence``-th call (from 1) of the aten op
``name`` (its overload packet, e.g. ``sqrt``) in a plain replay of the step
(``run_step(ops=False, monitors=False)``). Plain replays of one step run the same ops in the same
order, so the address found by :func:`locate` holds in :func:`capture` and :func:`replay_rewritten`
(every pass checks it: a call whose op differs is not rewritten and the pass says so). A forward
birth's call can also be found by :func:`replay_rewritten` itself (``find``), which spares the
locating replay: nothing before the birth's call runs rewritten but calls from its own source
line, which both ways rewrite.

Techniques and where they come from:

* ``TorchDispatchMode`` (``torch.utils._python_dispatch``) sees every aten op of the forward pass,
  the loss and the backward kernels; ``torch._C._current_autograd_node()`` names the autograd node
  whose backward kernel is running.
* The tensor a dispatch handler returns is the one autograd then attaches its node to, so once the
  op has returned, ``out.grad_fn`` is the node of that call: a birth in a backward kernel is traced
  to the forward call whose node it runs in.
* A rewrite below autograd changes the op's value, not the derivative autograd recorded for the
  original op. The rewrite therefore also replaces the input gradients of that call's node (a
  ``Node.register_hook`` post hook) by the gradient of the rewritten op, computed with
  ``torch.autograd.grad`` on the inputs captured at the call: the step is then the step the code
  would run had it called the rewritten op there.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import NanReplayError
from . import probes
from .monitors import born, flags_of
from .run import ReplayResult, StepInputs, run_step

__all__ = ["OpTarget", "OpCall", "Rewrite", "locate", "capture", "replay_rewritten"]

#: ``rewrite(func, args, kwargs) -> output``: the op's replacement, same output structure, shapes and dtypes
Rewrite = Callable[[Any, tuple, dict], Any]


@dataclass(frozen=True)
class OpTarget:
    """The birth to find: ``op`` (the aten op that gave birth, overload packet name), whether it
    ran in the backward pass, and there the autograd node's name (``SqrtBackward0``)."""

    op: Optional[str]
    backward: bool = False
    node: Optional[str] = None


@dataclass
class OpCall:
    """One call of an aten op in a plain replay of the step.

    Attributes:
        name: the op's overload packet name (``sqrt``, ``_softmax``); ``func`` the exact overload.
        occurrence: which call of ``name`` it is (from 1).
        backward_birth: the non-finite value was born in this call's backward, not in the call.
        args, kwargs: with :func:`capture`, the call's arguments, tensors detached and copied to
            the CPU at the call (before a later in-place op changes them).
        grad_outputs: with :func:`capture` of a backward birth, the gradients flowing into the
            call's autograd node (one per output, ``None`` where none flows), on the CPU.
    """

    name: str
    occurrence: int
    func: Any
    backward_birth: bool = False
    args: Optional[tuple] = None
    kwargs: Optional[dict] = None
    grad_outputs: Optional[list] = None

    @property
    def overload(self) -> str:
        """``"sqrt.default"``: the exact overload, as :mod:`nanreplay.engine.opset` names it."""
        return f"{self.name}.{getattr(self.func, '_overloadname', 'default')}"


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            yield x


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _birth(args: tuple, kwargs: dict, out: Any) -> bool:
    """The producer rule of :func:`nanreplay.engine.monitors.born` on one call."""
    ins = [flags_of(t) for t in _tensors((args, kwargs))]
    outs = [flags_of(t) for t in _tensors(out)]
    return born(any(n for n, _, _ in ins), any(n or i for n, i, _ in ins), any(n for n, _, _ in outs), any(i for _, i, _ in outs))


def _clone_args(args: tuple, kwargs: dict) -> tuple:
    """The call's arguments, tensors detached and cloned (what the rewrite's gradient reads in the
    backward pass, after later in-place ops may have changed them)."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))


def _cpu_copy(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, tree)


class _AtOp(TorchDispatchMode):
    """Counts the calls of each aten op and hands each call's autograd node, once autograd has
    attached it (at the next op dispatched), to a callback."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._pending: list[tuple[list[torch.Tensor], Callable[[Any], None]]] = []

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        for outs, then in pending:
            node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
            if node is not None:
                then(node)

    def on_node(self, outs: list[torch.Tensor], then: Callable[[Any], None]) -> None:
        self._pending.append((outs, then))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self._pending:
            self._settle()
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        self.counts[name] += 1
        return self.call(func, name, self.counts[name], args, kwargs)

    def call(self, func: Any, name: str, n: int, args: tuple, kwargs: dict) -> Any:  # pragma: no cover - overridden
        return func(*args, **kwargs)


class _Located(NanReplayError):
    """Raised by :class:`_Locate` once it found a forward birth's call: the call is the first one
    that gives birth, so nothing later in the step can change it, and the replay stops there
    (through the replay's ``finally`` blocks, as a deadline does; a nanreplay error, so the
    embedded program's runner lets it through). Never leaves :func:`locate`."""


class _Locate(_AtOp):
    def __init__(self, target: OpTarget) -> None:
        super().__init__()
        self.target = target
        self.nodes: dict[Any, tuple[str, int, Any]] = {}
        self.found: Optional[OpCall] = None

    def call(self, func: Any, name: str, n: int, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if self.found is not None:
            return out
        t = self.target
        node_now = torch._C._current_autograd_node()
        if t.backward:
            outs = list(_tensors(out))
            if outs:
                self.on_node(outs, lambda node, k=(name, n, func): self.nodes.setdefault(node, k))
            if node_now is not None and (t.node is None or node_now.name() == t.node) and _birth(args, kwargs, out):
                k = self.nodes.get(node_now)
                if k is not None:
                    self.found = OpCall(k[0], k[1], k[2], backward_birth=True)
        elif node_now is None and name == t.op and _birth(args, kwargs, out):
            self.found = OpCall(name, n, func)
            raise _Located()
        return out


class _Capture(_AtOp):
    def __init__(self, call: OpCall) -> None:
        super().__init__()
        self.target = call
        self.got: Optional[OpCall] = None

    def call(self, func: Any, name: str, n: int, args: tuple, kwargs: dict) -> Any:
        if self.got is not None or name != self.target.name or n != self.target.occurrence:
            return func(*args, **kwargs)
        got = dataclasses.replace(self.target, func=func, args=_cpu_copy(args), kwargs=_cpu_copy(kwargs))
        out = func(*args, **kwargs)
        self.got = got
        if self.target.backward_birth:
            outs = list(_tensors(out))

            def keep(grad_inputs: tuple, grad_outputs: tuple) -> None:
                got.grad_outputs = [None if g is None else g.detach().to("cpu", copy=True) for g in grad_outputs]

            self.on_node(outs, lambda node: node.register_hook(keep))
        return out


@dataclass
class _RewriteState:
    applied: bool = False
    others: int = 0  # calls of the op from the same source line, rewritten too
    error: Optional[str] = None
    backward_replaced: Optional[bool] = None
    notes: list[str] = field(default_factory=list)
    found: Optional[OpCall] = None  # the birth's call, when the pass looked for it (``find``)
    birth_seen: bool = False


class _Rewrite(_AtOp):
    """Rewrites ``call`` (and, with ``line``, the op's other calls from that source line); with
    ``find`` instead of a call (a forward or loss birth), the call is the first call of
    ``find.op`` that gives birth, as :func:`locate` would find it, decided in this same pass."""

    def __init__(self, call: Optional[OpCall], rewrite: Rewrite, line: Optional[tuple[str, int]] = None,
                 find: Optional[OpTarget] = None) -> None:
        super().__init__()
        self.target, self.rewrite, self.line, self.find = call, rewrite, line, find
        self.name = call.name if call is not None else (find.op if find is not None else None)
        self.state = _RewriteState()

    def _same_line(self) -> bool:
        frame = probes.user_frame_now()
        return frame is not None and (frame["file"], frame["line"]) == self.line

    def call(self, func: Any, name: str, n: int, args: tuple, kwargs: dict) -> Any:
        if name != self.name or self.state.error is not None:
            return func(*args, **kwargs)
        if self.target is None:
            return self._call_found(func, name, n, args, kwargs)
        if n == self.target.occurrence:
            self.state.applied = True
        elif self.line is None or not self._same_line():  # another call of the op: rewritten only from the same source line
            return func(*args, **kwargs)
        else:
            self.state.others += 1
        if self._refused_in_place(func, name):
            return func(*args, **kwargs)
        saved = _clone_args(args, kwargs)
        return self._rewritten(func, name, args, kwargs, saved, func(*args, **kwargs))

    def _call_found(self, func: Any, name: str, n: int, args: tuple, kwargs: dict) -> Any:
        """One pass of a forward birth: the op runs first; its first call that gives birth (the
        call :func:`locate` finds: nothing was rewritten before it but calls from the same line,
        which are rewritten in either pass) and its calls from ``line`` are then rewritten."""
        want = func(*args, **kwargs)  # a call that is not mutable leaves its arguments as they were
        birth = not self.state.birth_seen and torch._C._current_autograd_node() is None and _birth(args, kwargs, want)
        if not birth and (self.line is None or not self._same_line()):
            return want
        if birth or self.state.found is None:  # the birth's call; until it comes, the first call rewritten from its line
            self.state.found = OpCall(name, n, func)
        self.state.birth_seen = self.state.birth_seen or birth
        if self._refused_in_place(func, name):
            return want
        self.state.others += 1  # every rewritten call; one of them is the birth's (report: others = count - 1)
        self.state.applied = True
        return self._rewritten(func, name, args, kwargs, _clone_args(args, kwargs), want)

    def _refused_in_place(self, func: Any, name: str) -> bool:
        """An op that writes into its input is not rewritten: the pass says so in its error."""
        if getattr(getattr(func, "_schema", None), "is_mutable", False):
            self.state.error = f"{name} writes into its input (an in-place op): not rewritten"
            return True
        return False

    def _rewritten(self, func: Any, name: str, args: tuple, kwargs: dict, saved: tuple, want: Any) -> Any:
        try:
            out = self.rewrite(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a rewrite that cannot run on these inputs: the verification says so
            self.state.error = f"the rewrite of {name} raised {type(e).__name__}: {e}"
            return want
        if not _same_structure(want, out):
            self.state.error = f"the rewrite of {name} changed the output's structure, shape or dtype: not applied"
            return want
        outs = list(_tensors(out))
        self.on_node(outs, lambda node: node.register_hook(self._gradient_of_rewrite(func, saved)))
        return out

    def _gradient_of_rewrite(self, func: Any, saved: tuple) -> Callable:
        """A post hook for the call's node: its input gradients become the rewritten op's. The
        node has one input gradient per tensor input of the op, in order (``None`` for one that
        takes no gradient: an integer divisor, a mask); the floating ones are recomputed through
        the rewrite, the others left as the node gave them."""
        state, rewrite = self.state, self.rewrite

        def hook(grad_inputs: tuple, grad_outputs: tuple) -> Optional[tuple]:
            slots: list[Optional[torch.Tensor]] = []  # per tensor input: its lifted leaf, or None (not floating)

            def lift(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                y = x.detach().requires_grad_(True) if _is_float(x) else None
                slots.append(y)
                return x if y is None else y

            with torch.enable_grad():
                a, kw = pytree.tree_map(lift, saved)
                outs = list(_tensors(rewrite(func, a, kw)))
                pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
                leaves = [y for y in slots if y is not None]
                if len(slots) != len(grad_inputs) and len(leaves) != len(grad_inputs):
                    state.backward_replaced = False
                    state.notes.append(f"the node has {len(grad_inputs)} input gradient(s), the op {len(slots)} tensor input(s), "
                                       f"{len(leaves)} floating: its backward was left as recorded")
                    return None
                if len(slots) != len(grad_inputs):
                    slots = leaves  # a node over the floating inputs only
                if not pairs:
                    state.backward_replaced = True
                    return tuple(None if gi is None else torch.zeros_like(gi) for gi in grad_inputs)
                grads = iter(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True))
                by_slot = [gi if y is None else next(grads) for gi, y in zip(grad_inputs, slots)]
            state.backward_replaced = True
            return tuple(None if gi is None else (torch.zeros_like(gi) if g is None else g.to(gi.dtype))
                         for gi, g in zip(grad_inputs, by_slot))

        return hook


def _same_structure(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.shape != y.shape or x.dtype != y.dtype):
            return False
    return True


def _plain(model: torch.nn.Module, inp: StepInputs, device: Optional[torch.device], mode: TorchDispatchMode) -> ReplayResult:
    with mode:
        return run_step(model, dataclasses.replace(inp, recorded_grads={}), ops=False, monitors=False, device=device)


def locate(model: torch.nn.Module, inp: StepInputs, target: OpTarget, *, device: Optional[torch.device] = None) -> Optional[OpCall]:
    """The call of the step that gives birth to ``target``: for a forward (or loss) birth, the
    first call of ``target.op`` whose output is non-finite while its inputs are not; for a
    backward birth, the forward call whose autograd node (named ``target.node``) gives birth in
    its backward kernel. One plain replay, which stops at the call of a forward birth once found
    (the rest of the step cannot change which call is the first); ``None`` when no call matches.

    Raises:
        ReplayError: as :func:`~nanreplay.engine.run.run_step`.
    """
    mode = _Locate(target)
    try:
        _plain(model, inp, device, mode)
    except _Located:
        pass
    return mode.found


def capture(model: torch.nn.Module, inp: StepInputs, call: OpCall, *, device: Optional[torch.device] = None) -> Optional[OpCall]:
    """``call`` with its arguments (and, for a backward birth, the gradients flowing into its
    node) captured on the CPU in one plain replay; ``None`` when the replay never makes that call."""
    mode = _Capture(call)
    _plain(model, inp, device, mode)
    return mode.got


def replay_rewritten(model: torch.nn.Module, inp: StepInputs, call: Optional[OpCall], rewrite: Rewrite, *,
                     device: Optional[torch.device] = None, line: Optional[tuple[str, int]] = None,
                     find: Optional[OpTarget] = None) -> tuple[ReplayResult, dict]:
    """Replay the step with ``call`` computed by ``rewrite`` instead (its value, and its gradient
    in the backward pass); every other op as recorded. With ``line`` (``(file, line)``: the
    user's source line of the call, :func:`nanreplay.engine.probes.user_frame_now`), the other
    calls of the same op from that line are rewritten too, as a fix written on that line would
    be (a model called twice in a step, on real and on generated samples).

    ``call=None`` with ``find`` (a forward or loss birth, ``find.backward`` false): the call is
    found in this same replay, as the first call of ``find.op`` that gives birth (what
    :func:`locate` would return), so the fix is verified in one replay instead of a locating one
    and this one: the same ops are rewritten either way (nothing runs rewritten before the birth's
    call but calls from its own line, which both rewrite).

    Returns:
        ``(result, report)``: the plain replay (:meth:`ReplayResult.products_nonfinite`,
        ``loss_values``) and ``{"applied": bool, "others": int, "error": str | None,
        "backward_replaced": bool | None, "notes": [str], "call": OpCall | None}`` (``applied``
        false: the replay never made the call; ``others``: calls from the same line rewritten too;
        ``call``: the call rewritten, the one found with ``find``).

    Raises:
        ValueError: neither ``call`` nor a forward ``find`` given.
        ReplayError: as :func:`~nanreplay.engine.run.run_step`.
    """
    if call is None and (find is None or find.backward or not find.op):
        raise ValueError("replay_rewritten needs the call to rewrite, or a forward birth's op to find (find=OpTarget(op))")
    mode = _Rewrite(call, rewrite, line, find)
    res = _plain(model, inp, device, mode)
    s = mode.state
    others = s.others if call is not None else max(s.others - 1, 0)
    return res, {"applied": s.applied and s.error is None, "others": others, "error": s.error, "backward_replaced": s.backward_replaced,
                 "notes": list(s.notes), "call": call if call is not None else s.found}
