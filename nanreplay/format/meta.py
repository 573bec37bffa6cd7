"""The schema of a step bundle's metadata (``manifest["meta"]``), checked when a bundle is opened.

:func:`validate_step_meta` checks every field that nanreplay reads (types, ranges, string
lengths, the tree specs of batches, inputs, cotangents and optimizer states, the allowlist rules),
and that every tensor the metadata refers to exists in the file with a plausible dtype and
shape (RNG states, tree leaves, weights, buffers, gradients), before anything else reads them.
After it passed, the readers in :mod:`nanreplay.format.bundle` can index the metadata without
guarding each access, and a damaged or hostile file fails in one place, with one message.

Unknown keys are allowed (a newer writer may add some) and are never interpreted; they are
bounded like the rest of the manifest (size, nesting depth). The layout is specified in
``docs/bundle-format.md`` ("Logical layout").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..core.allowlist import AllowRule
from ..core.tree import SpecError, SpecNode, decode_spec, spec_types

__all__ = ["MetaError", "InfoFn", "MetaFacts", "validate_step_meta", "MAX_STEPS", "MAX_NAME"]

#: Longest string accepted where nanreplay reads a name (an FQN, an import path, a key).
MAX_NAME = 4096
#: Most ring-buffer steps, forwards per step and batches per step accepted.
MAX_STEPS = 100_000
_MAX_INT = 2**63 - 1
_FNUM_STRINGS = ("nan", "inf", "-inf")
_AUTOCAST_DTYPES = ("float16", "bfloat16", "float32")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_CACHED_SPEC = 1 << 16
_SCALER_FIELDS = {"scale": (int, float), "growth_factor": (int, float), "backoff_factor": (int, float),
                  "growth_interval": (int,), "_growth_tracker": (int,)}


class MetaError(ValueError):
    """The metadata violates the schema: ``where`` (e.g. ``meta.steps[0].rng``), what was
    expected and what was found."""

    def __init__(self, where: str, expected: str, found: str) -> None:
        self.where, self.expected, self.found = where, expected, found
        super().__init__(f"{where}: expected {expected}, found {found}")


#: ``info(key)`` -> ``(torch dtype, shape)`` of a stored tensor, or ``None`` when absent.
InfoFn = Callable[[str], Optional[tuple[torch.dtype, tuple[int, ...]]]]


@dataclass
class MetaFacts:
    """What validation learnt, for the readers: the small decoded tree specs (by their JSON text)
    and the typed-node types each tree records (``where`` -> ``module:QualName`` list)."""

    specs: dict[str, SpecNode] = field(default_factory=dict)
    types: dict[str, list[str]] = field(default_factory=dict)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


def _kind(v: Any) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


class _Checker:
    def __init__(self, info: InfoFn) -> None:
        self.info = info
        self.facts = MetaFacts()

    # -- scalars ---------------------------------------------------------------------------
    def obj(self, v: Any, where: str, required: tuple[str, ...] = ()) -> dict:
        if not isinstance(v, dict):
            raise MetaError(where, "an object", _kind(v))
        missing = [k for k in required if k not in v]
        if missing:
            raise MetaError(where, f"the fields {list(required)}", f"no {missing}")
        return v

    def array(self, v: Any, where: str, max_len: int = MAX_STEPS) -> list:
        if not isinstance(v, list):
            raise MetaError(where, "a list", _kind(v))
        if len(v) > max_len:
            raise MetaError(where, f"at most {max_len} entries", f"{len(v)}")
        return v

    def integer(self, v: Any, where: str, lo: int = 0, hi: int = _MAX_INT, *, null: bool = False) -> Optional[int]:
        if v is None and null:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise MetaError(where, f"an integer in [{lo}, {hi}]" + (" or null" if null else ""), _show(v))
        return v

    def string(self, v: Any, where: str, *, null: bool = False, max_len: int = MAX_NAME) -> Optional[str]:
        if v is None and null:
            return None
        if not isinstance(v, str) or len(v) > max_len:
            raise MetaError(where, f"a string of at most {max_len} characters" + (" or null" if null else ""), _kind(v) if not isinstance(v, str) else f"{len(v)} characters")
        return v

    def boolean(self, v: Any, where: str, *, null: bool = True) -> Optional[bool]:
        if (v is None and null) or isinstance(v, bool):
            return v
        raise MetaError(where, "true, false" + (" or null" if null else ""), _show(v))

    def fnum(self, v: Any, where: str, *, null: bool = True) -> None:
        """A float as :func:`nanreplay.core.jsonable.fnum` writes it: a number, one of the
        strings 'nan', 'inf', '-inf', or (``null``: where the writer may leave it out) null."""
        if (v is None and null) or (isinstance(v, str) and v in _FNUM_STRINGS):
            return
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return
        raise MetaError(where, "a finite number, 'nan', 'inf', '-inf'" + (" or null" if null else ""), _show(v))

    def names(self, v: Any, where: str, max_len: int = 10_000_000) -> list[str]:
        for i, n in enumerate(self.array(v, where, max_len)):
            self.string(n, f"{where}[{i}]")
        if len(set(v)) != len(v):
            raise MetaError(where, "names without repeats", "a repeated name")
        return v

    # -- tensors ---------------------------------------------------------------------------
    def tensor(self, key: str, where: str, *, dtype: Optional[torch.dtype] = None, shape: Optional[tuple] = None,
               ndim: Optional[int] = None) -> tuple[torch.dtype, tuple[int, ...]]:
        found = self.info(key)
        if found is None:
            raise MetaError(where, f"tensor {key[:200]!r} (the metadata refers to it)", "no such tensor in the file")
        t_dtype, t_shape = found
        if (dtype is not None and t_dtype != dtype) or (shape is not None and t_shape != shape) or (ndim is not None and len(t_shape) != ndim):
            want = " ".join(x for x in (str(dtype).replace("torch.", "") if dtype else "", str(list(shape)) if shape is not None else (f"{ndim}-D" if ndim is not None else "")) if x)
            raise MetaError(where, f"tensor {key[:200]!r} of {want}", f"{str(t_dtype).replace('torch.', '')} {list(t_shape)}")
        return found

    # -- records ---------------------------------------------------------------------------
    def rng(self, v: Any, where: str, prefix: str) -> None:
        m = self.obj(v, where, ("python_version", "numpy_name", "numpy_pos", "numpy_has_gauss", "numpy_cached_gaussian"))
        self.integer(m["python_version"], f"{where}.python_version", 0, 255)
        g = m.get("python_gauss_next")
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool)):
            raise MetaError(f"{where}.python_gauss_next", "a number or null", _show(g))
        if m["numpy_name"] != "MT19937":
            raise MetaError(f"{where}.numpy_name", "'MT19937'", _show(m["numpy_name"]))
        self.integer(m["numpy_pos"], f"{where}.numpy_pos", 0, 624)
        self.integer(m["numpy_has_gauss"], f"{where}.numpy_has_gauss", 0, 1)
        c = m["numpy_cached_gaussian"]
        if not (isinstance(c, (int, float)) and not isinstance(c, bool)):
            raise MetaError(f"{where}.numpy_cached_gaussian", "a number", _show(c))
        devices = self.integer(m.get("cuda_devices", 0), f"{where}.cuda_devices", 0, 1024)
        self.tensor(f"{prefix}python", where, dtype=torch.int64, shape=(625,))
        self.tensor(f"{prefix}numpy", where, dtype=torch.int64, shape=(624,))
        self.tensor(f"{prefix}torch_cpu", where, dtype=torch.uint8, ndim=1)
        for i in range(devices or 0):
            self.tensor(f"{prefix}cuda/{i}", where, dtype=torch.uint8, ndim=1)

    def tree(self, v: Any, where: str, prefix: str, *, root: Optional[str] = None) -> SpecNode:
        m = self.obj(v, where, ("spec", "n"))
        n = self.integer(m["n"], f"{where}.n", 0, 10**8)
        spec = self.string(m["spec"], f"{where}.spec", max_len=1 << 26)
        node = self.facts.specs.get(spec)
        if node is None:
            try:
                node = decode_spec(spec)
            except SpecError as e:
                raise MetaError(f"{where}.spec", "a valid tree spec", str(e)) from None
            if len(spec) <= _CACHED_SPEC:  # the same small specs repeat (a batch per step); large ones are decoded again
                self.facts.specs[spec] = node
        if node.leaves != n:
            raise MetaError(f"{where}.n", f"the spec's leaf count {node.leaves}", str(n))
        keys, values = m.get("keys", {}), m.get("values", {})
        self.obj(keys, f"{where}.keys")
        self.obj(values, f"{where}.values")
        if len(keys) + len(values) != n:
            raise MetaError(where, f"'keys' and 'values' covering its {n} leaves exactly", f"{len(keys)} keys and {len(values)} values")
        for i, key in keys.items():
            if not (i.isdigit() and int(i) < n and str(int(i)) == i) or i in values:
                raise MetaError(f"{where}.keys", f"leaf indices in [0, {n}) not also in 'values'", _show(i))
            if not isinstance(key, str) or not key.startswith(prefix):
                raise MetaError(f"{where}.keys[{i}]", f"a tensor key under {prefix!r}", _show(key))
            self.tensor(key, f"{where}.keys[{i}]")
        for i, rec in values.items():
            if not (i.isdigit() and int(i) < n and str(int(i)) == i):
                raise MetaError(f"{where}.values", f"leaf indices in [0, {n})", _show(i))
            ok = isinstance(rec, dict) and (
                (len(rec) == 1 and "json" in rec)
                or (len(rec) == 1 and rec.get("float") in _FNUM_STRINGS)
                or (set(rec) == {"repr", "type"} and isinstance(rec["repr"], str) and isinstance(rec["type"], str)))
            if not ok:
                raise MetaError(f"{where}.values[{i}]", "{'json': v}, {'float': 'nan'|'inf'|'-inf'} or {'repr': str, 'type': str}", _show(rec))
        if root == "inputs" and not (node.kind == "tuple" and len(node.children) == 2
                                     and node.children[0].kind in ("tuple", "list") and node.children[1].kind in ("dict", "odict", "ddict")):
            raise MetaError(f"{where}.spec", "(args, kwargs): a tuple of a tuple and a dict", f"a {node.kind} node")
        types = spec_types(node)
        if types:
            self.facts.types[where] = types
        return node

    def optimizer_state(self, v: Any, where: str, prefix: str, groups: Optional[list]) -> None:
        node = self.tree(v, where, prefix)
        # a state_dict(): {"state": {...}, "param_groups": [{..., "params": [ids]}, ...]}
        if node.kind not in ("dict", "odict") or set(node.context) != {"state", "param_groups"}:
            raise MetaError(f"{where}.spec", "an optimizer state_dict() with 'state' and 'param_groups'", f"a {node.kind} node")
        pg = node.children[list(node.context).index("param_groups")]
        if pg.kind not in ("list", "tuple") or any(g.kind not in ("dict", "odict") or "params" not in g.context for g in pg.children):
            raise MetaError(f"{where}.spec", "'param_groups' as a list of dicts with 'params'", "another structure")
        if groups is not None and len(pg.children) != len(groups):
            raise MetaError(where, f"{len(groups)} param groups (as meta.optimizer.param_groups_fqns)", f"{len(pg.children)}")

    def scaler_state(self, v: Any, where: str, prefix: str) -> None:
        node = self.tree(v, where, prefix)
        if node.kind not in ("dict", "odict") or any(c.kind != "leaf" for c in node.children):
            raise MetaError(f"{where}.spec", "a GradScaler state_dict(): a flat dict", f"a {node.kind} node")
        if not node.context:
            return  # a disabled scaler's state_dict() is empty
        unknown = set(node.context) - set(_SCALER_FIELDS)
        if unknown or len(node.context) != len(_SCALER_FIELDS):
            raise MetaError(f"{where}.spec", f"the keys {sorted(_SCALER_FIELDS)}", _show(sorted(map(str, node.context))))
        values = v.get("values", {})
        for i, name in enumerate(node.context):
            rec = values.get(str(i))
            value = rec.get("json") if isinstance(rec, dict) and "json" in rec else (float(rec["float"]) if isinstance(rec, dict) and "float" in rec else None)
            if not isinstance(value, _SCALER_FIELDS[name]) or isinstance(value, bool):
                raise MetaError(f"{where}.values", f"{name} as {' or '.join(t.__name__ for t in _SCALER_FIELDS[name])}", _show(rec))

    def snapshot(self, v: Any, where: str, prefix: str, groups: Optional[list], params_info: dict) -> list[str]:
        m = self.obj(v, where, ("params", "buffers"))
        params = self.names(m["params"], f"{where}.params")
        for k in params:
            dtype, shape = self.tensor(f"{prefix}params/{k}", f"{where}.params")
            rec = params_info.get(k)
            if rec is not None and (list(shape) != rec["shape"] or str(dtype).replace("torch.", "") != rec["dtype"]):
                raise MetaError(f"{where}.params", f"parameter {k[:200]!r} as meta.model.params says ({rec['dtype']} {rec['shape']})",
                                f"{str(dtype).replace('torch.', '')} {list(shape)}")
        for k in self.names(m["buffers"], f"{where}.buffers"):
            self.tensor(f"{prefix}buffers/{k}", f"{where}.buffers")
        if m.get("optimizer") is not None:
            self.optimizer_state(m["optimizer"], f"{where}.optimizer", f"{prefix}optimizer/", groups)
        extra = self.obj(m.get("extra", {}), f"{where}.extra")
        for name, rec in extra.items():
            self.string(name, f"{where}.extra")
            if name == "scaler":
                self.scaler_state(rec, f"{where}.extra[{name!r}]", f"{prefix}extra/{name}/")
            else:
                self.tree(rec, f"{where}.extra[{name[:100]!r}]", f"{prefix}extra/{name}/")
        return params

    def step(self, v: Any, where: str, groups: Optional[list], params_info: dict) -> int:
        m = self.obj(v, where, ("step", "rng", "forwards", "batches", "lrs"))
        k = self.integer(m["step"], f"{where}.step")
        p = f"steps/{k}/"
        self.rng(m["rng"], f"{where}.rng", f"{p}rng/")
        for i, fw in enumerate(self.array(m["forwards"], f"{where}.forwards")):
            fw = self.obj(fw, f"{where}.forwards[{i}]", ("inputs",))
            self.tree(fw["inputs"], f"{where}.forwards[{i}].inputs", f"{p}forward/{i}/inputs/", root="inputs")
            if fw.get("cotangent") is not None:
                self.tree(fw["cotangent"], f"{where}.forwards[{i}].cotangent", f"{p}forward/{i}/cotangent/")
            if fw.get("rng") is not None:
                self.rng(fw["rng"], f"{where}.forwards[{i}].rng", f"{p}forward/{i}/rng/")
        for i, b in enumerate(self.array(m["batches"], f"{where}.batches")):
            self.tree(b, f"{where}.batches[{i}]", f"{p}batch/{i}/")
        self.names(m.get("training", []), f"{where}.training")
        for i, lr in enumerate(self.array(m["lrs"], f"{where}.lrs")):
            self.fnum(lr, f"{where}.lrs[{i}]")
        self.fnum(m.get("loss"), f"{where}.loss")
        self.fnum(m.get("grad_norm"), f"{where}.grad_norm")
        self.fnum(m.get("grad_norm_pre_clip"), f"{where}.grad_norm_pre_clip")
        self.boolean(m.get("finite"), f"{where}.finite")
        self.boolean(m.get("stale_inputs", False), f"{where}.stale_inputs")
        self.boolean(m.get("scaler_skipped"), f"{where}.scaler_skipped")
        if m.get("buffers") is not None:
            for b in self.names(m["buffers"], f"{where}.buffers"):
                self.tensor(f"{p}buffers/{b}", f"{where}.buffers")
        if m.get("snapshot") is not None:
            self.snapshot(m["snapshot"], f"{where}.snapshot", f"{p}snapshot/", groups, params_info)
        ac = m.get("autocast")
        if ac is not None:
            ac = self.obj(ac, f"{where}.autocast", ("device_type", "dtype"))
            if not (isinstance(ac["device_type"], str) and _DEVICE.fullmatch(ac["device_type"]) and ac["dtype"] in _AUTOCAST_DTYPES):
                raise MetaError(f"{where}.autocast", f"{{'device_type': a device type, 'dtype': one of {list(_AUTOCAST_DTYPES)}}}", _show(ac))
        return k

    def tensors_info(self, v: Any, where: str) -> dict:
        m = self.obj(v, where)
        for name, rec in m.items():
            self.string(name, f"{where}")
            rec = self.obj(rec, f"{where}[{name[:100]!r}]", ("shape", "dtype", "device"))
            shape = self.array(rec["shape"], f"{where}[{name[:100]!r}].shape", 64)
            for d in shape:
                self.integer(d, f"{where}[{name[:100]!r}].shape")
            self.string(rec["dtype"], f"{where}[{name[:100]!r}].dtype", max_len=64)
            if not (isinstance(rec["device"], str) and _DEVICE.fullmatch(rec["device"])):
                raise MetaError(f"{where}[{name[:100]!r}].device", "a device such as 'cpu' or 'cuda:0'", _show(rec["device"]))
        return m


#: placements a sharded bundle may record: sharded on a dim, replicated, partial
_PLACEMENT = re.compile(r"S\(\d{1,3}\)|R|P")
#: a sibling bundle's file name: a plain name in the same directory (no separator, not . or ..)
_SIBLING = re.compile(r"[^/\\\x00]{1,255}")


def _check_origin(c: "_Checker", d: dict, where: str) -> None:
    """The optional origin keys of a ``distributed`` entry (format 2, additive): ``rank_flags``,
    ``state_ranks``, ``clean``, ``detection``, ``state_origin``."""
    for key in ("rank_flags", "state_ranks"):
        for i, x in enumerate(c.array(d.get(key) or [], f"{where}.{key}", 1_000_000)):
            c.integer(x, f"{where}.{key}[{i}]")
    c.boolean(d.get("clean"), f"{where}.clean")
    if d.get("detection") is not None:
        det = c.obj(d["detection"], f"{where}.detection")
        for key in ("on", "this_step"):
            c.boolean(det.get(key), f"{where}.detection.{key}")
        for key in ("method", "why_off"):
            c.string(det.get(key), f"{where}.detection.{key}", null=True, max_len=1 << 12)
    if d.get("state_origin") is not None:
        so = c.obj(d["state_origin"], f"{where}.state_origin", ("kind", "fqn", "local_index", "global_index"))
        for key in ("kind", "fqn", "key", "value"):
            c.string(so.get(key), f"{where}.state_origin.{key}", null=True)
        for key in ("local_index", "global_index", "local_shape", "global_shape"):
            for i, x in enumerate(c.array(so.get(key) or [], f"{where}.state_origin.{key}", 64)):
                c.integer(x, f"{where}.state_origin.{key}[{i}]")
        for i, pl in enumerate(c.array(so.get("placements") or [], f"{where}.state_origin.placements", 16)):
            if not (isinstance(pl, str) and _PLACEMENT.fullmatch(pl)):
                raise MetaError(f"{where}.state_origin.placements[{i}]", "'S(dim)', 'R' or 'P'", _show(pl))


def _check_sharded(c: "_Checker", d: dict, where: str) -> None:
    """The optional keys of a distributed run's ``distributed`` entry (format 2, additive):
    ``run_id``, ``siblings`` (every run's); ``mesh``, ``coordinate``, ``coordinates``,
    ``origin_coordinates``, ``sharding`` (a sharded run's)."""
    _check_origin(c, d, where)
    c.string(d.get("run_id"), f"{where}.run_id", null=True, max_len=64)
    for i, n in enumerate(c.array(d.get("siblings", []), f"{where}.siblings", 1_000_000)):
        if not (isinstance(n, str) and _SIBLING.fullmatch(n) and n not in (".", "..")):
            raise MetaError(f"{where}.siblings[{i}]", "a file name in the bundle's directory (no path separator)", _show(n))
    for i, x in enumerate(c.array(d.get("coordinate", []), f"{where}.coordinate", 16)):
        c.integer(x, f"{where}.coordinate[{i}]")
    if d.get("mesh") is not None:
        mesh = c.obj(d["mesh"], f"{where}.mesh")
        for i, x in enumerate(c.array(mesh.get("shape", []), f"{where}.mesh.shape", 16)):
            c.integer(x, f"{where}.mesh.shape[{i}]", 1)
    for r, coord in c.obj(d.get("coordinates") or {}, f"{where}.coordinates").items():
        for i, x in enumerate(c.array(coord, f"{where}.coordinates[{r!r}]", 16)):
            c.integer(x, f"{where}.coordinates[{r!r}][{i}]")
    if d.get("sharding") is None:
        return
    sh = c.obj(d["sharding"], f"{where}.sharding")
    params = c.obj(sh.get("params") or {}, f"{where}.sharding.params")
    for name, lay in params.items():
        w = f"{where}.sharding.params[{name!r}]"
        c.string(name, w)
        lay = c.obj(lay, w, ("global_shape", "local_shape", "offsets", "placements"))
        shapes = [c.array(lay[k], f"{w}.{k}", 64) for k in ("global_shape", "local_shape", "offsets")]
        if len({len(x) for x in shapes}) != 1:
            raise MetaError(w, "global_shape, local_shape and offsets of the same length", _show([len(x) for x in shapes]))
        for g, n, o in zip(*shapes):
            for k, v in (("global_shape", g), ("local_shape", n), ("offsets", o)):
                c.integer(v, f"{w}.{k}")
            if n + o > g:
                raise MetaError(w, "each shard inside the global shape (offset + local size <= global size)", _show(lay))
        for i, pl in enumerate(c.array(lay["placements"], f"{w}.placements", 16)):
            if not (isinstance(pl, str) and _PLACEMENT.fullmatch(pl)):
                raise MetaError(f"{w}.placements[{i}]", "'S(dim)', 'R' or 'P'", _show(pl))
    for k, v in c.obj(sh.get("optimizer") or {}, f"{where}.sharding.optimizer").items():
        c.string(k, f"{where}.sharding.optimizer")
        if v not in params:
            raise MetaError(f"{where}.sharding.optimizer[{k!r}]", "a parameter listed in sharding.params", _show(v))


def _scalar_history(c: "_Checker", v: Any) -> None:
    """``meta.scalar_history``: five lists of one length, and the optional ``scale`` and
    ``grad_norm_pre_clip``, oldest first (docs/bundle-format.md)."""
    where = "meta.scalar_history"
    h = c.obj(v, where, ("step", "loss", "grad_norm", "lrs", "finite"))
    optional = [k for k in ("scale", "grad_norm_pre_clip") if h.get(k) is not None]
    cols = {k: c.array(h[k], f"{where}.{k}") for k in ("step", "loss", "grad_norm", "lrs", "finite", *optional)}
    n = len(cols["step"])
    for k, col in cols.items():
        if len(col) != n:
            raise MetaError(f"{where}.{k}", f"{n} entries, one per entry of {where}.step", f"{len(col)}")
    last = -1
    for i in range(n):
        s = c.integer(cols["step"][i], f"{where}.step[{i}]")
        if s <= last:
            raise MetaError(f"{where}.step[{i}]", f"increasing step numbers (after {last})", str(s))
        last = s
        c.fnum(cols["loss"][i], f"{where}.loss[{i}]")
        c.fnum(cols["grad_norm"][i], f"{where}.grad_norm[{i}]")
        for k in optional:
            c.fnum(cols[k][i], f"{where}.{k}[{i}]")
        lrs = c.array(cols["lrs"][i], f"{where}.lrs[{i}]", 1_000_000)
        for j, lr in enumerate(lrs):
            if lr is None:
                raise MetaError(f"{where}.lrs[{i}][{j}]", "a float", "null")
            c.fnum(lr, f"{where}.lrs[{i}][{j}]")
        c.boolean(cols["finite"][i], f"{where}.finite[{i}]")


def _compile_state(c: "_Checker", v: Any) -> None:
    """``meta.compile``: the recording's torch.compile state (docs/bundle-format.md). Only read
    here; which backend a replay may run from it is the engine's allowlist
    (:data:`nanreplay.engine.compiled.BUNDLE_BACKENDS`)."""
    where = "meta.compile"
    st = c.obj(v, where, ("compiled", "backend", "mode", "modules"))
    c.boolean(st["compiled"], f"{where}.compiled", null=False)
    c.string(st["backend"], f"{where}.backend", null=True, max_len=512)
    c.string(st["mode"], f"{where}.mode", null=True, max_len=64)
    c.names(st["modules"], f"{where}.modules", 256)
    # optional (older bundles lack them): torch.compile's dynamic and fullgraph, the inductor options
    c.boolean(st.get("dynamic"), f"{where}.dynamic")
    c.boolean(st.get("fullgraph"), f"{where}.fullgraph")
    if st.get("options") is not None:
        opts = c.obj(st["options"], f"{where}.options")
        if len(opts) > 512:
            raise MetaError(f"{where}.options", "at most 512 options", f"{len(opts)}")
        for k, val in opts.items():
            c.string(k, f"{where}.options", max_len=128)
            if isinstance(val, str):
                c.string(val, f"{where}.options[{k!r}]", max_len=512)
            elif not (isinstance(val, (bool, int)) or (isinstance(val, float) and math.isfinite(val))):
                raise MetaError(f"{where}.options[{k!r}]", "a boolean, a number or a string", _show(val))


def _flat_obj(c: "_Checker", v: Any, where: str, max_keys: int, check: Callable[[Any, str], None], max_key: int = 128) -> dict:
    """An object of at most ``max_keys`` keys of at most ``max_key`` characters, each value passing ``check``."""
    o = c.obj(v, where)
    if len(o) > max_keys:
        raise MetaError(where, f"at most {max_keys} entries", f"{len(o)}")
    for k, val in o.items():
        c.string(k, where, max_len=max_key)
        check(val, f"{where}[{k[:100]!r}]")
    return o


def _setting_value(c: "_Checker", v: Any, where: str, *, lists: bool = True) -> None:
    """A recorded setting's value: null, a boolean, an integer, a float (as ``core.jsonable``
    writes it), a string of at most 512 characters, or (``lists``) a list of at most 16 of these."""
    if v is None or isinstance(v, (bool, int)):
        return
    if isinstance(v, float) or (isinstance(v, str) and v in _FNUM_STRINGS):
        c.fnum(v, where)
        return
    if isinstance(v, str):
        c.string(v, where, max_len=512)
        return
    if lists and isinstance(v, list):
        for i, x in enumerate(c.array(v, where, 16)):
            _setting_value(c, x, f"{where}[{i}]", lists=False)
        return
    raise MetaError(where, "null, a boolean, a number, a string" + (" or a list of at most 16 of these" if lists else ""), _show(v))


def _environment(c: "_Checker", v: Any) -> None:
    """``meta.environment``: the recording process's versions, numerics flags and environment
    variables (:mod:`nanreplay.format.environment`); every key optional (older bundles lack the
    newer ones), every string bounded."""
    where = "meta.environment"
    env = c.obj(v, where)
    for k in ("nanreplay", "torch", "numpy", "python", "platform", "cuda"):
        c.string(env.get(k), f"{where}.{k}", null=True, max_len=256)
    c.boolean(env.get("cuda_available"), f"{where}.cuda_available")
    c.integer(env.get("cudnn"), f"{where}.cudnn", null=True)
    c.integer(env.get("num_threads"), f"{where}.num_threads", 0, 1 << 20, null=True)
    if env.get("libraries") is not None:
        _flat_obj(c, env["libraries"], f"{where}.libraries", 64, lambda x, w: c.string(x, w, max_len=128))
    if env.get("determinism") is not None:
        _flat_obj(c, env["determinism"], f"{where}.determinism", 32, lambda x, w: c.boolean(x, w))
    if env.get("numerics") is not None:
        _flat_obj(c, env["numerics"], f"{where}.numerics", 64, lambda x, w: _setting_value(c, x, w, lists=False), 64)
    if env.get("variables") is not None:
        _flat_obj(c, env["variables"], f"{where}.variables", 256, lambda x, w: c.string(x, w, null=True, max_len=1024))


_DATA_SOURCES = ("batches", "inputs")


def _run_config(c: "_Checker", v: Any) -> None:
    """``meta.config``: the run's side of its configuration (:mod:`nanreplay.capture.settings`):
    the optimizer's param groups without their parameters, activation checkpointing, the reduce
    dtypes, and one data digest per step held."""
    where = "meta.config"
    cfg = c.obj(v, where)
    opt = c.obj(cfg.get("optimizer") or {}, f"{where}.optimizer")
    for i, g in enumerate(c.array(opt.get("param_groups") or [], f"{where}.optimizer.param_groups", 10_000)):
        _flat_obj(c, g, f"{where}.optimizer.param_groups[{i}]", 64, lambda x, w: _setting_value(c, x, w))
    training = c.obj(cfg.get("training") or {}, f"{where}.training")
    ckpt = c.obj(training.get("checkpointing") or {}, f"{where}.training.checkpointing")
    c.names(ckpt.get("gradient_checkpointing") or [], f"{where}.training.checkpointing.gradient_checkpointing", 256)
    if cfg.get("distributed") is not None:
        _flat_obj(c, cfg["distributed"], f"{where}.distributed", 16, lambda x, w: _setting_value(c, x, w, lists=False), 64)
    for i, row in enumerate(c.array(cfg.get("data") or [], f"{where}.data")):
        w = f"{where}.data[{i}]"
        row = c.obj(row, w, ("step", "sha256", "of"))
        c.integer(row["step"], f"{w}.step")
        sha = c.string(row["sha256"], f"{w}.sha256", max_len=64)
        if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
            raise MetaError(f"{w}.sha256", "64 lowercase hex digits", _show(sha))
        if row["of"] not in _DATA_SOURCES:
            raise MetaError(f"{w}.of", f"one of {list(_DATA_SOURCES)}", _show(row["of"]))


def validate_step_meta(meta: Any, info: InfoFn) -> MetaFacts:
    """Check a step bundle's metadata against the schema and against the tensors in the file.

    Args:
        meta: ``manifest["meta"]`` (already strict JSON, bounded in size and depth).
        info: ``info(key)`` -> ``(dtype, shape)`` of a stored tensor, or ``None``.

    Returns:
        the decoded tree specs and the typed-node types each tree records.

    Raises:
        MetaError: the first violation, with where it is, what was expected and what was found.
    """
    c = _Checker(info)
    m = c.obj(meta, "meta", ("kind", "failing_step", "steps", "state", "grads"))
    if m["kind"] != "nanreplay.step":
        raise MetaError("meta.kind", "'nanreplay.step'", _show(m["kind"]))
    failing = c.integer(m["failing_step"], "meta.failing_step")
    if m.get("created_unix") is not None and not isinstance(m["created_unix"], (int, float)):
        raise MetaError("meta.created_unix", "a number", _show(m["created_unix"]))
    if m.get("environment") is not None:
        _environment(c, m["environment"])
    if m.get("config") is not None:
        _run_config(c, m["config"])
    _check_reason(c, m)
    c.integer(m.get("rank"), "meta.rank", null=True)
    c.integer(m.get("world_size"), "meta.world_size", 1 if m.get("world_size") is not None else 0, null=True)

    params_info = _check_model(c, m)
    groups = _check_optimizer(c, m)
    _check_code_and_options(c, m)
    _check_state_and_grads(c, m, groups, params_info)
    _check_steps(c, m, failing, groups, params_info)
    return c.facts


def _check_reason(c: _Checker, m: dict) -> None:
    """``meta.reason`` (why the step was dumped, the GradScaler's view) and the ranks of ``meta.distributed``."""
    reason = c.obj(m.get("reason") or {}, "meta.reason")
    for name in ("nonfinite_grad", "nonfinite_loss", "nonfinite_update"):
        c.boolean(reason.get(name), f"meta.reason.{name}")
    c.fnum(reason.get("grad_norm"), "meta.reason.grad_norm")
    c.fnum(reason.get("loss"), "meta.reason.loss")
    for name in ("action", "message", "scaler_failure"):
        c.string(reason.get(name), f"meta.reason.{name}", null=True, max_len=1 << 16)
    if reason.get("scaler") is not None:
        s = c.obj(reason["scaler"], "meta.reason.scaler")
        for name in ("enabled", "skipped", "grads_unscaled"):
            c.boolean(s.get(name), f"meta.reason.scaler.{name}")
        for name in ("consecutive_skips", "total_skips"):
            c.integer(s.get(name), f"meta.reason.scaler.{name}", null=True)
        for name in ("scale_before", "scale_after"):
            c.fnum(s.get(name), f"meta.reason.scaler.{name}")
        for i, pair in enumerate(c.array(s.get("scale_history") or [], "meta.reason.scaler.scale_history")):
            pair = c.array(pair, f"meta.reason.scaler.scale_history[{i}]", 2)
            if len(pair) != 2:
                raise MetaError(f"meta.reason.scaler.scale_history[{i}]", "[step, scale]", _show(pair))
            c.integer(pair[0], f"meta.reason.scaler.scale_history[{i}][0]")
            c.fnum(pair[1], f"meta.reason.scaler.scale_history[{i}][1]")
    for where, d in (("meta.reason.distributed", reason.get("distributed")), ("meta.distributed", m.get("distributed"))):
        if d is not None:
            d = c.obj(d, where)
            c.integer(d.get("rank"), f"{where}.rank", null=True)
            c.integer(d.get("world_size"), f"{where}.world_size", null=True)
            for i, r in enumerate(c.array(d.get("origin_ranks", []), f"{where}.origin_ranks")):
                c.integer(r, f"{where}.origin_ranks[{i}]")
            c.boolean(d.get("is_origin"), f"{where}.is_origin")
            c.string(d.get("origin_method"), f"{where}.origin_method", null=True)
            if d.get("grads") not in (None, "local", "reduced", "sharded"):
                raise MetaError(f"{where}.grads", "'local', 'reduced', 'sharded' or null", _show(d.get("grads")))
            _check_sharded(c, d, where)


def _check_model(c: _Checker, m: dict) -> Any:
    """``meta.model``; returns what ``meta.model.params`` says of each parameter."""
    model = c.obj(m.get("model") or {}, "meta.model")
    c.string(model.get("class"), "meta.model.class", null=True)
    params_info = c.tensors_info(model.get("params", {}), "meta.model.params")
    # a sharded run's bundle holds this rank's shards: their shapes are the recorded local shapes
    layouts = (((m.get("distributed") or {}).get("sharding") or {}).get("params") or {})
    if layouts:
        params_info = {k: ({**v, "shape": layouts[k]["local_shape"]} if k in layouts else v) for k, v in params_info.items()}
    c.tensors_info(model.get("buffers", {}), "meta.model.buffers")
    for i, row in enumerate(c.array(model.get("modules", []), "meta.model.modules", 10_000_000)):
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) and len(x) <= MAX_NAME for x in row)):
            raise MetaError(f"meta.model.modules[{i}]", "[fqn, class name]", _show(row))
    return params_info


def _check_optimizer(c: _Checker, m: dict) -> Optional[list]:
    """``meta.optimizer``; returns its param groups' FQNs (``None`` when not recorded)."""
    opt = c.obj(m.get("optimizer") or {}, "meta.optimizer")
    c.string(opt.get("class"), "meta.optimizer.class", null=True)
    groups = None
    if opt.get("param_groups_fqns") is not None:
        groups = c.array(opt["param_groups_fqns"], "meta.optimizer.param_groups_fqns", 1_000_000)
        for i, g in enumerate(groups):
            c.names(g, f"meta.optimizer.param_groups_fqns[{i}]")
    if opt.get("defaults") is not None:
        c.obj(opt["defaults"], "meta.optimizer.defaults")
    return groups


def _check_code_and_options(c: _Checker, m: dict) -> None:
    """The code the bundle names (factory, loss function, ``model_init``), the replay options,
    the Lightning entry and the stored diagnosis."""
    c.string(m.get("model_factory"), "meta.model_factory", null=True)
    c.string(m.get("loss_fn"), "meta.loss_fn", null=True)
    if m.get("loss_fn_kwargs") is not None:
        c.obj(m["loss_fn_kwargs"], "meta.loss_fn_kwargs")
    if m.get("model_init") is not None:
        init = c.obj(m["model_init"], "meta.model_init", ("class",))
        c.string(init["class"], "meta.model_init.class")
        c.obj(init.get("kwargs", {}), "meta.model_init.kwargs")
    ro = c.obj(m.get("replay_options") or {}, "meta.replay_options")
    for i, rule in enumerate(c.array(ro.get("allow_nonfinite", []), "meta.replay_options.allow_nonfinite", 10_000)):
        c.string(rule, f"meta.replay_options.allow_nonfinite[{i}]")
        try:
            AllowRule.parse(rule)
        except ValueError as e:
            raise MetaError(f"meta.replay_options.allow_nonfinite[{i}]", "an allowlist rule MODULE:OP[:-inf]", str(e)[:200]) from None
    if m.get("lightning") is not None:
        c.obj(m["lightning"], "meta.lightning")
    if m.get("scalar_history") is not None:
        _scalar_history(c, m["scalar_history"])
    if m.get("compile") is not None:
        _compile_state(c, m["compile"])
    d = m.get("diagnosis")
    if d is not None:
        c.obj(d, "meta.diagnosis")
        c.string(d.get("summary"), "meta.diagnosis.summary", null=True, max_len=1 << 20)


def _check_state_and_grads(c: _Checker, m: dict, groups: Optional[list], params_info: Any) -> None:
    """``meta.state`` (every optimizer parameter among its params) and ``meta.grads`` (each of
    its parameter's shape)."""
    state_params = c.snapshot(m["state"], "meta.state", "state/", groups, params_info)
    if groups is not None:
        known = set(state_params)
        for i, g in enumerate(groups):
            missing = [f for f in g if f not in known]
            if missing:
                raise MetaError(f"meta.optimizer.param_groups_fqns[{i}]", "parameters listed in meta.state.params", _show(missing[:3]))
    shapes = {k: c.info(f"state/params/{k}") for k in state_params}
    for k in c.names(m["grads"], "meta.grads"):
        dtype, shape = c.tensor(f"grads/{k}", "meta.grads")
        want = shapes.get(k)
        if want is not None and want[1] != shape:
            raise MetaError("meta.grads", f"gradient {k[:200]!r} of the parameter's shape {list(want[1])}", f"{list(shape)}")
    digests = c.obj(m.get("grad_digests") or {}, "meta.grad_digests")
    both = sorted(set(digests) & set(m["grads"]))
    if both:
        raise MetaError("meta.grad_digests", "gradients not also listed in meta.grads", _show(both[:3]))
    for k, d in digests.items():
        _check_digest(c, k, d, f"meta.grad_digests[{k[:200]!r}]", shapes.get(k))


_DIGEST_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def _check_digest(c: _Checker, k: str, d: Any, where: str, param: Optional[tuple]) -> None:
    """One gradient digest (:class:`~nanreplay.core.digest.GradDigest`): its dtype and shape,
    counts within its element count, a SHA-256, and one packed-bit tensor per listed mask."""
    d = c.obj(d, where, ("dtype", "shape", "nan", "posinf", "neginf", "nonzero", "sum", "sumsq", "absmax", "sha256", "masks"))
    c.string(k, where)
    if d["dtype"] not in _DIGEST_DTYPES:
        raise MetaError(f"{where}.dtype", f"a floating dtype name, one of {sorted(_DIGEST_DTYPES)}", _show(d["dtype"]))
    shape = [c.integer(s, f"{where}.shape[{i}]") for i, s in enumerate(c.array(d["shape"], f"{where}.shape", 64))]
    if param is not None and tuple(shape) != tuple(param[1]):
        raise MetaError(f"{where}.shape", f"the parameter's shape {list(param[1])}", _show(shape))
    numel = math.prod(shape) * (2 if d["dtype"].startswith("complex") else 1)
    counts = [c.integer(d[n], f"{where}.{n}", 0, numel) for n in ("nan", "posinf", "neginf", "nonzero")]
    if sum(counts) > numel:
        raise MetaError(where, f"NaN, +Inf, -Inf and non-zero counts summing to at most {numel} elements", str(sum(counts)))
    for n in ("sum", "sumsq", "absmax"):
        c.fnum(d[n], f"{where}.{n}", null=False)  # a digest always has them (0.0 with no finite value)
    sha = c.string(d["sha256"], f"{where}.sha256", max_len=64)
    if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
        raise MetaError(f"{where}.sha256", "64 lowercase hex digits", _show(sha))
    masks = c.names(d["masks"], f"{where}.masks", 3)
    for kind, count in zip(("nan", "posinf", "neginf"), counts):
        if (kind in masks) != (0 < count < numel):
            raise MetaError(f"{where}.masks", f"{kind!r} listed exactly when 0 < {kind} < {numel}", _show(masks))
        if kind in masks:
            c.tensor(f"gradmask/{kind}/{k}", f"{where}.masks", dtype=torch.uint8, shape=((numel + 7) // 8,))
    extra = sorted(set(masks) - {"nan", "posinf", "neginf"})
    if extra:
        raise MetaError(f"{where}.masks", "names among 'nan', 'posinf', 'neginf'", _show(extra))


def _check_steps(c: _Checker, m: dict, failing: int, groups: Optional[list], params_info: Any) -> None:
    """``meta.steps``: each step once, the failing one among them."""
    held = set()
    for i, s in enumerate(c.array(m["steps"], "meta.steps")):
        k = c.step(s, f"meta.steps[{i}]", groups, params_info)
        if k in held:
            raise MetaError(f"meta.steps[{i}].step", "step numbers without repeats", str(k))
        held.add(k)
    if held and failing not in held:
        raise MetaError("meta.failing_step", f"one of the steps held {sorted(held)[:8]}", str(failing))
