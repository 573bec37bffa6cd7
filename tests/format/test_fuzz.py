"""Property-based fuzzing of the bundle reader (bounded, for CI): any mutation of a valid bundle
(bit flips, byte changes, truncation, edited JSON) opens, reads, inspects and replays cleanly or
fails with ``BundleFormatError`` / CLI exit 4; nothing else. The long, crash-isolated fuzzer with
HDF5 and safetensors structure edits is ``bench/fuzz.py`` (see bench/README.md)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanreplay import BundleFormatError, NanReplayError, NonFiniteGradientError, Recorder, open_bundle, replay, untrust_bundle
from nanreplay.cli import main


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def loss(model, batch):
    return model(batch["x"]).sum() / batch["x"][:, 0].abs().sum()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("fuzz-seeds")
    found = {}
    for fmt in ("h5", "safetensors"):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        try:
            with Recorder(model, opt, loss_fn=loss, out_dir=out / fmt, bundle_format=fmt, capacity=2, snapshot_every=1, diagnose=False) as rec:
                for step in range(2):
                    x = torch.randn(2, 3) if step == 0 else torch.zeros(2, 3)
                    rec.record({"x": x, "tag": [step, "s", 1.5]})
                    loss(model, {"x": x}).backward()
                    opt.step()
                    opt.zero_grad()
        except NonFiniteGradientError as e:
            untrust_bundle(e.bundle_path)
            found[fmt] = Path(e.bundle_path).read_bytes()
    assert set(found) == {"h5", "safetensors"}
    return found


def _manifest_text(data: bytes) -> str:
    if data.startswith(b"\x89HDF"):
        with tempfile.NamedTemporaryFile(suffix=".h5") as f:
            f.write(data)
            f.flush()
            with h5py.File(f.name, "r") as h:
                return h["__manifest__"][()].tobytes().decode()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]["nanreplay_manifest"]


def _with_manifest(data: bytes, text: str) -> bytes:
    if data.startswith(b"\x89HDF"):
        with tempfile.NamedTemporaryFile(suffix=".h5") as f:
            f.write(data)
            f.flush()
            with h5py.File(f.name, "r+") as h:
                del h["__manifest__"]
                h.create_dataset("__manifest__", data=np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8))
            return Path(f.name).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["nanreplay_manifest"] = text
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["nan", "inf", "subprocess:getoutput", "os:system", "", "cuda:7", "a:b:c:d"]) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)

mutations = st.one_of(
    st.tuples(st.just("bitflip"), st.lists(st.integers(0, 2**40), min_size=1, max_size=8)),
    st.tuples(st.just("bytes"), st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("json"), st.tuples(st.integers(0, 2**40), json_values)),
    st.tuples(st.just("jsondel"), st.integers(0, 2**40)),
)


def mutate(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "bitflip":
        buf = bytearray(data)
        for bit in arg:
            bit %= len(buf) * 8
            buf[bit // 8] ^= 1 << (bit % 8)
        return bytes(buf)
    if kind == "bytes":
        buf = bytearray(data)
        for at, value in arg:
            buf[at % len(buf)] = value
        return bytes(buf)
    if kind == "truncate":
        return data[: int(len(data) * arg)]
    manifest = json.loads(_manifest_text(data))
    paths = [p for p in _paths(manifest) if p]
    path = paths[(arg[0] if kind == "json" else arg) % len(paths)]
    parent = manifest
    for p in path[:-1]:
        parent = parent[p]
    if kind == "json":
        parent[path[-1]] = arg[1]
    elif isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    return _with_manifest(data, json.dumps(manifest))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fmt=st.sampled_from(["h5", "safetensors"]), mutation=mutations, name=st.sampled_from(["b.h5", "b.safetensors", "b.txt", "b"]))
def test_any_mutation_reads_cleanly_or_is_a_bundle_format_error(seeds, tmp_path_factory, fmt, mutation, name):
    path = tmp_path_factory.mktemp("mutant") / name
    path.write_bytes(mutate(seeds[fmt], mutation))
    try:
        with open_bundle(path) as b:
            for k in b.steps:
                b.step(k)
            b.state()
            b.grads()
        readable = True
    except BundleFormatError:
        readable = False
    r = CliRunner().invoke(main, ["inspect", "--json", str(path)], catch_exceptions=False)
    assert r.exit_code in (0, 4), r.output
    assert "Traceback" not in r.output
    if readable:  # the factory and loss function are the user's: only the bundle's data is under test
        try:
            diag = replay(path, model_factory=make_model, loss_fn=loss, samples=False, ops=False)
            assert diag["reproduction"]["verdict"] in ("reproduced exactly", "not reproduced") or diag["reproduction"]["verdict"].startswith("reproduced")
        except NanReplayError as e:  # a malformed bundle, or data the replay refuses with a reason (a step whose batch was deleted)
            assert str(e) and "Traceback" not in str(e)


def _structure_reference(raw: bytes) -> tuple[int, int, int]:
    """A character-by-character reading of JSON text: containers, separators and depth outside strings."""
    containers = separators = depth = deepest = 0
    in_string = escaped = False
    for c in raw.decode("utf-8"):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            containers += 1
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
        elif c in ",:":
            separators += 1
    return containers, separators, deepest


tricky_text = st.text(alphabet=st.sampled_from(list('ab"\\[]{},: \u00e9')), max_size=12)
json_documents = st.recursive(st.none() | st.integers() | tricky_text,
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(tricky_text, c, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(doc=json_documents, chunk=st.sampled_from([1, 2, 3, 7, 1 << 20]), ascii_only=st.booleans())
def test_the_pre_parse_scan_counts_exactly_what_lies_outside_strings(doc, chunk, ascii_only):
    import nanreplay.core.safejson as safejson

    raw = json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8")
    old, safejson._CHUNK = safejson._CHUNK, chunk  # small chunks: the string state and backslash runs cross chunk edges
    try:
        assert safejson.json_structure(raw) == _structure_reference(raw)
    finally:
        safejson._CHUNK = old
