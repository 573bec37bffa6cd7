"""Checks an embedded program before torch's deserializer sees it: operators and arguments.

The record's structure was checked when the bundle was opened
(:func:`nanreplay.format.program.validate_program_record`: JSON shapes, tree specs, symbolic
expressions). What is checked here is what the program *calls*, node by node, in every graph
(subgraphs of higher-order ops included):

* the target is one exact overload on the reviewed allowlist (:mod:`nanreplay.engine.opset`),
  resolved through ``torch.ops`` namespaces, never through attribute access on modules; torch's
  symbolic-size functions (``_operator.mul`` ...) take only sizes;
* every argument is of a kind a training step needs: tensors, numbers, sizes, dtypes, devices;
  never an operator name (``as_operator``), a script object, a string other than the few values
  :data:`~nanreplay.engine.opset.STRING_ARGS` lists; a subgraph only for a listed higher-order op;
* no ``out=`` argument.

What the program *does* with those operators (its sizes, strides, storages, bytes alive, work
and in-place writes) is proven on fake tensors from the bundle's real tensors before it runs
(:mod:`nanreplay.engine.bounds`), and its index values are checked while it runs
(:mod:`nanreplay.engine.guards`).

A refusal is a :class:`~nanreplay.errors.ReplayError` (CLI exit 5) that names the node, its
operator and the reason, with ``--model-factory`` as the way forward.
"""

from __future__ import annotations

from typing import Any

from ..errors import ReplayError
from . import opset

__all__ = ["check_program", "ProgramRefused"]

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
    """The embedded program calls something nanreplay does not run, or does something it does
    not allow (see the module doc, :mod:`nanreplay.engine.bounds` and :mod:`nanreplay.engine.guards`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # the message alone: torch.fx's interpreter appends its graph to an error's args in passing
        return self.message


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


def _check_node(n: dict, where: str, subgraphs: list) -> None:
    """Check one node: its operator is allowed, writes into no out= argument, each input passes
    :func:`_check_input`."""
    target = n["target"]
    try:
        name, op = _resolve(target)
    except KeyError as e:
        raise _refuse(where, target, str(e.args[0])) from None
    if op is not None and any(a.is_out for a in op._schema.arguments):
        raise _refuse(where, target, "writes into an out= argument")
    for inp in n["inputs"]:
        _check_input(inp, name, where, target, subgraphs)


def _check_input(inp: dict, name: str, where: str, target: str, subgraphs: list) -> None:
    """Check one input of a node (operator ``name``): no refused kind, only allowed strings, a
    subgraph only for a higher-order operator (queued on ``subgraphs``)."""
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


def check_program(program: dict) -> int:
    """Check every node of a serialized ``torch.export`` program (already schema-checked at open)
    against the operator allowlist. Returns the number of nodes checked.

    Args:
        program: the ``program`` JSON object of a program record.

    Raises:
        ProgramRefused: the first node that calls an operator off the allowlist, or passes an
            argument of a refused kind or value.
    """
    pending: list[tuple[dict, str]] = [(program["graph_module"]["graph"], "graph")]
    checked = 0
    while pending:
        g, gwhere = pending.pop()
        subgraphs: list = []
        for i, n in enumerate(g["nodes"]):
            _check_node(n, f"{gwhere}.nodes[{i}]", subgraphs)
            checked += 1
        pending.extend(subgraphs)
    return checked
