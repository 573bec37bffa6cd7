"""Hostile and damaged bundles, each with the exact outcome nanreplay must give.

``python tests/attacks/make_attacks.py OUTDIR`` writes every attack file into ``OUTDIR`` together
with ``index.json`` (name -> file and expected outcomes), the way safetensors keeps its attack
files; the test suite builds the same files into a temporary directory (``tests/house/test_attacks.py``),
so no binary is committed. Each attack is built from a small, valid bundle recorded by a real
``Recorder`` and then edited, by h5py or byte by byte, the way an attacker or a damaged disk would.

Expected outcomes (``Attack``):

* ``read``: ``None`` when opening the bundle and reading every step, the state and the gradients
  must succeed (the attack targets code execution, which reading never does), else the phrase
  the ``BundleFormatError`` message must start with after ``"<path>: "``;
* ``inspect``: the exit code of ``nanreplay inspect BUNDLE`` (0 or 4);
* ``replays``: ``(extra CLI arguments, exit code, text the output must contain)`` for
  ``nanreplay replay`` runs (the user's own model factory and loss function are passed unless
  the run is about the recorded ones);
* ``commands``: ``(command, extra CLI arguments, exit code, text the output must contain)`` for
  other commands (``inspect``, ``report --no-replay``, ``trust``), run on a pipe with a time limit;
  their output must hold no raw control character and a page they write no element from the
  bundle;
* ``marker``: the hostile payload would create ``<OUTDIR>/PWNED-<name>``; it must never exist.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(HERE.parents[1]))

from nanreplay import NonFiniteGradientError, Recorder, open_bundle, write_bundle  # noqa: E402

#: Import paths of this module's model factory and loss function (tests/ is on sys.path in pytest).
FACTORY = "attacks.make_attacks:make_model"
LOSS = "attacks.make_attacks:loss"
USER_CODE = ("--model-factory", FACTORY, "--loss-fn", LOSS)
PROBE = "nanreplay_attack_probe"  # a module the attacks name; importing it creates the marker


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x = batch["x"]
    return model(x).sum() / x.abs().sum()  # 0 / 0 = NaN for an all-zero batch


@dataclass
class Attack:
    name: str
    fmt: str
    what: str
    build: Callable[["Ctx"], Path]
    read: Optional[str]
    inspect: int
    replays: list[tuple[tuple[str, ...], int, str]] = field(default_factory=list)
    marker: bool = False
    commands: list[tuple[str, tuple[str, ...], int, str]] = field(default_factory=list)


@dataclass
class Ctx:
    out: Path
    base: dict[str, Path]  # fmt -> a valid, untrusted base bundle
    name: str = ""

    @property
    def marker(self) -> Path:
        return self.out / f"PWNED-{self.name}"

    def copy(self, fmt: str, suffix: Optional[str] = None) -> Path:
        p = self.out / f"{self.name}{suffix or ('.h5' if fmt == 'h5' else '.safetensors')}"
        shutil.copyfile(self.base[fmt], p)
        return p


# ------------------------------------------------------------------------------ building blocks
def record_base(out: Path, fmt: str) -> Path:
    """A valid bundle: 3 steps of a linear model, the last with an all-zero batch (NaN loss), a
    weight snapshot every step, Adam, a batch holding a tensor and a string."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        with Recorder(model, opt, loss_fn=loss, model_factory=make_model, out_dir=out, bundle_format=fmt,
                      snapshot_every=1, capacity=3, diagnose=False) as rec:
            for step in range(3):
                x = torch.zeros(3, 4) if step == 2 else torch.randn(3, 4)
                batch = {"x": x, "cmd": "echo harmless"}
                rec.record(batch)
                value = loss(model, batch)
                rec.log_loss(value)
                value.backward()
                opt.step()
                opt.zero_grad()
    except NonFiniteGradientError as e:
        return Path(e.bundle_path)
    raise AssertionError("the base bundle's step did not fail")


def read_manifest(path: Path) -> dict:
    data = path.read_bytes()
    if data.startswith(b"\x89HDF"):
        import h5py

        with h5py.File(path, "r") as f:
            return json.loads(f["__manifest__"][()].tobytes())
    n = int.from_bytes(data[:8], "little")
    return json.loads(json.loads(data[8:8 + n])["__metadata__"]["nanreplay_manifest"])


def write_manifest(path: Path, manifest: Any, text: Optional[str] = None) -> None:
    """Replace a bundle's manifest, keeping every tensor; ``text`` writes raw JSON text."""
    text = text if text is not None else json.dumps(manifest, separators=(",", ":"))
    data = path.read_bytes()
    if data.startswith(b"\x89HDF"):
        import h5py

        with h5py.File(path, "r+") as f:
            del f["__manifest__"]
            f.create_dataset("__manifest__", data=np.frombuffer(text.encode("utf-8"), dtype=np.uint8))
        return
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["nanreplay_manifest"] = text
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def edit_meta(ctx: Ctx, fmt: str, edit: Callable[[dict], Any], suffix: Optional[str] = None) -> Path:
    p = ctx.copy(fmt, suffix)
    m = read_manifest(p)
    edit(m["meta"])
    write_manifest(p, m)
    return p


def _batch_record(meta: dict, step: int) -> dict:
    return next(s for s in meta["steps"] if s["step"] == step)["batches"][0]


def _probe(ctx: Ctx) -> None:
    """The module the attacks name: importing it would create the marker."""
    (ctx.out / f"{PROBE}.py").write_text(
        "import pathlib, os\n"
        f"pathlib.Path(os.environ.get('NANREPLAY_ATTACK_MARKER', {str(ctx.out / 'PWNED-probe')!r})).touch()\n"
        "def loss(model, batch):\n    return model(batch['x']).sum()\n"
        "class Opt:\n    pass\n"
        "class Model:\n    pass\n"
        "import enum\nclass Color(enum.Enum):\n    RED = 1\n"
    )


# ------------------------------------------------------------------------------ the attacks
def typed_node_getoutput(ctx: Ctx) -> Path:
    """The batch's "cmd" leaf wrapped in a typed node naming subprocess:getoutput: the old reader
    imported it and called ``getoutput(cmd="touch ...")``."""
    def edit(meta: dict) -> None:
        rec = _batch_record(meta, 2)
        doc = json.loads(rec["spec"])
        keys = json.loads(doc[1]["context"])
        i = keys.index("cmd")
        doc[1]["children_spec"][i] = {"type": "nanreplay.tree.TypedNode", "context": ["subprocess:getoutput", "namedtuple", ["cmd"]],
                                      "children_spec": [doc[1]["children_spec"][i]]}
        rec["spec"] = json.dumps(doc)
        for v in rec["values"].values():
            if v.get("json") == "echo harmless":
                v["json"] = f"touch {ctx.marker}"
    return edit_meta(ctx, "h5", edit)


def model_init_popen(ctx: Ctx) -> Path:
    def edit(meta: dict) -> None:
        meta["model_factory"] = None
        meta["model_init"] = {"class": "subprocess:Popen", "kwargs": {"args": ["touch", str(ctx.marker)]}}
    return edit_meta(ctx, "safetensors", edit)


def factory_sys_exit(ctx: Ctx) -> Path:
    return edit_meta(ctx, "h5", lambda meta: meta.update(model_factory="sys:exit"))


def factory_py_path(ctx: Ctx) -> Path:
    evil = ctx.out / "evil.py"
    evil.write_text(f"import pathlib\npathlib.Path({str(ctx.marker)!r}).touch()\ndef make():\n    raise SystemExit(0)\n")
    return edit_meta(ctx, "safetensors", lambda meta: meta.update(model_factory=f"{evil}:make"))


def loss_fn_probe(ctx: Ctx) -> Path:
    _probe(ctx)
    return edit_meta(ctx, "h5", lambda meta: meta.update(loss_fn=f"{PROBE}:loss"))


def defaultdict_factory_import(ctx: Ctx) -> Path:
    _probe(ctx)

    def edit(meta: dict) -> None:
        rec = _batch_record(meta, 2)
        doc = json.loads(rec["spec"])
        doc[1] = {"type": "collections.defaultdict",
                  "context": {"default_factory_module": PROBE, "default_factory_name": "loss", "dict_context": json.loads(doc[1]["context"])},
                  "children_spec": doc[1]["children_spec"]}
        rec["spec"] = json.dumps(doc)
    return edit_meta(ctx, "h5", edit)


def enum_key_import(ctx: Ctx) -> Path:
    _probe(ctx)

    def edit(meta: dict) -> None:
        rec = _batch_record(meta, 2)
        doc = json.loads(rec["spec"])
        keys = json.loads(doc[1]["context"])
        keys[1] = {"__enum__": True, "fqn": f"{PROBE}:Color", "name": "RED"}
        doc[1]["context"] = json.dumps(keys)
        rec["spec"] = json.dumps(doc)
    return edit_meta(ctx, "safetensors", edit)


def optimizer_class_probe(ctx: Ctx) -> Path:
    _probe(ctx)
    return edit_meta(ctx, "h5", lambda meta: meta["optimizer"].update({"class": f"{PROBE}:Opt"}))


def model_init_hidden_model_class(ctx: Ctx) -> Path:
    """model_init naming nanreplay's own model_from_config, whose ``kwargs.model_class`` names the
    class it imports: the review listed only model_from_config, never the probe."""
    _probe(ctx)

    def edit(meta: dict) -> None:
        meta["model_factory"] = None
        meta["model_init"] = {"class": "nanreplay.integrations.transformers:model_from_config",
                              "kwargs": {"model_class": f"{PROBE}:Model", "config": {"n_layer": 1}}}
    return edit_meta(ctx, "h5", edit)


def factory_script_assigns_a_call(ctx: Ctx) -> Path:
    """A trusted model factory in a .py file whose top level is ``_ = call()``: the "runs code at
    import" check took an assignment for harmless and imported it."""
    evil = ctx.out / "evil_assign.py"
    evil.write_text(f"import pathlib\n_ = pathlib.Path({str(ctx.marker)!r}).touch()\ndef make():\n    raise SystemExit(0)\n")
    return edit_meta(ctx, "safetensors", lambda meta: meta.update(model_factory=f"{evil}:make"))


#: a name that, written raw to a terminal, sets the window title, clears the screen and, with the
#: carriage return, shows ``torch.nn:Linear`` over the real name
TERMINAL_NAME = "evil:run\x1b]0;owned\x07\x1b[2J\x08\x7f\x9b31m\u202e\rtorch.nn:Linear"


def terminal_escapes(ctx: Ctx) -> Path:
    def edit(meta: dict) -> None:
        meta["model_factory"] = TERMINAL_NAME
        meta["model"]["class"] = TERMINAL_NAME
        meta["diagnosis"] = {"summary": f"NaN in module {TERMINAL_NAME}", "phase": "forward", "origin": {"module": TERMINAL_NAME}}
    return edit_meta(ctx, "h5", edit)


#: stored diagnosis fields the page wrote unescaped: the meta refresh sent Chromium elsewhere
META_REFRESH = '<meta http-equiv="refresh" content="0; url=https://attacker.example/">'


def html_meta_refresh(ctx: Ctx) -> Path:
    def edit(meta: dict) -> None:
        meta["diagnosis"] = {
            "summary": "NaN born in the forward pass" + META_REFRESH, "phase": "forward", "step": 2,
            "propagated_ops": META_REFRESH, "allowed_births": META_REFRESH + "<script>alert(1)</script>",
            "allowlist": ['"><img src=x onerror=alert(1)>'],
            "forward_modules": [{"index": 0, "module": "</script><script>alert(2)</script>", "class": "Linear\" onload=\"alert(3)",
                                 "role": "producer", "allowed": {META_REFRESH: 1}, "output": {"nan": 1, "numel": 2}}],
            "reproduction": {"verdict": "not replayed"},
        }
    return edit_meta(ctx, "safetensors", edit)


def h5_external_link_tensors(ctx: Ctx) -> Path:
    import h5py

    other = ctx.out / f"{ctx.name}-other.h5"
    with h5py.File(other, "w") as f:  # another file's data, under the same names
        with h5py.File(ctx.base["h5"], "r") as src:
            for n in src["tensors"]:
                f.create_dataset(f"tensors/{n}", data=np.zeros_like(src["tensors"][n][()]))
    p = ctx.copy("h5")
    with h5py.File(p, "r+") as f:
        del f["tensors"]
        f["tensors"] = h5py.ExternalLink(str(other), "/tensors")
    return p


def _h5_replace(ctx: Ctx, how: Callable[[Any, str, np.ndarray], None]) -> Path:
    import h5py

    p = ctx.copy("h5")
    with h5py.File(p, "r+") as f:
        name = sorted(n for n in f["tensors"] if f["tensors"][n].ndim)[0]
        data = f["tensors"][name][()]
        del f["tensors"][name]
        how(f, name, data)
    return p


def h5_soft_link(ctx: Ctx) -> Path:
    import h5py

    return _h5_replace(ctx, lambda f, name, data: f["tensors"].__setitem__(name, h5py.SoftLink("/__manifest__")))


def h5_virtual_dataset(ctx: Ctx) -> Path:
    import h5py

    def how(f: Any, name: str, data: np.ndarray) -> None:
        layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
        layout[...] = h5py.VirtualSource(str(ctx.base["h5"]), f"/tensors/{name}".replace("%", "%%"), shape=data.shape)
        f["tensors"].create_virtual_dataset(name, layout)
    return _h5_replace(ctx, how)


def h5_external_storage(ctx: Ctx) -> Path:
    raw = ctx.out / f"{ctx.name}.raw"

    def how(f: Any, name: str, data: np.ndarray) -> None:
        np.ascontiguousarray(data).tofile(raw)
        f["tensors"].create_dataset(name, shape=data.shape, dtype=data.dtype, external=[(str(raw), 0, data.nbytes)])
    return _h5_replace(ctx, how)


def h5_gzip_dataset(ctx: Ctx) -> Path:
    return _h5_replace(ctx, lambda f, name, data: f["tensors"].create_dataset(name, data=data, chunks=True, compression="gzip"))


def h5_gzip_manifest_bomb(ctx: Ctx) -> Path:
    """A small file whose compressed manifest would inflate to 60 MiB (each MiB of it costs far
    more once parsed): refused before a byte of it is decompressed."""
    import h5py

    p = ctx.copy("h5")
    with h5py.File(p, "r+") as f:
        text = f["__manifest__"][()].tobytes()
        del f["__manifest__"]
        bomb = text[:-1] + b"," + b'"pad":[' + b"[]," * (20 << 20) + b"[]]}"
        f.create_dataset("__manifest__", data=np.frombuffer(bomb, dtype=np.uint8), chunks=(1 << 20,), compression="gzip", compression_opts=9)
    return p


def h5_v1_corrupt_vlen_attribute(ctx: Ctx) -> Path:
    """A version-1 style file (per-dataset variable-length ``torch_dtype`` attributes, written
    without checksummed metadata) with one byte of the attributes' global heap changed: reading
    such an attribute crashed or, with this byte, hung the HDF5 library (the old reader never
    returned). The reader never reads attributes."""
    import h5py

    from nanreplay.format.hdf5 import _h5_name

    p = ctx.out / f"{ctx.name}.h5"
    with h5py.File(ctx.base["h5"], "r") as src, h5py.File(p, "w", libver="earliest") as dst:
        manifest = json.loads(src["__manifest__"][()].tobytes())
        manifest["format_version"] = 1
        for key, entry in manifest["tensors"].items():
            ds = dst.create_dataset(f"tensors/{_h5_name(key)}", data=src["tensors"][_h5_name(key)][()], track_times=False)
            ds.attrs["torch_dtype"] = entry["dtype"]
        dst.create_dataset("__manifest__", data=np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8), track_times=False)
    data = bytearray(p.read_bytes())
    heap = data.find(b"GCOL")
    assert heap > 0
    data[heap + 8] = 0xFF  # the heap collection's size: the old reader looped forever inside the HDF5 library
    p.write_bytes(bytes(data))
    return p


def st_sparse_huge_tensor(ctx: Ctx) -> Path:
    """A safetensors file that declares a 1 GiB tensor but holds a few KiB on disk (sparse): the
    file size is what the header says, so opening is allowed; inspect must verify it in bounded
    memory (and finds the checksum wrong)."""
    base = ctx.base["safetensors"]
    m = read_manifest(base)
    data = base.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body_len = len(data) - 8 - n
    size = 1 << 30
    header["huge"] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [body_len, body_len + size]}
    m["tensors"]["huge"] = {"dtype": "float32", "shape": [size // 4], "nbytes": size, "crc32": 12345}
    header["__metadata__"]["nanreplay_manifest"] = json.dumps(m, separators=(",", ":"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    p = ctx.out / f"{ctx.name}.safetensors"
    with open(p, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
        f.truncate(8 + len(raw) + body_len + size)
    return p


def json_nonfinite_number(ctx: Ctx) -> Path:
    p = ctx.copy("safetensors")
    text = json.dumps(read_manifest(p), separators=(",", ":"))
    write_manifest(p, None, text.replace('"created_unix":', '"created_unix":1e999,"was":', 1))
    return p


def json_too_deep(ctx: Ctx) -> Path:
    p = ctx.copy("h5")
    text = json.dumps(read_manifest(p), separators=(",", ":"))
    write_manifest(p, None, text.replace('"diagnosis":null', '"diagnosis":' + "[" * 200 + "]" * 200, 1))
    return p


def tree_leaf_count_huge(ctx: Ctx) -> Path:
    return edit_meta(ctx, "safetensors", lambda meta: _batch_record(meta, 2).update(n=10**12))


def rng_state_unrestorable(ctx: Ctx) -> Path:
    with open_bundle(ctx.base["safetensors"]) as b:
        content = b.content()
    rec = next(s for s in content.steps if s.step == 2)
    version, words, gauss = rec.rng.python
    rec.rng.python = (version, tuple([2**40] * len(words)), gauss)
    return write_bundle(ctx.out / f"{ctx.name}.safetensors", content, trusted=False)


def cuda_states_missing(ctx: Ctx) -> Path:
    return edit_meta(ctx, "h5", lambda meta: next(s for s in meta["steps"] if s["step"] == 2)["rng"].update(cuda_devices=2))


def failing_step_not_held(ctx: Ctx) -> Path:
    return edit_meta(ctx, "safetensors", lambda meta: meta.update(failing_step=7))


def bad_allow_rule(ctx: Ctx) -> Path:
    return edit_meta(ctx, "h5", lambda meta: meta.update(replay_options={"allow_nonfinite": ["a:b:c:d"]}))


def st_overlapping_offsets(ctx: Ctx) -> Path:
    p = ctx.copy("safetensors")
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    header[second]["data_offsets"] = [header[first]["data_offsets"][0], header[first]["data_offsets"][0] + header[second]["data_offsets"][1] - header[second]["data_offsets"][0]]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    return p


def manifest_larger_than_file(ctx: Ctx) -> Path:
    p = ctx.copy("h5")
    m = read_manifest(p)
    key = next(k for k, e in m["tensors"].items() if e["shape"])
    m["tensors"][key].update(shape=[2**40], nbytes=2**42)
    write_manifest(p, m)
    return p


def fifo(ctx: Ctx) -> Path:
    p = ctx.out / f"{ctx.name}.h5"
    os.mkfifo(p)
    return p


_REFUSED = "refused: the bundle is not trusted and names code that would run"
_LINK = "manifest does not match the file: expected only hard links to objects stored in this file"
_PLAIN = "manifest does not match the file: expected tensor"

ATTACKS: list[Attack] = [
    # --- code execution: reading never runs code; replay refuses an untrusted bundle's code (exit 7) ---
    Attack("typed_node_getoutput", "h5", "a typed batch node naming subprocess:getoutput, with a shell command as its field",
           typed_node_getoutput, None, 0,
           [(USER_CODE, 7, "batch types 'subprocess:getoutput'"), (USER_CODE + ("--trust",), 0, "reproduced exactly")], marker=True),
    Attack("model_init_popen", "safetensors", "model_init naming subprocess:Popen with a command as its arguments",
           model_init_popen, None, 0,
           [(("--loss-fn", LOSS), 7, "model class (model_init) 'subprocess:Popen'"),
            (("--loss-fn", LOSS, "--trust"), 5, "not a torch.nn.Module subclass")], marker=True),
    Attack("factory_sys_exit", "h5", "a model factory naming sys:exit (made replay exit 0, 'reproduced')",
           factory_sys_exit, None, 0,
           [(("--loss-fn", LOSS), 7, "model factory 'sys:exit'"), (("--loss-fn", LOSS, "--trust"), 5, "called sys.exit")]),
    Attack("factory_py_path", "safetensors", "a model factory naming a .py file that runs code when imported",
           factory_py_path, None, 0, [(("--loss-fn", LOSS), 7, "model factory '")], marker=True),
    Attack("loss_fn_probe", "h5", "a loss function naming a module that runs code when imported",
           loss_fn_probe, None, 0, [(("--model-factory", FACTORY), 7, f"loss function '{PROBE}:loss'")], marker=True),
    Attack("defaultdict_factory_import", "h5", "a defaultdict node whose factory names a module (torch's treespec_loads imports it)",
           defaultdict_factory_import, None, 0, [(USER_CODE, 0, "reproduced exactly")], marker=True),
    Attack("enum_key_import", "safetensors", "a dict key naming an Enum of a module (torch's treespec_loads imports it)",
           enum_key_import, None, 0, [(USER_CODE, 0, "reproduced exactly")], marker=True),
    Attack("optimizer_class_probe", "h5", "an optimizer class naming a module outside torch.optim",
           optimizer_class_probe, None, 0, [(USER_CODE, 0, "reproduced exactly")], marker=True),
    Attack("model_init_hidden_model_class", "h5", "model_init naming model_from_config, whose kwargs.model_class (never reviewed) names a module",
           model_init_hidden_model_class, None, 0,
           [(("--loss-fn", LOSS), 7, f"imported by the model class (model_init.kwargs.model_class) '{PROBE}:Model'")], marker=True,
           commands=[("inspect", (), 0, f"imported by the model class (model_init.kwargs.model_class) {PROBE}:Model"),
                     ("trust", (), 0, f"imported by the model class (model_init.kwargs.model_class) {PROBE}:Model")]),
    Attack("factory_script_assigns_a_call", "safetensors", "a trusted factory in a .py file whose top level is `_ = call()`",
           factory_script_assigns_a_call, None, 0,
           [(("--loss-fn", LOSS), 7, "model factory '"), (("--loss-fn", LOSS, "--trust"), 5, "importing it runs its code (line 2: _ = pathlib.Path(")],
           marker=True),
    # --- every string from a bundle is inert: on the terminal and in the HTML page ---
    Attack("terminal_escapes", "h5", "ESC/OSC/CR/BS/DEL/C1 in the factory name, model class and stored diagnosis (a \\r hid the real name)",
           terminal_escapes, None, 0, [(("--loss-fn", LOSS), 7, "model factory 'evil:run\\x1b]0;owned\\x07")],
           commands=[("inspect", (), 0, "code it names: model factory evil:run\\x1b]0;owned\\x07\\x1b[2J\\b\\x7f\\x9b31m\\u202e\\rtorch.nn:Linear"),
                     ("trust", (), 0, "model factory evil:run\\x1b]0;owned"),
                     ("report", ("--no-replay",), 0, "NaN in module evil:run\\x1b]0;owned\\x07")]),
    Attack("html_meta_refresh", "safetensors", "<meta http-equiv=refresh>, <script> and attributes in the stored diagnosis (report --no-replay)",
           html_meta_refresh, None, 0, [(USER_CODE, 0, "reproduced exactly")],
           commands=[("report", ("--no-replay",), 0, "report written to")]),
    # --- hostile or damaged containers: BundleFormatError, exit 4, bounded memory ---
    Attack("h5_external_link_tensors", "h5", "/tensors is an external link to another file's data",
           h5_external_link_tensors, _LINK + ", found an external link at /tensors", 4, [(USER_CODE, 4, "external link")]),
    Attack("h5_soft_link", "h5", "a tensor dataset replaced by a soft link", h5_soft_link, _LINK, 4, [(USER_CODE, 4, "soft link")]),
    Attack("h5_virtual_dataset", "h5", "a tensor stored as a virtual dataset mapping another file",
           h5_virtual_dataset, _PLAIN, 4, [(USER_CODE, 4, "found a virtual dataset")]),
    Attack("h5_external_storage", "h5", "a tensor whose raw data lives in an external file",
           h5_external_storage, _PLAIN, 4, [(USER_CODE, 4, "with external storage")]),
    Attack("h5_gzip_dataset", "h5", "a tensor stored chunked and gzip-compressed", h5_gzip_dataset, _PLAIN, 4, [(USER_CODE, 4, "compression")]),
    Attack("h5_gzip_manifest_bomb", "h5", "a gzip-compressed manifest inflating to 60 MiB of JSON",
           h5_gzip_manifest_bomb, "manifest does not match the file: expected dataset '__manifest__' to be a contiguous, uncompressed dataset",
           4, [(USER_CODE, 4, "compression")]),
    Attack("h5_v1_corrupt_vlen_attribute", "h5", "a version-1 file with one corrupted byte in its variable-length attributes' heap (hung or crashed the HDF5 library)",
           h5_v1_corrupt_vlen_attribute, None, 0, [(USER_CODE, 0, "reproduced exactly")]),
    Attack("st_sparse_huge_tensor", "safetensors", "a 1 GiB tensor declared in a sparse file of a few KiB",
           st_sparse_huge_tensor, None, 4, []),
    Attack("json_nonfinite_number", "safetensors", "a manifest number (1e999) that overflows to infinity",
           json_nonfinite_number, "corrupt manifest: expected a UTF-8 JSON object, found ValueError: number 1e999 is not a finite float", 4, []),
    Attack("json_too_deep", "h5", "JSON nested 200 levels deep", json_too_deep,
           "corrupt manifest: expected a UTF-8 JSON object, found ValueError: JSON nested", 4, []),
    Attack("tree_leaf_count_huge", "safetensors", "a batch tree claiming 10**12 leaves (took 36 s and 4.4 GB)",
           tree_leaf_count_huge, "invalid metadata: expected an integer in [0, 100000000] at meta.steps[2].batches[0].n", 4, []),
    Attack("rng_state_unrestorable", "safetensors", "RNG words out of range (a raw traceback from the RNG restore)",
           rng_state_unrestorable, "the step 2 data is malformed (ValueError: RNG state under 'steps/2/rng/' cannot be restored", 0,
           [(USER_CODE, 4, "cannot be restored")]),
    Attack("cuda_states_missing", "h5", "an RNG record claiming CUDA generator states the file lacks",
           cuda_states_missing, "invalid metadata: expected tensor 'steps/2/rng/cuda/0' (the metadata refers to it) at meta.steps[2].rng", 4, []),
    Attack("failing_step_not_held", "safetensors", "a failing step that is not among the steps held",
           failing_step_not_held, "invalid metadata: expected one of the steps held [0, 1, 2] at meta.failing_step, found 7", 4, []),
    Attack("bad_allow_rule", "h5", "an allowlist rule that does not parse", bad_allow_rule,
           "invalid metadata: expected an allowlist rule MODULE:OP[:-inf] at meta.replay_options.allow_nonfinite[0]", 4, []),
    Attack("st_overlapping_offsets", "safetensors", "two tensors sharing bytes in the data buffer", st_overlapping_offsets,
           "unreadable safetensors file: expected tensor data that tiles the data buffer without gaps or overlaps", 4, []),
    Attack("manifest_larger_than_file", "h5", "a tensor declared larger than the file", manifest_larger_than_file,
           "invalid manifest: expected tensors totalling at most the file size", 4, []),
    Attack("fifo", "h5", "a FIFO named like a bundle (waited on forever)", fifo,
           "not a regular file: expected a bundle file, found a FIFO (named pipe)", 4, [(USER_CODE, 4, "FIFO")]),
]


def build_all(out: Path) -> dict[str, Path]:
    """Record the base bundles and build every attack into ``out``; returns name -> file. The base
    bundles are made untrusted (their trust entries are revoked), as a stranger's would be."""
    from nanreplay import untrust_bundle

    out.mkdir(parents=True, exist_ok=True)
    base = {fmt: record_base(out / f"base-{fmt}", fmt) for fmt in ("h5", "safetensors")}
    for p in base.values():
        untrust_bundle(p)
    files = {}
    for attack in ATTACKS:
        files[attack.name] = attack.build(Ctx(out, base, attack.name))
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1])
        return 2
    out = Path(argv[0])
    files = build_all(out)
    index = {a.name: {"file": files[a.name].name, "what": a.what, "read": a.read, "inspect_exit": a.inspect,
                      "replays": [{"args": list(r[0]), "exit": r[1], "says": r[2]} for r in a.replays],
                      "commands": [{"command": c[0], "args": list(c[1]), "exit": c[2], "says": c[3]} for c in a.commands],
                      "marker": f"PWNED-{a.name}" if a.marker else None}
             for a in ATTACKS}
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {len(files)} attack files and index.json to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
