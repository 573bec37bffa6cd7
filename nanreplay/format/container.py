"""The low-level bundle file layer: one flat ``{key: tensor}`` dict plus a JSON manifest per file.

A bundle is a single file in one of two containers, chosen by the file extension:

* **HDF5** (``.h5`` / ``.hdf5``): every tensor is a contiguous, uncompressed dataset in the group
  ``/tensors`` (its name is the key with ``%``, ``/`` and NUL percent-encoded); dtypes numpy lacks
  (bfloat16, float8, and bool) are stored as same-width unsigned-integer bit views, and every dataset
  carries a ``torch_dtype`` attribute. The manifest is a 1-D ``uint8`` dataset ``/__manifest__``
  holding UTF-8 JSON; it is written after every tensor dataset.
* **safetensors** (``.safetensors``): the layout of huggingface/safetensors (README "Format": an
  8-byte little-endian header length, a JSON header, then the raw little-endian tensor bytes); the
  manifest is the JSON string in the header's metadata field ``nanreplay_manifest``. A dtype the
  installed safetensors cannot hold (complex128 in 0.8) is stored as a ``U8`` tensor of shape
  ``shape + [itemsize]`` holding its raw bytes, and the manifest says so with ``"stored_as": "uint8"``.

The manifest (``format``, ``format_version``, ``writer``, ``tensors``, ``meta``) lists every tensor
with its dtype, shape, byte count and the zlib CRC-32 of its raw little-endian bytes. As in
pytorch/torchsnapshot, the manifest is committed last, so a file without one is a torn write; in
addition every file is written to a hidden ``.<name>.<random>.partial`` file in the same directory,
flushed, fsync'ed and then renamed onto its final name with :func:`os.replace`, so readers only ever
see complete files.

Reading treats every file as untrusted input: no pickle and no ``torch.load`` anywhere, the manifest
size is capped before JSON parsing, the manifest is validated against a strict schema, every listed
tensor must exist in the container with exactly the dtype and shape the manifest states, and every
h5py / safetensors / json / I/O failure is re-raised as :class:`~nanreplay.errors.BundleFormatError`
whose message starts with the file path and says what was expected, what was found and how to fix it.
The full byte/key-level specification is ``docs/bundle-format.md``.

Example::

    >>> p = write_flat("step_12.safetensors", {"param/fc.weight": torch.ones(2, 3)}, {"step": 12})
    >>> with read_flat(p) as b:
    ...     b.keys(), b.info("param/fc.weight"), b.meta
    (['param/fc.weight'], TensorInfo(dtype=torch.float32, shape=(2, 3), nbytes=24), {'step': 12})
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import functools
import json
import logging
import math
import os
import pathlib
import secrets
import sys
import zlib
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Union

import numpy as np
import torch

from nanreplay.errors import BundleFormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "TensorInfo",
    "FlatBundle",
    "bundle_format_for",
    "write_flat",
    "read_flat",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "nanreplay-bundle"
FORMAT_VERSION = 1

#: Largest manifest (UTF-8 JSON bytes) written or read; checked before any JSON parsing.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: Largest safetensors header accepted before handing the file to safetensors (its own limit).
_MAX_SAFETENSORS_HEADER = 100_000_000
#: Largest number of dimensions accepted in a manifest shape.
_MAX_NDIM = 64

_MANIFEST_DATASET = "__manifest__"
_TENSOR_GROUP = "tensors"
_DTYPE_ATTR = "torch_dtype"
_ST_MANIFEST_KEY = "nanreplay_manifest"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_EXTENSIONS = {".h5": "hdf5", ".hdf5": "hdf5", ".safetensors": "safetensors"}
_REINSTATE = "re-record the bundle, or restore it from a copy"

PathLike = Union[str, "os.PathLike[str]"]


class TensorInfo(NamedTuple):
    """What the manifest says about one tensor, without reading its data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class _DType(NamedTuple):
    name: str  # the torch dtype name used in the manifest and in the HDF5 attribute
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

_LIB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    RuntimeError,
    MemoryError,
)
try:  # safetensors >= 0.3 re-exports its Rust error type
    from safetensors import SafetensorError as _SafetensorError

    _LIB_ERRORS = _LIB_ERRORS + (_SafetensorError,)
except ImportError:  # pragma: no cover - very old safetensors
    pass


# --------------------------------------------------------------------------------------- helpers


def bundle_format_for(path: PathLike) -> str:
    """Return the container a bundle path uses, from its extension (case-insensitive).

    ``'hdf5'`` for ``.h5`` / ``.hdf5``, ``'safetensors'`` for ``.safetensors``.

    Raises:
        ValueError: any other extension; the message names the accepted ones.
    """
    name = pathlib.Path(path).name.lower()
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext) and len(name) > len(ext):
            return fmt
    raise ValueError(
        f"{os.fspath(path)}: unknown bundle extension: expected one of .h5, .hdf5 (HDF5) or "
        f".safetensors (safetensors), found {pathlib.Path(path).suffix or 'no extension'!r}; "
        "rename the file or choose one of those extensions"
    )


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - torch targets little-endian hosts
        raise NotImplementedError(
            "nanreplay bundles are little-endian and this host is big-endian; "
            "read and write bundles on a little-endian machine"
        )


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


def _h5_name(key: str) -> str:
    """The HDF5 dataset name of a key: '%', '/' and NUL percent-encoded (injective)."""
    name = key.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
    if name in (".", ".."):
        name = name.replace(".", "%2E")
    return name


def _error(path: pathlib.Path, phrase: str, expected: str, found: str, fix: str) -> BundleFormatError:
    return BundleFormatError(f"{path}: {phrase}: expected {expected}, found {found}; {fix}")


@contextlib.contextmanager
def _translating(path: pathlib.Path, phrase: str, expected: str, fix: str = _REINSTATE) -> Iterator[None]:
    """Re-raise any library failure inside the block as a BundleFormatError chained to it."""
    try:
        yield
    except BundleFormatError:
        raise
    except _LIB_ERRORS as e:
        raise _error(path, phrase, expected, f"{type(e).__name__}: {e}", fix) from e


@functools.lru_cache(maxsize=None)
def _safetensors_native(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors round-trips ``dtype`` natively (probed once per dtype)."""
    spec = _BY_TORCH[dtype]
    if spec.st is None:
        return False
    from safetensors.torch import load as safetensors_bytes_to_tensors  # safetensors' own parser: no pickle
    from safetensors.torch import save as tensors_to_safetensors_bytes

    try:
        loaded = safetensors_bytes_to_tensors(tensors_to_safetensors_bytes({"x": torch.zeros(2, dtype=dtype)}))
    except Exception as e:  # noqa: BLE001 - a capability probe: any failure means "not supported"
        logger.debug("safetensors cannot store %s natively (%s); using the uint8 bit view", dtype, e)
        return False
    return loaded["x"].dtype == dtype


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


# --------------------------------------------------------------------------------------- writing


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
    if fmt == "safetensors":
        _unshare(out)
    return out


def _unshare(prepared: dict[str, tuple[_DType, torch.Tensor]]) -> None:
    """Clone tensors whose bytes overlap another's (safetensors refuses those); others stay views."""
    by_storage: dict[int, list[str]] = {}
    for key, (_, t) in prepared.items():
        if t.untyped_storage().nbytes():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        if len(keys) < 2:
            continue
        areas = sorted(
            (prepared[k][1].data_ptr(), prepared[k][1].data_ptr() + prepared[k][1].nbytes, k) for k in keys
        )
        last_stop = areas[0][1]
        for start, stop, key in areas[1:]:
            if start < last_stop:
                spec, t = prepared[key]
                prepared[key] = (spec, t.clone())
            else:
                last_stop = max(last_stop, stop)


def _create_tmp(path: pathlib.Path) -> pathlib.Path:
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.partial")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        os.close(fd)
        return tmp


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: pathlib.Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:  # some filesystems refuse fsync on directories; the rename still happened
        logger.debug("could not fsync directory %s: %s", directory, e)


def _write_hdf5(tmp: pathlib.Path, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes) -> None:
    import h5py

    with h5py.File(tmp, "w") as f:
        group = f.create_group(_TENSOR_GROUP)
        for key, (spec, t) in prepared.items():
            arr = (t.view(spec.h5_view) if spec.h5_view is not None else t).numpy()
            ds = group.create_dataset(_h5_name(key), data=arr, track_times=False)
            ds.attrs[_DTYPE_ATTR] = spec.name
        # The manifest is the last object written: a file without it is a torn write.
        f.create_dataset(_MANIFEST_DATASET, data=np.frombuffer(manifest, dtype=np.uint8), track_times=False)


def _write_safetensors(
    tmp: pathlib.Path, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes
) -> None:
    import safetensors.torch

    out = {}
    for key, (spec, t) in prepared.items():
        if _safetensors_native(spec.torch):
            out[key] = t
        else:
            out[key] = torch.from_numpy(_raw_bytes(t)).reshape(*t.shape, spec.itemsize)
    safetensors.torch.save_file(out, tmp, metadata={_ST_MANIFEST_KEY: manifest.decode("utf-8")})


def write_flat(
    path: PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, fsync: bool = True
) -> pathlib.Path:
    """Write one bundle file atomically and return its path.

    The container follows the extension (see :func:`bundle_format_for`). The data goes to a hidden
    ``.<name>.<random>.partial`` file in the same directory, is flushed and fsync'ed, and is renamed
    onto ``path`` with :func:`os.replace` (replacing any existing file). On any failure the
    temporary file is removed and the exception re-raised unchanged, so ``path`` is either the old
    file, absent, or the complete new one.

    Args:
        path: destination, ending in ``.h5``, ``.hdf5`` or ``.safetensors``; its directory must exist.
        tensors: flat ``str`` keys (any characters except the empty key and ``'__metadata__'``;
            ``'/'`` and ``'.'`` are fine) to dense tensors on any device (copied to CPU) of dtype
            float64/32/16, bfloat16, float8_e4m3fn, float8_e5m2, int8/16/32/64, uint8, bool,
            complex64 or complex128. Any shape, 0-dim and 0-element included; non-contiguous and
            storage-sharing tensors are written as contiguous copies. Values are stored bit-exactly
            (NaN payloads, -0.0 and infinities included). Autograd history is dropped.
        meta: a JSON object; it must pass ``json.dumps(allow_nan=False)`` (encode non-finite floats
            yourself). Non-string keys come back as strings, tuples as lists.
        fsync: flush the file and its directory to stable storage before returning (default).
            ``False`` skips both fsyncs (about 0.1 s per bundle on a typical disk, more on network
            filesystems): the file is still complete-or-absent for other processes, but a power
            loss right after the call may lose it. For benchmarks and throwaway bundles.

    Returns:
        ``pathlib.Path(path)``.

    Raises:
        ValueError: unknown extension, reserved key, meta not JSON-serialisable (the message names
            the offending entry, e.g. ``meta['lr']``), or a manifest over ``MAX_MANIFEST_BYTES``.
        TypeError: a key that is not ``str``, a value that is not a dense tensor, or an
            unsupported dtype.
        FileNotFoundError: the destination directory does not exist.
        OSError: any I/O failure (disk full, permissions), unchanged.
    """
    _require_little_endian()
    path = pathlib.Path(path)
    fmt = bundle_format_for(path)
    meta = _check_meta(meta)
    prepared = _prepare(tensors, fmt)

    entries: dict[str, dict[str, Any]] = {}
    crcs = _crc32_all([t for _, t in prepared.values()])
    for (key, (spec, t)), crc in zip(prepared.items(), crcs):
        entry: dict[str, Any] = {
            "dtype": spec.name,
            "shape": list(t.shape),
            "nbytes": t.numel() * spec.itemsize,
            "crc32": crc,
        }
        if fmt == "safetensors" and not _safetensors_native(spec.torch):
            entry["stored_as"] = "uint8"
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
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path}: the destination directory {path.parent} does not exist; create it first"
        )

    tmp = _create_tmp(path)
    try:
        mode = tmp.stat().st_mode & 0o777  # 0o666 minus the umask, as the OS applied it
        if fmt == "hdf5":
            _write_hdf5(tmp, prepared, manifest_bytes)
        else:
            _write_safetensors(tmp, prepared, manifest_bytes)
        if tmp.stat().st_mode & 0o777 != mode:  # safetensors recreates the file as 0o600
            os.chmod(tmp, mode)
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        except OSError as cleanup_error:
            logger.warning("could not remove temporary file %s: %s", tmp, cleanup_error)
        raise
    if fsync:
        _fsync_dir(path.parent)
    logger.debug("wrote %s bundle %s: %d tensors, %d manifest bytes", fmt, path, len(entries), len(manifest_bytes))
    return path


# --------------------------------------------------------------------------------------- reading


class _Entry(NamedTuple):
    spec: _DType
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    stored_as: Optional[str]


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} in a JSON object")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_manifest(path: pathlib.Path, raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _error(
            path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes of JSON", f"{len(raw)} bytes",
            f"the manifest was damaged or forged; {_REINSTATE}",
        )
    try:
        manifest = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _error(
            path, "corrupt manifest", "a UTF-8 JSON object", f"{type(e).__name__}: {e}",
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

    if m.get("format") != FORMAT_NAME:
        raise invalid(f"'format' to be {FORMAT_NAME!r}", f"{m.get('format')!r}")
    version = m.get("format_version")
    if not _is_int(version) or version < 1:
        raise invalid("'format_version' to be a positive integer", repr(version))
    if version > FORMAT_VERSION:
        raise _error(
            path, f"unsupported format_version {version}",
            f"format_version <= {FORMAT_VERSION} (what this nanreplay reads)",
            f"format_version {version}, written by a newer nanreplay",
            "upgrade nanreplay (pip install -U nanreplay) to read it",
        )
    allowed = {"format", "format_version", "writer", "tensors", "meta"}
    extra = sorted(set(m) - allowed)
    if extra:
        raise invalid(f"only the keys {sorted(allowed)}", f"unexpected {extra}")
    for required in ("tensors", "meta"):
        if required not in m:
            raise invalid(f"a {required!r} key", "none")
    if not isinstance(m["meta"], dict):
        raise invalid("'meta' to be a JSON object", f"a JSON {type(m['meta']).__name__}")
    writer = m.get("writer", {})
    if not isinstance(writer, dict) or not all(isinstance(v, str) for v in writer.values()):
        raise invalid("'writer' to be an object of strings", repr(writer)[:200])
    tensors = m["tensors"]
    if not isinstance(tensors, dict):
        raise invalid("'tensors' to be a JSON object", f"a JSON {type(tensors).__name__}")

    entries: dict[str, _Entry] = {}
    total = 0
    for key, e in tensors.items():
        where = f"tensors[{key!r}]"
        if key in ("", "__metadata__"):
            raise invalid("non-empty tensor keys other than '__metadata__'", f"{key!r}")
        if not isinstance(e, dict):
            raise invalid(f"{where} to be a JSON object", f"a JSON {type(e).__name__}")
        fields = {"dtype", "shape", "nbytes", "crc32"} | ({"stored_as"} if fmt == "safetensors" else set())
        missing, unknown = sorted({"dtype", "shape", "nbytes", "crc32"} - set(e)), sorted(set(e) - fields)
        if missing or unknown:
            raise invalid(f"{where} to have the fields {sorted(fields)}", f"missing {missing}, unexpected {unknown}")
        spec = _DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if spec is None:
            raise invalid(f"{where}['dtype'] to be one of {list(_DTYPES)}", repr(e["dtype"]))
        shape = e["shape"]
        if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(_is_int(s) and s >= 0 for s in shape)):
            raise invalid(f"{where}['shape'] to be a list of at most {_MAX_NDIM} non-negative integers", repr(shape)[:200])
        nbytes = math.prod(shape) * spec.itemsize
        if not _is_int(e["nbytes"]) or e["nbytes"] != nbytes:
            raise invalid(
                f"{where}['nbytes'] to be prod(shape) * itemsize = {nbytes} for {spec.name} {shape}", repr(e["nbytes"])
            )
        if not _is_int(e["crc32"]) or not 0 <= e["crc32"] < 2**32:
            raise invalid(f"{where}['crc32'] to be an integer in [0, 2**32)", repr(e["crc32"]))
        stored_as = e.get("stored_as")
        if stored_as is not None and stored_as != "uint8":
            raise invalid(f"{where}['stored_as'] to be 'uint8' or absent", repr(stored_as))
        total += nbytes
        entries[key] = _Entry(spec, tuple(shape), nbytes, e["crc32"], stored_as)
    if total > file_size:
        raise invalid(
            f"tensors totalling at most the file size ({file_size} bytes)", f"{total} bytes declared"
        )
    return entries


class _HDF5Reader:
    def __init__(self, path: pathlib.Path) -> None:
        import h5py

        self.path = path
        with _translating(path, "unreadable HDF5 file", "a complete HDF5 file (h5py could not open it)",
                          f"the file is truncated or corrupted; {_REINSTATE}"):
            self.file = h5py.File(path, "r")

    def _dataset(self, parent: Any, name: str, what: str) -> Any:
        import h5py

        link = parent.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise _error(self.path, "manifest does not match the file", f"{what} to be stored in this file",
                         f"a {type(link).__name__}", f"nanreplay never writes links; {_REINSTATE}")
        ds = parent[name]
        if not isinstance(ds, h5py.Dataset) or ds.is_virtual or ds.id.get_create_plist().get_external_count():
            raise _error(self.path, "manifest does not match the file", f"{what} to be a plain dataset",
                         f"a {type(ds).__name__} (virtual or external storage or a group)", _REINSTATE)
        return ds

    def manifest_bytes(self) -> bytes:
        with _translating(self.path, "unreadable HDF5 file", f"a readable {_MANIFEST_DATASET!r} dataset"):
            ds = self._dataset(self.file, _MANIFEST_DATASET, f"dataset {_MANIFEST_DATASET!r}")
            if ds is None:
                found = sorted(self.file.keys())
                raise _error(
                    self.path, "no manifest: the bundle is incomplete (torn write?)",
                    f"a {_MANIFEST_DATASET!r} dataset (written last)",
                    f"only {found[:10]}" if found else "an empty HDF5 file",
                    "the writer stopped before finishing, or this HDF5 file is not a nanreplay bundle; "
                    + _REINSTATE,
                )
            if ds.dtype != np.uint8 or ds.ndim != 1:
                raise _error(self.path, "corrupt manifest", "a 1-D uint8 dataset",
                             f"dtype {ds.dtype}, shape {ds.shape}", _REINSTATE)
            if ds.size > MAX_MANIFEST_BYTES:
                raise _error(self.path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes",
                             f"{ds.size} bytes", _REINSTATE)
            raw = np.empty(ds.shape, dtype=np.uint8)
            if ds.size:
                ds.read_direct(raw)
            return raw.tobytes()

    def check(self, entries: dict[str, _Entry]) -> None:
        with _translating(self.path, "unreadable HDF5 file", "readable tensor datasets"):
            group = self.file.get(_TENSOR_GROUP)
            names = set(group.keys()) if group is not None else set()
            for key, entry in entries.items():
                what = f"tensor {key!r}"
                ds = self._dataset(group, _h5_name(key), what) if group is not None else None
                if ds is None:
                    raise _error(self.path, "manifest does not match the file", f"{what} (listed in the manifest) "
                                 f"at /{_TENSOR_GROUP}/{_h5_name(key)}", "no such dataset", _REINSTATE)
                attr = ds.attrs.get(_DTYPE_ATTR)
                if isinstance(attr, bytes):
                    attr = attr.decode("utf-8", "replace")
                if ds.dtype != entry.spec.h5 or ds.shape != entry.shape or attr != entry.spec.name:
                    raise _error(
                        self.path, "manifest does not match the file",
                        f"{what} stored as {entry.spec.h5} {entry.shape} with {_DTYPE_ATTR}={entry.spec.name!r}",
                        f"{ds.dtype} {ds.shape} with {_DTYPE_ATTR}={attr!r}", _REINSTATE,
                    )
                names.discard(_h5_name(key))
            if names:
                logger.warning("%s: ignoring %d dataset(s) not listed in the manifest: %s",
                               self.path, len(names), sorted(names)[:10])

    def read(self, key: str, entry: _Entry) -> torch.Tensor:
        ds = self.file[_TENSOR_GROUP][_h5_name(key)]
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=entry.spec.torch)
        arr = np.empty(entry.shape, dtype=entry.spec.h5)
        ds.read_direct(arr)
        t = torch.from_numpy(arr)
        return t.view(entry.spec.torch) if entry.spec.h5_view is not None else t

    def close(self) -> None:
        self.file.close()


class _SafetensorsReader:
    def __init__(self, path: pathlib.Path, head: bytes, size: int) -> None:
        from safetensors import safe_open

        self.path = path
        header_len = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
        expected = "an 8-byte little-endian header length, then that many bytes of JSON header starting with '{'"
        fix = f"the file is truncated, corrupted or not a safetensors file; {_REINSTATE}"
        if header_len is None:
            raise _error(path, "not a safetensors file", expected, f"a file of only {size} bytes", fix)
        if header_len > size - 8 or header_len > _MAX_SAFETENSORS_HEADER:
            raise _error(path, "not a safetensors file", expected,
                         f"a header length of {header_len} bytes in a file of {size} bytes", fix)
        if head[8:9] != b"{":
            raise _error(path, "not a safetensors file", expected, f"header starting with {head[8:16]!r}", fix)
        with _translating(path, "unreadable safetensors file", "a valid safetensors file (safetensors refused it)", fix):
            self.file = safe_open(path, framework="pt")
            self.file.__enter__()

    def manifest_bytes(self) -> bytes:
        with _translating(self.path, "unreadable safetensors file", "readable safetensors metadata"):
            metadata = self.file.metadata() or {}
        text = metadata.get(_ST_MANIFEST_KEY)
        if not isinstance(text, str):
            raise _error(
                self.path, "no manifest: the bundle is incomplete (torn write?)",
                f"a {_ST_MANIFEST_KEY!r} entry in the safetensors metadata",
                f"metadata keys {sorted(metadata)[:10]}" if metadata else "no metadata",
                "this safetensors file was not written by nanreplay, or its writer did not finish; " + _REINSTATE,
            )
        if len(text) > MAX_MANIFEST_BYTES:
            raise _error(self.path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes",
                         f"{len(text)} characters", _REINSTATE)
        return text.encode("utf-8", "surrogatepass")

    def check(self, entries: dict[str, _Entry]) -> None:
        with _translating(self.path, "unreadable safetensors file", "readable tensor headers"):
            names = set(self.file.keys())
            for key, entry in entries.items():
                what = f"tensor {key!r}"
                if key not in names:
                    raise _error(self.path, "manifest does not match the file", f"{what} (listed in the manifest)",
                                 "no such tensor", _REINSTATE)
                sl = self.file.get_slice(key)
                found = (sl.get_dtype(), tuple(sl.get_shape()))
                if entry.stored_as == "uint8":
                    want = ("U8", entry.shape + (entry.spec.itemsize,))
                else:
                    want = (entry.spec.st, entry.shape)
                if found != want:
                    raise _error(self.path, "manifest does not match the file",
                                 f"{what} stored as {want[0]} {list(want[1])}",
                                 f"{found[0]} {list(found[1])}", _REINSTATE)
                names.discard(key)
            if names:
                logger.warning("%s: ignoring %d tensor(s) not listed in the manifest: %s",
                               self.path, len(names), sorted(names)[:10])

    def read(self, key: str, entry: _Entry) -> torch.Tensor:
        # clone(): safe_open hands out views of one copy-on-write mapping shared by every get.
        t = self.file.get_tensor(key).clone()
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=entry.spec.torch)
        if entry.stored_as == "uint8":
            t = t.reshape(-1).view(entry.spec.torch).reshape(entry.shape)
        return t

    def close(self) -> None:
        self.file.__exit__(None, None, None)


class FlatBundle:
    """A read-only, lazily read view of one bundle file; returned by :func:`read_flat`.

    Use it as a context manager (or call :meth:`close`); the file stays open until then and
    tensors are read on demand by :meth:`get`.

    Attributes:
        path: the bundle file.
        format: ``'hdf5'`` or ``'safetensors'``.
        manifest: the whole validated manifest (``format``, ``format_version``, ``writer``,
            ``tensors``, ``meta``).
        meta: ``manifest["meta"]``.
    """

    def __init__(self, path: pathlib.Path, fmt: str, manifest: dict[str, Any], entries: dict[str, _Entry],
                 reader: Union[_HDF5Reader, _SafetensorsReader]) -> None:
        self.path = path
        self.format = fmt
        self.manifest = manifest
        self.meta: dict[str, Any] = manifest["meta"]
        self._entries = entries
        self._reader: Optional[Union[_HDF5Reader, _SafetensorsReader]] = reader

    def keys(self) -> list[str]:
        """All tensor keys, sorted."""
        return sorted(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            close = difflib.get_close_matches(str(key), self._entries, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; it holds {len(self._entries)} tensors, see .keys()"
            raise KeyError(f"{self.path}: no tensor {key!r} in this bundle{hint}") from None

    def info(self, key: str) -> TensorInfo:
        """Dtype, shape and byte count of tensor ``key`` from the manifest (reads no data).

        Raises:
            KeyError: no such key (the message suggests close matches).
        """
        e = self._entry(key)
        return TensorInfo(e.spec.torch, e.shape, e.nbytes)

    def get(self, key: str, *, verify: bool = True) -> torch.Tensor:
        """Read tensor ``key``: a new CPU tensor the caller owns, with the recorded dtype and shape,
        bit-exact (NaN payloads included).

        Args:
            verify: compare the CRC-32 of the bytes read with the manifest's (about 1 GB/s).

        Raises:
            KeyError: no such key.
            BundleFormatError: the data cannot be read, or (``verify=True``) its checksum differs;
                the message names the key.
            ValueError: the bundle is closed.
        """
        entry = self._entry(key)
        if self._reader is None:
            raise ValueError(f"{self.path}: the bundle is closed; open it again with read_flat()")
        with _translating(self.path, f"cannot read tensor {key!r}", f"{entry.nbytes} readable bytes"):
            t = self._reader.read(key, entry)
        if verify:
            crc = _crc32(t)
            if crc != entry.crc32:
                raise _error(
                    self.path, f"checksum mismatch for tensor {key!r}",
                    f"crc32 {entry.crc32:#010x} (from the manifest)", f"{crc:#010x} in the data",
                    "the tensor's bytes changed after they were written (disk, copy or hand edit); "
                    f"{_REINSTATE}, or pass verify=False to read the damaged data anyway",
                )
        return t

    def close(self) -> None:
        """Close the file; safe to call twice."""
        if self._reader is not None:
            reader, self._reader = self._reader, None
            reader.close()

    def __enter__(self) -> FlatBundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._reader is None else "open"
        return f"FlatBundle({str(self.path)!r}, format={self.format!r}, tensors={len(self._entries)}, {state})"


def read_flat(path: PathLike) -> FlatBundle:
    """Open a bundle written by :func:`write_flat`, validating its manifest against the file.

    Only the manifest and the tensors' headers are read now; data is read by
    :meth:`FlatBundle.get`. The file is treated as untrusted: no pickle, capped manifest size,
    strict schema.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        ValueError: the extension is not ``.h5`` / ``.hdf5`` / ``.safetensors``.
        PermissionError: the file cannot be opened for reading.
        BundleFormatError: anything else wrong with the file (empty, truncated, foreign, no
            manifest, corrupt or hand-edited manifest, newer ``format_version``); the message
            starts with the path, then a fixed phrase such as ``no manifest: the bundle is
            incomplete (torn write?)``, ``invalid manifest`` or ``unsupported format_version``.
    """
    _require_little_endian()
    path = pathlib.Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, expected a bundle file (.h5, .hdf5 or .safetensors) inside it")
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such bundle file; check the path (bundles are single .h5, .hdf5 or "
            ".safetensors files written by the recorder into its output directory)"
        )
    fmt = bundle_format_for(path)
    with open(path, "rb") as f:  # PermissionError propagates unchanged
        with _translating(path, "cannot read the file", "a readable file"):
            size = os.fstat(f.fileno()).st_size
            head = f.read(16)
    if size == 0:
        kind = "an HDF5" if fmt == "hdf5" else "a safetensors"
        raise _error(path, "empty file (0 bytes)", f"{kind} nanreplay bundle", "an empty file",
                     f"the write was interrupted before any data reached the disk; {_REINSTATE}")

    reader: Union[_HDF5Reader, _SafetensorsReader]
    if fmt == "hdf5":
        if not head.startswith(_HDF5_SIGNATURE):
            hint = " (it looks like safetensors: rename it to .safetensors)" if head[8:9] == b"{" else ""
            raise _error(path, "not an HDF5 file", f"the HDF5 signature {_HDF5_SIGNATURE.hex(' ')} at byte 0",
                         f"{head[:8].hex(' ')}{hint}", f"the file is corrupted or not a bundle; {_REINSTATE}")
        reader = _HDF5Reader(path)
    else:
        reader = _SafetensorsReader(path, head, size)
    try:
        manifest = _parse_manifest(path, reader.manifest_bytes())
        entries = _validate_manifest(path, manifest, fmt, size)
        reader.check(entries)
    except BaseException:
        reader.close()
        raise
    logger.debug("opened %s bundle %s: %d tensors", fmt, path, len(entries))
    return FlatBundle(path, fmt, manifest, entries, reader)
