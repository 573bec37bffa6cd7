"""The safetensors container (``.safetensors``): the layout of huggingface/safetensors (README
"Format": an 8-byte little-endian header length, a JSON header, then the raw little-endian tensor
bytes), written straight from the tensors' memory; the manifest is the JSON string in the header's
metadata field ``nanreplay_manifest``. A dtype the installed safetensors cannot hold (complex128 in
0.8) is stored as a ``U8`` tensor of shape ``shape + [itemsize]`` holding its raw bytes, and the
manifest says so with ``"stored_as": "uint8"``. The reader parses the header itself (strict JSON,
offsets that tile the data buffer exactly) so each tensor is read once (``docs/bundle-format.md``).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from typing import Any, Optional

import torch

from .atomic import _pread_into, _pwrite_all
from .manifest import MAX_MANIFEST_BYTES, _BY_TORCH, _REINSTATE, _DType, _Entry, _error, _is_int, _raw_bytes, _RawReader, _translating, strict_json

__all__ = ["stored_as", "write_safetensors", "SafetensorsReader"]

logger = logging.getLogger(__name__)

#: Largest safetensors header accepted (safetensors' own limit).
_MAX_SAFETENSORS_HEADER = 100_000_000
_ST_MANIFEST_KEY = "nanreplay_manifest"


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


def _st_stored(spec: _DType, t: torch.Tensor) -> tuple[str, list[int], int]:
    """(safetensors dtype, stored shape, stored itemsize) of a tensor in the safetensors container."""
    if _safetensors_native(spec.torch):
        return spec.st or "U8", list(t.shape), spec.itemsize
    return "U8", [*t.shape, spec.itemsize], 1


def write_safetensors(fd: int, prepared: dict[str, tuple[_DType, torch.Tensor]], manifest: bytes) -> None:
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


class SafetensorsReader(_RawReader):
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


def stored_as(spec: _DType) -> Optional[str]:
    """The manifest's ``stored_as`` of a dtype in this container: ``"uint8"`` where the installed
    safetensors cannot hold it natively, else ``None``."""
    return None if _safetensors_native(spec.torch) else "uint8"
