"""The manifest both bundle containers share, and what it describes: the dtype table, the tensor
checks of the writer, the CRC-32 checksums, the strict JSON of the manifest and its schema.

The manifest (``format``, ``format_version``, ``writer``, ``tensors``, ``meta``) lists every tensor
with its dtype, shape, byte count and the zlib CRC-32 of its raw little-endian bytes; it is
written last (:mod:`nanreplay.format.hdf5`, :mod:`nanreplay.format.safetensors`), so a file
without one is a torn write. Reading validates it against the schema here before any tensor is
touched. The byte-level specification is ``docs/bundle-format.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import json
import math
import os
import pathlib
import zlib
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Union

import numpy as np
import torch

from nanreplay.core.safejson import strict_loads
from nanreplay.errors import BundleFormatError

from .atomic import _pread_into

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_CONTAINERS",
    "MAX_JSON_SEPARATORS",
    "TensorInfo",
    "strict_json",
]

FORMAT_NAME = "nanreplay-bundle"
#: Written by this version; every version from 1 up to it is read (see docs/bundle-format.md).
FORMAT_VERSION = 2
#: Largest manifest (UTF-8 JSON bytes) written or read; checked before any JSON parsing.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: Deepest nesting of JSON arrays and objects accepted in a manifest (and written).
MAX_JSON_DEPTH = 64
#: Most JSON arrays and objects, and most separators (``,`` and ``:``, i.e. about as many values),
#: a manifest or safetensors header may hold: checked on the raw bytes before parsing, they bound
#: the memory the parsed document takes (a bundle of 150 000 tensors uses about a tenth of each).
MAX_JSON_CONTAINERS = 1 << 22
MAX_JSON_SEPARATORS = 1 << 23
#: Largest number of dimensions accepted in a manifest shape.
_MAX_NDIM = 64
_READ_CHUNK = 8 << 20
_REINSTATE = "re-record the bundle, or restore it from a copy"


class TensorInfo(NamedTuple):
    """What the manifest says about one tensor, without reading its data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class _DType(NamedTuple):
    name: str  # the torch dtype name used in the manifest
    torch: torch.dtype
    itemsize: int
    h5: np.dtype  # the numpy dtype of the HDF5 dataset
    h5_view: Optional[torch.dtype]  # same-width integer dtype when HDF5 stores a bit view
    st: Optional[str]  # the safetensors dtype string, None when safetensors has none


def _dt(name: str, np_dtype: str, h5_view: Optional[torch.dtype], st: Optional[str]) -> _DType:
    t = getattr(torch, name)
    return _DType(name, t, t.itemsize, np.dtype(np_dtype), h5_view, st)


_DTYPES: dict[str, _DType] = {
    d.name: d
    for d in (
        _dt("float64", "<f8", None, "F64"),
        _dt("float32", "<f4", None, "F32"),
        _dt("float16", "<f2", None, "F16"),
        _dt("bfloat16", "<u2", torch.uint16, "BF16"),
        _dt("float8_e4m3fn", "|u1", torch.uint8, "F8_E4M3"),
        _dt("float8_e5m2", "|u1", torch.uint8, "F8_E5M2"),
        _dt("int8", "|i1", None, "I8"),
        _dt("int16", "<i2", None, "I16"),
        _dt("int32", "<i4", None, "I32"),
        _dt("int64", "<i8", None, "I64"),
        _dt("uint8", "|u1", None, "U8"),
        _dt("bool", "|u1", torch.uint8, "BOOL"),
        _dt("complex64", "<c8", None, "C64"),
        _dt("complex128", "<c16", None, None),
    )
}


_BY_TORCH: dict[torch.dtype, _DType] = {d.torch: d for d in _DTYPES.values()}


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a flat uint8 numpy view (no copy)."""
    if t.numel() == 0:  # a 0-element tensor may carry strides that view() refuses
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(_raw_bytes(t))


def _crc32_all(ts: list[torch.Tensor]) -> list[int]:
    """CRC-32 of each tensor, on up to 4 threads when there is enough data to be worth it:
    ``zlib.crc32`` releases the GIL on buffers over a few KiB, so tensors are checksummed in
    parallel (the checksums are most of a bundle write's cost beyond the I/O itself)."""
    workers = min(4, os.cpu_count() or 1)
    if workers < 2 or len(ts) < 2 or sum(t.numel() * t.element_size() for t in ts) < (16 << 20):
        return [_crc32(t) for t in ts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nanreplay-crc") as pool:
        return list(pool.map(_crc32, ts))


def _error(path: pathlib.Path, phrase: str, expected: str, found: str, fix: str) -> BundleFormatError:
    return BundleFormatError(f"{path}: {phrase}: expected {expected}, found {found}; {fix}")


@contextlib.contextmanager
def _translating(path: pathlib.Path, phrase: str, expected: str, fix: str = _REINSTATE) -> Iterator[None]:
    """Re-raise any failure inside the block (h5py, the HDF5 library, json, I/O, a hostile size
    that cannot be allocated) as a BundleFormatError chained to it. Only for reading."""
    try:
        yield
    except BundleFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - every library failure on a bad file is a format error
        raise _error(path, phrase, expected, f"{type(e).__name__}: {str(e)[:300]}", fix) from e


@functools.lru_cache(maxsize=None)
def _writer_versions(fmt: str) -> dict[str, str]:
    import importlib.metadata

    versions = {"torch": torch.__version__, "numpy": np.__version__}
    for dist in ("nanreplay", "h5py" if fmt == "hdf5" else "safetensors"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def _json_problem(obj: Any, where: str, seen: set[int]) -> Optional[str]:
    """Locate the first value json.dumps(allow_nan=False) refuses; None if there is none."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return None
    if isinstance(obj, float):
        if math.isfinite(obj):
            return None
        return f"{where} is {obj!r} (non-finite floats are not JSON; encode them, e.g. as the string 'nan')"
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in seen:
            return f"{where} contains itself (a circular reference)"
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    return f"{where} has a key of type {type(k).__name__} ({k!r}); JSON keys are strings"
                found = _json_problem(v, f"{where}[{k!r}]", seen)
                if found:
                    return found
        else:
            for i, v in enumerate(obj):
                found = _json_problem(v, f"{where}[{i}]", seen)
                if found:
                    return found
        return None
    return f"{where} has type {type(obj).__module__}.{type(obj).__qualname__}, which JSON cannot represent"


def _check_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping (a JSON object), found {type(meta).__name__}")
    meta = dict(meta)
    try:
        json.dumps(meta, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:
        problem = _json_problem(meta, "meta", set()) or str(e)
        raise ValueError(
            f"meta is not JSON-serialisable: {problem}; expected only dicts, lists, str, int, "
            f"finite float, bool and None (json.dumps(allow_nan=False) said: {e})"
        ) from e
    return meta


def _depth_problem(obj: Any, limit: int) -> Optional[int]:
    """The nesting depth of JSON containers in ``obj`` when it exceeds ``limit``, else None
    (iterative: safe on any depth)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            children: Any = x.values()
        elif isinstance(x, (list, tuple)):
            children = x
        else:
            continue
        if d > limit:
            return d
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return None


def _prepare(tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, tuple[_DType, torch.Tensor]]:
    """Validate keys and tensors; return contiguous CPU tensors in sorted key order."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of str to torch.Tensor, found {type(tensors).__name__}")
    out: dict[str, tuple[_DType, torch.Tensor]] = {}
    for key in sorted(tensors, key=lambda k: (not isinstance(k, str), str(k))):
        t = tensors[key]
        if not isinstance(key, str):
            raise TypeError(f"tensor keys must be str, found {type(key).__name__} {key!r}")
        if key in ("", "__metadata__"):
            raise ValueError(
                f"tensor key {key!r} is reserved: keys must be non-empty and must not be "
                "'__metadata__' (safetensors reserves it); rename the tensor"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {key!r}: expected a torch.Tensor, found {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"tensor {key!r}: expected a dense (strided) tensor, found layout {t.layout}; call .to_dense() first")
        spec = _BY_TORCH.get(t.dtype)
        if spec is None:
            raise TypeError(
                f"tensor {key!r}: dtype {t.dtype} is not supported; supported dtypes: {', '.join(_DTYPES)}"
            )
        if t.device.type == "meta":
            raise ValueError(f"tensor {key!r} is on the meta device and has no data to write")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        out[key] = (spec, t)
    return out


def _encode(path: pathlib.Path, fmt: str, prepared: dict[str, tuple[_DType, torch.Tensor]], meta: dict[str, Any],
            stored_as: Callable[[_DType], Optional[str]]) -> tuple[bytes, int]:
    """The manifest of ``prepared`` tensors and ``meta`` as UTF-8 JSON bytes, and its tensor count;
    ``stored_as(spec)`` is ``"uint8"`` for a dtype the container stores as raw bytes.

    Raises:
        ValueError: the manifest exceeds :data:`MAX_MANIFEST_BYTES`.
    """
    entries: dict[str, dict[str, Any]] = {}
    crcs = _crc32_all([t for _, t in prepared.values()])
    for (key, (spec, t)), crc in zip(prepared.items(), crcs):
        entry: dict[str, Any] = {
            "dtype": spec.name,
            "shape": list(t.shape),
            "nbytes": t.numel() * spec.itemsize,
            "crc32": crc,
        }
        if stored_as(spec) is not None:
            entry["stored_as"] = stored_as(spec)
        entries[key] = entry
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "writer": _writer_versions(fmt),
        "tensors": entries,
        "meta": meta,
    }
    manifest_bytes = json.dumps(manifest, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise ValueError(
            f"{path}: manifest too large: expected at most {MAX_MANIFEST_BYTES} bytes of JSON, found "
            f"{len(manifest_bytes)} ({len(entries)} tensors); store large data as tensors, not in meta"
        )
    return manifest_bytes, len(entries)


class _Entry(NamedTuple):
    spec: _DType
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    stored_as: Optional[str]


def strict_json(raw: Union[bytes, str]) -> Any:
    """Parse an untrusted manifest or safetensors header
    (:func:`nanreplay.core.safejson.strict_loads`): UTF-8, no duplicate keys, no ``NaN``/``Infinity``
    and no number that overflows to infinity; before parsing, the raw text must nest at most
    :data:`MAX_JSON_DEPTH` levels and hold at most :data:`MAX_JSON_CONTAINERS` arrays and objects
    and :data:`MAX_JSON_SEPARATORS` separators, which bounds the memory the parsed document takes
    (about 0.5 GiB for the worst 64 MiB).

    Raises:
        ValueError: any of the above (``UnicodeDecodeError`` included).
    """
    return strict_loads(raw, max_depth=MAX_JSON_DEPTH, max_containers=MAX_JSON_CONTAINERS, max_separators=MAX_JSON_SEPARATORS)


def _parse_manifest(path: pathlib.Path, raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _error(
            path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes of JSON", f"{len(raw)} bytes",
            f"the manifest was damaged or forged; {_REINSTATE}",
        )
    try:
        manifest = strict_json(raw)
    except (ValueError, RecursionError, MemoryError) as e:
        raise _error(
            path, "corrupt manifest", "a UTF-8 JSON object", f"{type(e).__name__}: {str(e)[:300]}",
            f"the manifest was hand-edited or damaged; {_REINSTATE}",
        ) from e
    if not isinstance(manifest, dict):
        raise _error(path, "corrupt manifest", "a JSON object", f"a JSON {type(manifest).__name__}", _REINSTATE)
    return manifest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_manifest(path: pathlib.Path, m: dict[str, Any], fmt: str, file_size: int) -> dict[str, _Entry]:
    """Check the manifest schema; return the parsed tensor entries."""

    def invalid(expected: str, found: str) -> BundleFormatError:
        return _error(path, "invalid manifest", expected, found, f"the manifest was hand-edited or damaged; {_REINSTATE}")

    _validate_header(path, m, invalid)
    entries: dict[str, _Entry] = {}
    total = 0
    for key, e in m["tensors"].items():
        entry = _validate_entry(key, e, fmt, invalid)
        total += entry.nbytes
        if total > file_size:
            raise invalid(
                f"tensors totalling at most the file size ({file_size} bytes)", "more bytes declared"
            )
        entries[key] = entry
    return entries


def _validate_header(path: pathlib.Path, m: dict[str, Any], invalid: Callable[[str, str], BundleFormatError]) -> None:
    """The manifest's top level: format name and version, its keys, ``meta``, ``writer``, ``tensors``."""
    if m.get("format") != FORMAT_NAME:
        raise invalid(f"'format' to be {FORMAT_NAME!r}", f"{str(m.get('format'))[:100]!r}")
    version = m.get("format_version")
    if not _is_int(version) or version < 1:
        raise invalid("'format_version' to be a positive integer", repr(version)[:100])
    if version > FORMAT_VERSION:
        shown = str(version) if version < 10**6 else f"{str(version)[:6]}..."
        raise _error(
            path, f"unsupported format_version {shown}",
            f"format_version <= {FORMAT_VERSION} (what this nanreplay reads)",
            f"format_version {shown}, written by a newer nanreplay",
            "upgrade nanreplay (pip install -U nanreplay) to read it",
        )
    allowed = {"format", "format_version", "writer", "tensors", "meta"}
    extra = sorted(set(m) - allowed)
    if extra:
        raise invalid(f"only the keys {sorted(allowed)}", f"unexpected {[k[:100] for k in extra[:10]]}")
    for required in ("tensors", "meta"):
        if required not in m:
            raise invalid(f"a {required!r} key", "none")
    if not isinstance(m["meta"], dict):
        raise invalid("'meta' to be a JSON object", f"a JSON {type(m['meta']).__name__}")
    writer = m.get("writer", {})
    if not isinstance(writer, dict) or not all(isinstance(v, str) for v in writer.values()):
        raise invalid("'writer' to be an object of strings", repr(writer)[:200])
    if not isinstance(m["tensors"], dict):
        raise invalid("'tensors' to be a JSON object", f"a JSON {type(m['tensors']).__name__}")


def _validate_entry(key: str, e: Any, fmt: str, invalid: Callable[[str, str], BundleFormatError]) -> _Entry:
    """One ``tensors`` entry: its fields, dtype, shape, byte count, CRC and ``stored_as``."""
    where = f"tensors[{key[:200]!r}]"
    if key in ("", "__metadata__"):
        raise invalid("non-empty tensor keys other than '__metadata__'", f"{key!r}")
    if not isinstance(e, dict):
        raise invalid(f"{where} to be a JSON object", f"a JSON {type(e).__name__}")
    fields = {"dtype", "shape", "nbytes", "crc32"} | ({"stored_as"} if fmt == "safetensors" else set())
    missing, unknown = sorted({"dtype", "shape", "nbytes", "crc32"} - set(e)), sorted(set(e) - fields)
    if missing or unknown:
        raise invalid(f"{where} to have the fields {sorted(fields)}", f"missing {missing}, unexpected {[u[:50] for u in unknown[:10]]}")
    spec = _DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if spec is None:
        raise invalid(f"{where}['dtype'] to be one of {list(_DTYPES)}", repr(e["dtype"])[:100])
    shape = e["shape"]
    if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(_is_int(s) and 0 <= s < 2**62 for s in shape)):
        raise invalid(f"{where}['shape'] to be a list of at most {_MAX_NDIM} non-negative integers", repr(shape)[:200])
    nbytes = math.prod(shape) * spec.itemsize
    if not _is_int(e["nbytes"]) or e["nbytes"] != nbytes:
        raise invalid(
            f"{where}['nbytes'] to be prod(shape) * itemsize = {nbytes if nbytes < 10**30 else 'a huge number'} for {spec.name} {shape}",
            repr(e["nbytes"])[:100],
        )
    if not _is_int(e["crc32"]) or not 0 <= e["crc32"] < 2**32:
        raise invalid(f"{where}['crc32'] to be an integer in [0, 2**32)", repr(e["crc32"])[:100])
    stored_as = e.get("stored_as")
    if stored_as is not None and stored_as != "uint8":
        raise invalid(f"{where}['stored_as'] to be 'uint8' or absent", repr(stored_as)[:100])
    return _Entry(spec, tuple(shape), nbytes, e["crc32"], stored_as)


class _RawReader:
    """Reads tensor bytes at known offsets of the open file, straight into the destination."""

    def __init__(self, path: pathlib.Path, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size
        self.offsets: dict[str, int] = {}

    def read(self, key: str, entry: _Entry) -> torch.Tensor:
        t = torch.empty(entry.shape, dtype=entry.spec.torch)
        if entry.nbytes:
            got = _pread_into(self.fd, memoryview(_raw_bytes(t)).cast("B"), self.offsets[key])
            if got != entry.nbytes:
                raise OSError(errno.EIO, f"the file ends after {got} of the tensor's {entry.nbytes} bytes")
        return t

    def crc32(self, key: str, entry: _Entry) -> int:
        """The CRC-32 of a tensor's stored bytes, read in chunks of at most 8 MiB."""
        crc, offset, left = 0, self.offsets.get(key, 0), entry.nbytes
        buf = memoryview(bytearray(min(_READ_CHUNK, left)))
        while left:
            n = min(left, len(buf))
            if _pread_into(self.fd, buf[:n], offset) != n:
                raise OSError(errno.EIO, "the file ends inside the tensor's bytes")
            crc = zlib.crc32(buf[:n], crc)
            offset += n
            left -= n
        return crc

    def close(self) -> None:
        os.close(self.fd)
