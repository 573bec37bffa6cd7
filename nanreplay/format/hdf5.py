"""The HDF5 container (``.h5`` / ``.hdf5``): every tensor a contiguous, uncompressed dataset in the
group ``/tensors`` (its name the key with ``%``, ``/`` and NUL percent-encoded); dtypes numpy lacks
(bfloat16, float8, and bool) stored as same-width unsigned-integer bit views; the manifest a 1-D
``uint8`` dataset ``/__manifest__`` of UTF-8 JSON written after every tensor dataset. Since
format version 2 the file uses checksummed HDF5 metadata (superblock v2, object headers v2) and no
attributes. The reader opens the already-checked file descriptor (no second open by name) and
refuses links, virtual datasets, external storage and filters (``docs/bundle-format.md``).
"""

from __future__ import annotations

import errno
import functools
import io
import logging
from typing import Any, Optional

import numpy as np
import torch

from .atomic import _GuardedWriter, _pread_into
from .manifest import MAX_MANIFEST_BYTES, _REINSTATE, _DType, _Entry, _error, _RawReader, _translating

__all__ = ["HDF5_SIGNATURE", "write_hdf5", "HDF5Reader"]

logger = logging.getLogger(__name__)

#: HDF5 links beyond the listed tensors, the manifest and /tensors itself that a file may hold.
_MAX_EXTRA_LINKS = 1024
_MANIFEST_DATASET = "__manifest__"
_TENSOR_GROUP = "tensors"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_H5_LIBVER = ("v108", "v110")  # superblock v2 and v2 object headers: every metadata block is checksummed


def _h5_name(key: str) -> str:
    """The HDF5 dataset name of a key: '%', '/' and NUL percent-encoded (injective)."""
    name = key.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
    if name in (".", ".."):
        name = name.replace(".", "%2E")
    return name


def write_hdf5(fd: int, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes) -> None:
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


class HDF5Reader(_RawReader):
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
