"""Nested batches as flat leaves plus a JSON tree spec, built on ``torch.utils._pytree``.

A batch is any nesting of tuples, lists, dicts (plain, ordered, default), deques, namedtuples
and dataclasses, with tensors and plain values as leaves. ``torch.utils._pytree`` flattens the
standard containers and serialises their spec to JSON; namedtuples and dataclasses are user
types it cannot serialise, so they are first turned into a :class:`TypedNode` (registered once
with pytree) that stores the type's import path and its fields. Non-tensor leaves are stored as
JSON values when they are JSON-able (int, float, str, bool, None); anything else is stored as
its ``repr`` and marked unrestorable, never pickled.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)

__all__ = ["TypedNode", "to_typed", "flatten_typed", "map_tensors", "tensor_leaves", "flatten_batch", "unflatten_batch", "encode_value", "decode_value"]


class TypedNode:
    """A namedtuple or dataclass instance, as pytree sees it: its type's import path
    (``module:QualName``), its kind (``"namedtuple"`` or ``"dataclass"``) and its fields.

    A plain class, not a namedtuple: pytree flattens every namedtuple generically (its fields
    as children) before it looks at its registry, so only a plain class keeps the type path
    in the spec's context instead of among the leaves."""

    __slots__ = ("type_path", "kind", "fields")

    def __init__(self, type_path: str, kind: str, fields: dict) -> None:
        self.type_path, self.kind, self.fields = type_path, kind, fields

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TypedNode) and (self.type_path, self.kind, self.fields) == (other.type_path, other.kind, other.fields)

    def __repr__(self) -> str:
        return f"TypedNode({self.type_path!r}, {self.kind!r}, {self.fields!r})"


def _flatten_typed(node: TypedNode):
    names = list(node.fields)
    return [node.fields[n] for n in names], (node.type_path, node.kind, names)


def _flatten_typed_with_keys(node: TypedNode):
    children, ctx = _flatten_typed(node)
    return [(pytree.GetAttrKey(n), c) for n, c in zip(ctx[2], children)], ctx


def _unflatten_typed(children, context) -> TypedNode:
    type_path, kind, names = context
    return TypedNode(type_path, kind, dict(zip(names, children)))


pytree.register_pytree_node(
    TypedNode,
    _flatten_typed,
    _unflatten_typed,
    serialized_type_name="nanreplay.tree.TypedNode",
    to_dumpable_context=lambda ctx: [ctx[0], ctx[1], list(ctx[2])],
    from_dumpable_context=lambda ctx: (str(ctx[0]), str(ctx[1]), [str(n) for n in ctx[2]]),
    flatten_with_keys_fn=_flatten_typed_with_keys,
)


def _type_path(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def to_typed(obj: Any) -> Any:
    """Replace namedtuples and dataclass instances, at any depth, by TypedNode."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, TypedNode):  # already converted (a cotangent tree built from an output)
        return TypedNode(obj.type_path, obj.kind, {k: to_typed(v) for k, v in obj.fields.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: to_typed(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return TypedNode(_type_path(obj), "dataclass", fields)
    if pytree.is_namedtuple_instance(obj):
        return TypedNode(_type_path(obj), "namedtuple", {k: to_typed(v) for k, v in obj._asdict().items()})
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_typed(v) for v in obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        if hasattr(obj, "default_factory"):
            out = type(obj)(obj.default_factory)
        for k, v in obj.items():
            out[k] = to_typed(v)
        return out
    return obj


def _from_typed(obj: Any, *, import_types: bool) -> Any:
    def convert(node: Any) -> Any:
        if not isinstance(node, TypedNode):
            return node
        fields = {k: convert(v) for k, v in node.fields.items()}
        if import_types:
            cls = _import_type(node.type_path)
            if cls is not None:
                try:
                    return cls(**fields)
                except Exception as e:  # a changed class signature: fall back, never crash replay
                    logger.warning("could not rebuild %s from the bundle (%s); using a dict", node.type_path, e)
        return fields

    def walk(node: Any) -> Any:
        if isinstance(node, TypedNode):
            return convert(TypedNode(node.type_path, node.kind, {k: walk(v) for k, v in node.fields.items()}))
        if type(node) in (list, tuple):
            return type(node)(walk(v) for v in node)
        if isinstance(node, dict):
            for k in list(node):
                node[k] = walk(node[k])
            return node
        return node

    return walk(obj)


def _import_type(path: str) -> Any:
    module, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    except Exception as e:
        logger.warning("batch type %s is not importable here (%s); it is rebuilt as a dict", path, e)
        return None


def flatten_batch(batch: Any) -> tuple[list[Any], str]:
    """Flatten ``batch`` into leaves (tensors and plain values) and a JSON spec string.

    >>> leaves, spec = flatten_batch({"x": torch.ones(2, 3), "ids": [1, 2]})
    >>> [type(l).__name__ for l in leaves]
    ['Tensor', 'int', 'int']
    """
    leaves, spec = pytree.tree_flatten(to_typed(batch))
    return leaves, pytree.treespec_dumps(spec)


def flatten_typed(tree: Any) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten`` after turning namedtuples and dataclasses (model
    outputs such as Hugging Face's ``ModelOutput``, which pytree sees as one opaque leaf) into
    :class:`TypedNode`, so their tensors are leaves. Returns (leaves, TreeSpec)."""
    return pytree.tree_flatten(to_typed(tree))


def map_tensors(fn: Any, tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor, dataclass fields included (pytree alone
    treats a dataclass, e.g. a batch object, as one opaque leaf), rebuilding every container with
    its own type: a dataclass is copied and its fields set (frozen ones too, no ``__init__`` call),
    the rest goes through ``torch.utils._pytree.tree_map``. Non-tensor leaves pass unchanged."""

    def is_dc(x: Any) -> bool:
        return dataclasses.is_dataclass(x) and not isinstance(x, type)

    def go(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if is_dc(x):
            y = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(y, f.name, go(getattr(x, f.name)))
            return y
        return x

    if is_dc(tree):
        return go(tree)
    return pytree.tree_map(go, tree, is_leaf=is_dc)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, namedtuple and dataclass fields included, in flattening order."""
    return [t for t in flatten_typed(tree)[0] if isinstance(t, torch.Tensor)]


def unflatten_batch(leaves: list[Any], spec_json: str, *, import_types: bool = True) -> Any:
    """Inverse of :func:`flatten_batch`. Namedtuples and dataclasses are rebuilt when their type
    imports (``import_types=True``), else returned as dicts of their fields.

    Raises:
        ValueError: the spec is not valid JSON of a pytree spec, or the leaf count differs.
    """
    try:
        spec = pytree.treespec_loads(spec_json)
    except Exception as e:
        raise ValueError(f"the batch tree spec is not a valid pytree spec ({e})") from e
    if spec.num_leaves != len(leaves):
        raise ValueError(f"the batch tree spec expects {spec.num_leaves} leaves, the bundle holds {len(leaves)}")
    return _from_typed(pytree.tree_unflatten(leaves, spec), import_types=import_types)


def encode_value(v: Any) -> dict:
    """A non-tensor leaf as a JSON-able record. Non-finite floats are kept exactly
    (``{"float": "nan"}``); non-JSON objects are kept as ``repr`` and flagged unrestorable."""
    if v is None or isinstance(v, (bool, int, str)):
        return {"json": v}
    if isinstance(v, float):
        return {"json": v} if math.isfinite(v) else {"float": repr(v)}
    try:
        json.dumps(v, allow_nan=False)
        return {"json": v}
    except (TypeError, ValueError):
        return {"repr": repr(v)[:1000], "type": _type_path(v)}


def decode_value(rec: dict) -> Any:
    """Inverse of :func:`encode_value`; an unrestorable object comes back as its repr string."""
    if "json" in rec:
        return rec["json"]
    if "float" in rec:
        return float(rec["float"])
    logger.warning("batch leaf of type %s was not storable; replay gets its repr string", rec.get("type"))
    return rec.get("repr")


def _key_name(path: tuple) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def tree_to_flat(obj: Any, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Any pytree (a batch, an optimizer ``state_dict()``, a scaler state) as bundle content:
    the tensor leaf ``i`` under ``{prefix}{i}`` or ``{prefix}{i}:{dotted.key.path}`` (readable in
    ``nanreplay inspect``), and a JSON record ``{"spec", "n", "keys", "values"}`` where ``values``
    maps the index of every non-tensor leaf to :func:`encode_value` of it. Tensors are
    referenced, not copied (the storage layer copies to the CPU when writing)."""
    leaves, spec = flatten_batch(obj)
    paths = [p for p, _ in pytree.tree_flatten_with_path(to_typed(obj))[0]]
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict] = {}
    keys: dict[str, str] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            name = _key_name(paths[i]) if i < len(paths) else ""
            key = f"{prefix}{i}:{name}" if name else f"{prefix}{i}"
            keys[str(i)] = key
            tensors[key] = leaf.detach()
        else:
            values[str(i)] = encode_value(leaf)
    return tensors, {"spec": spec, "n": len(leaves), "keys": keys, "values": values}


def tree_from_flat(get, record: dict, prefix: str, *, import_types: bool = True) -> Any:
    """Inverse of :func:`tree_to_flat`; ``get(key)`` returns a stored tensor.

    Raises:
        ValueError: the record is malformed (wrong leaf count, bad spec, a key outside ``prefix``).
    """
    n = int(record["n"])
    values = record.get("values", {})
    keys = record.get("keys", {})
    leaves = []
    for i in range(n):
        if str(i) in values:
            leaves.append(decode_value(values[str(i)]))
            continue
        key = keys.get(str(i), f"{prefix}{i}")
        if not isinstance(key, str) or not key.startswith(prefix):
            raise ValueError(f"leaf {i} points at {key!r}, outside {prefix!r}")
        leaves.append(get(key))
    return unflatten_batch(leaves, record["spec"], import_types=import_types)
