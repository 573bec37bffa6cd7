"""Specification tests for nanreplay.format.container: the bundle file layer (both containers)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile
import zlib

import h5py
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanreplay.format import atomic, hdf5, manifest
from nanreplay.errors import BundleFormatError
from nanreplay.format.container import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FlatBundle,
    TensorInfo,
    bundle_format_for,
    read_flat,
    write_flat,
)

FORMATS = ["h5", "safetensors"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "cpu"
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def from_bits(values, int_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=int_dtype).view(dtype)


def special_values() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, full of the values that are easy to lose."""
    f32_bits = [
        0x7FC00000,  # canonical quiet NaN
        0x7FC00001,  # quiet NaN with a payload
        0x7F800001,  # signalling NaN
        np.int32(np.uint32(0xFFA00005).view(np.int32)).item(),  # negative NaN with payload
        np.int32(np.uint32(0x80000000).view(np.int32)).item(),  # -0.0
        0x7F800000,  # +inf
        np.int32(np.uint32(0xFF800000).view(np.int32)).item(),  # -inf
        0x00000001,  # smallest subnormal
        0x3F800000,  # 1.0
    ]
    f64_bits = [
        0x7FF8000000000001,
        0x7FF0000000000001,
        np.int64(np.uint64(0xFFF8DEADBEEF0000).view(np.int64)).item(),
        np.int64(np.uint64(0x8000000000000000).view(np.int64)).item(),
        0x7FF0000000000000,
        1,
    ]
    f16_bits = [0x7E01, 0x7C01, -0x0200 - 1, -0x8000, 0x7C00, -0x0400, 0x0001]  # NaNs, -0.0, inf, -inf
    bf16_bits = [0x7FC1, 0x7F81, -0x007F, -0x8000, 0x7F80, -0x0080, 0x0001]
    f32 = from_bits(f32_bits, torch.int32, torch.float32)
    f64 = from_bits(f64_bits, torch.int64, torch.float64)
    return {
        "float64": f64,
        "float32": f32,
        "float16": from_bits(f16_bits, torch.int16, torch.float16),
        "bfloat16": from_bits(bf16_bits, torch.int16, torch.bfloat16),
        "float8_e4m3fn": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16),
        "float8_e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
        "int8": torch.tensor([-128, -1, 0, 127], dtype=torch.int8),
        "int16": torch.tensor([-(2**15), -1, 0, 2**15 - 1], dtype=torch.int16),
        "int32": torch.tensor([-(2**31), -1, 0, 2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([-(2**63), -1, 0, 2**63 - 1], dtype=torch.int64),
        "uint8": torch.tensor([0, 1, 254, 255], dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "complex64": f32[:8].view(torch.complex64),
        "complex128": f64.view(torch.complex128),
    }


def leading(path: pathlib.Path, phrase: str) -> str:
    """A pytest ``match`` pattern: the message starts with the path and then the phrase."""
    return "^" + re.escape(f"{path}: {phrase}")


@pytest.fixture(params=FORMATS)
def ext(request) -> str:
    return request.param


def small_bundle(path: pathlib.Path) -> pathlib.Path:
    """A small valid bundle holding 'w' (float32 2x3 arange+1000) and 'b' (bfloat16)."""
    return write_flat(
        path,
        {"w": torch.arange(1000.0, 1006.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)},
        {"step": 7},
    )


@pytest.fixture
def bundle(tmp_path, ext) -> pathlib.Path:
    return small_bundle(tmp_path / f"b.{ext}")


# ------------------------------------------------------------------------------------ extension


@pytest.mark.parametrize(
    "name, fmt",
    [("a.h5", "hdf5"), ("a.HDF5", "hdf5"), ("dir.x/a.b.H5", "hdf5"), ("a.safetensors", "safetensors"),
     ("A.SafeTensors", "safetensors")],
)
def test_bundle_format_for_uses_the_extension(name, fmt):
    assert bundle_format_for(name) == fmt
    assert bundle_format_for(pathlib.Path(name)) == fmt


@pytest.mark.parametrize("name", ["a.pt", "a.h5.bak", "h5", "a", ".h5"])
def test_unknown_extension_is_a_value_error_naming_the_accepted_ones(tmp_path, name):
    with pytest.raises(ValueError, match=r"expected one of \.h5, \.hdf5 \(HDF5\) or \.safetensors"):
        bundle_format_for(name)
    with pytest.raises(ValueError, match="unknown bundle extension"):
        write_flat(tmp_path / name, {}, {})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ round trip


def test_every_dtype_round_trips_bit_exactly(tmp_path, ext):
    tensors = special_values()
    assert {str(t.dtype).removeprefix("torch.") for t in tensors.values()} == set(manifest._DTYPES)
    path = write_flat(tmp_path / f"all.{ext}", tensors, {})
    with read_flat(path) as b:
        assert b.keys() == sorted(tensors)
        for key, want in tensors.items():
            assert b.info(key) == TensorInfo(want.dtype, tuple(want.shape), want.numel() * want.element_size())
            assert_bit_exact(b.get(key), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.bool, torch.complex128])
def test_zero_dim_and_empty_tensors_round_trip(tmp_path, ext, dtype):
    tensors = {
        "scalar": torch.ones((), dtype=dtype),
        "empty": torch.empty(0, dtype=dtype),
        "empty2d": torch.empty(3, 0, dtype=dtype),
    }
    with read_flat(write_flat(tmp_path / f"z.{ext}", tensors, {})) as b:
        for key, want in tensors.items():
            assert_bit_exact(b.get(key), want)


def test_non_contiguous_and_storage_sharing_tensors_round_trip(tmp_path, ext):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {
        "base": base,
        "same": base,  # the identical tensor under a second key
        "transposed": base.t(),
        "strided": base[:, ::2],
        "overlap": base.view(-1)[3:9],
        "tail": base.view(-1)[20:],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "bf16_view": base.to(torch.bfloat16)[1:3],
    }
    assert not tensors["transposed"].is_contiguous()
    with read_flat(write_flat(tmp_path / f"s.{ext}", tensors, {})) as b:
        for key, want in tensors.items():
            assert_bit_exact(b.get(key), want)
    assert torch.equal(base, torch.arange(24.0).reshape(4, 6))  # the inputs are untouched


def test_keys_with_slashes_dots_and_percent_signs(tmp_path, ext):
    keys = ["a", "a/b", "a/b.c", "layer.0.weight", "%2F", "/", ".", "..", "x%y", "é/ü", "__manifest__", "tensors"]
    tensors = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    with read_flat(write_flat(tmp_path / f"k.{ext}", tensors, {})) as b:
        assert b.keys() == sorted(keys)
        for k in keys:
            assert_bit_exact(b.get(k), tensors[k])


def test_meta_round_trips_and_manifest_records_format_and_checksums(tmp_path, ext):
    meta = {"step": 12, "lr": 1e-3, "nested": {"list": [1, "two", None, True], "ünïcode": "✓"}, "nan": "nan"}
    path = write_flat(tmp_path / f"m.{ext}", {"w": torch.zeros(3)}, meta)
    with read_flat(path) as b:
        assert b.meta == meta
        assert b.path == path and b.format == bundle_format_for(path)
        assert b.manifest["format"] == FORMAT_NAME
        assert b.manifest["format_version"] == FORMAT_VERSION
        assert b.manifest["tensors"]["w"] == {"dtype": "float32", "shape": [3], "nbytes": 12,
                                              "crc32": zlib.crc32(bytes(12))}
        assert set(b.manifest["writer"]) >= {"torch", "numpy"}


def test_write_returns_the_path_and_replaces_an_existing_bundle(tmp_path, ext):
    path = tmp_path / f"r.{ext}"
    assert write_flat(str(path), {"v": torch.zeros(2)}, {"n": 1}) == path
    write_flat(path, {"v": torch.ones(3)}, {"n": 2})
    with read_flat(path) as b:
        assert b.meta == {"n": 2}
        assert_bit_exact(b.get("v"), torch.ones(3))


def test_returned_tensors_belong_to_the_caller(bundle):
    with read_flat(bundle) as b:
        first = b.get("w")
        first.add_(1)
        assert_bit_exact(b.get("w"), torch.arange(1000.0, 1006.0).reshape(2, 3))
    assert first.sum().item() == sum(range(1001, 1007))  # still usable after close


def test_autograd_tensors_are_written_detached(tmp_path, ext):
    p = torch.nn.Parameter(torch.randn(3, 2))
    with read_flat(write_flat(tmp_path / f"g.{ext}", {"p": p.t()}, {})) as b:
        got = b.get("p")
    assert not got.requires_grad
    assert_bit_exact(got, p.detach().t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_written_from_the_cpu_copy(tmp_path, ext):
    t = torch.randn(5, 5, device="cuda").to(torch.bfloat16)
    with read_flat(write_flat(tmp_path / f"c.{ext}", {"t": t}, {})) as b:
        assert_bit_exact(b.get("t"), t.cpu())


@settings(max_examples=30, deadline=None)
@given(
    f32=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    bf16=st.lists(st.integers(-(2**15), 2**15 - 1), max_size=40),
    ext=st.sampled_from(FORMATS),
)
def test_property_random_float_bit_patterns_round_trip(f32, bf16, ext):
    tensors = {
        "f32": torch.tensor(f32, dtype=torch.int32).view(torch.float32),
        "bf16": torch.tensor(bf16, dtype=torch.int16).view(torch.bfloat16),
    }
    with tempfile.TemporaryDirectory() as d:
        with read_flat(write_flat(pathlib.Path(d) / f"p.{ext}", tensors, {})) as b:
            for key, want in tensors.items():
                assert_bit_exact(b.get(key), want)


# ------------------------------------------------------------------------------------ bad input to write


@pytest.mark.parametrize(
    "meta, where",
    [
        ({"lr": float("nan")}, r"meta\['lr'\] is nan"),
        ({"a": [1, {"b": float("-inf")}]}, r"meta\['a'\]\[1\]\['b'\] is -inf"),
        ({"s": {1, 2}}, r"meta\['s'\] has type builtins\.set"),
        ({"t": torch.tensor(1.0)}, r"meta\['t'\] has type torch\.Tensor"),
    ],
)
def test_meta_that_is_not_json_is_a_value_error_naming_the_entry(tmp_path, ext, meta, where):
    with pytest.raises(ValueError, match="^meta is not JSON-serialisable: " + where):
        write_flat(tmp_path / f"m.{ext}", {}, meta)
    assert list(tmp_path.iterdir()) == []


def test_bad_keys_and_values_are_rejected_before_anything_is_written(tmp_path, ext):
    path = tmp_path / f"x.{ext}"
    with pytest.raises(ValueError, match="reserved"):
        write_flat(path, {"": torch.zeros(1)}, {})
    with pytest.raises(ValueError, match="reserved"):
        write_flat(path, {"__metadata__": torch.zeros(1)}, {})
    with pytest.raises(TypeError, match="tensor keys must be str"):
        write_flat(path, {1: torch.zeros(1)}, {})
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        write_flat(path, {"a": np.zeros(1)}, {})
    with pytest.raises(TypeError, match="dtype torch.uint16 is not supported; supported dtypes: float64"):
        write_flat(path, {"a": torch.zeros(1, dtype=torch.uint16)}, {})
    with pytest.raises(TypeError, match="dense"):
        write_flat(path, {"a": torch.eye(2).to_sparse()}, {})
    assert list(tmp_path.iterdir()) == []


def test_missing_destination_directory_is_file_not_found(tmp_path, ext):
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        write_flat(tmp_path / "nope" / f"x.{ext}", {}, {})


# ------------------------------------------------------------------------------------ atomicity


def test_a_failing_write_leaves_neither_a_file_nor_a_partial(tmp_path, ext, monkeypatch):
    def disk_full(path):
        assert path.name.startswith(".") and path.name.endswith(".partial")
        assert path.stat().st_size > 0  # the data had been written to the temporary file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "_fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        write_flat(tmp_path / f"a.{ext}", {"w": torch.zeros(100)}, {})
    assert list(tmp_path.iterdir()) == []


def test_a_failing_write_keeps_the_previous_bundle(tmp_path, ext, monkeypatch):
    path = write_flat(tmp_path / f"a.{ext}", {"w": torch.zeros(2)}, {"v": "old"})
    monkeypatch.setattr(atomic, "_fsync", lambda p: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_flat(path, {"w": torch.ones(2)}, {"v": "new"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with read_flat(path) as b:
        assert b.meta == {"v": "old"}


def test_written_file_has_umask_permissions(tmp_path, ext):
    umask = os.umask(0)
    os.umask(umask)
    path = write_flat(tmp_path / f"a.{ext}", {}, {})
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_hdf5_manifest_is_the_last_object_written(tmp_path):
    path = write_flat(tmp_path / "a.h5", {f"t{i}": torch.randn(64) for i in range(5)}, {})
    with h5py.File(path, "r") as f:
        offsets = [f["tensors"][name].id.get_offset() for name in f["tensors"]]
        assert f["__manifest__"].id.get_offset() > max(offsets)
        assert f["__manifest__"].dtype == np.uint8
        assert all(f["tensors"][n].compression is None and f["tensors"][n].chunks is None for n in f["tensors"])
        assert all(len(f["tensors"][n].attrs) == 0 for n in f["tensors"])  # format 2: no attributes at all
    assert path.read_bytes()[8] == 2  # superblock v2: checksummed HDF5 metadata


def test_bit_views_are_recorded_in_each_container(tmp_path):
    tensors = {"bf": torch.ones(2, dtype=torch.bfloat16), "f8": torch.ones(2, dtype=torch.float8_e4m3fn),
               "b": torch.ones(2, dtype=torch.bool), "c": torch.ones(2, dtype=torch.complex128)}
    h5 = write_flat(tmp_path / "a.h5", tensors, {})
    with h5py.File(h5, "r") as f:
        got = {k: str(f["tensors"][k].dtype) for k in tensors}
    assert got == {"bf": "uint16", "f8": "uint8", "b": "uint8", "c": "complex128"}
    with read_flat(h5) as b:  # the torch dtype comes from the checksummed manifest
        assert {k: e["dtype"] for k, e in b.manifest["tensors"].items()} == {
            "bf": "bfloat16", "f8": "float8_e4m3fn", "b": "bool", "c": "complex128"}
    sf = write_flat(tmp_path / "a.safetensors", tensors, {})
    with read_flat(sf) as b:
        assert {k: e.get("stored_as") for k, e in b.manifest["tensors"].items()} == {
            "bf": None, "f8": None, "b": None, "c": "uint8"}
    raw = safetensors.torch.load_file(sf)
    assert (raw["c"].dtype, tuple(raw["c"].shape)) == (torch.uint8, (2, 16))


# ------------------------------------------------------------------------------------ reading: the API


def test_flat_bundle_api(bundle):
    b = read_flat(bundle)
    assert isinstance(b, FlatBundle)
    assert b.keys() == ["b", "w"]
    assert "w" in b and "nope" not in b
    assert b.info("b") == TensorInfo(torch.bfloat16, (4,), 8)
    with pytest.raises(KeyError, match="no tensor 'ww' in this bundle; did you mean 'w'"):
        b.info("ww")
    with pytest.raises(KeyError, match="no tensor 'zzz'"):
        b.get("zzz")
    assert "open" in repr(b)
    b.close()
    b.close()  # idempotent
    with pytest.raises(ValueError, match="the bundle is closed"):
        b.get("w")
    assert b.info("w").shape == (2, 3)  # the manifest stays available


def test_hdf5_reads_are_lazy_through_an_open_read_only_handle(tmp_path):
    path = write_flat(tmp_path / "a.h5", {"w": torch.zeros(3)}, {})
    with read_flat(path) as b:
        handle = b._reader.file
        assert handle.id.valid and handle.mode == "r"
    assert not handle.id.valid


def test_missing_file_is_file_not_found_with_a_hint(tmp_path):
    missing = tmp_path / "gone.h5"
    with pytest.raises(FileNotFoundError, match=leading(missing, "no such bundle file; check the path")):
        read_flat(missing)


def test_directory_is_a_directory_error(tmp_path):
    d = tmp_path / "dir.h5"
    d.mkdir()
    with pytest.raises(IsADirectoryError, match=leading(d, "is a directory")):
        read_flat(d)


# ------------------------------------------------------------------------------------ reading: corruption


def rewrite_manifest(path: pathlib.Path, text: str) -> None:
    """Replace a bundle's manifest by ``text``, keeping every tensor as it is."""
    if path.suffix == ".h5":
        with h5py.File(path, "r+") as f:
            del f["__manifest__"]
            f.create_dataset("__manifest__", data=np.frombuffer(text.encode(), dtype=np.uint8))
    else:
        tensors = safetensors.torch.load_file(path)
        safetensors.torch.save_file(tensors, path, metadata={"nanreplay_manifest": text})


def edited(path: pathlib.Path, edit) -> None:
    with read_flat(path) as b:
        manifest = json.loads(json.dumps(b.manifest))
    edit(manifest)
    rewrite_manifest(path, json.dumps(manifest))


def test_empty_file(tmp_path, ext):
    path = tmp_path / f"e.{ext}"
    path.touch()
    kind = "an HDF5" if ext == "h5" else "a safetensors"
    with pytest.raises(BundleFormatError, match=leading(path, f"empty file (0 bytes): expected {kind} nanreplay bundle")):
        read_flat(path)


def test_random_bytes(tmp_path):
    rng = np.random.default_rng(0)
    junk = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    h5, sf = tmp_path / "r.h5", tmp_path / "r.safetensors"
    h5.write_bytes(junk)
    sf.write_bytes(junk)
    with pytest.raises(BundleFormatError, match=leading(h5, "not an HDF5 file: expected the HDF5 signature")):
        read_flat(h5)
    with pytest.raises(BundleFormatError, match=leading(sf, "not a safetensors file: expected an 8-byte")):
        read_flat(sf)


def test_random_bytes_after_a_plausible_safetensors_prefix(tmp_path):
    path = tmp_path / "r.safetensors"
    path.write_bytes((40).to_bytes(8, "little") + b'{"a": garbage that is not json' + b"\0" * 40)
    with pytest.raises(BundleFormatError, match=leading(path, "unreadable safetensors file")) as e:
        read_flat(path)
    assert e.value.__cause__ is not None


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_file(bundle, keep):
    data = bundle.read_bytes()
    bundle.write_bytes(data[: int(len(data) * keep)])
    phrase = "unreadable HDF5 file" if bundle.suffix == ".h5" else "(unreadable|not a) safetensors file"
    with pytest.raises(BundleFormatError, match="^" + re.escape(f"{bundle}: ") + phrase) as e:
        read_flat(bundle)
    assert "truncated" in str(e.value)


def test_truncated_safetensors_keeps_header_but_loses_data(tmp_path):
    bundle = small_bundle(tmp_path / "b.safetensors")
    bundle.write_bytes(bundle.read_bytes()[:-3])
    with pytest.raises(BundleFormatError, match=leading(bundle, "unreadable safetensors file")) as e:
        read_flat(bundle)
    assert "covering the" in str(e.value) and "truncated" in str(e.value)


@pytest.mark.parametrize("name", ["renamed.txt", "no_extension", "other.safetensors", "other.h5"])
def test_the_container_is_recognised_by_its_first_bytes_not_its_name(tmp_path, ext, name):
    original = small_bundle(tmp_path / f"b.{ext}")
    renamed = tmp_path / name
    renamed.write_bytes(original.read_bytes())
    with read_flat(renamed) as b:
        assert b.format == ("hdf5" if ext == "h5" else "safetensors")
        assert torch.equal(b.get("w"), torch.arange(1000.0, 1006.0).reshape(2, 3))


def test_a_file_of_neither_container_without_a_known_extension(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"just some text, not a bundle")
    with pytest.raises(BundleFormatError, match=leading(path, "not a bundle: expected the HDF5 signature 89 48 44 46 0d 0a 1a 0a or a safetensors header")):
        read_flat(path)


def test_a_fifo_named_like_a_bundle_is_refused_without_waiting(tmp_path):
    path = tmp_path / "x.h5"
    os.mkfifo(path)  # no writer: opening it for reading the ordinary way would block forever
    with pytest.raises(BundleFormatError, match=leading(path, "not a regular file: expected a bundle file, found a FIFO")):
        read_flat(path)


def test_a_device_named_like_a_bundle_is_refused(tmp_path):
    path = tmp_path / "zero.safetensors"
    path.symlink_to("/dev/zero")
    with pytest.raises(BundleFormatError, match=leading(path, "not a regular file: expected a bundle file, found a character device")):
        read_flat(path)


def test_foreign_hdf5_file_has_no_manifest(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(3)
    with pytest.raises(BundleFormatError, match=leading(path, "no manifest: the bundle is incomplete (torn write?)")):
        read_flat(path)


def test_torn_hdf5_write_has_no_manifest(tmp_path):
    bundle = small_bundle(tmp_path / "b.h5")
    with h5py.File(bundle, "r+") as f:
        del f["__manifest__"]
    with pytest.raises(BundleFormatError, match=leading(bundle, "no manifest: the bundle is incomplete (torn write?)")) as e:
        read_flat(bundle)
    assert "found only ['tensors']" in str(e.value)


def test_foreign_safetensors_file_has_no_manifest(tmp_path):
    path = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(2)}, path, metadata={"format": "pt"})
    with pytest.raises(BundleFormatError, match=leading(path, "no manifest: the bundle is incomplete (torn write?)")) as e:
        read_flat(path)
    assert "metadata keys ['format']" in str(e.value)


def test_manifest_that_is_not_json(bundle):
    rewrite_manifest(bundle, '{"format": "nanreplay-bundle", ')
    with pytest.raises(BundleFormatError, match=leading(bundle, "corrupt manifest: expected a UTF-8 JSON object")) as e:
        read_flat(bundle)
    assert isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize("text", ["[1, 2]", '{"a": 1, "a": 2}', '{"x": NaN}'])
def test_manifest_json_that_is_not_an_object_or_not_strict(bundle, text):
    rewrite_manifest(bundle, text)
    with pytest.raises(BundleFormatError, match=leading(bundle, "corrupt manifest")):
        read_flat(bundle)


def test_manifest_newer_format_version_asks_for_an_upgrade(bundle):
    edited(bundle, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(BundleFormatError, match=leading(bundle, f"unsupported format_version {FORMAT_VERSION + 1}")) as e:
        read_flat(bundle)
    assert "upgrade nanreplay" in str(e.value)


@pytest.mark.parametrize(
    "edit, detail",
    [
        (lambda m: m.update(format="other"), "'format' to be 'nanreplay-bundle'"),
        (lambda m: m.update(format_version="1"), "'format_version' to be a positive integer"),
        (lambda m: m.update(extra=1), "unexpected ['extra']"),
        (lambda m: m.update(meta=[]), "'meta' to be a JSON object"),
        (lambda m: m["tensors"]["w"].update(dtype="float128"), "['dtype'] to be one of"),
        (lambda m: m["tensors"]["w"].update(shape=[3, 3]), "['nbytes'] to be prod(shape) * itemsize = 36"),
        (lambda m: m["tensors"]["w"].update(shape=[2, -3], nbytes=-24), "['shape'] to be a list"),
        (lambda m: m["tensors"]["w"].update(shape=[2.0, 3]), "['shape'] to be a list"),
        (lambda m: m["tensors"]["w"].update(nbytes=True), "['nbytes'] to be"),
        (lambda m: m["tensors"]["w"].update(crc32=-1), "['crc32'] to be an integer in [0, 2**32)"),
        (lambda m: m["tensors"]["w"].pop("crc32"), "missing ['crc32']"),
        (lambda m: m["tensors"]["w"].update(stored_as="pickle"), "stored_as"),
        (lambda m: m["tensors"]["w"].update(shape=[2**20, 2**20], nbytes=4 * 2**40), "at most the file size"),
    ],
)
def test_hand_edited_manifest_fails_the_schema(bundle, edit, detail):
    edited(bundle, edit)
    with pytest.raises(BundleFormatError, match=leading(bundle, "invalid manifest: expected ")) as e:
        read_flat(bundle)
    assert detail in str(e.value)
    assert "re-record the bundle" in str(e.value)


@pytest.mark.parametrize(
    "edit, detail",
    [
        (lambda m: m["tensors"]["w"].update(shape=[3, 2]), "tensor 'w' stored as"),
        (lambda m: m["tensors"]["w"].update(shape=[6], dtype="int32"), "tensor 'w' stored as"),
        (lambda m: m["tensors"]["b"].update(dtype="float16"), "tensor 'b' stored as"),
        (lambda m: m["tensors"].update(ghost=dict(m["tensors"]["b"])), "tensor 'ghost' (listed in the manifest)"),
    ],
)
def test_hand_edited_manifest_that_disagrees_with_the_file(bundle, edit, detail):
    edited(bundle, edit)
    with pytest.raises(BundleFormatError, match=leading(bundle, "manifest does not match the file: expected ")) as e:
        read_flat(bundle)
    assert detail in str(e.value)


def test_flipped_byte_inside_a_tensor_fails_the_checksum(bundle):
    want = torch.arange(1000.0, 1006.0).reshape(2, 3)
    data = bytearray(bundle.read_bytes())
    at = bytes(data).find(want.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x01
    bundle.write_bytes(bytes(data))
    with read_flat(bundle) as b:
        assert_bit_exact(b.get("b"), torch.ones(4, dtype=torch.bfloat16))  # the other tensor is fine
        with pytest.raises(BundleFormatError, match=leading(bundle, "checksum mismatch for tensor 'w': expected crc32 0x")):
            b.get("w")
        damaged = b.get("w", verify=False)
    assert not torch.equal(damaged, want)
    assert (damaged != want).sum().item() == 1


def test_extra_tensors_not_in_the_manifest_are_ignored_with_a_warning(bundle, caplog):
    with read_flat(bundle) as b:
        manifest = json.dumps(b.manifest)
    if bundle.suffix == ".h5":
        with h5py.File(bundle, "r+") as f:
            f["tensors"]["stray"] = np.zeros(2)
    else:
        tensors = safetensors.torch.load_file(bundle)
        tensors["stray"] = torch.zeros(2)
        safetensors.torch.save_file(tensors, bundle, metadata={"nanreplay_manifest": manifest})
    with caplog.at_level("WARNING", logger="nanreplay.format.container"):
        with read_flat(bundle) as b:
            assert b.keys() == ["b", "w"]
    assert "not listed in the manifest" in caplog.text


def test_hdf5_attributes_are_never_read(tmp_path):
    """Version-1 files carry a variable-length ``torch_dtype`` attribute per dataset; one corrupted
    byte of such an attribute crashed the HDF5 library. The reader takes the dtype from the
    checksummed manifest and never reads attributes, whatever they say."""
    bundle = small_bundle(tmp_path / "b.h5")
    with h5py.File(bundle, "r+") as f:
        f["tensors"]["b"].attrs["torch_dtype"] = "float16"
        f["tensors"]["w"].attrs["anything"] = np.arange(3)
    with read_flat(bundle) as b:
        assert b.get("b").dtype == torch.bfloat16


def test_hdf5_external_link_is_refused(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["w"] = np.zeros(1, dtype=np.float32)
    path = write_flat(tmp_path / "a.h5", {"w": torch.zeros(1)}, {})
    with h5py.File(path, "r+") as f:
        del f["tensors"]["w"]
        f["tensors"]["w"] = h5py.ExternalLink(str(other), "w")
    with pytest.raises(BundleFormatError, match=leading(path, "manifest does not match the file")) as e:
        read_flat(path)
    assert "found an external link at /tensors/w" in str(e.value)


def test_a_version_1_hdf5_file_still_reads_bit_exactly(tmp_path):
    """Version 1 (the previous writer): HDF5 metadata without checksums and a variable-length
    ``torch_dtype`` attribute on every dataset, which the reader never reads."""
    tensors = special_values()
    v2 = write_flat(tmp_path / "v2.h5", tensors, {"step": 3})
    v1 = tmp_path / "v1.h5"
    with h5py.File(v2, "r") as src, h5py.File(v1, "w", libver="earliest") as dst:
        manifest = json.loads(src["__manifest__"][()].tobytes())
        manifest["format_version"] = 1
        for key, entry in manifest["tensors"].items():
            name = hdf5._h5_name(key)
            dst.create_dataset(f"tensors/{name}", data=src["tensors"][name][()], track_times=False).attrs["torch_dtype"] = entry["dtype"]
        dst.create_dataset("__manifest__", data=np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8), track_times=False)
    assert v1.read_bytes()[8] == 0  # superblock version 0, as the version-1 writer produced
    with read_flat(v1) as b:
        assert b.manifest["format_version"] == 1 and b.meta == {"step": 3}
        for key, want in tensors.items():
            assert_bit_exact(b.get(key), want)
