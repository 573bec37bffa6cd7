"""The embedded program's checks, unit by unit: the operator allowlist is real (every entry is an
operator of this torch, none writes to an out= argument, every str argument has its values
listed), the expression grammar accepts what torch writes and refuses what would not finish, and
a record's damage is named by its path."""

from __future__ import annotations

import json

import pytest
import torch

from nanreplay.engine import opset
from nanreplay.engine.program import export_program
from nanreplay.engine.program_check import ProgramRefused, check_program
from nanreplay.format.meta import MetaError
from nanreplay.format.program import SymExprError, parse_sym_expr, validate_program_record


def _overload(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload)


@pytest.mark.parametrize("name", sorted(opset.OPS))
def test_every_allowlisted_overload_exists_and_takes_no_out_argument(name):
    op = _overload(name)
    assert isinstance(op, torch._ops.OpOverload)
    assert not any(a.is_out for a in op._schema.arguments), f"{name} writes into an out= argument"
    for a in op._schema.arguments:
        if "str" in str(a.type):
            assert (name, a.name) in opset.STRING_ARGS, f"{name}'s str argument {a.name!r} has no STRING_ARGS entry"


def test_file_and_io_operators_are_not_on_the_list():
    for name in ("from_file.default", "_load_from_state_dict", "save.default", "set_.source_Storage", "as_strided.default", "atan2.out",
                 "_reshape_alias.default", "_unsafe_view.default"):
        assert not opset.allowed(name), name
    assert not opset.allowed("higher_order.while_loop") and opset.allowed("higher_order.cond")


@pytest.mark.parametrize("text", [
    "Symbol('s95', positive=True, integer=True)",
    "Mul(Integer(2), Symbol('s0', positive=True, integer=True))",
    "Add(Symbol('s0', integer=True), Integer(-1))",
    "FloorDiv(Symbol('s0', positive=True, integer=True), Integer(2))",
    "Max(Integer(1), Symbol('s1', integer=True))",
    "Pow(Symbol('s0', integer=True), Integer(2))",
    "StrictLessThan(Integer(2), Symbol('u0', integer=True))",
    "Float('2.5', precision=53)",
])
def test_the_expressions_torch_writes_parse(text):
    assert parse_sym_expr(text)[0] == "call"


@pytest.mark.parametrize("text, why", [
    ("9**9**9**9", "unexpected"),
    ("Pow(Integer(2), Pow(Integer(2), Integer(40)))", "exponent"),
    ("Pow(Pow(Integer(9), Integer(8)), Integer(8))", "inside the base"),
    ("Pow(Symbol('s0'), Integer(1000))", "exponent"),
    ("Integer(123456789012345678901234567890)", "unexpected"),
    ("__import__('os').system('true')", "unexpected"),
    ("Symbol('s0').__class__", "unexpected"),
    ("Symbol('import os')", "shape-symbol name"),
    ("Lambda(Symbol('s0'), Integer(1))", "unknown function"),
    ("Add(" * 40 + "Integer(1)" + ")" * 40, "nested deeper"),
])
def test_expressions_outside_the_grammar_are_refused(text, why):
    with pytest.raises(SymExprError, match=why):
        parse_sym_expr(text)


@pytest.fixture(scope="module")
def mlp_capture():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4, 2))
    cap = export_program(model, (torch.randn(3, 8),), dynamic="batch")
    assert cap.ok, cap.error
    return cap


def test_a_genuine_program_passes_every_check(mlp_capture):
    validate_program_record(mlp_capture.meta, lambda k: (torch.float32, ()))
    assert check_program(mlp_capture.meta["program"]) >= 3


def test_damage_is_named_by_its_path(mlp_capture):
    meta = json.loads(json.dumps(mlp_capture.meta))
    meta["program"]["graph_module"]["graph"]["nodes"][1]["outputs"] = [{"as_tensor": {"name": 7}}]
    with pytest.raises(MetaError) as e:
        validate_program_record(meta, lambda k: (torch.float32, ()))
    assert e.value.where == "meta.program.program.graph_module.graph.nodes[1].outputs[0].as_tensor.name"


def test_a_gelu_with_an_unlisted_approximation_is_refused(mlp_capture):
    meta = json.loads(json.dumps(mlp_capture.meta))
    gelu = next(n for n in meta["program"]["graph_module"]["graph"]["nodes"] if "gelu" in n["target"])
    next(i for i in gelu["inputs"] if i["name"] == "approximate")["arg"] = {"as_string": "erf; rm -rf /"}
    with pytest.raises(ProgramRefused, match="not one of the values allowed"):
        check_program(meta["program"])


def test_a_program_loaded_untrusted_is_proven_and_guarded_and_a_trusted_one_is_not(mlp_capture):
    from nanreplay.engine.program import load_program

    pm = load_program(mlp_capture.meta, mlp_capture.tensors.__getitem__)
    assert pm(torch.randn(5, 8)).shape == (5, 2)
    (proof,) = pm._root._nanreplay_bounds.proven.values()  # proven once for this shape of call ...
    assert proof.nodes >= 5 and 0 < proof.peak_bytes <= proof.budget.bytes
    pm(torch.randn(5, 8))
    assert len(pm._root._nanreplay_bounds.proven) == 1  # ... and not again
    pm(torch.randn(7, 8))  # the batch dimension is dynamic: another shape, another proof
    assert len(pm._root._nanreplay_bounds.proven) == 2
    trusted = load_program(mlp_capture.meta, mlp_capture.tensors.__getitem__, trusted=True)
    assert not hasattr(trusted._root, "_nanreplay_bounds") and trusted(torch.randn(5, 8)).shape == (5, 2)
