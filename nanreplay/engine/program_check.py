"""Checks an embedded program before torch's deserializer sees it: operators, arguments, sizes.

The record's structure was checked when the bundle was opened
(:func:`nanreplay.format.program.validate_program_record`: JSON shapes, tree specs, symbolic
expressions). What is checked here is what the program *does*, node by node, in every graph
(subgraphs of higher-order ops included):

* the target is one exact overload on the reviewed allowlist (:mod:`nanreplay.engine.opset`),
  resolved through ``torch.ops`` namespaces, never through attribute access on modules; torch's
  symbolic-size functions (``_operator.mul`` ...) take only sizes;
* every argument is of a kind a training step needs: tensors, numbers, sizes, dtypes, devices;
  never an operator name (``as_operator``), a script object, a string other than the few values
  :data:`~nanreplay.engine.opset.STRING_ARGS` lists; a subgraph only for a listed higher-order op;
* no ``out=`` argument; an in-place write only into a tensor the same graph created, or into a
  buffer of the model;
* every size the program declares or passes (tensor metadata, size lists, ``arange`` ranges) is
  bounded by the bundle's own tensors (:func:`element_limits`), so a replay cannot be made to
  allocate more than a small multiple of what the bundle holds.

A refusal is a :class:`~nanreplay.errors.ReplayError` (CLI exit 5) that names the node, its
operator and the reason, with ``--model-factory`` as the way forward.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

from ..errors import ReplayError
from . import opset
from .deadline import check_deadline

__all__ = ["check_program", "element_limits", "ProgramRefused"]

#: a program may declare tensors of at least this many elements, whatever the bundle holds
MIN_ELEMENTS = 1 << 24
#: ... and in all at least this many
MIN_TOTAL_ELEMENTS = 1 << 28
_PER_TENSOR_FACTOR = 64
_TOTAL_FACTOR = 4096

_REFUSED_KINDS = {
    "as_operator": "an operator passed as a value (resolved by name)",
    "as_custom_obj": "a script object",
    "as_strings": "a list of strings",
    "as_string_to_argument": "a dict of arguments",
    "as_nested_tensors": "nested tensor lists",
    "as_int_lists": "lists of integer lists (kernel launch grids)",
    "as_float_lists": "lists of float lists",
}


class ProgramRefused(ReplayError):
    """The embedded program calls something nanreplay does not run (see the module doc)."""


def element_limits(numels: Iterator[int]) -> tuple[int, int]:
    """``(per tensor, in all)``: the most elements a program may declare for one tensor and for
    all of its tensors together, given the element counts of the tensors the bundle gives it
    (its weights, buffers and recorded inputs): 64 and 4096 times the largest of them, and at
    least 2**24 and 2**28."""
    biggest = max(numels, default=0)
    return max(MIN_ELEMENTS, _PER_TENSOR_FACTOR * biggest), max(MIN_TOTAL_ELEMENTS, _TOTAL_FACTOR * biggest)


def _refuse(where: str, target: str, why: str) -> ProgramRefused:
    short = target.replace("torch.ops.", "")
    return ProgramRefused(
        f"the embedded program's node {where} ({short}) {why}: nanreplay runs only the pure tensor operators on its "
        "allowlist (nanreplay/engine/opset.py, docs/security.md); the program was not loaded and nothing of it ran. "
        "Replay with your own model code: model_factory='module:function'"
    ).with_cli_fix("model_factory='module:function'", "--model-factory module:function")


def _resolve(target: str) -> tuple[str, Any]:
    """``(short name, OpOverload or None)`` of an allowed target, or raise KeyError with why."""
    if target.startswith("torch.ops.aten."):
        name = target[len("torch.ops.aten."):]
        if not opset.allowed(name):
            raise KeyError("is not on the operator allowlist")
        import torch

        op_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, op_name, None)  # torch.ops namespaces only: no module attribute walk
        op = getattr(packet, overload, None) if packet is not None else None
        if op is None or not isinstance(op, torch._ops.OpOverload):
            raise KeyError("is not an operator of this torch version")
        return name, op
    if target.startswith("torch.ops.higher_order."):
        name = "higher_order." + target[len("torch.ops.higher_order."):]
        if not opset.allowed(name):
            raise KeyError("is a higher-order operator not on the allowlist")
        return name, None
    if target in opset.SYM_FUNCTIONS:
        return target, None
    raise KeyError("is not a torch operator on the allowlist")


class _Graph:
    """The values of one graph: what it created, its symbolic-size hints."""

    def __init__(self, g: dict, buffers: frozenset[str]) -> None:
        self.g = g
        self.created: set[str] = set()
        self.buffers = buffers
        self.hints: dict[str, int] = {}
        for name, s in g.get("sym_int_values", {}).items():
            v = _sym_value(s)
            if v is not None:
                self.hints[name] = v


def _sym_value(s: dict) -> Optional[int]:
    """The integer (or its recorded hint) of a SymInt record."""
    if "as_int" in s:
        return s["as_int"]
    hint = (s.get("as_expr") or {}).get("hint") or {}
    v = hint.get("as_int")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _numel(sizes: list, hints: dict[str, int]) -> int:
    n = 1
    for s in sizes:
        v = _sym_value(s) if isinstance(s, dict) and ("as_int" in s or "as_expr" in s) else None
        if v is None and isinstance(s, dict) and "as_name" in s:
            v = hints.get(s["as_name"])
        n *= abs(v) if v is not None else 1
    return n


def _arg_numel(kind: str, val: Any, hints: dict[str, int]) -> Optional[int]:
    if kind == "as_ints":
        return math.prod(abs(x) for x in val) if val else 1
    if kind == "as_sym_ints":
        return _numel(val, hints)
    return None


def _scalar(arg: dict, hints: dict[str, int]) -> Optional[float]:
    if "as_int" in arg:
        return arg["as_int"]
    if "as_float" in arg and isinstance(arg["as_float"], (int, float)):
        return arg["as_float"]
    if "as_sym_int" in arg:
        s = arg["as_sym_int"]
        return s.get("as_int") if "as_int" in s else hints.get(s.get("as_name"))
    return None


def _check_node(n: dict, where: str, graph: _Graph, per_tensor: int, subgraphs: list) -> None:
    """Check one node: its operator is allowed, writes into no out= argument, each input passes
    :func:`_check_input`, a range it makes is bounded; then note the tensors it creates."""
    target = n["target"]
    try:
        name, op = _resolve(target)
    except KeyError as e:
        raise _refuse(where, target, str(e.args[0])) from None
    schema_args = {a.name: a for a in op._schema.arguments} if op is not None else {}
    if any(a.is_out for a in schema_args.values()):
        raise _refuse(where, target, "writes into an out= argument")
    written = {a.name for a in schema_args.values() if a.alias_info is not None and a.alias_info.is_write}
    numbers = {inp["name"]: _check_input(inp, name, where, target, written, graph, per_tensor, subgraphs) for inp in n["inputs"]}
    if name.startswith("arange."):
        start, end, step = numbers.get("start") or 0, numbers.get("end"), numbers.get("step") or 1
        if end is not None and step and abs((end - start) / step) > per_tensor:
            raise _refuse(where, target, f"makes a range of {abs((end - start) / step):,.0f} elements, more than the bundle's tensors justify ({per_tensor:,})")
    _note_outputs(n, graph)


def _check_input(inp: dict, name: str, where: str, target: str, written: set[str], graph: _Graph, per_tensor: int, subgraphs: list) -> Optional[float]:
    """Check one input of a node (operator ``name``) and return its scalar value, if any: no
    refused kind, only allowed strings, a subgraph only for a higher-order operator (queued on
    ``subgraphs``), sizes within ``per_tensor``, in-place writes only into tensors the program
    created or buffers."""
    arg_name, arg = inp["name"], inp["arg"]
    (kind, val), = arg.items()
    if kind in _REFUSED_KINDS:
        raise _refuse(where, target, f"takes {_REFUSED_KINDS[kind]} as its argument {arg_name!r}")
    if kind == "as_string" and not opset.string_allowed(name, arg_name, val):
        raise _refuse(where, target, f"takes the string {val[:60]!r} as its argument {arg_name!r}, not one of the values allowed there")
    if kind == "as_graph":
        if not name.startswith("higher_order."):
            raise _refuse(where, target, "takes a subgraph but is not a higher-order operator")
        subgraphs.append((val["graph"], f"{where}.inputs[{arg_name or '?'}].as_graph"))
    size = _arg_numel(kind, val, graph.hints)
    if size is not None and size > per_tensor:
        raise _refuse(where, target, f"passes a size of {size:,} elements as {arg_name!r}, more than the bundle's tensors justify ({per_tensor:,})")
    if kind in ("as_int", "as_sym_int") and arg_name in opset.SIZE_ARGS:
        v = _scalar(arg, graph.hints)
        if v is not None and abs(v) > per_tensor:
            raise _refuse(where, target, f"passes {arg_name}={v:,}, more than the bundle's tensors justify ({per_tensor:,})")
    if arg_name in written:
        tensors = [val["name"]] if kind == "as_tensor" else [t["name"] for t in val] if kind == "as_tensors" else []
        for t in tensors:
            if t not in graph.created and t not in graph.buffers:
                raise _refuse(where, target, f"writes in place into {t!r}, which is neither a tensor the program created nor a buffer of the model")
    return _scalar(arg, graph.hints)


def _note_outputs(n: dict, graph: _Graph) -> None:
    """Add the tensors a node creates to ``graph.created`` (in-place writes into them are allowed)."""
    for out in n["outputs"]:
        (kind, val), = out.items()
        if kind == "as_tensor":
            graph.created.add(val["name"])
        elif kind == "as_tensors":
            graph.created.update(t["name"] for t in val)
        elif kind == "as_optional_tensors":
            graph.created.update(t["as_tensor"]["name"] for t in val if "as_tensor" in t)


def check_program(program: dict, *, per_tensor: int, total: int) -> int:
    """Check every node of a serialized ``torch.export`` program (already schema-checked at open)
    against the operator allowlist and bound its sizes. Returns the number of nodes checked.

    Args:
        program: the ``program`` JSON object of a program record.
        per_tensor, total: the most elements one declared tensor, and all of them together, may
            have (:func:`element_limits`).

    Raises:
        ProgramRefused: the first node that calls an operator off the allowlist, passes an
            argument of a refused kind or value, writes in place into a tensor it did not create,
            or declares or passes a size over the limits.
    """
    gm = program["graph_module"]
    buffers = frozenset(
        spec["buffer"]["arg"]["name"] for spec in gm["signature"]["input_specs"]
        if "buffer" in spec and isinstance(spec["buffer"].get("arg"), dict) and isinstance(spec["buffer"]["arg"].get("name"), str)
    )
    pending: list[tuple[dict, str]] = [(gm["graph"], "graph")]
    checked = 0
    declared = 0
    while pending:
        g, gwhere = pending.pop()
        graph = _Graph(g, buffers if gwhere == "graph" else frozenset())
        for name, tm in g.get("tensor_values", {}).items():
            numel = _numel(tm["sizes"], graph.hints)
            if numel > per_tensor:
                raise _refuse(f"{gwhere}.tensor_values[{name!r}]", "a tensor", f"is declared with {numel:,} elements, more than the bundle's tensors justify ({per_tensor:,})")
            declared += numel
        if declared > total:
            raise _refuse(gwhere, "its tensors", f"declare {declared:,} elements in all, more than the bundle's tensors justify ({total:,})")
        subgraphs: list = []
        for i, n in enumerate(g["nodes"]):
            _check_node(n, f"{gwhere}.nodes[{i}]", graph, per_tensor, subgraphs)
            checked += 1
        pending.extend(subgraphs)
    return checked


class SizeGuard:
    """While an embedded program runs: every aten op's requested sizes (integer lists, such as
    ``full``'s or ``expand``'s, now with their real values), the size its tensor inputs broadcast
    to (an outer product ``[N, 1] * [1, N]`` or ``[N, 1] @ [1, N]``), and the size of each output
    stay within ``per_tensor`` elements (:func:`element_limits`). It catches what the static
    check cannot see: sizes computed from symbolic values at run time, and tensor metadata that
    lies about an op's output. A ``TorchDispatchMode`` (``torch.utils._python_dispatch``): one
    Python call per op, not used under ``torch.compile`` (Dynamo does not trace such a mode).

    Raises (while the program runs):
        ProgramRefused: an op over the limit, before it runs when its inputs say so.
    """

    def __init__(self, per_tensor: int) -> None:
        self.per_tensor = per_tensor

    def __enter__(self) -> "SizeGuard":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        guard = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                guard._before(func, args, kwargs, torch)
                out = func(*args, **kwargs)
                guard._after(func, out, torch)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The guard off for the block when it is the innermost dispatch mode (taken off the
        stack, put back after): around a compiled part of the program, which Dynamo would
        otherwise run eagerly. Another mode above it stays, and so does the guard."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

        if _get_current_dispatch_mode() is not self._mode:
            yield
            return
        with _pop_mode_temporarily():
            yield

    def _over(self, func: Any, n: int, what: str) -> ProgramRefused:
        return _refuse("at run time", str(func), f"{what} {n:,} elements, more than the bundle's tensors justify ({self.per_tensor:,})")

    def _before(self, func: Any, args: tuple, kwargs: dict, torch: Any) -> None:
        check_deadline()  # a diagnosis's time limit (engine.deadline) holds inside the program too
        shapes = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                shapes.append(a.shape)
            elif isinstance(a, (list, tuple)) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
                n = math.prod(abs(x) for x in a)
                if n > self.per_tensor:
                    raise self._over(func, n, "asks for")
        if len(shapes) > 1:
            try:
                n = math.prod(torch.broadcast_shapes(*shapes))
            except RuntimeError:
                return
            if n > self.per_tensor:
                raise self._over(func, n, "would broadcast its inputs to")

    def _after(self, func: Any, out: Any, torch: Any) -> None:
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.per_tensor:
                raise self._over(func, t.numel(), "made a tensor of")
