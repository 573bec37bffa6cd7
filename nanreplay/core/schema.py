"""JSON Schema (draft 2020-12) from the ``TypedDict`` s of :mod:`nanreplay.core.results`, and the
schemas shipped in the package (``nanreplay/schema/*.schema.json``).

The generator knows the few annotations the results use: ``int``, ``float``, ``str``, ``bool``,
``None``, ``Any``, ``Literal``, ``Union`` / ``Optional``, ``list[X]``, ``dict[str, X]`` and
``TypedDict`` (one ``$defs`` entry each: required keys are those not ``NotRequired``; only the
objects in :data:`nanreplay.core.results.OPEN` allow more keys). Anything else raises
``TypeError``, so an annotation the generator cannot say is found when the schema is written.

>>> schema_for(results.DiagnosisDict)["$defs"]["Counterfactuals"]["required"]
['float64_finite', 'persists_with_perturbed_weights']
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

from . import results

__all__ = ["schema_for", "SCHEMAS", "schema_path", "shipped_schema", "schema_text", "write_schemas", "conforms"]

#: the shipped schemas: file stem -> (result type, title)
SCHEMAS: dict[str, tuple[Any, str]] = {
    "diagnosis": (results.DiagnosisDict, "nanreplay replay --json"),
    "bisect": (results.BisectResult, "nanreplay bisect --json"),
    "diff": (results.ConfigDiff, "nanreplay diff --json"),
}

_SCALARS = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"}, bool: {"type": "boolean"},
            type(None): {"type": "null"}}

#: the folder of the shipped schemas (package data, ``[tool.setuptools.package-data]``)
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _schema(tp: Any, defs: dict[str, dict]) -> dict:
    if tp is Any:
        return {}
    if tp in _SCALARS:
        return dict(_SCALARS[tp])
    if _is_typeddict(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder: a type that refers to itself terminates
            hints = typing.get_type_hints(tp)
            defs[tp.__name__] = {
                "type": "object",
                **({"description": " ".join(tp.__doc__.split())} if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "(") else {}),
                "properties": {k: _schema(v, defs) for k, v in hints.items()},
                "required": sorted(tp.__required_keys__),
                "additionalProperties": tp.__name__ in results.OPEN,
            }
        return {"$ref": f"#/$defs/{tp.__name__}"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        alts: list[dict] = []
        for a in args:
            s = _schema(a, defs)
            for one in s["anyOf"] if set(s) == {"anyOf"} else [s]:
                if one not in alts:
                    alts.append(one)
        return {"anyOf": alts}
    if origin is list:
        return {"type": "array", "items": _schema(args[0], defs)} if args else {"type": "array"}
    if origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"expected dict[str, X] (JSON object keys are strings), found {tp!r}")
        return {"type": "object", "additionalProperties": _schema(args[1], defs)} if args else {"type": "object"}
    raise TypeError(f"no JSON Schema for the annotation {tp!r}: expected int, float, str, bool, None, Any, Literal, "
                    "Union/Optional, list[X], dict[str, X] or a TypedDict; add it to nanreplay.core.schema._schema")


def schema_for(tp: Any, *, name: str = "", title: str = "") -> dict:
    """The JSON Schema of a ``TypedDict`` of :mod:`nanreplay.core.results`: the type itself at the
    top, every object type it uses under ``$defs``."""
    defs: dict[str, dict] = {}
    _schema(tp, defs)
    top = defs.pop(tp.__name__)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://nanreplay.invalid/schema/{name or tp.__name__.lower()}-{results.SCHEMA_VERSION}.schema.json",
        "title": title or tp.__name__,
        "x-schema-version": results.SCHEMA_VERSION,
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def schema_text(name: str) -> str:
    """The shipped file's text of schema ``name`` (a key of :data:`SCHEMAS`), as generated now."""
    tp, title = SCHEMAS[name]
    return json.dumps(schema_for(tp, name=name, title=title), indent=1) + "\n"


def schema_path(name: str) -> Path:
    """Where schema ``name`` is shipped: ``nanreplay/schema/<name>.schema.json``."""
    if name not in SCHEMAS:
        raise KeyError(f"no schema named {name!r}: expected one of {sorted(SCHEMAS)}")
    return SCHEMA_DIR / f"{name}.schema.json"


def shipped_schema(name: str) -> dict:
    """The shipped JSON Schema of ``name`` (``"diagnosis"``: ``replay --json``; ``"bisect"``:
    ``bisect --json``; ``"diff"``: ``diff --json``), for tools that validate nanreplay's output."""
    return json.loads(schema_path(name).read_text(encoding="utf-8"))


_JSON_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list), "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int, "number": lambda v: type(v) in (int, float), "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
}


def conforms(value: Any, schema: dict, *, limit: int = 8) -> list[str]:
    """Where ``value`` (parsed JSON) breaks ``schema``, as ``"$.origin.op: expected ..."`` lines
    (at most ``limit``); an empty list when it conforms. Knows what :func:`schema_for` writes:
    ``type``, ``enum``, ``anyOf``, ``properties``, ``required``, ``additionalProperties``, ``items``
    and ``$ref`` into ``$defs``; the parent of a sandboxed replay checks its result with it
    (:mod:`nanreplay.engine.sandbox`), so a result is data of the documented shape before
    anything reads it. Recursion follows the value, whose depth the JSON parser bounded.

    >>> conforms({"a": 1}, {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    ['$.a: expected string, found int']
    """
    errors: list[str] = []
    _conforms(value, schema, schema, "$", errors, limit)
    return errors


def _conforms(value: Any, node: dict, root: dict, path: str, errors: list[str], limit: int) -> bool:
    if len(errors) >= limit:
        return False
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return _conforms(value, root["$defs"][name], root, path, errors, limit)
    if "anyOf" in node:
        for alt in node["anyOf"]:
            if not _conforms(value, alt, root, path, [], limit):
                continue
            return True
        errors.append(f"{path}: expected {' or '.join(_describe(a, root) for a in node['anyOf'])}, found {_found(value)}")
        return False
    if "enum" in node and value not in node["enum"]:
        errors.append(f"{path}: expected one of {node['enum'][:8]}, found {_found(value)}")
        return False
    kind = node.get("type")
    if kind is not None and not _JSON_TYPES[kind](value):
        errors.append(f"{path}: expected {kind}, found {_found(value)}")
        return False
    ok = True
    if isinstance(value, dict):
        props = node.get("properties", {})
        missing = [k for k in node.get("required", []) if k not in value]
        if missing:
            errors.append(f"{path}: expected the keys {missing[:8]}, found none")
            ok = False
        extra = node.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                ok = _conforms(v, props[k], root, f"{path}.{k}", errors, limit) and ok
            elif extra is False:
                errors.append(f"{path}: unexpected key {k[:60]!r}")
                ok = False
            elif isinstance(extra, dict):
                ok = _conforms(v, extra, root, f"{path}.{k[:60]}", errors, limit) and ok
    elif isinstance(value, list) and "items" in node:
        for i, v in enumerate(value):
            ok = _conforms(v, node["items"], root, f"{path}[{i}]", errors, limit) and ok
            if len(errors) >= limit:
                break
    return ok


def _describe(node: dict, root: dict) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[-1]
    if "enum" in node:
        return " or ".join(repr(v) for v in node["enum"][:4])
    return str(node.get("type", "any value"))


def _found(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def write_schemas(docs: Path | None = None) -> list[Path]:
    """Write every schema of :data:`SCHEMAS` into the package (and into ``docs``, a checkout's
    ``docs/schema/``, when given); the paths written. ``python -m nanreplay.core.schema`` runs it
    from a checkout after a change to :mod:`nanreplay.core.results`."""
    written = []
    for name in SCHEMAS:
        text = schema_text(name)
        for folder in [SCHEMA_DIR] + ([docs] if docs is not None else []):
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{name}.schema.json"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - the maintainer's regeneration command
    for p in write_schemas(SCHEMA_DIR.parent.parent / "docs" / "schema"):
        print(p)
