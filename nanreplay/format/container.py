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

import difflib
import logging
import os
import pathlib
import shlex
import stat
import sys
from typing import Any, Mapping, Optional, Union

import torch

from nanreplay.core.trust import manifest_digest, mark_trusted
from nanreplay.errors import BundleFormatError

from .atomic import STALE_PARTIAL_SECONDS, atomic_write
from .hdf5 import HDF5_SIGNATURE, HDF5Reader, write_hdf5
from .manifest import (  # noqa: F401 - MAX_JSON_*, strict_json: this module's names before the split
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_JSON_SEPARATORS,
    MAX_MANIFEST_BYTES,
    _REINSTATE,
    TensorInfo,
    _check_meta,
    _crc32,
    _depth_problem,
    _encode,
    _Entry,
    _error,
    _parse_manifest,
    _prepare,
    _RawReader,
    _translating,
    _validate_manifest,
    strict_json,
)
from .safetensors import SafetensorsReader, stored_as, write_safetensors

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

_EXTENSIONS = {".h5": "hdf5", ".hdf5": "hdf5", ".safetensors": "safetensors"}

PathLike = Union[str, "os.PathLike[str]"]

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


def write_flat(    path: PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, fsync: bool = True,
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
    manifest_bytes, n = _encode(path, fmt, prepared, meta, stored_as if fmt == "safetensors" else lambda spec: None)
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path}: the destination directory {path.parent} does not exist; create it first"
        )
    write = write_hdf5 if fmt == "hdf5" else write_safetensors
    atomic_write(path, lambda fd: write(fd, prepared, manifest_bytes), fsync=fsync)
    if trusted:
        try:
            mark_trusted(manifest_digest(manifest_bytes), note=str(path.resolve()))
        except OSError as e:  # PermissionError included: a dump never fails for the trust store
            logger.warning("nanreplay: wrote %s but could not record it as trusted (%s); replay will ask for "
                           "`nanreplay trust %s` or --trust", path, e, path)
    logger.debug("wrote %s bundle %s: %d tensors, %d manifest bytes", fmt, path, n, len(manifest_bytes))
    return path


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
    if head.startswith(HDF5_SIGNATURE):
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
                raise _error(path, "not an HDF5 file", f"the HDF5 signature {HDF5_SIGNATURE.hex(' ')} at byte 0",
                             head[:8].hex(" "), fix)
            if named == "safetensors":
                SafetensorsReader(path, fd, size, head)  # raises its precise "not a safetensors file" error
            raise _error(path, "not a bundle", f"the HDF5 signature {HDF5_SIGNATURE.hex(' ')} or a safetensors header at byte 0",
                         head[:8].hex(" "), fix)
        if named is not None and named != fmt:
            logger.info("%s: named like %s but holds %s; reading it as %s", path, named, fmt, fmt)
        reader = HDF5Reader(path, fd, size) if fmt == "hdf5" else SafetensorsReader(path, fd, size, head)
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
