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

import collections
import copy
import dataclasses
import json
import logging
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Union

import torch
from torch.utils import _pytree as pytree

from .safejson import strict_loads

logger = logging.getLogger(__name__)

__all__ = ["TypedNode", "to_typed", "flatten_typed", "map_tensors", "tensor_leaves", "flatten_batch", "unflatten_batch", "encode_value",
           "decode_value", "type_path", "accepted_types", "decode_spec", "spec_types", "SpecNode", "SpecError", "MAX_TREE_DEPTH",
           "MAX_SPEC_CONTAINERS"]


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


def _is_record_type(cls: Any, kind: Optional[str] = None) -> bool:
    """Whether ``cls`` is a dataclass type (kind ``"dataclass"``) or a namedtuple class (kind
    ``"namedtuple"``): the only types a typed node is ever rebuilt as."""
    if not isinstance(cls, type):
        return False
    is_dc = dataclasses.is_dataclass(cls)
    is_nt = issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)
    if kind == "dataclass":
        return is_dc
    if kind == "namedtuple":
        return is_nt
    return is_dc or is_nt


def type_path(cls: type) -> str:
    """``module:QualName`` of a class, the name a bundle records for a typed node."""
    return f"{cls.__module__}:{cls.__qualname__}"


def accepted_types(types: Union[Iterable[type], Mapping[str, type], None]) -> dict[str, type]:
    """The typed-node types a reader accepts, keyed by the ``module:QualName`` a bundle records.

    Args:
        types: dataclass types and namedtuple classes (an iterable), or a mapping from recorded
            ``module:QualName`` to such a class (to rebuild a type recorded under another name),
            or ``None`` (none: typed nodes come back as dicts of their fields).

    Raises:
        TypeError: an entry is not a dataclass type or a namedtuple class (arbitrary callables are
            never used to rebuild data).
    """
    if types is None:
        return {}
    items = list(types.items()) if isinstance(types, Mapping) else [(None, t) for t in types]
    out: dict[str, type] = {}
    for name, cls in items:
        if not _is_record_type(cls):
            raise TypeError(
                f"batch types must be dataclass types or namedtuple classes, found {cls!r}; "
                "a typed batch node is rebuilt only as one of those, never through another callable"
            )
        out[name if name is not None else type_path(cls)] = cls
    return out


def _rebuild(path: str, kind: str, fields: dict, types: Mapping[str, type]) -> Any:
    """A typed node's fields as the accepted type recorded under ``path``, else as the dict."""
    cls = types.get(path)
    if cls is None:
        return fields
    if not _is_record_type(cls, kind):
        logger.warning("batch type %s was recorded as a %s but %r is not one; it is rebuilt as a dict", path, kind, cls)
        return fields
    try:
        return cls(**fields)
    except Exception as e:  # noqa: BLE001 - a changed class signature: fall back, never crash replay
        logger.warning("could not rebuild %s from the bundle (%s: %s); using a dict of its fields", path, type(e).__name__, e)
        return fields


# ------------------------------------------------------------------------------ reading tree specs
#
# A bundle's tree spec is untrusted JSON. torch.utils._pytree.treespec_loads must not read it: its
# defaultdict and Enum-key decoders import any module the JSON names, and every node type some
# library registered in this process gets its own deserializer. The spec is decoded here instead,
# from an allowlist of node types, into a small validated tree, and rebuilt without any import.

#: Deepest container nesting accepted in a tree spec.
MAX_TREE_DEPTH = 64

_SAFE_DEFAULT_FACTORIES = {"list": list, "dict": dict, "set": set, "int": int, "float": float, "str": str,
                           "tuple": tuple, "frozenset": frozenset, "bytes": bytes, "bool": bool}
_SEQUENCE_TYPES = {"builtins.tuple": "tuple", "builtins.list": "list", "torch.fx.immutable_collections.immutable_list": "list",
                   "torch.Size": "size"}
_MAPPING_TYPES = {"builtins.dict": "dict", "collections.OrderedDict": "odict", "torch.fx.immutable_collections.immutable_dict": "dict"}
_TYPED_NAME = "nanreplay.tree.TypedNode"
_TYPED_KINDS = ("namedtuple", "dataclass")


class SpecNode(NamedTuple):
    """One validated node of a stored tree spec.

    ``kind``: ``leaf``, ``tuple``, ``list``, ``size`` (torch.Size), ``dict``, ``odict``,
    ``ddict`` (defaultdict), ``deque``, ``typed`` (namedtuple / dataclass) or ``other`` (a node
    type registered with pytree by other code: rebuilt as a list of its children). ``context``:
    the dict keys, ``(factory, keys)`` for a defaultdict, the deque's maxlen, the TypedNode
    ``(type_path, kind, names)``, or the recorded type name for ``other``.
    """

    kind: str
    context: Any
    children: tuple
    leaves: int


class SpecError(ValueError):
    """A stored tree spec is malformed or uses an unsupported node type."""


#: Most arrays and objects (and four times as many separators) in one stored tree spec: a node is an
#: object and a list, so this is about 500 000 nodes, more than a manifest of 64 MiB can list
#: leaves for; it bounds the memory a spec takes to decode (about 0.2 GiB at the limit).
MAX_SPEC_CONTAINERS = 1 << 20


def _strict_json(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        raise SpecError(f"{what}: expected a JSON string, found {type(text).__name__}")
    try:
        return strict_loads(text, max_depth=2 * MAX_TREE_DEPTH + 4, max_containers=MAX_SPEC_CONTAINERS,
                            max_separators=4 * MAX_SPEC_CONTAINERS)
    except ValueError as e:
        raise SpecError(f"{what}: not valid JSON within bounds ({type(e).__name__}: {str(e)[:200]})") from None


def _dict_key(k: Any, where: str) -> Any:
    if k is None or isinstance(k, (str, int, float, bool)):
        return k
    if isinstance(k, dict) and k.get("__enum__") is True and isinstance(k.get("fqn"), str) and isinstance(k.get("name"), str):
        return f"{k['fqn']}.{k['name']}"  # an Enum key, kept as its name: rebuilding it would import its module
    if isinstance(k, list):
        return tuple(_dict_key(x, where) for x in k)
    raise SpecError(f"{where}: a dict key of JSON type {type(k).__name__} ({str(k)[:80]})")


def _keys(ctx: Any, n: int, where: str) -> tuple:
    if not isinstance(ctx, list) or len(ctx) != n:
        raise SpecError(f"{where}: expected a list of {n} dict keys, found {str(ctx)[:120]}")
    keys = tuple(_dict_key(k, where) for k in ctx)
    try:
        if len(set(keys)) != n:
            raise SpecError(f"{where}: duplicate dict keys")
    except TypeError:
        raise SpecError(f"{where}: unhashable dict keys") from None
    return keys


def _decode_node(obj: Any, depth: int, where: str) -> SpecNode:
    if not isinstance(obj, dict) or set(obj) != {"type", "context", "children_spec"}:
        raise SpecError(f"{where}: expected a node {{'type', 'context', 'children_spec'}}, found {str(obj)[:120]}")
    typ, ctx, kids = obj["type"], obj["context"], obj["children_spec"]
    if not isinstance(kids, list):
        raise SpecError(f"{where}: 'children_spec' must be a list")
    if typ is None:
        if ctx is not None or kids:
            raise SpecError(f"{where}: a leaf has no context and no children")
        return SpecNode("leaf", None, (), 1)
    if not isinstance(typ, str):
        raise SpecError(f"{where}: node type must be a string or null, found {type(typ).__name__}")
    if depth >= MAX_TREE_DEPTH:
        raise SpecError(f"{where}: containers nested deeper than {MAX_TREE_DEPTH} levels")
    children = tuple(_decode_node(c, depth + 1, f"{where}.{i}") for i, c in enumerate(kids))
    n = len(children)
    leaves = sum(c.leaves for c in children)
    if typ in _SEQUENCE_TYPES:
        return _sequence_node(typ, ctx, children, leaves, where)
    if typ in _MAPPING_TYPES:
        return SpecNode(_MAPPING_TYPES[typ], _keys(_strict_json(ctx, where), n, where), children, leaves)
    decode = _CONTEXT_DECODERS.get(typ)
    if decode is not None:
        return decode(ctx, children, leaves, where)
    logger.info("%s: tree node type %r is not one nanreplay writes; it is read as a list of its children", where, typ[:200])
    return SpecNode("other", typ[:200], children, leaves)


def _sequence_node(typ: str, ctx: Any, children: tuple, leaves: int, where: str) -> SpecNode:
    """A tuple, list or torch.Size node: no context; a torch.Size holds only leaves."""
    if ctx not in (None, "null"):
        raise SpecError(f"{where}: a {typ} node has no context, found {str(ctx)[:80]}")
    kind = _SEQUENCE_TYPES[typ]
    if kind == "size" and any(c.kind != "leaf" for c in children):
        raise SpecError(f"{where}: a torch.Size holds only leaves")
    return SpecNode(kind, None, children, leaves)


def _ddict_node(ctx: Any, children: tuple, leaves: int, where: str) -> SpecNode:
    """A defaultdict node: its keys, and its factory only when it is a safe builtin (nothing is
    imported from a bundle)."""
    if not isinstance(ctx, dict) or set(ctx) != {"default_factory_module", "default_factory_name", "dict_context"}:
        raise SpecError(f"{where}: a defaultdict context is {{'default_factory_module', 'default_factory_name', 'dict_context'}}")
    factory = None
    if ctx["default_factory_module"] == "builtins" and isinstance(ctx["default_factory_name"], str):
        factory = _SAFE_DEFAULT_FACTORIES.get(ctx["default_factory_name"])
    if factory is None:
        logger.info("%s: defaultdict factory %s.%s is not rebuilt (no import from a bundle); the dict has none",
                    where, str(ctx["default_factory_module"])[:80], str(ctx["default_factory_name"])[:80])
    return SpecNode("ddict", (factory, _keys(ctx["dict_context"], len(children), where)), children, leaves)


def _deque_node(ctx: Any, children: tuple, leaves: int, where: str) -> SpecNode:
    """A deque node: its maxlen, null or an integer that holds the children."""
    n = len(children)
    maxlen = _strict_json(ctx, where)
    if maxlen is not None and not (isinstance(maxlen, int) and not isinstance(maxlen, bool) and 0 <= maxlen < 2**31):
        raise SpecError(f"{where}: a deque's maxlen must be null or a non-negative integer, found {str(maxlen)[:40]}")
    if maxlen is not None and maxlen < n:
        raise SpecError(f"{where}: a deque of maxlen {maxlen} cannot hold {n} children")
    return SpecNode("deque", maxlen, children, leaves)


def _typed_node(ctx: Any, children: tuple, leaves: int, where: str) -> SpecNode:
    """A namedtuple or dataclass node: ``['module:QualName', kind, [unique field names]]``; the
    class is named, never imported here."""
    n = len(children)
    ok = (isinstance(ctx, list) and len(ctx) == 3 and isinstance(ctx[0], str) and ctx[1] in _TYPED_KINDS
          and isinstance(ctx[2], list) and len(ctx[2]) == n and all(isinstance(x, str) for x in ctx[2])
          and len(set(ctx[2])) == n)
    if not ok or len(ctx[0]) > 1000 or ":" not in ctx[0]:
        raise SpecError(f"{where}: a typed node's context is ['module:QualName', 'namedtuple'|'dataclass', [{n} unique field names]], found {str(ctx)[:160]}")
    return SpecNode("typed", (ctx[0], ctx[1], tuple(ctx[2])), children, leaves)


#: how the context of each container type with one is read (sequences and mappings aside)
_CONTEXT_DECODERS: dict[str, Callable[[Any, tuple, int, str], SpecNode]] = {
    "collections.defaultdict": _ddict_node,
    "collections.deque": _deque_node,
    _TYPED_NAME: _typed_node,
}


def decode_spec(spec_json: Any) -> SpecNode:
    """Validate and decode a stored tree spec (``treespec_dumps`` JSON, protocol 1) without
    importing or calling anything it names.

    Raises:
        SpecError: malformed JSON or structure, an unsupported protocol, nesting deeper than
            :data:`MAX_TREE_DEPTH`.
    """
    doc = _strict_json(spec_json, "tree spec")
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] == 1 and not isinstance(doc[0], bool)):
        raise SpecError(f"tree spec: expected [1, <root node>] (pytree serialization protocol 1), found {str(doc)[:120]}")
    try:
        return _decode_node(doc[1], 0, "tree spec: root")
    except RecursionError:
        raise SpecError("tree spec: nested too deeply") from None


def spec_types(node: SpecNode) -> list[str]:
    """The ``module:QualName`` of every typed node in a decoded spec, in order, without repeats."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n.kind == "typed" and n.context[0] not in out:
            out.append(n.context[0])
        stack.extend(reversed(n.children))
    return out


def _build(node: SpecNode, leaves: Iterator[Any], types: Mapping[str, type], keep_typed: bool = False) -> Any:
    if node.kind == "leaf":
        return next(leaves)
    children = [_build(c, leaves, types, keep_typed) for c in node.children]
    kind, ctx = node.kind, node.context
    if kind == "tuple":
        return tuple(children)
    if kind in ("list", "other"):
        return children
    if kind == "size":
        return torch.Size(children) if all(isinstance(c, int) and not isinstance(c, bool) for c in children) else tuple(children)
    if kind == "dict":
        return dict(zip(ctx, children))
    if kind == "odict":
        return collections.OrderedDict(zip(ctx, children))
    if kind == "ddict":
        out = collections.defaultdict(ctx[0])
        out.update(zip(ctx[1], children))
        return out
    if kind == "deque":
        return collections.deque(children, maxlen=ctx)
    path, tkind, names = ctx
    if keep_typed:
        return TypedNode(path, tkind, dict(zip(names, children)))
    return _rebuild(path, tkind, dict(zip(names, children)), types)


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


_SCALARS = frozenset((int, float, str, bool, bytes, type(None)))
_PLAIN_DEPTH = 8
_Tensor = torch.Tensor


def _plain(x: Any, depth: int = 0) -> bool:
    """Whether ``x`` is a tree of exact ``tuple`` / ``list`` / ``dict`` nodes with tensor and
    scalar leaves, at most :data:`_PLAIN_DEPTH` deep (subclasses such as namedtuples and
    ``OrderedDict``, dataclasses and other leaves are not: they go through pytree)."""
    if isinstance(x, _Tensor):
        return True
    kind = type(x)
    if kind is tuple or kind is list or kind is dict:
        if depth >= _PLAIN_DEPTH:
            return False
        for v in (x.values() if kind is dict else x):
            if not isinstance(v, _Tensor) and not _plain(v, depth + 1):  # a tensor child: no call
                return False
        return True
    return kind in _SCALARS


def _map_plain(fn: Any, x: Any) -> Any:
    """:func:`map_tensors` for a tree :func:`_plain` accepted (a tensor child is mapped in place, without a call)."""
    if isinstance(x, _Tensor):
        return fn(x)
    kind = type(x)
    if kind is tuple:
        return tuple([fn(v) if isinstance(v, _Tensor) else _map_plain(fn, v) for v in x])
    if kind is list:
        return [fn(v) if isinstance(v, _Tensor) else _map_plain(fn, v) for v in x]
    if kind is dict:
        return {k: fn(v) if isinstance(v, _Tensor) else _map_plain(fn, v) for k, v in x.items()}
    return x


def map_tensors(fn: Any, tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor, dataclass fields included (pytree alone
    treats a dataclass, e.g. a batch object, as one opaque leaf), rebuilding every container with
    its own type: a dataclass is copied and its fields set (frozen ones too, no ``__init__`` call),
    the rest goes through ``torch.utils._pytree.tree_map``. Non-tensor leaves pass unchanged.

    A tree made of plain ``tuple`` / ``list`` / ``dict`` around tensors and scalars (most batches
    and forward calls: the Recorder maps two per step) is mapped directly, without pytree's
    flatten and unflatten (about 1 µs instead of 8); the result is the same."""
    if _plain(tree):
        return _map_plain(fn, tree)

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


def unflatten_batch(leaves: list[Any], spec_json: str, *, types: Union[Iterable[type], Mapping[str, type], None] = None,
                    keep_typed: bool = False) -> Any:
    """Inverse of :func:`flatten_batch`, safe on untrusted specs: nothing named in the spec is
    imported or called. Namedtuples and dataclasses come back as dicts of their fields unless
    their type is in ``types`` (see :func:`accepted_types`), which rebuilds them as that type, or
    as :class:`TypedNode` with ``keep_typed=True`` (``types`` is then ignored).

    Raises:
        ValueError: the spec is malformed (see :func:`decode_spec`) or the leaf count differs.
        TypeError: ``types`` holds something other than dataclass types and namedtuple classes.
    """
    node = decode_spec(spec_json)
    if node.leaves != len(leaves):
        raise ValueError(f"the batch tree spec expects {node.leaves} leaves, the bundle holds {len(leaves)}")
    return _build(node, iter(leaves), accepted_types(types), keep_typed)


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


#: the unstorable types :func:`decode_value` has warned about in this process
_UNSTORABLE_SEEN: set[str] = set()


def decode_value(rec: Any) -> Any:
    """Inverse of :func:`encode_value`; an unrestorable object comes back as its repr string.

    Raises:
        ValueError: ``rec`` is not a record :func:`encode_value` writes.
    """
    if isinstance(rec, dict) and len(rec) == 1 and "json" in rec:
        return rec["json"]
    if isinstance(rec, dict) and len(rec) == 1 and rec.get("float") in ("nan", "inf", "-inf"):
        return float(rec["float"])
    if isinstance(rec, dict) and set(rec) == {"repr", "type"} and isinstance(rec["repr"], str) and isinstance(rec["type"], str):
        kind = rec["type"][:200]
        if kind not in _UNSTORABLE_SEEN:  # once per type and process: a replay decodes every step held
            _UNSTORABLE_SEEN.add(kind)
            logger.warning("a recorded value of type %s (in a batch or a forward's inputs) was not storable; replay gets its repr string", kind)
        return rec["repr"]
    raise ValueError(f"a leaf value record must be {{'json': v}}, {{'float': 'nan'|'inf'|'-inf'}} or {{'repr', 'type'}}; found {str(rec)[:120]}")


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


def tree_from_flat(get, record: dict, prefix: str, *, types: Union[Iterable[type], Mapping[str, type], None] = None) -> Any:
    """Inverse of :func:`tree_to_flat`; ``get(key)`` returns a stored tensor. Nothing named in
    the record is imported: typed nodes are rebuilt only as the types in ``types`` (see
    :func:`unflatten_batch`), else returned as dicts of their fields.

    Raises:
        ValueError: the record is malformed (wrong leaf count, bad spec, a key outside ``prefix``).
    """
    if not isinstance(record, dict):
        raise ValueError(f"a tree record must be a JSON object, found {type(record).__name__}")
    n = record["n"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"a tree record's 'n' must be a non-negative integer, found {str(n)[:40]}")
    values = record.get("values", {})
    keys = record.get("keys", {})
    if not isinstance(values, dict) or not isinstance(keys, dict) or len(values) + len(keys) != n:
        raise ValueError(f"a tree record's 'keys' and 'values' must cover its {n} leaves exactly")
    node = decode_spec(record["spec"])
    if node.leaves != n:
        raise ValueError(f"the tree spec has {node.leaves} leaves, the record says {n}")
    leaves = []
    for i in range(n):
        if str(i) in values:
            leaves.append(decode_value(values[str(i)]))
            continue
        key = keys.get(str(i))
        if not isinstance(key, str) or not key.startswith(prefix):
            raise ValueError(f"leaf {i} points at {str(key)[:200]!r}, outside {prefix!r}")
        leaves.append(get(key))
    return _build(node, iter(leaves), accepted_types(types))
