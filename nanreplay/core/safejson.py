"""Strict, bounded JSON parsing for untrusted input (bundle manifests, safetensors headers, the
tree specs stored inside them).

:func:`strict_loads` refuses, before parsing, text that nests too deeply or holds too many arrays
and objects or separators (each limit is the caller's), which bounds the memory the parsed
document takes; then it parses strictly: UTF-8, no duplicate keys, no ``NaN``/``Infinity``
literals and no number that overflows to infinity. The structure is measured on the raw bytes,
with string literals removed, by a C-speed regular expression and numpy, in 8 MiB chunks.
"""

from __future__ import annotations

import gc
import json
import math
from typing import Any, Union

import numpy as np

__all__ = ["json_structure", "strict_loads"]

_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CONTAINER = np.zeros(256, dtype=bool)
_CONTAINER[[ord("["), ord("{")]] = True
_SEPARATOR = np.zeros(256, dtype=bool)
_SEPARATOR[[ord(","), ord(":")]] = True
_CHUNK = 1 << 20  # bytes per chunk: int32 arithmetic inside a chunk cannot overflow


def json_structure(raw: bytes) -> tuple[int, int, int]:
    """``(arrays + objects, separators, deepest nesting)`` of JSON text, counting only characters
    outside string literals. Vectorised over 1 MiB chunks (numpy), carrying the string state and a
    run of backslashes across chunks, so time is linear and memory a few MiB whatever the text
    holds. A quote ends or starts a string unless an odd run of backslashes precedes it; on text
    that is not JSON the counts may be off only after the first character ``json`` refuses."""
    containers = separators = depth = deepest = 0
    in_string, backslashes = 0, 0  # carried: inside a string at the chunk's start; backslashes just before it
    view = memoryview(raw)
    for at in range(0, len(raw), _CHUNK):
        b = np.frombuffer(view[at:at + _CHUNK], dtype=np.uint8)
        m = len(b)
        quotes = b == 34
        is_bs = b == 92
        if backslashes or is_bs.any():  # rare: find the quotes an odd run of backslashes escapes
            pos = np.arange(m, dtype=np.int32)
            last = np.where(is_bs, np.int32(-1 - backslashes), pos)
            np.maximum.accumulate(last, out=last)  # index of the last non-backslash at or before i
            before = np.empty(m, dtype=np.int32)  # backslashes immediately before i
            before[0] = backslashes
            np.subtract(pos[:-1], last[:-1], out=before[1:])
            quotes &= (before & 1) == 0
            backslashes = int(m - 1 - last[-1])
        inside = np.cumsum(quotes, dtype=np.int32)
        inside += in_string
        inside &= 1
        outside = (inside == 0) & ~quotes
        containers += int(np.count_nonzero(_CONTAINER[b] & outside))
        separators += int(np.count_nonzero(_SEPARATOR[b] & outside))
        steps = _STEP[b]
        steps *= outside
        if steps.any():
            level = np.cumsum(steps, dtype=np.int32)
            deepest = max(deepest, depth + int(level.max()))
            depth += int(level[-1])
        in_string = int(inside[-1])
    return containers, separators, deepest


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:100]!r} in a JSON object")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is not a finite float (write non-finite values as the strings 'nan', 'inf', '-inf')")
    return value


def strict_loads(raw: Union[bytes, str], *, max_depth: int, max_containers: int, max_separators: int) -> Any:
    """Parse untrusted JSON strictly and within bounds (see the module docstring). The cyclic
    garbage collector is paused while parsing: JSON builds no cycles, and on crafted input the
    collector would otherwise spend most of the time scanning.

    Raises:
        ValueError: text over a limit (checked before parsing), not UTF-8, not JSON, a duplicate
            key, a non-finite number, or an integer over the interpreter's digit limit.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    containers, separators, depth = json_structure(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep, expected at most {max_depth}")
    if containers > max_containers or separators > max_separators:
        raise ValueError(f"JSON of {containers} arrays and objects and {separators} separators, expected at most "
                         f"{max_containers} and {max_separators}")
    text = data.decode("utf-8")
    del data
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as e:  # cannot happen under max_depth; kept a ValueError for callers
        raise ValueError(f"JSON nested too deeply ({e})") from None
    finally:
        if enabled:
            gc.enable()
