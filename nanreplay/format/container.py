"""The low-level bundle file layer: one flat ``{key: tensor}`` dict plus a JSON manifest per file.

A bundle is a single file in one of two containers. The writer chooses by the file extension;
the reader recognises the container by its first bytes (the HDF5 signature, or a safetensors
header), whatever the file is called:

* **HDF5** (``.h5`` / ``.hdf5``): every tensor is a contiguous, uncompressed dataset in the group
  ``/tensors`` (its name is the key with ``%``, ``/`` and NUL percent-encoded); dtypes numpy lacks
  (bfloat16, float8, and bool) are stored as same-width unsigned-integer bit views. The manifest
  is a 1-D ``uint8`` dataset ``/__manifest__`` holding UTF-8 JSON; it is written after every
  tensor dataset. Since format version 2 the file uses checksummed HDF5 metadata (superblock v2,
  object headers v2) and no attributes.
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
see complete files. A failed write (a full disk) is reported as the ``OSError`` it is and never
leaves the HDF5 library with a half-closed file; a killed writer's temporary file is removed by
the next write into that directory.

Reading treats every file as untrusted input: only regular files are opened; no pickle and no
``torch.load`` anywhere; the manifest size, nesting depth and numbers are checked before and
while parsing; the manifest is validated against a strict schema; every listed tensor must exist
in the container with exactly the dtype and shape the manifest states, stored contiguously and
uncompressed inside the file (HDF5 links, virtual datasets, external storage and filters are
refused); tensor bytes are read with plain ``pread`` calls straight into the returned tensor (one
copy, bounded by the file size). Every failure is a :class:`~nanreplay.errors.BundleFormatError`
whose message starts with the file path and says what was expected, what was found and how to
fix it. The full byte/key-level specification is ``docs/bundle-format.md``.

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
import errno
import functools
import io
import json
import logging
import math
import os
import pathlib
import re
import secrets
import shlex
import stat
import sys
import time
import zlib
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Union

import numpy as np
import torch

from nanreplay.core.safejson import strict_loads
from nanreplay.core.trust import manifest_digest, mark_trusted
from nanreplay.errors import BundleFormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
    "STALE_PARTIAL_SECONDS",
    "TensorInfo",
    "FlatBundle",
    "bundle_format_for",
    "sniff_format",
    "write_flat",
    "read_flat",
]

logger = logging.getLogger(__name__)

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
#: Largest safetensors header accepted (safetensors' own limit).
_MAX_SAFETENSORS_HEADER = 100_000_000
#: Largest number of dimensions accepted in a manifest shape.
_MAX_NDIM = 64
#: HDF5 links beyond the listed tensors, the manifest and /tensors itself that a file may hold.
_MAX_EXTRA_LINKS = 1024
#: A temporary ``.partial`` file untouched for this long is removed by the next write into its
#: directory even where file locks cannot tell whether its writer is alive.
STALE_PARTIAL_SECONDS = 3600
#: ...and one younger than this is never touched (its writer may be between create and lock).
_PARTIAL_MIN_AGE = 60
_READ_CHUNK = 8 << 20
_MAX_IO = 1 << 30

_MANIFEST_DATASET = "__manifest__"
_TENSOR_GROUP = "tensors"
_ST_MANIFEST_KEY = "nanreplay_manifest"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_H5_LIBVER = ("v108", "v110")  # superblock v2 and v2 object headers: every metadata block is checksummed
_EXTENSIONS = {".h5": "hdf5", ".hdf5": "hdf5", ".safetensors": "safetensors"}
_PARTIAL_RE = re.compile(r"\..+\.[0-9a-f]{12}\.partial")
_REINSTATE = "re-record the bundle, or restore it from a copy"

PathLike = Union[str, "os.PathLike[str]"]


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
    """Re-raise any failure inside the block (h5py, the HDF5 library, json, I/O, a hostile size
    that cannot be allocated) as a BundleFormatError chained to it. Only for reading."""
    try:
        yield
    except BundleFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - every library failure on a bad file is a format error
        raise _error(path, phrase, expected, f"{type(e).__name__}: {str(e)[:300]}", fix) from e


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
    return out


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:done + _MAX_IO], offset + done)
        if n <= 0:  # pragma: no cover - pwrite reports errors by raising
            raise OSError(errno.EIO, "write returned no progress")
        done += n


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (less than ``len(buf)`` only at EOF)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + _MAX_IO]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _GuardedWriter(io.RawIOBase):
    """The file object h5py's ``fileobj`` driver writes the HDF5 file through.

    The HDF5 library cannot survive a failed write: after ``ENOSPC`` its file stays half-open and
    the process crashes later, when the object is finalised (h5py issue #914). So a failed write
    is never reported to it: the first ``OSError`` is kept in :attr:`error` and every later write
    goes to memory instead (only blocks of up to 1 MiB, i.e. metadata, which the library may read
    back; raw data is dropped), so the library finishes and closes the file normally. The writer
    then raises :attr:`error` itself.
    """

    _OVERLAY_WRITE = 1 << 20
    _OVERLAY_TOTAL = 256 << 20

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.pos, self.end = fd, 0, 0
        self.error: Optional[OSError] = None
        self._overlay: list[tuple[int, bytes]] = []
        self._overlay_bytes = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.end + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self.error is None:
            try:
                _pwrite_all(self.fd, mv, self.pos)
            except OSError as e:
                self.error = e
                logger.debug("bundle write failed at offset %d (%s); letting the HDF5 library finish in memory", self.pos, e)
        if self.error is not None and len(mv) <= self._OVERLAY_WRITE and self._overlay_bytes < self._OVERLAY_TOTAL:
            self._overlay.append((self.pos, bytes(mv)))
            self._overlay_bytes += len(mv)
        self.pos += len(mv)
        self.end = max(self.end, self.pos)
        return len(mv)

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        got = _pread_into(self.fd, mv, self.pos)
        mv[got:] = bytes(len(mv) - got)
        lo, hi = self.pos, self.pos + len(mv)
        for off, data in self._overlay:  # in write order: the last write wins
            a, z = max(lo, off), min(hi, off + len(data))
            if a < z:
                mv[a - lo:z - lo] = data[a - off:z - off]
        self.pos = hi
        return len(mv)

    def truncate(self, size: Optional[int] = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                self.error = e
        self.end = size
        return size

    def flush(self) -> None:
        return None


def _lock(fd: int) -> None:
    """Hold an exclusive lock on our temporary file while writing it: the stale-file cleanup of
    another writer in the same directory then knows it is alive (best effort)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError) as e:  # Windows, or a filesystem without locks: the age rule remains
        logger.debug("could not lock the temporary bundle file (%s); stale-file cleanup falls back to its age", e)


def _create_tmp(path: pathlib.Path) -> tuple[pathlib.Path, int]:
    """Create and lock ``.<name>.<12 hex>.partial`` beside ``path``; returns it and its fd
    (read-write, mode 0o666 minus the umask)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.partial")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        _lock(fd)
        return tmp, fd


def _writer_gone(path: str, st: os.stat_result) -> Optional[bool]:
    """Whether nobody holds the lock on the temporary file ``path`` (True: its writer died),
    False while a writer holds it, None when locks cannot tell (no fcntl, unsupported)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return False  # replaced meanwhile: leave it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return None
        return True
    finally:
        os.close(fd)


def _remove_stale_partials(directory: pathlib.Path, own: pathlib.Path) -> None:
    """Delete temporary files of earlier, killed writes into ``directory``: only names of our own
    pattern ``.<name>.<12 hex>.partial``, only regular files of this user, never one younger than
    a minute, and only when no writer holds its lock (or, where locks cannot tell, when it is
    older than :data:`STALE_PARTIAL_SECONDS`). Never raises."""
    now = time.time()
    try:
        entries = [e for e in os.scandir(directory) if _PARTIAL_RE.fullmatch(e.name) and e.name != own.name]
    except OSError as e:
        logger.debug("could not list %s for stale temporary files: %s", directory, e)
        return
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue
            age = now - st.st_mtime
            if age < _PARTIAL_MIN_AGE:
                continue
            gone = _writer_gone(entry.path, st)
            if gone or (gone is None and age > STALE_PARTIAL_SECONDS):
                os.unlink(entry.path)
                logger.info("removed %s, the temporary file of an interrupted bundle write (%d bytes, %.0f s old)",
                            entry.path, st.st_size, age)
        except OSError as e:
            logger.debug("could not check temporary file %s: %s", entry.path, e)


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


def _write_hdf5(fd: int, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes) -> None:
    import h5py

    guard = _GuardedWriter(fd)
    with h5py.File(guard, "w", libver=_H5_LIBVER) as f:
        group = f.create_group(_TENSOR_GROUP)
        for key, (spec, t) in prepared.items():
            if guard.error is not None:
                break  # the disk is full: stop feeding data, let the library close cleanly
            arr = (t.view(spec.h5_view) if spec.h5_view is not None else t).numpy()
            group.create_dataset(_h5_name(key), data=arr, track_times=False)
        # The manifest is the last object written: a file without it is a torn write.
        if guard.error is None:
            f.create_dataset(_MANIFEST_DATASET, data=np.frombuffer(manifest, dtype=np.uint8), track_times=False)
    if guard.error is not None:
        raise guard.error


def _st_stored(spec: _DType, t: torch.Tensor) -> tuple[str, list[int], int]:
    """(safetensors dtype, stored shape, stored itemsize) of a tensor in the safetensors container."""
    if _safetensors_native(spec.torch):
        return spec.st or "U8", list(t.shape), spec.itemsize
    return "U8", [*t.shape, spec.itemsize], 1


def _write_safetensors(fd: int, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes) -> None:
    """Write the safetensors layout (huggingface/safetensors README, "Format") straight from the
    tensors' memory: 8-byte little-endian header length, the JSON header padded with spaces to a
    multiple of 8 bytes, then each tensor's bytes, larger items first so every tensor is aligned to
    its item size (as safetensors orders them). Read back by ``safetensors.torch.load_file``."""
    order = sorted(prepared, key=lambda k: (-_st_stored(*prepared[k])[2], k))
    header: dict[str, Any] = {}
    offset = 0
    for key in order:
        spec, t = prepared[key]
        dtype, shape, _ = _st_stored(spec, t)
        nbytes = t.numel() * spec.itemsize
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {_ST_MANIFEST_KEY: manifest.decode("utf-8")}
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    pos = 0
    for chunk in (len(raw).to_bytes(8, "little"), raw):
        _pwrite_all(fd, memoryview(chunk), pos)
        pos += len(chunk)
    for key in order:
        data = _raw_bytes(prepared[key][1])
        _pwrite_all(fd, memoryview(data).cast("B"), pos)
        pos += data.nbytes
    os.ftruncate(fd, pos)


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


def write_flat(
    path: PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, fsync: bool = True,
    trusted: bool = False,
) -> pathlib.Path:
    """Write one bundle file atomically and return its path.

    The container follows the extension (see :func:`bundle_format_for`). The data goes to a hidden
    ``.<name>.<random>.partial`` file in the same directory (locked while it is written), is
    flushed and fsync'ed, and is renamed onto ``path`` with :func:`os.replace` (replacing any
    existing file). On any failure the temporary file is removed and the exception re-raised
    unchanged, so ``path`` is either the old file, absent, or the complete new one. Temporary
    files of earlier writes into the same directory whose writer is gone are removed first.

    Args:
        path: destination, ending in ``.h5``, ``.hdf5`` or ``.safetensors``; its directory must exist.
        tensors: flat ``str`` keys (any characters except the empty key and ``'__metadata__'``;
            ``'/'`` and ``'.'`` are fine) to dense tensors on any device (copied to CPU) of dtype
            float64/32/16, bfloat16, float8_e4m3fn, float8_e5m2, int8/16/32/64, uint8, bool,
            complex64 or complex128. Any shape, 0-dim and 0-element included; non-contiguous and
            storage-sharing tensors are written as contiguous copies. Values are stored bit-exactly
            (NaN payloads, -0.0 and infinities included). Autograd history is dropped.
        meta: a JSON object; it must pass ``json.dumps(allow_nan=False)`` (encode non-finite floats
            yourself) and nest at most :data:`MAX_JSON_DEPTH` levels (with the manifest's own).
            Non-string keys come back as strings, tuples as lists.
        fsync: flush the file and its directory to stable storage before returning (default).
            ``False`` skips both fsyncs (about 0.1 s per bundle on a typical disk, more on network
            filesystems): the file is still complete-or-absent for other processes, but a power
            loss right after the call may lose it. For benchmarks and throwaway bundles.
        trusted: record the new file in this user's trust store
            (:mod:`nanreplay.core.trust`), so that the code its metadata names may run on replay
            without asking. A failure to record it is logged, never raised.

    Returns:
        ``pathlib.Path(path)``.

    Raises:
        ValueError: unknown extension, reserved key, meta not JSON-serialisable (the message names
            the offending entry, e.g. ``meta['lr']``) or nested too deeply, or a manifest over
            ``MAX_MANIFEST_BYTES``.
        TypeError: a key that is not ``str``, a value that is not a dense tensor, or an
            unsupported dtype.
        FileNotFoundError: the destination directory does not exist.
        OSError: any I/O failure (disk full, permissions), unchanged.
    """
    _require_little_endian()
    path = pathlib.Path(path)
    fmt = bundle_format_for(path)
    meta = _check_meta(meta)
    depth = _depth_problem(meta, MAX_JSON_DEPTH - 1)
    if depth is not None:
        raise ValueError(f"meta nests {depth} levels deep; expected at most {MAX_JSON_DEPTH - 1} (readers refuse deeper JSON)")
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

    tmp, fd = _create_tmp(path)
    try:
        _remove_stale_partials(path.parent, tmp)
        if fmt == "hdf5":
            _write_hdf5(fd, prepared, manifest_bytes)
        else:
            _write_safetensors(fd, prepared, manifest_bytes)
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
    finally:
        os.close(fd)  # releases the lock
    if fsync:
        _fsync_dir(path.parent)
    if trusted:
        try:
            mark_trusted(manifest_digest(manifest_bytes), note=str(path.resolve()))
        except OSError as e:  # PermissionError included: a dump never fails for the trust store
            logger.warning("nanreplay: wrote %s but could not record it as trusted (%s); replay will ask for "
                           "`nanreplay trust %s` or --trust", path, e, path)
    logger.debug("wrote %s bundle %s: %d tensors, %d manifest bytes", fmt, path, len(entries), len(manifest_bytes))
    return path


# --------------------------------------------------------------------------------------- reading


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
    tensors = m["tensors"]
    if not isinstance(tensors, dict):
        raise invalid("'tensors' to be a JSON object", f"a JSON {type(tensors).__name__}")

    entries: dict[str, _Entry] = {}
    total = 0
    for key, e in tensors.items():
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
        total += nbytes
        if total > file_size:
            break
        entries[key] = _Entry(spec, tuple(shape), nbytes, e["crc32"], stored_as)
    if total > file_size:
        raise invalid(
            f"tensors totalling at most the file size ({file_size} bytes)", "more bytes declared"
        )
    return entries


class _FdFile(io.RawIOBase):
    """A read-only file object over an open file descriptor, for h5py's ``fileobj`` driver: the
    HDF5 library parses exactly the file that was checked (no second open by name), and reads
    past the end return zeros like its own driver's."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self.fd, self.size, self.pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        got = _pread_into(self.fd, mv, self.pos)
        mv[got:] = bytes(len(mv) - got)
        self.pos += len(mv)
        return len(mv)

    def write(self, b: Any) -> int:
        raise OSError(errno.EBADF, "a bundle is opened read-only")

    def flush(self) -> None:
        return None


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


class _HDF5Reader(_RawReader):
    def __init__(self, path: pathlib.Path, fd: int, size: int) -> None:
        import h5py

        super().__init__(path, fd, size)
        self.file: Any = None
        self._links: Optional[dict[bytes, int]] = None
        with _translating(path, "unreadable HDF5 file", "a complete HDF5 file (h5py could not open it)",
                          f"the file is truncated or corrupted; {_REINSTATE}"):
            self.file = h5py.File(_FdFile(fd, size), "r")

    def _walk(self, limit: int) -> dict[bytes, int]:
        """Every link in the file (name -> link type), refusing all but hard links anywhere."""
        import h5py

        links: dict[bytes, int] = {}

        def visit(name: bytes, info: Any) -> Optional[bool]:
            links[name] = info.type
            return True if len(links) > limit or info.type != h5py.h5l.TYPE_HARD else None

        self.file.id.links.visit(visit, info=True)
        if len(links) > limit:
            raise _error(self.path, "unexpected HDF5 content", f"at most {limit} objects (the listed tensors and a few more)",
                         "more", f"this file was not written by nanreplay or was altered; {_REINSTATE}")
        for name, kind in links.items():
            if kind != h5py.h5l.TYPE_HARD:
                what = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}.get(kind, f"a link of type {kind}")
                raise _error(self.path, "manifest does not match the file", "only hard links to objects stored in this file",
                             f"{what} at /{name.decode('utf-8', 'replace')[:200]}",
                             f"nanreplay never writes links (they could make a bundle read other files); {_REINSTATE}")
        return links

    def _dataset(self, parent: Any, name: str, what: str, dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> int:
        """Open a plain dataset and check it holds ``nbytes`` bytes of ``dtype`` in ``shape``,
        contiguous and unfiltered inside this file; return the file offset of its data."""
        from h5py import h5d, h5s, h5t

        mismatch = functools.partial(_error, self.path, "manifest does not match the file")
        ds = h5d.open(parent, name.encode("utf-8"))
        dcpl = ds.get_create_plist()
        layout = dcpl.get_layout()
        if layout != h5d.CONTIGUOUS or dcpl.get_external_count() or dcpl.get_nfilters():
            kind = {h5d.VIRTUAL: "virtual", h5d.CHUNKED: "chunked", h5d.COMPACT: "compact"}.get(layout, "contiguous")
            found = f"a {kind} dataset" + (" with external storage" if dcpl.get_external_count() else "") + (
                f" with {dcpl.get_nfilters()} filter(s) (compression)" if dcpl.get_nfilters() else "")
            raise mismatch(f"{what} to be a contiguous, uncompressed dataset inside this file", found, _REINSTATE)
        space = ds.get_space()
        kind = space.get_simple_extent_type()
        dims = tuple(space.shape) if kind == h5s.SIMPLE else ()
        same_type = ds.get_type().equal(h5t.py_create(dtype))
        if not same_type or kind != (h5s.SCALAR if shape == () else h5s.SIMPLE) or dims != shape:
            found_type = str(dtype) if same_type else "another HDF5 type"
            found_shape = str(list(dims)) if kind in (h5s.SIMPLE, h5s.SCALAR) else "a null dataspace"
            raise mismatch(f"{what} stored as {dtype} {list(shape)}", f"{found_type} {found_shape}", _REINSTATE)
        if not nbytes:
            return 0
        offset = ds.get_offset()
        if offset is None or ds.get_storage_size() != nbytes or offset + nbytes > self.size:
            raise mismatch(f"{what}'s {nbytes} bytes stored inside the file", "no such storage", _REINSTATE)
        return int(offset)

    def manifest_bytes(self) -> bytes:
        from h5py import h5d, h5l, h5s, h5t

        with _translating(self.path, "unreadable HDF5 file", f"a readable {_MANIFEST_DATASET!r} dataset"):
            root = self.file.id
            if not root.links.exists(_MANIFEST_DATASET.encode()):
                found = sorted(self.file.keys())
                raise _error(
                    self.path, "no manifest: the bundle is incomplete (torn write?)",
                    f"a {_MANIFEST_DATASET!r} dataset (written last)",
                    f"only {[f[:100] for f in found[:10]]}" if found else "an empty HDF5 file",
                    "the writer stopped before finishing, or this HDF5 file is not a nanreplay bundle; "
                    + _REINSTATE,
                )
            if root.links.get_info(_MANIFEST_DATASET.encode()).type != h5l.TYPE_HARD:
                raise _error(self.path, "manifest does not match the file", f"{_MANIFEST_DATASET!r} stored in this file",
                             "a link", f"nanreplay never writes links; {_REINSTATE}")
            ds = h5d.open(root, _MANIFEST_DATASET.encode())
            space = ds.get_space()
            size = space.shape[0] if space.get_simple_extent_type() == h5s.SIMPLE and len(space.shape) == 1 else None
            if size is None or not ds.get_type().equal(h5t.py_create(np.dtype("u1"))):
                raise _error(self.path, "corrupt manifest", "a 1-D uint8 dataset", "another type or shape", _REINSTATE)
            if size > MAX_MANIFEST_BYTES:
                raise _error(self.path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes",
                             f"{size} bytes", _REINSTATE)
            offset = self._dataset(root, _MANIFEST_DATASET, f"dataset {_MANIFEST_DATASET!r}", np.dtype("u1"), (size,), size)
            raw = bytearray(size)
            if size and _pread_into(self.fd, memoryview(raw), offset) != size:
                raise OSError(errno.EIO, "the file ends inside the manifest")
            return bytes(raw)

    def check(self, entries: dict[str, _Entry]) -> None:
        from h5py import h5g

        with _translating(self.path, "unreadable HDF5 file", "readable tensor datasets"):
            links = self._walk(len(entries) + 2 + _MAX_EXTRA_LINKS)
            group_name = _TENSOR_GROUP.encode()
            group = h5g.open(self.file.id, group_name) if group_name in links else None
            listed = set()
            for key, entry in entries.items():
                what = f"tensor {key[:200]!r}"
                name = _h5_name(key)
                full = group_name + b"/" + name.encode("utf-8")
                if group is None or full not in links:
                    raise _error(self.path, "manifest does not match the file", f"{what} (listed in the manifest) "
                                 f"at /{_TENSOR_GROUP}/{name[:200]}", "no such dataset", _REINSTATE)
                self.offsets[key] = self._dataset(group, name, what, entry.spec.h5, entry.shape, entry.nbytes)
                listed.add(full)
            stray = [n for n in links if n.startswith(group_name + b"/") and n not in listed]
            if stray:
                logger.warning("%s: ignoring %d dataset(s) not listed in the manifest: %s",
                               self.path, len(stray), sorted(n.decode("utf-8", "replace")[len(_TENSOR_GROUP) + 1:] for n in stray)[:10])

    def close(self) -> None:
        try:
            if self.file is not None:
                self.file.close()
        finally:
            super().close()


class _SafetensorsReader(_RawReader):
    """Parses the safetensors header itself (strict JSON, the offsets tiling the data buffer
    exactly, as ``safetensors`` checks) so each tensor is read once, straight into the result."""

    def __init__(self, path: pathlib.Path, fd: int, size: int, head: bytes) -> None:
        super().__init__(path, fd, size)
        expected = "an 8-byte little-endian header length, then that many bytes of JSON header starting with '{'"
        fix = f"the file is truncated, corrupted or not a safetensors file; {_REINSTATE}"
        header_len = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
        if header_len is None:
            raise _error(path, "not a safetensors file", expected, f"a file of only {size} bytes", fix)
        if header_len > size - 8 or header_len > _MAX_SAFETENSORS_HEADER:
            raise _error(path, "not a safetensors file", expected,
                         f"a header length of {header_len} bytes in a file of {size} bytes", fix)
        if head[8:9] != b"{":
            raise _error(path, "not a safetensors file", expected, f"header starting with {head[8:16]!r}", fix)
        with _translating(path, "unreadable safetensors file", "a valid safetensors header (strict JSON)", fix):
            raw = bytearray(header_len)
            if _pread_into(fd, memoryview(raw), 8) != header_len:
                raise OSError(errno.EIO, "the file ends inside the header")
            header = strict_json(bytes(raw).rstrip(b" "))
        if not isinstance(header, dict):
            raise _error(path, "unreadable safetensors file", "a JSON object header", f"a JSON {type(header).__name__}", fix)
        self.metadata = header.pop("__metadata__", None)
        buffer = size - 8 - header_len
        spans = []
        self.stored: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            ok = (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"} and isinstance(info["dtype"], str)
                  and isinstance(info["shape"], list) and all(_is_int(d) and d >= 0 for d in info["shape"])
                  and isinstance(info["data_offsets"], list) and len(info["data_offsets"]) == 2
                  and all(_is_int(o) for o in info["data_offsets"]) and 0 <= info["data_offsets"][0] <= info["data_offsets"][1])
            if not ok:
                raise _error(path, "unreadable safetensors file", f"tensor {key[:200]!r} described by dtype, shape and data_offsets",
                             str(info)[:200], fix)
            begin, end = info["data_offsets"]
            spans.append((begin, end, key))
            self.stored[key] = (info["dtype"], tuple(info["shape"]), begin, end)
        spans.sort()
        at = 0
        for begin, end, key in spans:
            if begin != at:
                raise _error(path, "unreadable safetensors file", "tensor data that tiles the data buffer without gaps or overlaps",
                             f"tensor {key[:200]!r} at bytes {begin}..{end}, after byte {at}", fix)
            at = end
        if at != buffer:
            raise _error(path, "unreadable safetensors file", f"tensor data covering the {buffer}-byte data buffer exactly",
                         f"{at} bytes described", fix)
        self.data_start = 8 + header_len

    def manifest_bytes(self) -> bytes:
        metadata = self.metadata
        if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise _error(self.path, "unreadable safetensors file", "'__metadata__' mapping strings to strings",
                         str(metadata)[:200], _REINSTATE)
        text = (metadata or {}).get(_ST_MANIFEST_KEY)
        if not isinstance(text, str):
            raise _error(
                self.path, "no manifest: the bundle is incomplete (torn write?)",
                f"a {_ST_MANIFEST_KEY!r} entry in the safetensors metadata",
                f"metadata keys {[k[:100] for k in sorted(metadata)[:10]]}" if metadata else "no metadata",
                "this safetensors file was not written by nanreplay, or its writer did not finish; " + _REINSTATE,
            )
        if len(text) > MAX_MANIFEST_BYTES:
            raise _error(self.path, "corrupt manifest", f"at most {MAX_MANIFEST_BYTES} bytes",
                         f"{len(text)} characters", _REINSTATE)
        return text.encode("utf-8", "surrogatepass")

    def check(self, entries: dict[str, _Entry]) -> None:
        names = set(self.stored)
        for key, entry in entries.items():
            what = f"tensor {key[:200]!r}"
            if key not in self.stored:
                raise _error(self.path, "manifest does not match the file", f"{what} (listed in the manifest)",
                             "no such tensor", _REINSTATE)
            dtype, shape, begin, end = self.stored[key]
            if entry.stored_as == "uint8":
                want = ("U8", entry.shape + (entry.spec.itemsize,))
            else:
                want = (entry.spec.st, entry.shape)
            if (dtype, shape) != want or end - begin != entry.nbytes:
                raise _error(self.path, "manifest does not match the file",
                             f"{what} stored as {want[0]} {list(want[1])} in {entry.nbytes} bytes",
                             f"{dtype[:20]} {list(shape)[:10]} in {end - begin} bytes", _REINSTATE)
            self.offsets[key] = self.data_start + begin
            names.discard(key)
        if names:
            logger.warning("%s: ignoring %d tensor(s) not listed in the manifest: %s",
                           self.path, len(names), sorted(n[:100] for n in names)[:10])


class FlatBundle:
    """A read-only, lazily read view of one bundle file; returned by :func:`read_flat`.

    Use it as a context manager (or call :meth:`close`); the file stays open until then and
    tensors are read on demand by :meth:`get`.

    Attributes:
        path: the bundle file.
        format: ``'hdf5'`` or ``'safetensors'`` (what the file is, whatever its name).
        manifest: the whole validated manifest (``format``, ``format_version``, ``writer``,
            ``tensors``, ``meta``).
        meta: ``manifest["meta"]``.
        manifest_digest: SHA-256 of the manifest bytes (what trust signatures cover).
    """

    def __init__(self, path: pathlib.Path, fmt: str, manifest: dict[str, Any], entries: dict[str, _Entry],
                 reader: _RawReader, digest: bytes) -> None:
        self.path = path
        self.format = fmt
        self.manifest = manifest
        self.meta: dict[str, Any] = manifest["meta"]
        self.manifest_digest = digest
        self._entries = entries
        self._reader: Optional[_RawReader] = reader

    def keys(self) -> list[str]:
        """All tensor keys, sorted."""
        return sorted(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            close = difflib.get_close_matches(str(key), self._entries, n=3) if len(self._entries) < 10000 else []
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; it holds {len(self._entries)} tensors, see .keys()"
            raise KeyError(f"{self.path}: no tensor {key!r} in this bundle{hint}") from None

    def info(self, key: str) -> TensorInfo:
        """Dtype, shape and byte count of tensor ``key`` from the manifest (reads no data).

        Raises:
            KeyError: no such key (the message suggests close matches).
        """
        e = self._entry(key)
        return TensorInfo(e.spec.torch, e.shape, e.nbytes)

    def _open_reader(self) -> _RawReader:
        if self._reader is None:
            raise ValueError(f"{self.path}: the bundle is closed; open it again with read_flat()")
        return self._reader

    def _checksum_error(self, key: str, entry: _Entry, crc: int) -> BundleFormatError:
        python = "pass verify=False to read the damaged data anyway"
        err = _error(
            self.path, f"checksum mismatch for tensor {key!r}",
            f"crc32 {entry.crc32:#010x} (from the manifest)", f"{crc:#010x} in the data",
            "the tensor's bytes changed after they were written (disk, copy or hand edit); "
            f"{_REINSTATE}, or {python}",
        )
        cli = f"run `nanreplay inspect --no-verify {shlex.quote(str(self.path))}` to see what it still holds"
        err.with_cli_fix(python, cli)
        return err

    def get(self, key: str, *, verify: bool = True) -> torch.Tensor:
        """Read tensor ``key``: a new CPU tensor the caller owns, with the recorded dtype and shape,
        bit-exact (NaN payloads included). The bytes are read once, straight into it.

        Args:
            verify: compare the CRC-32 of the bytes read with the manifest's (about 1 GB/s).

        Raises:
            KeyError: no such key.
            BundleFormatError: the data cannot be read, or (``verify=True``) its checksum differs;
                the message names the key.
            ValueError: the bundle is closed.
        """
        entry = self._entry(key)
        reader = self._open_reader()
        with _translating(self.path, f"cannot read tensor {key!r}", f"{entry.nbytes} readable bytes"):
            t = reader.read(key, entry)
        if verify:
            crc = _crc32(t)
            if crc != entry.crc32:
                raise self._checksum_error(key, entry, crc)
        return t

    def verify(self, key: str) -> None:
        """Check tensor ``key``'s checksum without keeping its data: the bytes are read in chunks
        of at most 8 MiB, so memory stays bounded whatever the tensor's size.

        Raises:
            KeyError: no such key. ValueError: the bundle is closed.
            BundleFormatError: the data cannot be read or its checksum differs.
        """
        entry = self._entry(key)
        reader = self._open_reader()
        with _translating(self.path, f"cannot read tensor {key!r}", f"{entry.nbytes} readable bytes"):
            crc = reader.crc32(key, entry)
        if crc != entry.crc32:
            raise self._checksum_error(key, entry, crc)

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


def sniff_format(head: bytes, size: int) -> Optional[str]:
    """The container a file's first bytes announce: ``'hdf5'`` (the HDF5 signature at byte 0),
    ``'safetensors'`` (a plausible 8-byte header length followed by ``{``) or ``None``."""
    if head.startswith(_HDF5_SIGNATURE):
        return "hdf5"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    return None


def _open_regular(path: pathlib.Path) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading only if it is a regular file: a FIFO, socket or device named like a
    bundle is refused without opening it (no endless wait), and the opened file is checked again."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no such bundle file; check the path (bundles are single .h5, .hdf5 or "
            ".safetensors files written by the recorder into its output directory)"
        ) from None
    except PermissionError:
        raise
    except OSError as e:
        raise _error(path, "cannot read the file", "a readable file", f"{type(e).__name__}: {e}", _REINSTATE) from e
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{path}: is a directory, expected a bundle file (.h5, .hdf5 or .safetensors) inside it")

    def not_regular(mode: int) -> BundleFormatError:
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "not a regular file")
        return _error(path, "not a regular file", "a bundle file", kind, "pass the path of a bundle file written by the recorder")

    if not stat.S_ISREG(st.st_mode):
        raise not_regular(st.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:
        raise
    except OSError as e:
        raise _error(path, "cannot read the file", "a readable file", f"{type(e).__name__}: {e}", _REINSTATE) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
        os.close(fd)
        raise not_regular(st.st_mode)
    return fd, st


def read_flat(path: PathLike) -> FlatBundle:
    """Open a bundle written by :func:`write_flat`, validating its manifest against the file.

    The container is recognised by the file's first bytes (a bundle renamed to ``.txt`` or
    without extension opens too). Only the manifest and the tensors' headers are read now; data is
    read by :meth:`FlatBundle.get`. The file is treated as untrusted: only a regular file is
    opened, no pickle, capped manifest size and depth, strict schema, links and foreign storage
    refused. Time and memory are bounded by the file's size (plus, for the manifest's JSON, a
    fixed bound: see ``docs/security.md``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        PermissionError: the file cannot be opened for reading.
        BundleFormatError: anything else wrong with the file (not a regular file, empty,
            truncated, foreign, no manifest, corrupt or hand-edited manifest, newer
            ``format_version``); the message starts with the path, then a fixed phrase such as
            ``no manifest: the bundle is incomplete (torn write?)``, ``invalid manifest`` or
            ``unsupported format_version``.
    """
    _require_little_endian()
    path = pathlib.Path(path)
    fd, st = _open_regular(path)
    reader: Optional[_RawReader] = None
    try:
        size = st.st_size
        with _translating(path, "cannot read the file", "a readable file"):
            head = os.pread(fd, 16, 0)
        named = _EXTENSIONS.get(path.suffix.lower())
        fmt = sniff_format(head, size)
        if size == 0:
            kind = {"hdf5": "an HDF5", "safetensors": "a safetensors"}.get(named or "", "a")
            raise _error(path, "empty file (0 bytes)", f"{kind} nanreplay bundle", "an empty file",
                         f"the write was interrupted before any data reached the disk; {_REINSTATE}")
        if fmt is None:
            fix = f"the file is corrupted or not a bundle; {_REINSTATE}"
            if named == "hdf5":
                raise _error(path, "not an HDF5 file", f"the HDF5 signature {_HDF5_SIGNATURE.hex(' ')} at byte 0",
                             head[:8].hex(" "), fix)
            if named == "safetensors":
                _SafetensorsReader(path, fd, size, head)  # raises its precise "not a safetensors file" error
            raise _error(path, "not a bundle", f"the HDF5 signature {_HDF5_SIGNATURE.hex(' ')} or a safetensors header at byte 0",
                         head[:8].hex(" "), fix)
        if named is not None and named != fmt:
            logger.info("%s: named like %s but holds %s; reading it as %s", path, named, fmt, fmt)
        reader = _HDF5Reader(path, fd, size) if fmt == "hdf5" else _SafetensorsReader(path, fd, size, head)
        raw = reader.manifest_bytes()
        manifest = _parse_manifest(path, raw)
        entries = _validate_manifest(path, manifest, fmt, size)
        reader.check(entries)
    except BaseException:
        if reader is not None:
            reader.close()
        else:
            os.close(fd)
        raise
    logger.debug("opened %s bundle %s: %d tensors", fmt, path, len(entries))
    return FlatBundle(path, fmt, manifest, entries, reader, manifest_digest(raw))
