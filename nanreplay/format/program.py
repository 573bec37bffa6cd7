"""The schema of an embedded program record (``meta["program"]``), checked when a bundle is opened.

The record is what :func:`nanreplay.engine.program.export_program` writes: nanreplay's own fields
(``kind``, ``inputs``, ``outputs``, ``state``, ``modules`` ...) and ``program``, the JSON of
``torch.export``'s serializer (``torch/_export/serde/schema.py``). Every field that nanreplay or
torch's deserializer reads is checked here, before either reads it: a damaged or hostile record
fails at open with the path of the first bad field (``meta.program.program.graph_module.graph.
nodes[3].inputs[1].arg``), a :class:`~nanreplay.format.meta.MetaError` (CLI exit 4), never later
in a replay as "a bug".

What is checked here is structure, not meaning: which operators a program may call is checked by
:mod:`nanreplay.engine.program_check` when a replay loads the program, and what it may allocate
by :mod:`nanreplay.engine.bounds` before it runs (a program that is well formed but refused is
exit 5, and ``--model-factory`` still replays the bundle). Two things are checked here because torch's deserializer would act on them:

* every tree spec (``inputs.spec``, ``outputs.spec``, the module call graph's ``in_spec`` and
  ``out_spec``) is decoded by nanreplay (:func:`nanreplay.core.tree.decode_spec`) and may hold
  only tuples, lists, dicts and leaves (torch's ``treespec_loads`` imports the module a
  ``defaultdict`` node names);
* every symbolic expression (``expr_str``, which the deserializer hands to ``sympy.sympify``, an
  ``eval``) is parsed by :func:`parse_sym_expr`, a small grammar of the form torch writes
  (``sympy.srepr``) with bounded integers, no nested powers and small constant exponents.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from ..core.tree import SpecError, SpecNode, decode_spec
from .meta import MetaError

__all__ = ["validate_program_record", "parse_sym_expr", "SymExprError", "PROGRAM_FORMAT", "MAX_EXPR", "MAX_NODES"]

PROGRAM_FORMAT = "nanreplay.program"
#: longest symbolic expression accepted (characters)
MAX_EXPR = 2048
#: most nodes in one program (all graphs together): loading time grows with them (torch's
#: deserializer and unflatten: about 1 s for the bench GPT's program, 75 nodes; a 124M GPT-2 has a few thousand)
MAX_NODES = 100_000
_MAX_INT = 2**63 - 1
_MAX_EXPONENT = 8

_ARG_KINDS = frozenset({
    "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string", "as_strings",
    "as_sym_int", "as_sym_ints", "as_scalar_type", "as_memory_format", "as_layout", "as_device", "as_bool", "as_bools",
    "as_sym_bool", "as_sym_bools", "as_graph", "as_optional_tensors", "as_custom_obj", "as_operator", "as_sym_float",
    "as_sym_floats", "as_optional_tensor", "as_complex", "as_nested_tensors", "as_int_lists", "as_string_to_argument",
    "as_float_lists",
})
_FLOAT_WORDS = ("Infinity", "-Infinity", "NaN", "inf", "-inf", "nan")
_SPEC_KINDS = ("leaf", "tuple", "list", "dict", "odict")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")


def _kind(v: Any) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


# ------------------------------------------------------------------------------ symbolic expressions

class SymExprError(ValueError):
    """A symbolic expression outside the grammar :func:`parse_sym_expr` accepts."""


_EXPR_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>-?\d{1,19})(?![\d.])|(?P<str>'[^'\\]{0,40}')|(?P<p>[(),=]))")
#: the functions torch's deserializer knows (``torch.utils._sympy.functions`` and sympy's core)
_EXPR_FUNCS = frozenset({
    "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "FloorDiv", "CeilDiv", "CleanDiv", "PythonMod", "ModularIndexing",
    "Where", "CeilToInt", "FloorToInt", "TruncToInt", "RoundToInt", "TruncToFloat", "ToFloat", "Identity", "IntTrueDiv",
    "FloatTrueDiv", "PowByNatural", "IsNonOverlappingAndDenseIndicator", "Eq", "Ne", "Lt", "Le", "Gt", "Ge",
    "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Equality", "Unequality", "And", "Or", "Not",
    "Integer", "Rational", "Float", "Symbol",
})
_EXPR_CONSTANTS = frozenset({"true", "false", "True", "False", "BooleanTrue", "BooleanFalse", "oo", "Infinity",
                             "NegativeInfinity", "S"})
_ASSUMPTIONS = frozenset({"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "nonzero",
                          "zero", "even", "odd", "precision"})
_SYMBOL = re.compile(r"[a-z]{1,8}\d{1,9}")
#: the largest ``precision`` (bits) of a ``Float``: a double's 53, what ``sympy.srepr`` writes for
#: the floats of torch's symbolic sizes
_FLOAT_PRECISION = 53
_NUMBER = re.compile(r"-?\d{1,30}(?:\.\d{1,30})?(?:[eE][-+]?\d{1,4})?")


def parse_sym_expr(text: Any) -> tuple:
    """Parse a symbolic size expression as ``torch.export`` writes it (``sympy.srepr``: calls such
    as ``Mul(Integer(2), Symbol('s0', positive=True, integer=True))``), into a tuple tree, or raise.

    The grammar: ``Name(arg, ..., key=value)`` calls of the functions torch's deserializer knows,
    ``Symbol('s12', <assumption>=True|False ...)`` with a shape-symbol name, ``Integer(n)`` with
    ``|n| < 2**63``, ``Rational(p, q)``, ``Float('1.5', precision=53)`` (at most 53 bits: sympy computes a Float
    in its precision, so ``precision=10**9`` would never finish), and the constants
    ``true``/``false``/``oo``. ``Pow`` and ``PowByNatural`` take a constant exponent of at most
    8 in magnitude and a base without a power inside, so the value of an expression stays within
    a few thousand bits (``9**9**9**9`` and ``2**2**40`` are refused). At most :data:`MAX_EXPR`
    characters, 32 levels of nesting.

    Raises:
        SymExprError: anything else.
    """
    if not isinstance(text, str) or not text or len(text) > MAX_EXPR:
        raise SymExprError(f"expected a sympy.srepr expression of 1 to {MAX_EXPR} characters, found {_show(text)[:60]}")
    tokens = []
    pos = 0
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise SymExprError(f"unexpected {text[pos:pos + 12]!r} at character {pos}")
        kind = m.lastgroup
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    tree, end = _parse_call(tokens, 0, 0)
    if end != len(tokens):
        raise SymExprError("text after the end of the expression")
    _check_expr(tree, inside_pow=False)
    return tree


def _parse_call(tokens: list, i: int, depth: int) -> tuple[tuple, int]:
    if depth > 32:
        raise SymExprError("nested deeper than 32 levels")
    if i >= len(tokens):
        raise SymExprError("the expression ends too early")
    kind, tok = tokens[i]
    if kind == "int":
        return ("int", int(tok)), i + 1
    if kind == "str":
        return ("str", tok[1:-1]), i + 1
    if kind != "name":
        raise SymExprError(f"unexpected {tok!r}")
    if i + 1 >= len(tokens) or tokens[i + 1] != ("p", "("):
        if tok not in _EXPR_CONSTANTS:
            raise SymExprError(f"unknown name {tok[:40]!r}")
        return ("const", tok), i + 1
    if tok not in _EXPR_FUNCS:
        raise SymExprError(f"unknown function {tok[:40]!r}")
    args: list = []
    kwargs: dict = {}
    i += 2
    while True:
        if i >= len(tokens):
            raise SymExprError(f"{tok}( is not closed")
        if tokens[i] == ("p", ")"):
            return ("call", tok, tuple(args), kwargs), i + 1
        if tokens[i][0] == "name" and i + 1 < len(tokens) and tokens[i + 1] == ("p", "="):
            key = tokens[i][1]
            if key not in _ASSUMPTIONS:
                raise SymExprError(f"unknown keyword {key[:40]!r}")
            value, i = _parse_call(tokens, i + 2, depth + 1)
            kwargs[key] = value
        else:
            value, i = _parse_call(tokens, i, depth + 1)
            args.append(value)
        if i < len(tokens) and tokens[i] == ("p", ","):
            i += 1
        elif i >= len(tokens) or tokens[i] != ("p", ")"):
            raise SymExprError(f"expected ',' or ')' in {tok}(...)")


def _check_expr(node: tuple, *, inside_pow: bool) -> None:
    kind = node[0]
    if kind == "int":
        if abs(node[1]) > _MAX_INT:
            raise SymExprError(f"integer {str(node[1])[:30]} out of range")
        return
    if kind in ("const",):
        return
    if kind == "str":
        raise SymExprError("a string outside Symbol(...) or Float(...)")
    _, name, args, kwargs = node
    if name == "Symbol":
        _check_symbol(args, kwargs)
        return
    if name == "Float":
        if not args or args[0][0] != "str" or not _NUMBER.fullmatch(args[0][1]) or len(args) > 1:
            raise SymExprError("Float takes one number in quotes")
        precision = kwargs.get("precision", ("int", _FLOAT_PRECISION))
        if set(kwargs) - {"precision"} or precision[0] != "int" or not 1 <= precision[1] <= _FLOAT_PRECISION:
            # sympy computes in `precision` bits: Float('0.1', precision=10**9) never finishes
            raise SymExprError(f"Float takes at most precision={_FLOAT_PRECISION} (the binary digits of a double, what torch writes)")
        return
    if kwargs:
        raise SymExprError(f"{name} takes no keyword arguments")
    if name in ("Integer", "Rational"):
        if not args or len(args) > 2 or any(a[0] != "int" for a in args):
            raise SymExprError(f"{name} takes integers")
    if name in ("Pow", "PowByNatural"):
        _check_pow(name, args, inside_pow)
        return
    for a in args:
        _check_expr(a, inside_pow=inside_pow)


def _check_symbol(args: list, kwargs: dict) -> None:
    """``Symbol('s0', positive=True, ...)``: one shape-symbol name, assumptions True or False."""
    if len(args) != 1 or args[0][0] != "str" or not _SYMBOL.fullmatch(args[0][1]):
        raise SymExprError("Symbol takes one shape-symbol name such as 's0'")
    if any(v not in (("const", "True"), ("const", "False")) for v in kwargs.values()):
        raise SymExprError("a Symbol's assumptions are True or False")


def _check_pow(name: str, args: list, inside_pow: bool) -> None:
    """A power: a base without a power in it, and an integer constant exponent of at most
    :data:`_MAX_EXPONENT` (no expression grows past a bound while it is evaluated)."""
    if inside_pow:
        raise SymExprError("a power inside the base of a power")
    if len(args) != 2:
        raise SymExprError(f"{name} takes a base and an exponent")
    exp = args[1]
    value = exp[1] if exp[0] == "int" else (exp[2][0][1] if exp[0] == "call" and exp[1] == "Integer" and exp[2] and exp[2][0][0] == "int" else None)
    if value is None or abs(value) > _MAX_EXPONENT:
        raise SymExprError(f"a power's exponent must be an integer constant of at most {_MAX_EXPONENT}")
    _check_expr(args[0], inside_pow=True)


# ------------------------------------------------------------------------------ the record

class _Walker:
    def __init__(self, info: Callable[[str], Optional[tuple]]) -> None:
        self.info = info
        self.nodes = 0

    @staticmethod
    def obj(v: Any, where: str, required: tuple[str, ...] = ()) -> dict:
        if not isinstance(v, dict):
            raise MetaError(where, "an object", _kind(v))
        missing = [k for k in required if k not in v]
        if missing:
            raise MetaError(where, f"the fields {list(required)}", f"no {missing}")
        return v

    @staticmethod
    def array(v: Any, where: str, max_len: int = 10_000_000) -> list:
        if not isinstance(v, list):
            raise MetaError(where, "a list", _kind(v))
        if len(v) > max_len:
            raise MetaError(where, f"at most {max_len} entries", str(len(v)))
        return v

    @staticmethod
    def integer(v: Any, where: str, lo: int = -_MAX_INT, hi: int = _MAX_INT, *, null: bool = False) -> Optional[int]:
        if v is None and null:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise MetaError(where, f"an integer in [{lo}, {hi}]" + (" or null" if null else ""), _show(v))
        return v

    @staticmethod
    def string(v: Any, where: str, max_len: int = 4096, *, null: bool = False) -> Optional[str]:
        if v is None and null:
            return None
        if not isinstance(v, str) or len(v) > max_len:
            raise MetaError(where, f"a string of at most {max_len} characters" + (" or null" if null else ""),
                            _kind(v) if not isinstance(v, str) else f"{len(v)} characters")
        return v

    @staticmethod
    def boolean(v: Any, where: str, *, null: bool = False) -> None:
        if not (isinstance(v, bool) or (v is None and null)):
            raise MetaError(where, "true or false" + (" or null" if null else ""), _show(v))

    def name(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not _NAME.fullmatch(v):
            raise MetaError(where, "a graph value name (letters, digits, '_')", _show(v))
        return v

    def spec(self, v: Any, where: str) -> SpecNode:
        try:
            node = decode_spec(v)
        except SpecError as e:
            raise MetaError(where, "a tree spec", str(e)[:200]) from None
        stack = [node]
        while stack:
            n = stack.pop()
            if n.kind not in _SPEC_KINDS:
                raise MetaError(where, "a tree of tuples, lists and dicts (what a program's signature holds)", f"a {n.kind} node")
            stack.extend(n.children)
        return node

    def expr(self, v: Any, where: str) -> None:
        try:
            parse_sym_expr(v)
        except SymExprError as e:
            raise MetaError(where, "a symbolic size expression (sympy.srepr of shape arithmetic)", str(e)[:200]) from None

    def sym(self, v: Any, where: str, scalar: str = "as_int") -> None:
        """A SymInt / SymBool / SymFloat: ``{as_int: n}`` (or bool/float) or ``{as_expr: {expr_str, hint}}``."""
        v = self.obj(v, where)
        if len(v) != 1:
            raise MetaError(where, f"one of 'as_expr', '{scalar}'", _show(sorted(v)))
        (key, val), = v.items()
        if key == "as_expr":
            e = self.obj(val, f"{where}.as_expr", ("expr_str",))
            self.expr(e["expr_str"], f"{where}.as_expr.expr_str")
            hint = e.get("hint")
            if hint is not None:
                h = self.obj(hint, f"{where}.as_expr.hint")
                if len(h) != 1 or next(iter(h)) not in ("as_int", "as_bool", "as_float"):
                    raise MetaError(f"{where}.as_expr.hint", "{'as_int': n}", _show(h))
                hv = next(iter(h.values()))
                if not isinstance(hv, (int, float)) or (isinstance(hv, int) and not isinstance(hv, bool) and abs(hv) > _MAX_INT):
                    raise MetaError(f"{where}.as_expr.hint", "a number", _show(hv))
        elif key == scalar:
            self.scalar(val, f"{where}.{key}", scalar)
        else:
            raise MetaError(where, f"one of 'as_expr', '{scalar}'", _show(key))

    def scalar(self, v: Any, where: str, kind: str) -> None:
        if kind == "as_int":
            self.integer(v, where)
        elif kind == "as_bool":
            self.boolean(v, where)
        elif not (isinstance(v, (int, float)) and not isinstance(v, bool)) and v not in _FLOAT_WORDS:
            raise MetaError(where, "a number", _show(v))

    def sym_arg(self, v: Any, where: str, scalar: str) -> None:
        """A SymIntArgument (``{as_name}`` or ``{as_int}``) and its bool/float kin."""
        v = self.obj(v, where)
        if len(v) != 1 or next(iter(v)) not in ("as_name", scalar):
            raise MetaError(where, f"{{'as_name': name}} or {{'{scalar}': value}}", _show(v))
        (key, val), = v.items()
        if key == "as_name":
            self.name(val, f"{where}.as_name")
        else:
            self.scalar(val, f"{where}.{key}", scalar)

    def tensor_ref(self, v: Any, where: str) -> None:
        self.name(self.obj(v, where, ("name",))["name"], f"{where}.name")

    def optional_tensor(self, v: Any, where: str) -> None:
        v = self.obj(v, where)
        if len(v) != 1 or next(iter(v)) not in ("as_tensor", "as_none"):
            raise MetaError(where, "{'as_tensor': {...}} or {'as_none': ...}", _show(v))
        if "as_tensor" in v:
            self.tensor_ref(v["as_tensor"], f"{where}.as_tensor")

    def arg(self, v: Any, where: str, graphs: list) -> None:
        """One ``Argument`` (a union: exactly one key)."""
        v = self.obj(v, where)
        if len(v) != 1 or next(iter(v)) not in _ARG_KINDS:
            raise MetaError(where, "an argument with one key of torch's Argument union (as_tensor, as_int ...)", _show(sorted(v))[:120])
        (key, val), = v.items()
        w = f"{where}.{key}"
        if key == "as_graph":
            g = self.obj(val, w, ("name", "graph"))
            self.name(g["name"], f"{w}.name")
            graphs.append((g["graph"], f"{w}.graph"))
        elif key in _ARRAY_ARGS:
            check = _ARG_CHECKS[_ARRAY_ARGS[key]]
            for i, x in enumerate(self.array(val, w)):
                check(self, x, f"{w}[{i}]")
        elif key in _ARG_CHECKS:
            _ARG_CHECKS[key](self, val, w)
        # the other kinds: well-formed JSON no replayable program uses (see _ARG_CHECKS)

    def device(self, v: Any, where: str) -> None:
        """A Device argument: ``{type, index}``."""
        d = self.obj(v, where, ("type",))
        if not (isinstance(d["type"], str) and re.fullmatch(r"[a-z]{1,16}", d["type"])):
            raise MetaError(f"{where}.type", "a device type such as 'cpu'", _show(d["type"]))
        self.integer(d.get("index"), f"{where}.index", 0, 1 << 16, null=True)

    def tensor_meta(self, v: Any, where: str) -> None:
        m = self.obj(v, where, ("dtype", "sizes", "requires_grad", "device", "strides", "storage_offset", "layout"))
        self.integer(m["dtype"], f"{where}.dtype", 0, 255)
        self.integer(m["layout"], f"{where}.layout", 0, 255)
        self.boolean(m["requires_grad"], f"{where}.requires_grad")
        self.arg({"as_device": m["device"]}, f"{where}.device", [])
        for k in ("sizes", "strides"):
            for i, s in enumerate(self.array(m[k], f"{where}.{k}", 64)):
                self.sym(s, f"{where}.{k}[{i}]")
        self.sym(m["storage_offset"], f"{where}.storage_offset")

    def graph(self, g: Any, where: str, graphs: list) -> None:
        g = self.obj(g, where, ("inputs", "outputs", "nodes", "tensor_values", "sym_int_values", "sym_bool_values"))
        for k in ("inputs", "outputs"):
            for i, a in enumerate(self.array(g[k], f"{where}.{k}")):
                self.arg(a, f"{where}.{k}[{i}]", graphs)
        nodes = self.array(g["nodes"], f"{where}.nodes", MAX_NODES)
        self.nodes += len(nodes)
        if self.nodes > MAX_NODES:
            raise MetaError(where, f"at most {MAX_NODES} nodes in all graphs", str(self.nodes))
        for i, n in enumerate(nodes):
            w = f"{where}.nodes[{i}]"
            n = self.obj(n, w, ("target", "inputs", "outputs"))
            self.string(n["target"], f"{w}.target", 256)
            for j, inp in enumerate(self.array(n["inputs"], f"{w}.inputs", 4096)):
                inp = self.obj(inp, f"{w}.inputs[{j}]", ("name", "arg"))
                self.string(inp["name"], f"{w}.inputs[{j}].name", 256)
                self.integer(inp.get("kind"), f"{w}.inputs[{j}].kind", 0, 16, null=True)
                self.arg(inp["arg"], f"{w}.inputs[{j}].arg", graphs)
            for j, out in enumerate(self.array(n["outputs"], f"{w}.outputs", 4096)):
                self.arg(out, f"{w}.outputs[{j}]", graphs)
            md = self.obj(n.get("metadata", {}), f"{w}.metadata")
            for k, val in md.items():
                self.string(val, f"{w}.metadata[{k[:40]!r}]", 1 << 20)
        for name, tm in self.obj(g["tensor_values"], f"{where}.tensor_values").items():
            self.name(name, f"{where}.tensor_values")
            self.tensor_meta(tm, f"{where}.tensor_values[{name!r}]")
        for key, scalar in (("sym_int_values", "as_int"), ("sym_bool_values", "as_bool"), ("sym_float_values", "as_float")):
            for name, s in self.obj(g.get(key, {}), f"{where}.{key}").items():
                self.name(name, f"{where}.{key}")
                self.sym(s, f"{where}.{key}[{name!r}]", scalar)
        if self.obj(g.get("custom_obj_values", {}), f"{where}.custom_obj_values"):
            raise MetaError(f"{where}.custom_obj_values", "no script objects (they cannot be stored without pickle)", "some")

    def program(self, p: Any, where: str) -> None:
        p = self.obj(p, where, ("graph_module", "range_constraints", "schema_version"))
        gm = self.obj(p["graph_module"], f"{where}.graph_module", ("graph", "signature", "module_call_graph"))
        graphs: list = [(gm["graph"], f"{where}.graph_module.graph")]
        while graphs:
            g, w = graphs.pop()
            self.graph(g, w, graphs)
        sig = self.obj(gm["signature"], f"{where}.graph_module.signature", ("input_specs", "output_specs"))
        for k in ("input_specs", "output_specs"):
            for i, s in enumerate(self.array(sig[k], f"{where}.graph_module.signature.{k}")):
                s = self.obj(s, f"{where}.graph_module.signature.{k}[{i}]")
                if len(s) != 1:
                    raise MetaError(f"{where}.graph_module.signature.{k}[{i}]", "one kind of spec", _show(sorted(s)))
                self.obj(next(iter(s.values())), f"{where}.graph_module.signature.{k}[{i}]")
        for i, entry in enumerate(self.array(gm["module_call_graph"], f"{where}.graph_module.module_call_graph", 1_000_000)):
            w = f"{where}.graph_module.module_call_graph[{i}]"
            entry = self.obj(entry, w, ("fqn",))
            self.string(entry["fqn"], f"{w}.fqn")
            s = entry.get("signature")
            if s is not None:
                s = self.obj(s, f"{w}.signature", ("in_spec", "out_spec"))
                self.spec(s["in_spec"], f"{w}.signature.in_spec")
                self.spec(s["out_spec"], f"{w}.signature.out_spec")
        if self.obj(gm.get("treespec_namedtuple_fields", {}), f"{where}.graph_module.treespec_namedtuple_fields"):
            raise MetaError(f"{where}.graph_module.treespec_namedtuple_fields", "no named tuple types (a program's signature holds none)", "some")
        if gm.get("metadata") is not None:
            md = self.obj(gm["metadata"], f"{where}.graph_module.metadata")
            if "custom" in md:
                raise MetaError(f"{where}.graph_module.metadata.custom", "no custom metadata (torch decodes it)", "some")
        for name, rc in self.obj(p["range_constraints"], f"{where}.range_constraints").items():
            self.name(name, f"{where}.range_constraints")
            rc = self.obj(rc, f"{where}.range_constraints[{name!r}]", ("min_val", "max_val"))
            for k in ("min_val", "max_val"):
                self.integer(rc[k], f"{where}.range_constraints[{name!r}].{k}", null=True)
        sv = self.obj(p["schema_version"], f"{where}.schema_version", ("major", "minor"))
        self.integer(sv["major"], f"{where}.schema_version.major", 0, 1 << 16)
        self.integer(sv["minor"], f"{where}.schema_version.minor", 0, 1 << 16)

    def tree_info(self, v: Any, where: str) -> None:
        t = self.obj(v, where, ("spec", "n", "values", "tensors"))
        node = self.spec_any(t["spec"], f"{where}.spec")
        n = self.integer(t["n"], f"{where}.n", 0, 10_000_000)
        if node.leaves != n:
            raise MetaError(f"{where}.n", f"the spec's leaf count {node.leaves}", str(n))
        for k, rec in self.obj(t["values"], f"{where}.values").items():
            if not (k.isdigit() and int(k) < n):
                raise MetaError(f"{where}.values", f"leaf indices below {n}", _show(k))
            self.obj(rec, f"{where}.values[{k!r}]")
        idx = self.array(t["tensors"], f"{where}.tensors")
        for i, x in enumerate(idx):
            self.integer(x, f"{where}.tensors[{i}]", 0, max(n - 1, 0))
        metas = self.array(t.get("tensor_meta", []), f"{where}.tensor_meta")
        if "tensor_meta" in t and len(metas) != len(idx):
            raise MetaError(f"{where}.tensor_meta", f"one entry per tensor leaf ({len(idx)})", f"{len(metas)} entries")
        for i, tm in enumerate(metas):
            tm = self.obj(tm, f"{where}.tensor_meta[{i}]", ("dtype", "shape"))
            self.string(tm["dtype"], f"{where}.tensor_meta[{i}].dtype", 32)
            for j, d in enumerate(self.array(tm["shape"], f"{where}.tensor_meta[{i}].shape", 64)):
                self.integer(d, f"{where}.tensor_meta[{i}].shape[{j}]", 0, null=True)

    def spec_any(self, v: Any, where: str) -> SpecNode:
        """A tree spec of the recorded call or output, which may hold typed nodes (dataclasses,
        namedtuples: rebuilt as stand-ins, never imported)."""
        try:
            return decode_spec(v)
        except SpecError as e:
            raise MetaError(where, "a tree spec", str(e)[:200]) from None


#: how each kind of torch's ``Argument`` union is checked (one value; ``as_graph`` is checked in
#: :meth:`_Walker.arg`, which queues its graph). Kinds absent from both tables (as_strings,
#: as_custom_obj, as_operator, as_complex, as_nested_tensors, as_int_lists, as_float_lists,
#: as_string_to_argument) are well-formed JSON of a kind no replayable program uses; the operator
#: check refuses them (exit 5) before torch reads them.
_ARG_CHECKS: dict[str, Callable[[_Walker, Any, str], Any]] = {
    "as_none": lambda w, v, where: None,
    "as_tensor": _Walker.tensor_ref,
    **dict.fromkeys(("as_int", "as_scalar_type", "as_memory_format", "as_layout"), lambda w, v, where: w.integer(v, where)),
    "as_float": lambda w, v, where: w.scalar(v, where, "as_float"),
    "as_bool": lambda w, v, where: w.boolean(v, where),
    "as_string": lambda w, v, where: w.string(v, where, 1 << 16),
    "as_sym_int": lambda w, v, where: w.sym_arg(v, where, "as_int"),
    "as_sym_bool": lambda w, v, where: w.sym_arg(v, where, "as_bool"),
    "as_sym_float": lambda w, v, where: w.sym_arg(v, where, "as_float"),
    "as_device": _Walker.device,
    "as_optional_tensor": _Walker.optional_tensor,
}
#: the list kinds of the union and the kind of their elements
_ARRAY_ARGS = {"as_tensors": "as_tensor", "as_ints": "as_int", "as_floats": "as_float", "as_bools": "as_bool", "as_sym_ints": "as_sym_int",
               "as_sym_bools": "as_sym_bool", "as_sym_floats": "as_sym_float", "as_optional_tensors": "as_optional_tensor"}


def validate_program_record(rec: Any, info: Callable[[str], Optional[tuple]], where: str = "meta.program") -> None:
    """Check an embedded program record against its schema and the bundle's tensors.

    Args:
        rec: ``meta["program"]`` (strict JSON, already bounded in size and depth).
        info: ``info(key)`` -> ``(dtype, shape)`` of a stored tensor, or ``None`` when absent.
        where: the record's path, for messages.

    Raises:
        MetaError: the first violation: where (a JSON path), what was expected, what was found.
    """
    w = _Walker(info)
    rec = w.obj(rec, where, ("kind",))
    if rec["kind"] is None:  # no program: the export failed when recording, and says why
        w.string(rec.get("error"), f"{where}.error", 1 << 16, null=True)
        return
    rec = w.obj(rec, where, ("format", "version"))
    if rec["format"] != PROGRAM_FORMAT:
        raise MetaError(f"{where}.format", repr(PROGRAM_FORMAT), _show(rec["format"]))
    w.integer(rec["version"], f"{where}.version", 0, 1 << 16)
    if rec["kind"] not in ("forward", "loss"):
        raise MetaError(f"{where}.kind", "'forward', 'loss' or null", _show(rec["kind"]))
    rec = w.obj(rec, where, ("program", "inputs", "state", "modules", "schema"))
    for k in ("torch", "device", "root_class", "error", "loss_error"):
        w.string(rec.get(k), f"{where}.{k}", 1 << 16, null=True)
    schema = w.array(rec["schema"], f"{where}.schema", 4)
    for i, x in enumerate(schema):
        w.integer(x, f"{where}.schema[{i}]", 0, 1 << 16)
    w.tree_info(rec["inputs"], f"{where}.inputs")
    if rec["kind"] == "forward" or rec.get("outputs") is not None:
        w.tree_info(rec.get("outputs"), f"{where}.outputs")
    for name, ent in w.obj(rec["state"], f"{where}.state").items():
        ew = f"{where}.state[{name[:100]!r}]"
        ent = w.obj(ent, ew, ("key", "kind", "store"))
        w.string(ent["key"], f"{ew}.key")
        if ent["kind"] not in ("parameter", "buffer", "constant"):
            raise MetaError(f"{ew}.kind", "'parameter', 'buffer' or 'constant'", _show(ent["kind"]))
        if ent["store"] not in ("state_dict", "constants"):
            raise MetaError(f"{ew}.store", "'state_dict' or 'constants'", _show(ent["store"]))
        w.boolean(ent.get("requires_grad"), f"{ew}.requires_grad", null=True)
        if info(ent["key"]) is None:
            raise MetaError(f"{ew}.key", f"tensor {ent['key'][:200]!r} (the program refers to it)", "no such tensor in the file")
    for k, v in w.obj(rec["modules"], f"{where}.modules").items():
        w.string(v, f"{where}.modules[{k[:100]!r}]", 256)
    for i, x in enumerate(w.array(rec.get("training", []), f"{where}.training")):
        w.string(x, f"{where}.training[{i}]")
    for k, v in w.obj(rec.get("method_of") or {}, f"{where}.method_of").items():
        w.string(v, f"{where}.method_of[{k[:100]!r}]", 1 << 12)
    for i, x in enumerate(w.array(rec.get("custom_functions", []), f"{where}.custom_functions")):
        w.string(x, f"{where}.custom_functions[{i}]", 1 << 12)
    w.program(rec["program"], f"{where}.program")
