"""Fault-injection fuzzer for reading bundles: every damaged or hostile file must end in a
``BundleFormatError`` (CLI exit 4), or read fine, with bounded memory and time, and run no code.

Method. Four seed bundles are recorded by a real ``Recorder`` (two formats x two shapes of
content: a dict batch with a loss function and weight snapshots; a namedtuple batch with nested
defaultdict / deque / OrderedDict and model-only cotangents). Each mutant is one seed with one
mutation, drawn reproducibly from ``(--seed, mutant index)``:

* ``bitflip``: 1 to 8 random bits; ``bytes``: 1 to 4 random bytes set to 0x00/0xff/0x7f/0x80/random;
  ``int64``: an 8-byte little-endian integer at an aligned offset set to a huge or negative value;
  ``truncate``: the file cut at a random length;
* ``json``: one random edit of the manifest (a value replaced by another type, a huge or negative
  number, a deep nesting, a hostile import path, a deleted key, a swapped subtree, an edited tree
  spec), written back properly (h5py for HDF5, a re-serialised header for safetensors), so the
  container stays valid and the schema is what is tested;
* ``h5struct`` (HDF5 seeds, via h5py): external / soft links (also for ``/tensors`` and the
  manifest), virtual datasets, external raw storage, chunked + gzip datasets and manifests,
  changed dtypes and shapes, variable-length attributes, extra groups and datasets, deleted datasets;
* ``stheader`` (safetensors seeds): edited dtype strings, shapes and data offsets, removed or added
  tensors, non-string metadata, a wrong header length;
* ``program`` (seeds with an embedded program): one structure-aware edit of ``meta.program``: a
  node deleted, duplicated or moved; a target replaced by another allowlisted op, an unlisted one
  or a hostile name (``aten.from_file``, ``torch.os.system``, a higher-order op); an argument's kind
  or value changed (``as_operator``, strings, huge sizes, other tensors' names); a tensor's
  declared sizes, a symbolic expression (power towers, Python), a tree spec of the signature
  (a defaultdict naming a module), a state entry or a whole sub-record replaced.

Each mutant is checked in a child process forked from a worker that imported torch and
nanreplay but computed nothing (so the fork is safe), under a memory limit (``RLIMIT_AS``) and a
wall-clock limit, in four stages: ``open_bundle`` + reading every step, the state and the
gradients; ``nanreplay inspect --json``; ``nanreplay inspect`` (text); ``replay`` with the
seed's model factory and loss function passed explicitly (so only the bundle's data is under
test); and, for seeds with a program, ``replay program``: a replay with no code of the user's,
which loads and runs the embedded program. A stage's outcome is ``ok``, ``BundleFormatError``
(exit 4 for the CLI), ``ReplayError`` (exit 5: a program refused or one that cannot run: only
accepted from the program stage), or anything else,
by signature (exception type, stage, first words of the message). A child killed by a signal is a
``crash``; one over the time limit a ``timeout``. The peak RSS of every child is measured
(``wait4``) and reported above the worker's own RSS at fork time.

Run: ``python bench/fuzz.py --mutants 10000`` (``--workers`` defaults to the number of CPUs;
``--keep DIR`` saves every mutant that did not end in ok/BundleFormatError, with its description).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional

HERE = Path(__file__).resolve()
ROOT = Path(os.environ.get("NANREPLAY_FUZZ_CODE") or HERE.parents[1])  # the nanreplay tree under test (see --code)
MARKER = Path(tempfile.gettempdir()) / "nanreplay-fuzz-pwned"  # what the hostile code names in the edits would create
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------ seed models
def _torch():
    import torch

    return torch


class Pair(NamedTuple):
    x: Any
    y: Any


def make_model():
    torch = _torch()
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def dict_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean() / batch["x"][:, :1].abs().sum()


def pair_loss(model, batch):
    return ((model(batch.x) - batch.y) ** 2).mean()


def make_seeds(out: Path) -> list[Path]:
    """Record the four seed bundles into ``out`` (a subprocess: the fuzzer's workers never compute)."""
    torch = _torch()
    from nanreplay import NonFiniteGradientError, Recorder

    paths = []
    for fmt in ("h5", "safetensors"):
        # seed A: dict batch, a loss function, snapshots of every step, Adam
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        try:
            with Recorder(model, opt, loss_fn=dict_loss, model_factory=make_model, out_dir=out / f"a_{fmt}", bundle_format=fmt,
                          snapshot_every=1, capacity=3, diagnose=False) as rec:
                for step in range(3):
                    x = torch.randn(5, 4)
                    if step == 2:
                        x[:, 0] = 0.0  # division by a zero sum: NaN loss and gradients
                    batch = {"x": x, "y": torch.randn(5, 2), "meta": {"step": step, "tag": "s", "f": 0.5}}
                    rec.record(batch)
                    loss = dict_loss(model, batch)
                    rec.log_loss(loss)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        except NonFiniteGradientError as e:
            paths.append(Path(e.bundle_path))
        # seed B: a namedtuple batch in nested containers, no loss function (cotangents), SGD
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            with Recorder(model, opt, model_factory=make_model, out_dir=out / f"b_{fmt}", bundle_format=fmt, capacity=2, diagnose=False) as rec:
                for step in range(2):
                    x = torch.randn(3, 4)
                    extra = collections.OrderedDict(d=collections.defaultdict(list, k=[1, 2]), q=collections.deque([1.5, 2], maxlen=4))
                    rec.record({"pair": Pair(x, torch.randn(3, 2)), "extra": extra, "nan": float("nan")})
                    out_ = model(x)
                    (out_.sum() * (float("inf") if step == 1 else 1.0)).backward()
                    opt.step()
                    opt.zero_grad()
        except NonFiniteGradientError as e:
            paths.append(Path(e.bundle_path))
    return paths


# ------------------------------------------------------------------------------------ mutations
def _manifest(path: Path) -> tuple[dict, str]:
    from nanreplay.format.container import read_flat

    with read_flat(path) as b:
        return json.loads(json.dumps(b.manifest)), b.format


def _st_split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_join(header: dict, body: bytes, raw_text: Optional[str] = None) -> bytes:
    text = (raw_text if raw_text is not None else json.dumps(header, separators=(",", ":"))).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


_HOSTILE_STRINGS = ["subprocess:getoutput", "os:system", "/tmp/evil.py:run", "builtins:eval", "sys:exit", "", "\udcff",
                    "x" * 5000, "nan", "inf", "-inf", "1e999", "torch.optim:Optimizer", "..", "cuda:99", "mps", "meta"]


def _random_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 1, 2**31, 2**32 + 1, 2**63, -(2**63) - 1, 10**30, 1.5, -0.0, 1e308, 3.0,
        rng.choice(_HOSTILE_STRINGS), [], {}, [1, 2, 3], {"a": 1}, [[[[[]]]]], "nan",
        {"json": 1}, {"float": "nan"}, {"repr": "x", "type": "y"}, list(range(700)),
    ])


def _edit_spec(spec: str, rng: random.Random) -> str:
    doc = json.loads(spec)
    paths = _paths(doc)
    p = rng.choice(paths)
    choice = rng.randrange(7)
    if choice == 0:
        _set(doc, p, _random_value(rng))
    elif choice == 1:  # a hostile node type / context
        node = {"type": rng.choice(["collections.defaultdict", "nanreplay.tree.TypedNode", "builtins.dict", "collections.namedtuple", "x.y"]),
                "context": rng.choice([{"default_factory_module": "subprocess", "default_factory_name": "getoutput", "dict_context": []},
                                       ["subprocess:getoutput", "dataclass", []], "[{\"__enum__\": true, \"fqn\": \"os:environ\", \"name\": \"HOME\"}]", "null", 5]),
                "children_spec": []}
        doc = _set(doc, p, node) if p else doc
    elif choice == 2:
        node = {"type": "builtins.list", "context": "null", "children_spec": []}
        inner = node
        for _ in range(rng.choice([70, 200, 3000])):
            child = {"type": "builtins.list", "context": "null", "children_spec": []}
            inner["children_spec"].append(child)
            inner = child
        doc = [1, node]
    elif choice == 3:
        doc = [rng.choice([0, 2, "1", None]), doc[1] if isinstance(doc, list) and len(doc) > 1 else doc]
    elif choice == 4:
        target = _get(doc, p)
        if isinstance(target, dict) and target:
            del target[rng.choice(list(target))]
    elif choice == 5:
        target = _get(doc, p)
        if isinstance(target, list) and target:
            target.append(target[0])
    else:
        return spec[: rng.randrange(len(spec))]
    return json.dumps(doc)


def _edit_json(manifest: dict, rng: random.Random) -> tuple[dict, str]:
    paths = [p for p in _paths(manifest) if p]
    specs = [p for p in paths if p[-1] == "spec"]
    if specs and rng.random() < 0.25:
        p = rng.choice(specs)
        _set(manifest, p, _edit_spec(_get(manifest, p), rng))
        return manifest, f"spec edit at {'/'.join(map(str, p))}"
    p = rng.choice(paths)
    op = rng.randrange(8)
    if op <= 2:
        v = _random_value(rng)
        _set(manifest, p, v)
        return manifest, f"set {'/'.join(map(str, p))} = {str(v)[:40]!r}"
    if op == 3:
        parent = _get(manifest, p[:-1])
        if isinstance(parent, dict):
            del parent[p[-1]]
        else:
            parent.pop(p[-1])
        return manifest, f"delete {'/'.join(map(str, p))}"
    if op == 4:
        depth = rng.choice([60, 63, 70, 500, 5000])
        _set(manifest, p, f"__DEEP__{depth}")  # spliced into the JSON text by _write_manifest
        return manifest, f"deep nesting ({depth}) at {'/'.join(map(str, p))}"
    if op == 5:
        q = rng.choice(paths)
        try:
            a, b = _get(manifest, p), _get(manifest, q)
            _set(manifest, p, json.loads(json.dumps(b)))
            _set(manifest, q, json.loads(json.dumps(a)))
        except (KeyError, IndexError, TypeError):
            pass
        return manifest, f"swap {'/'.join(map(str, p))} <-> {'/'.join(map(str, q))}"
    if op == 6:
        v = _get(manifest, p)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _set(manifest, p, rng.choice([v + 1, v - 1, -v, v * 1000, 2**62, 10**400 if rng.random() < 0.1 else 2**40]))
        elif isinstance(v, str):
            _set(manifest, p, rng.choice(_HOSTILE_STRINGS) if rng.random() < 0.5 else v[::-1])
        return manifest, f"tweak {'/'.join(map(str, p))}"
    for key, value in (("model_factory", "subprocess:getoutput"), ("loss_fn", "/tmp/evil.py:run"),
                       ("model_init", {"class": "subprocess:Popen", "kwargs": {"args": ["touch", str(MARKER)]}})):
        if rng.random() < 0.5:
            manifest["meta"][key] = value
    return manifest, "hostile code names"


_PROGRAM_TARGETS = ["torch.ops.aten.from_file.default", "torch.ops.aten.save.default", "torch.ops.aten._load_from_state_dict",
                    "torch.os.system", "builtins.eval", "torch.ops.higher_order.while_loop", "torch.ops.higher_order.map_impl",
                    "torch.ops.aten.linear.out", "torch.ops.aten.empty.memory_format", "torch.ops.aten.full.default",
                    "torch.ops.aten.add_.Tensor", "torch.ops.aten.copy_.default", "torch.ops.aten.mul.Tensor",
                    "torch.ops.aten.relu.default", "_operator.mul", "torch.ops.aten.sym_size.int", "math.trunc", "#custom"]
_PROGRAM_ARGS = [{"as_operator": "torch.os.system"}, {"as_string": "$(touch PWNED)"}, {"as_ints": [1 << 30, 1 << 30]},
                 {"as_int": 2**62}, {"as_float": 1e300}, {"as_tensor": {"name": "nope"}}, {"as_none": True},
                 {"as_custom_obj": {"name": "obj", "class_fqn": "os.system"}}, {"as_strings": ["a"]}, {"as_sym_int": {"as_name": "s0"}},
                 {"as_graph": {"name": "g", "graph": {}}}, {"as_scalar_type": 999}, {"as_device": {"type": "disk", "index": None}}, {}]
_PROGRAM_EXPRS = ["9**9**9**9", "2**2**40", "Pow(Integer(2), Pow(Integer(2), Integer(40)))", "__import__('os').getcwd()",
                  "Symbol('s0').__class__", "Integer(" + "9" * 5000 + ")", "Max(" * 500 + "Integer(1)" + ")" * 500]
_PROGRAM_SPECS = [json.dumps([1, {"type": "collections.defaultdict", "context": {"default_factory_module": "os", "default_factory_name": "system",
                                                                                 "dict_context": []}, "children_spec": []}]),
                  json.dumps([1, {"type": "builtins.dict", "context": json.dumps([{"__enum__": True, "fqn": "os.Enum", "name": "X"}]),
                                  "children_spec": [{"type": None, "context": None, "children_spec": []}]}]), "[1, 5]", "{}"]


def _edit_program(prog: dict, rng: random.Random) -> str:
    """One structure-aware edit of an embedded program record (see the module doc)."""
    if not prog.get("kind"):
        return "no program to edit"
    graph = prog["program"]["graph_module"]["graph"]
    nodes = graph["nodes"]
    op = rng.randrange(10)
    i = rng.randrange(len(nodes)) if nodes else 0
    if op == 0 and nodes:
        del nodes[i]
        return f"node {i} deleted"
    if op == 1 and nodes:
        j = rng.randrange(len(nodes))
        nodes.insert(j, json.loads(json.dumps(nodes[i])))
        return f"node {i} copied to {j}"
    if op == 2 and nodes:
        t = rng.choice(_PROGRAM_TARGETS)
        nodes[i]["target"] = t
        return f"node {i} target -> {t}"
    if op in (3, 4) and nodes and nodes[i]["inputs"]:
        k = rng.randrange(len(nodes[i]["inputs"]))
        a = json.loads(json.dumps(rng.choice(_PROGRAM_ARGS)))
        nodes[i]["inputs"][k]["arg"] = a
        return f"node {i} input {k} -> {str(a)[:40]}"
    if op == 5 and graph["tensor_values"]:
        name = rng.choice(sorted(graph["tensor_values"]))
        sizes = rng.choice([[{"as_int": 1 << 40}], [{"as_int": -5}], [{"as_expr": {"expr_str": rng.choice(_PROGRAM_EXPRS), "hint": None}}], "x"])
        graph["tensor_values"][name]["sizes"] = sizes
        return f"tensor_values[{name}].sizes edited"
    if op == 6:
        graph.setdefault("sym_int_values", {})["s_fuzz"] = {"as_expr": {"expr_str": rng.choice(_PROGRAM_EXPRS), "hint": {"as_int": 3}}}
        return "symbolic expression added"
    if op == 7:
        mcg = prog["program"]["graph_module"]["module_call_graph"]
        if mcg and mcg[0].get("signature"):
            key = rng.choice(["in_spec", "out_spec"])
            mcg[0]["signature"][key] = rng.choice(_PROGRAM_SPECS)
            return f"signature {key} edited"
        return "no signature to edit"
    if op == 8 and prog.get("state"):
        name = rng.choice(sorted(prog["state"]))
        field = rng.choice(["key", "kind", "store", "requires_grad"])
        prog["state"][name][field] = rng.choice(["state/params/nope", "weird", None, 5, {"a": 1}])
        return f"state[{name}].{field} edited"
    paths = [p for p in _paths(prog) if p]
    p = rng.choice(paths)
    v = _random_value(rng)
    _set(prog, p, v)
    return f"set program/{'/'.join(map(str, p))[:60]} = {str(v)[:30]!r}"


def _write_manifest(data: bytes, fmt: str, manifest: dict, tmp: Path, rng: random.Random, raw_text: Optional[str] = None) -> bytes:
    text = raw_text if raw_text is not None else json.dumps(manifest, separators=(",", ":"))
    text = re.sub(r'"__DEEP__(\d+)"', lambda m: "[" * int(m.group(1)) + "0" + "]" * int(m.group(1)), text)
    if fmt == "safetensors":
        header, body = _st_split(data)
        header["__metadata__"]["nanreplay_manifest"] = text
        return _st_join(header, body)
    import h5py
    import numpy as np

    tmp.write_bytes(data)
    with h5py.File(tmp, "r+") as f:
        del f["__manifest__"]
        f.create_dataset("__manifest__", data=np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8))
    return tmp.read_bytes()


def _h5struct(seed: Path, tmp: Path, rng: random.Random) -> str:
    import h5py
    import numpy as np

    tmp.write_bytes(seed.read_bytes())
    with h5py.File(tmp, "r+") as f:
        names = list(f["tensors"])
        name = rng.choice(names)
        ds = f["tensors"][name]
        data, dtype = ds[()], ds.dtype
        op = rng.randrange(14)
        if op == 0:
            del f["tensors"][name]
            f["tensors"][name] = h5py.ExternalLink(str(seed), f"/tensors/{name}")
            return f"external link for {name}"
        if op == 1:
            f.move("tensors", "tensors_old")
            f["tensors"] = h5py.ExternalLink(str(seed), "/tensors")
            return "external link for /tensors"
        if op == 2:
            del f["tensors"][name]
            f["tensors"][name] = h5py.SoftLink(f"/tensors/{rng.choice(names)}")
            return f"soft link for {name}"
        if op == 3:
            del f["tensors"][name]
            layout = h5py.VirtualLayout(shape=data.shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(seed), f"/tensors/{name}".replace("%", "%%"), shape=data.shape)
            f["tensors"].create_virtual_dataset(name, layout)
            return f"virtual dataset {name}"
        if op == 4 and data.ndim:
            del f["tensors"][name]
            ext = tmp.with_suffix(".raw")
            np.ascontiguousarray(data).tofile(ext)
            f["tensors"].create_dataset(name, shape=data.shape, dtype=dtype, external=[(str(ext), 0, data.nbytes)])
            return f"external storage for {name}"
        if op == 5 and data.ndim:
            del f["tensors"][name]
            f["tensors"].create_dataset(name, data=data, chunks=True, compression="gzip")
            return f"gzip dataset {name}"
        if op == 6:
            raw = f["__manifest__"][()]
            del f["__manifest__"]
            f.create_dataset("__manifest__", data=raw, chunks=True, compression="gzip", shuffle=True)
            return "gzip manifest"
        if op == 7:
            del f["tensors"][name]
            f["tensors"][name] = data.astype(np.float64) if data.dtype != np.float64 else data.astype(np.float32)
            return f"dtype change {name}"
        if op == 8 and data.ndim and data.size > 1:
            del f["tensors"][name]
            f["tensors"][name] = data.reshape(-1)[::-1].copy() if data.ndim > 1 else data.reshape(1, -1)
            return f"shape change {name}"
        if op == 9:
            ds.attrs[rng.choice(["torch_dtype", "x"])] = rng.choice(["float16", "\u00e9" * 1000, "garbage"])
            return f"vlen attribute on {name}"
        if op == 10:
            g = f.create_group("extra")
            for i in range(rng.choice([1, 50, 2000])):
                g.create_dataset(f"d{i}", data=np.zeros(2))
            return "extra datasets"
        if op == 11:
            del f["tensors"][name]
            return f"deleted {name}"
        if op == 12:
            raw = f["__manifest__"][()].tobytes().decode()
            del f["__manifest__"]
            f["__manifest__"] = raw
            return "manifest as a string dataset"
        f.create_group(f"tensors/{name}_g").create_dataset("x", data=np.zeros(3))
        return "group inside /tensors"


def _stheader(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    header, body = _st_split(data)
    keys = [k for k in header if k != "__metadata__"]
    k = rng.choice(keys)
    op = rng.randrange(9)
    if op == 0:
        header[k]["dtype"] = rng.choice(["F64", "F16", "I64", "BOOL", "U8", "F8_E4M3", "C64", "XX", "BF16"])
        return _st_join(header, body), f"dtype of {k}"
    if op == 1:
        header[k]["shape"] = rng.choice([[], [0], [2**40], [1] * 70, [-1], list(reversed(header[k]["shape"]))])
        return _st_join(header, body), f"shape of {k}"
    if op == 2:
        b, e = header[k]["data_offsets"]
        header[k]["data_offsets"] = rng.choice([[b, e + 8], [b - 4, e - 4], [0, e - b], [b, 2**62], [e, b]])
        return _st_join(header, body), f"offsets of {k}"
    if op == 3:
        del header[k]
        return _st_join(header, body), f"removed {k}"
    if op == 4:
        header["ghost"] = {"dtype": "F32", "shape": [2**20], "data_offsets": [len(body), len(body) + 2**22]}
        return _st_join(header, body), "added a huge tensor past the end"
    if op == 5:
        header["__metadata__"]["nanreplay_manifest"] = rng.choice([None, 5, ["x"], {"a": 1}])
        return _st_join(header, body), "non-string manifest"
    if op == 6:
        n = int.from_bytes(data[:8], "little")
        return (n + rng.choice([-8, 8, 2**40, -n])).to_bytes(8, "little", signed=False) + data[8:], "header length"
    if op == 7:
        text = json.dumps(header, separators=(",", ":"))
        text = text[:-1] + f',"{k}":' + json.dumps(header[k]) + "}"
        return _st_join(header, body, text), "duplicate key"
    return _st_join(header, body, json.dumps(header) + " " * rng.choice([0, 1000])), "reserialised with padding"


def mutate(seed: Path, index: int, base_seed: int, tmp: Path) -> tuple[bytes, str]:
    """The mutant ``index`` of ``seed``: its bytes and a description."""
    rng = random.Random(base_seed * 1_000_003 + index)
    data = seed.read_bytes()
    fmt = "hdf5" if data[:8] == b"\x89HDF\r\n\x1a\n" else "safetensors"
    ops = ["bitflip", "bytes", "int64", "truncate", "json", "json", "h5struct" if fmt == "hdf5" else "stheader"]
    if seed.parent.name.startswith("a"):  # seeds with an embedded program: half the mutants edit it
        ops += ["program"] * len(ops)
    op = rng.choice(ops)
    if op == "bitflip":
        buf = bytearray(data)
        flips = [rng.randrange(len(buf) * 8) for _ in range(rng.randint(1, 8))]
        for bit in flips:
            buf[bit // 8] ^= 1 << (bit % 8)
        return bytes(buf), f"bitflip {flips}"
    if op == "bytes":
        buf = bytearray(data)
        at = [rng.randrange(len(buf)) for _ in range(rng.randint(1, 4))]
        for a in at:
            buf[a] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        return bytes(buf), f"bytes at {at}"
    if op == "int64":
        buf = bytearray(data)
        a = rng.randrange(len(buf) // 8) * 8
        v = rng.choice([2**31, 2**32, 2**40, 2**62, 2**64 - 1, 2**63, 2**48 + 3])
        buf[a:a + 8] = v.to_bytes(8, "little")
        return bytes(buf), f"int64 {v} at {a}"
    if op == "truncate":
        n = rng.randrange(len(data))
        return data[:n], f"truncate to {n}"
    if op == "json":
        manifest, fmt2 = _manifest(seed)
        manifest, what = _edit_json(manifest, rng)
        try:
            return _write_manifest(data, fmt2, manifest, tmp, rng), f"json: {what}"
        except (ValueError, OverflowError) as e:  # an edit json cannot write (a huge deep nest)
            return data, f"json edit not writable ({e})"
    if op == "program":
        manifest, fmt2 = _manifest(seed)
        what = _edit_program(manifest["meta"]["program"], rng)
        try:
            return _write_manifest(data, fmt2, manifest, tmp, rng), f"program: {what}"
        except (ValueError, OverflowError) as e:
            return data, f"program edit not writable ({e})"
    if op == "h5struct":
        what = _h5struct(seed, tmp, rng)
        return tmp.read_bytes(), f"h5: {what}"
    out, what = _stheader(data, rng)
    return out, f"st: {what}"


# ------------------------------------------------------------------------------------ hostile arguments
#: values an argument of each kind is set to (besides a valid one)
_HOSTILE_INTS = [0, -1, -2, 1, 7, 2**31, -2**31, 2**40, -2**40, 2**62, -2**63]
_HOSTILE_INT_LISTS = [[], [0], [-1], [0, 0], [2**40], [2**31, 2**31], [-3, 4], [1] * 40, [5, 4, 3, 2, 1, 1], [2**62, 1], [3, -1]]
_HOSTILE_FLOATS = [0.0, -0.0, 1e308, -1e308, 5e-324, 1e-45, 3.5, -7.25]
#: argument names whose tensor holds indices, lengths or targets: given an int64 tensor (in or out of range)
_INDEX_ARGS = frozenset({"index", "indices", "target", "targets", "offsets", "lengths", "input_lengths", "target_lengths", "repeats",
                         "weights", "minlength", "sorter", "boundaries"})
#: what an index tensor is made of: (sizes, fill value)
_INDEX_TENSORS = [([5], 1), ([5], 3), ([5], 4), ([5], 5), ([5], -1), ([5], -7), ([5], 2**40), ([5], -2**62), ([0], 0), ([], 2**31),
                  ([5, 4], 2), ([2**10], 2**33)]
_STRINGS = ["none", "mean", "sum", "tanh", "reflect", "constant", "ij->ij", "i,i->", "backward", "ortho", "floor", "trunc"]


def _ops() -> list[str]:
    """The allowlisted aten overloads whose every output is a tensor or a list of tensors, sorted."""
    import torch

    from nanreplay.engine.opset import OPS

    out = []
    for name in sorted(OPS):
        packet, overload = name.rsplit(".", 1)
        rets = [str(r.type) for r in getattr(getattr(torch.ops.aten, packet), overload)._schema.returns]
        if rets and all(r in ("Tensor", "List[Tensor]") for r in rets):
            out.append(name)
    return out


class _ArgMutant:
    """One node calling an allowlisted op, inserted at the head of a seed's program graph, with
    valid arguments built from the op's schema and the graph's own tensors, then some of them set
    to hostile values (:data:`_HOSTILE_INTS` ...; index tensors out of range; dtype changes; empty
    tensors). Tensors it needs beyond the graph's are made by ``aten.full`` nodes inserted before it."""

    def __init__(self, prog: dict, rng: random.Random) -> None:
        import torch
        from torch._export.serde import serialize as serde

        self.torch, self.serde, self.rng = torch, serde, rng
        self.graph = prog["program"]["graph_module"]["graph"]
        self.values = self.graph["tensor_values"]
        sig = prog["program"]["graph_module"]["signature"]["input_specs"]
        self.inputs = [s.get("user_input", {}).get("arg", {}).get("as_tensor", {}).get("name") for s in sig]
        self.inputs = [n for n in self.inputs if n] + [s[k]["arg"]["name"] for s in sig for k in ("parameter", "buffer") if k in s]
        self.nodes: list[dict] = []
        self.count = 0
        first = self.graph["nodes"][0].get("metadata") or {} if self.graph["nodes"] else {}
        # the module the inserted nodes sit in (unflatten places each node by its nn_module_stack)
        self.meta = {k: v for k, v in first.items() if k in ("nn_module_stack", "stack_trace")}

    def _dtype_code(self, dtype) -> int:
        return self.serde._TORCH_TO_SERIALIZE_DTYPE[dtype].value

    def _declare(self, name: str, meta) -> None:
        t = meta if isinstance(meta, self.torch.Tensor) else self.torch.empty(1, device="meta")
        self.values[name] = {"dtype": self._dtype_code(t.dtype), "sizes": [{"as_int": int(s)} for s in t.shape], "requires_grad": False,
                             "device": {"type": "cpu", "index": None}, "strides": [{"as_int": int(s)} for s in t.stride()],
                             "storage_offset": {"as_int": int(t.storage_offset())}, "layout": 7}

    def _meta_of(self, name: str):
        v = self.values[name]
        dtype = self.serde._SERIALIZE_TO_TORCH_DTYPE[self.serde.ScalarType(v["dtype"])]
        sizes = [s.get("as_int", 2) for s in v["sizes"]]
        return self.torch.empty(sizes, dtype=dtype, device="meta")

    def made(self, sizes: list, value: Any, dtype) -> dict:
        """An ``aten.full`` node of ``sizes`` filled with ``value``: its output as an argument."""
        self.count += 1
        name = f"fuzz_full{self.count}"
        scalar = {"as_float": float(value)} if isinstance(value, float) else {"as_bool": value} if isinstance(value, bool) else {"as_int": int(value)}
        self.nodes.append({"target": "torch.ops.aten.full.default", "inputs": [
            {"name": "size", "arg": {"as_ints": list(sizes)}, "kind": 1}, {"name": "fill_value", "arg": scalar, "kind": 1},
            {"name": "dtype", "arg": {"as_scalar_type": self._dtype_code(dtype)}, "kind": 2}], "outputs": [{"as_tensor": {"name": name}}],
            "metadata": dict(self.meta)})
        try:
            meta = self.torch.full([min(int(s), 1 << 20) if int(s) >= 0 else 1 for s in sizes], 0, dtype=dtype, device="meta")
        except Exception:  # noqa: BLE001 - a hostile size: declared as given where torch can say it, else [1]
            meta = None
        self._declare(name, meta)
        return {"as_tensor": {"name": name}}

    def tensor(self, name: str, hostile: bool) -> dict:
        torch = self.torch
        if name in _INDEX_ARGS:
            sizes, value = self.rng.choice(_INDEX_TENSORS) if hostile else ([5], 1)
            return self.made(sizes, value, torch.int64)
        if hostile:
            kind = self.rng.randrange(4)
            if kind == 0:
                return self.made(self.rng.choice([[0], [5, 0], [0, 4], []]), 1.5, torch.float32)  # empty or 0-d
            if kind == 1:  # a dtype change
                return self.made([5, 4], self.rng.choice([1, 0, True]), self.rng.choice([torch.int64, torch.bool, torch.float16, torch.int8, torch.complex64]))
        return {"as_tensor": {"name": self.rng.choice(self.inputs)}}

    def value(self, arg, hostile: bool) -> Optional[dict]:
        """The serialized value of one schema argument (``None``: leave it out, its default)."""
        torch, rng = self.torch, self.rng
        t, name = str(arg.type), arg.name
        optional = t.startswith("Optional[")
        base = t[len("Optional["):-1] if optional else t
        if not hostile and arg.has_default_value() and base not in ("Tensor",):
            return None
        if optional and hostile and rng.random() < 0.2:
            return {"as_none": True}
        if name == "dtype":
            codes = [c.value for c in self.serde._TORCH_TO_SERIALIZE_DTYPE.values()]
            return {"as_scalar_type": rng.choice(codes + [999]) if hostile else self._dtype_code(torch.float32)}
        if name == "layout":
            return {"as_layout": rng.choice([0, 1, 2, 7, 99]) if hostile else 7}
        if name == "memory_format":
            return {"as_memory_format": rng.choice([0, 1, 2, 3, 4, 77]) if hostile else 1}
        if base == "Device":
            return {"as_device": rng.choice([{"type": "cuda", "index": 0}, {"type": "meta", "index": None}, {"type": "cpu", "index": 7}])
                    if hostile else {"type": "cpu", "index": None}}
        if base == "Tensor":
            return self.tensor(name, hostile)
        if base == "List[Tensor]":
            return {"as_tensors": [self.tensor(name, hostile and rng.random() < 0.5)["as_tensor"] for _ in range(rng.choice([1, 2, 3] if not hostile else [0, 1, 2, 5]))]}
        if base == "List[Optional[Tensor]]":
            return {"as_optional_tensors": [self.tensor("index", hostile)] if rng.random() < 0.8 else [{"as_none": True}]}
        if base == "int":
            return {"as_int": rng.choice(_HOSTILE_INTS) if hostile else rng.choice([0, 1, -1, 2])}
        if base == "List[int]":
            return {"as_ints": rng.choice(_HOSTILE_INT_LISTS) if hostile else rng.choice([[5, 4], [1], [0], [20], [4, 5]])}
        if base == "float":
            return {"as_float": rng.choice(_HOSTILE_FLOATS) if hostile else 0.5}
        if base == "List[float]":
            return {"as_floats": [rng.choice(_HOSTILE_FLOATS) for _ in range(rng.randrange(4))] if hostile else [0.5, 0.5]}
        if base == "bool":
            return {"as_bool": rng.random() < 0.5}
        if base == "number":
            return rng.choice([{"as_int": rng.choice(_HOSTILE_INTS)}, {"as_float": rng.choice(_HOSTILE_FLOATS)}, {"as_bool": True}]) if hostile else {"as_float": 2.0}
        if base == "str":
            return {"as_string": rng.choice(_STRINGS)}
        return {"as_none": True}  # a Generator: never given

    def node(self, op: str, hostile: int) -> str:
        """Insert the call of ``op`` with ``hostile`` of its arguments set to hostile values; a description."""
        torch = self.torch
        packet, overload = op.rsplit(".", 1)
        fn = getattr(getattr(torch.ops.aten, packet), overload)
        args = list(fn._schema.arguments)
        chosen = set(self.rng.sample(range(len(args)), min(hostile, len(args)))) if args else set()
        inputs, changed = [], []
        for i, a in enumerate(args):
            v = self.value(a, i in chosen)
            if v is None:
                continue
            inputs.append({"name": a.name, "arg": v, "kind": 2 if a.kwarg_only else 1})
            if i in chosen:
                changed.append(f"{a.name}={json.dumps(v, separators=(',', ':'))[:50]}")
        outs = self._outputs(fn, inputs)
        self.nodes.append({"target": f"torch.ops.aten.{op}", "inputs": inputs, "outputs": outs, "metadata": dict(self.meta)})
        self._sink(outs[0])
        self.graph["nodes"][0:0] = self.nodes
        return f"{op}({'; '.join(changed) or 'valid arguments'})"

    def _sink(self, out: dict) -> None:
        """Use the op's first output (``sum`` of it added in place into a tensor the graph makes), so
        that no pass drops the node as dead code: an unused pure node would never run."""
        first = out["as_tensor"] if "as_tensor" in out else out["as_tensors"][0]
        sink = self.made([], 0.0, self.torch.float32)
        self.count += 1
        total, done = f"fuzz_sum{self.count}", f"fuzz_sink{self.count}"
        self.nodes.append({"target": "torch.ops.aten.sum.default", "inputs": [{"name": "self", "arg": {"as_tensor": first}, "kind": 1}],
                           "outputs": [{"as_tensor": {"name": total}}], "metadata": dict(self.meta)})
        self.nodes.append({"target": "torch.ops.aten.add_.Tensor", "inputs": [{"name": "self", "arg": sink, "kind": 1},
                                                                            {"name": "other", "arg": {"as_tensor": {"name": total}}, "kind": 1}],
                           "outputs": [{"as_tensor": {"name": done}}], "metadata": dict(self.meta)})
        try:
            meta = self._meta_of(first["name"]).sum()
        except Exception:  # noqa: BLE001
            meta = None
        self._declare(total, meta)
        self._declare(done, self.torch.empty([], device="meta"))

    def _outputs(self, fn, inputs: list[dict]) -> list[dict]:
        """The node's outputs, declared with the sizes a run on meta tensors gives (``[1]`` where it raises)."""
        torch = self.torch
        try:
            def real(v):
                if "as_tensor" in v:
                    return self._meta_of(v["as_tensor"]["name"])
                if "as_tensors" in v:
                    return [self._meta_of(t["name"]) for t in v["as_tensors"]]
                if "as_scalar_type" in v:
                    return self.serde._SERIALIZE_TO_TORCH_DTYPE[self.serde.ScalarType(v["as_scalar_type"])]
                if "as_device" in v:
                    return torch.device("meta")
                if "as_none" in v or "as_optional_tensors" in v or "as_layout" in v or "as_memory_format" in v:
                    return None
                return next(iter(v.values()))
            pos = [real(i["arg"]) for i in inputs if i["kind"] == 1]
            kw = {i["name"]: real(i["arg"]) for i in inputs if i["kind"] == 2}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = fn(*pos, **kw)
        except Exception:  # noqa: BLE001 - hostile arguments: the declaration is a guess
            got = None
        rets = [str(r.type) for r in fn._schema.returns]
        got = list(got) if isinstance(got, tuple) else [got]
        out = []
        for i, r in enumerate(rets):
            g = got[i] if i < len(got) else None
            self.count += 1
            if r == "List[Tensor]":
                items = g if isinstance(g, list) and g else [None]
                names = []
                for t in items:
                    self.count += 1
                    names.append({"name": f"fuzz_out{self.count}"})
                    self._declare(names[-1]["name"], t)
                out.append({"as_tensors": names})
            else:
                name = f"fuzz_out{self.count}"
                self._declare(name, g)
                out.append({"as_tensor": {"name": name}})
        return out


def mutate_args(seed: Path, index: int, base_seed: int, tmp: Path) -> tuple[bytes, str]:
    """Mutant ``index`` of the argument mutator: a program seed with one node calling allowlisted
    op ``index % len(ops)`` (every op in turn), 1 in 8 with valid arguments only, the others with
    1 to 3 hostile ones."""
    rng = random.Random(base_seed * 1_000_003 + index)
    ops = _ops()
    op = ops[index % len(ops)]
    manifest, fmt = _manifest(seed)
    prog = manifest["meta"]["program"]
    hostile = 0 if rng.random() < 0.125 else rng.randint(1, 3)
    what = _ArgMutant(prog, rng).node(op, hostile)
    return _write_manifest(seed.read_bytes(), fmt, manifest, tmp, rng), f"args: {what}"


#: the outcomes a stranger's replay may have: reproduced or not (exit 0 / 3), refused (4, 5, 7)
_STRANGER_OK = ("ok", "exit 4", "exit 5", "exit 7")


def check_stranger(path: Path, timeout: float) -> dict:
    """``nanreplay replay --no-samples BUNDLE`` as a stranger (the mutant is in no trust store):
    the outcome as ``ok`` (exit 0 or 3), ``exit 4``, ``exit 5``, ``exit 7``, or the exit code and
    the last line; ``sandbox`` says whether an exit 5 was a crash or a limit the sandbox contained."""
    from click.testing import CliRunner

    from nanreplay.cli import main

    r = CliRunner().invoke(main, ["replay", "--no-samples", "--timeout", str(timeout), str(path)])
    sandbox_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the sandboxed replay: this process's only child
    code = r.exit_code
    last = r.output.strip().splitlines()[-1] if r.output.strip() else ""
    out = {"replay": "ok" if code in (0, 3) else f"exit {code}"}
    if code not in (0, 3, 4, 5, 7) or "Traceback" in r.output:
        exc = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
        out["replay"] = _signature("replay", exc) if exc is not None else f"replay: exit {code}: {re.sub(r'[0-9]+', 'N', last)[:90]}"
    out["sandbox_rss_kb"] = sandbox_kb
    if code == 5 and "crashed the sandboxed replay" in r.output:
        out["contained"] = re.sub(r".*\(signal (\w+).*", r"signal \1", last)[:40]
    elif code == 5 and ("time limit" in r.output or "out of memory" in r.output):
        out["contained"] = "time limit" if "time limit" in r.output else "memory limit"
    return out


# ------------------------------------------------------------------------------------ checking
def _signature(stage: str, e: BaseException) -> str:
    msg = re.sub(r"\d+", "N", str(e).splitlines()[0] if str(e) else "")
    msg = re.sub(r"/[^\s:']+", "PATH", msg)
    return f"{stage}: {type(e).__name__}: {msg[:90]}"


def check(path: Path, seed_name: str) -> dict:
    """Run every stage on ``path``; return ``{stage: outcome}`` (outcome ``ok``, ``BundleFormatError``
    or a signature)."""
    import torch
    from click.testing import CliRunner

    from nanreplay import BundleFormatError, open_bundle, replay
    from nanreplay.cli import main

    torch.set_num_threads(1)
    out: dict[str, str] = {}
    try:
        with open_bundle(path) as b:
            for k in b.steps:
                b.step(k)
            b.state()
            b.grads()
        out["read"] = "ok"
    except BundleFormatError:
        out["read"] = "BundleFormatError"
    except Exception as e:  # noqa: BLE001 - classified, that is the point
        out["read"] = _signature("read", e)
    for stage, args in (("inspect --json", ["inspect", "--json", str(path)]), ("inspect", ["inspect", str(path)])):
        r = CliRunner().invoke(main, args)
        if r.exit_code == 0:
            out[stage] = "ok"
        elif r.exit_code == 4 and r.exception is not None and isinstance(r.exception, SystemExit) and "Traceback" not in r.output:
            out[stage] = "BundleFormatError"
        else:
            exc = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
            out[stage] = _signature(stage, exc) if exc is not None else f"{stage}: exit {r.exit_code}: {re.sub(r'[0-9]+', 'N', r.output.strip().splitlines()[-1] if r.output.strip() else '')[:90]}"
    typed = {"batch_types": [Pair]} if "batch_types" in inspect.signature(replay).parameters else {}  # (older nanreplay: no such argument)
    try:
        if seed_name.startswith("a"):
            replay(path, model_factory=make_model, loss_fn=dict_loss, samples=False)
        else:
            replay(path, model_factory=make_model, use_loss_fn=False, samples=False, **typed)
        out["replay"] = "ok"
    except BundleFormatError:
        out["replay"] = "BundleFormatError"
    except Exception as e:  # noqa: BLE001
        out["replay"] = _signature("replay", e)
    if seed_name.startswith("a"):  # the embedded program, with no code of the user's
        from nanreplay import ReplayError

        try:
            replay(path, samples=False)
            out["replay program"] = "ok"
        except BundleFormatError:
            out["replay program"] = "BundleFormatError"
        except ReplayError:
            out["replay program"] = "ReplayError"
        except Exception as e:  # noqa: BLE001
            out["replay program"] = _signature("replay program", e)
    return out


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_one(seed: Path, index: int, base_seed: int, work: Path, timeout: float, mem: int, keep: Optional[Path], same_name: bool = False,
            args_mode: bool = False) -> dict:
    tmp = work / f"scratch{index}.h5"
    try:
        data, what = (mutate_args if args_mode else mutate)(seed, index, base_seed, tmp)
    except Exception as e:  # noqa: BLE001 - a mutation the editing library refused: flip a bit of the seed instead
        data = bytearray(seed.read_bytes())
        bit = random.Random(index).randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        data, what = bytes(data), f"bitflip [{bit}] (the drawn mutation failed: {type(e).__name__})"
    finally:
        tmp.unlink(missing_ok=True)
    name = "m" + seed.suffix if same_name else random.Random(index).choice(["m.h5", "m.safetensors", "m.txt", "m"])  # names must not matter
    path = work / f"{index}-{name}"
    path.write_bytes(data)
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: limits, then every stage
        os.close(r)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + mem, resource.RLIM_INFINITY))
            result = check_stranger(path, timeout=max(5.0, timeout / 2)) if args_mode else check(path, seed.parent.name)
            os.write(w, json.dumps(result).encode())
        except BaseException as e:  # noqa: BLE001
            os.write(w, json.dumps({"child": _signature("child", e)}).encode())
        os._exit(0)
    os.close(w)
    status, usage, timed_out = None, None, False
    while True:
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            timed_out = True
            break
        time.sleep(0.005)
    raw = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        raw += chunk
    os.close(r)
    elapsed = time.monotonic() - t0
    if timed_out:
        stages = {"all": "timeout"}
    elif os.WIFSIGNALED(status):
        stages = {"all": f"crash: signal {os.WTERMSIG(status)}"}
    else:
        try:
            stages = json.loads(raw or b"{}") or {"all": "child: no result"}
        except ValueError:
            stages = {"all": "child: unreadable result"}
    bad = [v for k, v in stages.items() if k not in ("contained", "sandbox_rss_kb") and v not in (_STRANGER_OK if args_mode else _EXPECTED)]
    if bad and keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / path.name).write_bytes(data)
        (keep / (path.name + ".txt")).write_text(json.dumps({"seed": str(seed), "index": index, "mutation": what, "stages": stages}, indent=1))
    path.unlink()
    tmp.with_suffix(".raw").unlink(missing_ok=True)
    return {"index": index, "seed": seed.parent.name, "what": what[:200],
            "mutation": what.split(" ")[0] + (" " + what.split(" ")[1] if what.startswith(("h5:", "st:", "json:", "program:")) else ""),
            "stages": stages, "peak_rss_kb": usage.ru_maxrss if usage else 0, "seconds": elapsed,
            "file_bytes": len(data), "marker": MARKER.exists()}


_EXPECTED = ("ok", "BundleFormatError", "ReplayError")


def _baseline_kb() -> int:
    """Peak RSS of a child forked from this worker that does nothing: what every check starts from."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, _, usage = os.wait4(pid, 0)
    return usage.ru_maxrss


def worker(args: argparse.Namespace) -> None:
    import torch

    # One thread, so no OpenMP pool exists when children are forked; one warm-up check per seed,
    # so the children do not each pay torch's and nanreplay's lazy initialisation (seconds).
    torch.set_num_threads(1)
    seeds = [Path(p) for p in args.seeds.split(",")]
    if args.args:  # hostile arguments: only the seeds that carry a program
        seeds = [p for p in seeds if p.parent.name.startswith("a")]
    for seed in seeds:
        got = {"replay": check_stranger(seed, args.timeout)["replay"]} if args.args else check(seed, seed.parent.name)
        assert set(got.values()) == {"ok"}, f"the seed {seed} does not read and replay cleanly: {got}"
    base = _baseline_kb()
    # building a mutant runs its op on meta tensors here (to declare its outputs): hostile counts
    # (tensor_split into 2**31 sections: one tensor object each) must fail here, not take the machine
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (args.memory << 20), resource.RLIM_INFINITY))
    work = Path(tempfile.mkdtemp(prefix="nanreplay-fuzz-"))
    for line in sys.stdin:
        index = int(line)
        seed = seeds[index % len(seeds)]
        res = run_one(seed, index, args.seed, work, args.timeout, args.memory << 20, Path(args.keep) if args.keep else None, args.same_name,
                      args_mode=args.args)
        res["base_rss_kb"] = base
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()


_WORST_CASE_CHILD = """
import resource, sys, time
from click.testing import CliRunner
from nanreplay import BundleFormatError, open_bundle
from nanreplay.cli import main
t = time.perf_counter()
if sys.argv[1] == "open":
    try:
        with open_bundle(sys.argv[2]):
            outcome = "opened"
    except BundleFormatError as e:
        outcome = "BundleFormatError: " + str(e).split(": ", 2)[1]
else:
    r = CliRunner().invoke(main, ["inspect", "--json", sys.argv[2]])
    outcome = f"inspect exit {r.exit_code}"
print(f"{outcome}|{time.perf_counter() - t:.1f}|{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
"""


def worst_cases(env: dict) -> int:
    """Files crafted for the largest memory and time a reader can be made to spend, each measured
    in a fresh process against the same process opening a small valid bundle."""
    out = Path(tempfile.mkdtemp(prefix="nanreplay-worst-"))
    seeds = [Path(p) for p in subprocess.run([sys.executable, str(HERE), "--make-seeds", str(out / "seeds")], env=env,
                                             capture_output=True, text=True, check=True).stdout.split()]
    small = next(p for p in seeds if p.suffix == ".safetensors")
    data = small.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    manifest = json.loads(header["__metadata__"]["nanreplay_manifest"])

    def st_file(name: str, manifest: dict, header: dict, size: Optional[int] = None, text: Optional[str] = None) -> Path:
        h = dict(header)
        h["__metadata__"] = {"nanreplay_manifest": text if text is not None else json.dumps(manifest, separators=(",", ":"))}
        raw = json.dumps(h, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        p = out / name
        with open(p, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + body)
            if size is not None:
                f.truncate(8 + len(raw) + size)
        return p

    cases = []
    text = json.dumps(manifest, separators=(",", ":"))
    budget = (64 << 20) - len(text) - 64
    bomb = text[:-1] + ',"pad":[' + ",".join(["[]"] * (budget // 3)) + "]}"
    cases.append(("open", st_file("json_bomb.safetensors", manifest, header, text=bomb), "a 64 MiB manifest of empty JSON lists (the most Python objects per byte)"))
    n_lists = (1 << 22) - 4000  # just under the caps: the most a manifest can make the parser build
    capped = text[:-1] + ',"pad":[' + "[]," * n_lists + "1.5," * ((1 << 23) - n_lists - 4000) + "0]}"
    cases.append(("open", st_file("json_at_caps.safetensors", manifest, header, text=capped),
                  "a manifest just under the caps (4.2 M empty lists and 4.2 M floats, parsed, then refused by the schema)"))
    leaf = '{"type":null,"context":null,"children_spec":[]}'
    for count, what in ((600_000, "a tree spec string of 600 000 leaves (1.2 M JSON containers inside a string of the manifest)"),
                        (500_000, "a tree spec string of 500 000 leaves, just under the spec cap (decoded, then refused)")):
        m3 = json.loads(text)
        rec = next(s for s in m3["meta"]["steps"] if s["step"] == m3["meta"]["failing_step"])["batches"][0]
        rec["spec"] = '[1,{"type":"builtins.list","context":"null","children_spec":[' + ",".join([leaf] * count) + "]}]"
        cases.append(("open", st_file(f"spec_{count}.safetensors", m3, header), what))
    huge = dict(header)
    m2 = json.loads(text)
    size = 4 << 30
    huge["huge"] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [len(body), len(body) + size]}
    m2["tensors"]["huge"] = {"dtype": "float32", "shape": [size // 4], "nbytes": size, "crc32": 0}
    cases.append(("inspect", st_file("sparse_4gib.safetensors", m2, huge, size=len(body) + size), "a 4 GiB tensor in a sparse file (147 KiB on disk)"))
    cases.insert(0, ("inspect", small, f"a valid {small.stat().st_size // 1024} KiB bundle (the baseline)"))
    print("worst cases (each in a fresh process; peak RSS includes Python, torch and nanreplay):")
    for mode, path, what in cases:
        r = subprocess.run([sys.executable, "-c", _WORST_CASE_CHILD, mode, str(path)], env=env, capture_output=True, text=True)
        outcome, seconds, rss = (r.stdout.strip().splitlines() or ["?|?|0"])[-1].split("|")
        disk = path.stat().st_blocks * 512
        print(f"  {mode:<8} {what}: file {path.stat().st_size / 2**20:.0f} MiB ({disk / 2**20:.1f} MiB on disk) -> {outcome}; "
              f"{seconds} s, peak RSS {int(rss) / 1024:.0f} MiB")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=10000)
    ap.add_argument("--start", type=int, default=0, help="first mutant index (resume a campaign: mutants are drawn from (--seed, index))")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant (all stages)")
    ap.add_argument("--memory", type=int, default=2048, help="MiB of address space a mutant's check may add")
    ap.add_argument("--keep", help="directory for the mutants that ended in anything but ok / BundleFormatError")
    ap.add_argument("--json", help="write every result to this file (JSON lines)")
    ap.add_argument("--code", help="the directory holding the nanreplay package to test (default: this checkout), e.g. an older release for a before/after figure")
    ap.add_argument("--worst-cases", action="store_true", help="measure the files crafted for the most memory and time instead of fuzzing")
    ap.add_argument("--same-name", action="store_true", help="give every mutant its seed's extension (by default names vary: .h5, .safetensors, .txt, none)")
    ap.add_argument("--report", nargs="+", metavar="JSONL", help="print the report of earlier runs' --json files (one campaign resumed with --start) instead of fuzzing; --seconds gives their summed wall time")
    ap.add_argument("--seconds", type=float, default=0.0, help="with --report: the campaign's wall time in seconds (the sum of its runs')")
    ap.add_argument("--args", action="store_true", help="hostile arguments instead of damaged files: each mutant calls one allowlisted "
                    "op (every op in turn) with hostile sizes, indices, dtypes or empty tensors, replayed as a stranger's bundle "
                    "(the sandbox); outcomes must be ok / exit 4 / exit 5 / exit 7")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--make-seeds", help=argparse.SUPPRESS)
    ap.add_argument("--seeds", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_seeds:
        print("\n".join(str(p) for p in make_seeds(Path(args.make_seeds))))
        return 0
    if args.worker:
        worker(args)
        return 0
    if args.report:
        results = [json.loads(line) for f in args.report for line in open(f) if line.strip()]
        return report(results, args.seconds, args)

    home = tempfile.mkdtemp(prefix="nanreplay-fuzz-home-")
    if args.code:
        os.environ["NANREPLAY_FUZZ_CODE"] = str(Path(args.code).resolve())
    code = os.environ.get("NANREPLAY_FUZZ_CODE") or str(ROOT)
    env = {**os.environ, "NANREPLAY_HOME": home, "PYTHONPATH": os.pathsep.join([code, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if args.worst_cases:
        return worst_cases(env)
    seed_dir = Path(tempfile.mkdtemp(prefix="nanreplay-fuzz-seeds-"))
    out = subprocess.run([sys.executable, str(HERE), "--make-seeds", str(seed_dir)], env=env, capture_output=True, text=True, check=True)
    seeds = [Path(p) for p in out.stdout.split()]
    assert len(seeds) == 4, out.stderr
    print(f"seeds: {', '.join(f'{p.parent.name}/{p.name} ({p.stat().st_size} B)' for p in seeds)}", flush=True)
    procs = [subprocess.Popen([sys.executable, str(HERE), "--worker", "--seeds", ",".join(map(str, seeds)), "--seed", str(args.seed),
                               "--timeout", str(args.timeout), "--memory", str(args.memory)] + (["--keep", args.keep] if args.keep else [])
                              + (["--args"] if args.args else [])
                              + (["--same-name"] if args.same_name else []),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1) for _ in range(args.workers)]
    t0 = time.monotonic()
    results: list[dict] = []
    pending = {p: None for p in procs}
    next_index = args.start
    import selectors

    sel = selectors.DefaultSelector()
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ, p)
    for p in procs:
        if next_index < args.mutants:
            p.stdin.write(f"{next_index}\n"); p.stdin.flush(); pending[p] = next_index; next_index += 1
    sink = open(args.json, "w") if args.json else None
    while any(v is not None for v in pending.values()):
        for key, _ in sel.select():
            p = key.data
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"a fuzz worker died (exit {p.wait()}); see its stderr")
            res = json.loads(line)
            results.append(res)
            if sink:
                sink.write(line)
            pending[p] = None
            if next_index < args.mutants:
                p.stdin.write(f"{next_index}\n"); p.stdin.flush(); pending[p] = next_index; next_index += 1
            if len(results) % 500 == 0:
                print(f"  {len(results)} mutants, {time.monotonic() - t0:.0f} s", flush=True)
    for p in procs:
        p.stdin.close()
        p.wait()
    if sink:
        sink.close()
    return report(results, time.monotonic() - t0, args)


def report_args(results: list[dict], seconds: float, args: argparse.Namespace) -> int:
    """The argument mutator's figures: outcomes of the stranger's replays, what the sandbox
    contained, the ops covered, time and memory."""
    outcomes = collections.Counter(r["stages"].get("replay", r["stages"].get("all", "?")) for r in results)
    contained = collections.Counter(r["stages"]["contained"] for r in results if "contained" in r["stages"])
    others = {k: v for k, v in outcomes.items() if k not in _STRANGER_OK}
    ops = collections.Counter(r["what"].split("(")[0].removeprefix("args: ") for r in results)
    valid = [r for r in results if r["what"].endswith("(valid arguments)")]
    print(f"\n{len(results)} argument mutants over {len(ops)} allowlisted ops in {seconds:.0f} s ({args.workers} workers), seed {args.seed}")
    print("outcomes of `nanreplay replay` as a stranger: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(f"  of the exit 5s, contained by the sandbox: {sum(contained.values())}" + (" (" + ", ".join(f"{k} {v}" for k, v in contained.most_common()) + ")" if contained else ""))
    print(f"  mutants with valid arguments only: {len(valid)}, of which replayed ok {sum(r['stages'].get('replay') == 'ok' for r in valid)}")
    print(f"other outcomes (not ok / exit 4 / exit 5 / exit 7, a signal or a timeout of the outer process): {sum(others.values())}")
    for sig, n in sorted(others.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {n:5d}  {sig}")
    extra = [(r["peak_rss_kb"] - r["base_rss_kb"]) / 1024 for r in results]
    worst = max(results, key=lambda r: r["peak_rss_kb"] - r["base_rss_kb"])
    slow = max(results, key=lambda r: r["seconds"])
    print(f"peak RSS of the outer child above an idle one: max {max(extra):.1f} MiB ({worst['what'][:80]}), median {sorted(extra)[len(extra) // 2]:.1f} MiB")
    boxed = [r for r in results if "sandbox_rss_kb" in r["stages"]]
    if boxed:
        big = max(boxed, key=lambda r: r["stages"]["sandbox_rss_kb"])
        kb = sorted(r["stages"]["sandbox_rss_kb"] for r in boxed)
        print(f"peak RSS of the sandboxed replay (a child of its own, whole): max {kb[-1] / 1024:.0f} MiB ({big['what'][:80]}), "
              f"median {kb[len(kb) // 2] / 1024:.0f} MiB")
    print(f"slowest mutant: {slow['seconds']:.1f} s ({slow['what'][:100]}); median {sorted(r['seconds'] for r in results)[len(results) // 2]:.1f} s")
    markers = sum(r["marker"] for r in results)
    print(f"marker files created: {markers}")
    return 0 if not others and not markers else 1


def report(results: list[dict], seconds: float, args: argparse.Namespace) -> int:
    if getattr(args, "args", False) or (results and results[0].get("what", "").startswith("args:")):
        return report_args(results, seconds, args)
    per_mutant = collections.Counter()
    per_stage = collections.Counter()
    others = collections.Counter()
    for r in results:
        outcomes = list(r["stages"].values())
        if any(o not in _EXPECTED for o in outcomes):
            per_mutant["other"] += 1
        elif "BundleFormatError" in outcomes:
            per_mutant["BundleFormatError"] += 1
        elif "ReplayError" in outcomes:
            per_mutant["ReplayError (program refused or cannot run)"] += 1
        else:
            per_mutant["ok (mutation without effect on what is read)"] += 1
        for stage, o in r["stages"].items():
            kind = o if o in _EXPECTED else ("crash" if o.startswith("crash") else "timeout" if o == "timeout" else "other")
            per_stage[(stage, kind)] += 1
            if kind not in _EXPECTED:
                others[o] += 1
    extra = [(r["peak_rss_kb"] - r["base_rss_kb"]) / 1024 for r in results]
    worst = max(results, key=lambda r: r["peak_rss_kb"] - r["base_rss_kb"])
    by_op = collections.Counter(r["mutation"].split(" ")[0] for r in results)
    print(f"\n{len(results)} mutants of {len({r['seed'] for r in results})} seed bundles in {seconds:.0f} s ({args.workers} workers), seed {args.seed}")
    print("mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items())))
    print("per mutant: " + ", ".join(f"{k}: {v}" for k, v in sorted(per_mutant.items())))
    print("per stage:")
    for stage in ("read", "inspect --json", "inspect", "replay", "replay program", "all"):
        row = {k: v for (s, k), v in per_stage.items() if s == stage}
        if row:
            print(f"  {stage:<15} " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    print(f"other outcomes (exceptions other than BundleFormatError and the program stage's ReplayError, crashes, timeouts): {sum(others.values())}")
    for sig, n in others.most_common(40):
        print(f"  {n:5d}  {sig}")
    print(f"peak RSS of a check above an idle forked child's: max {max(extra):.1f} MiB (mutant {worst['index']}, {worst['file_bytes']} B file, "
          f"{worst['mutation']}), median {sorted(extra)[len(extra) // 2]:.1f} MiB; idle child {results[0]['base_rss_kb'] / 1024:.0f} MiB, "
          f"largest absolute peak {max(r['peak_rss_kb'] for r in results) / 1024:.0f} MiB")
    slow = max(results, key=lambda r: r["seconds"])
    print(f"slowest mutant: {slow['seconds']:.1f} s (all stages, mutant {slow['index']}, {slow['mutation']})")
    markers = sum(r["marker"] for r in results)
    print(f"marker files created by hostile code names: {markers}")
    return 0 if not others and not markers else 1


if __name__ == "__main__":
    sys.exit(main())
