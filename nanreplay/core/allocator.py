"""The heap of nanreplay's own command-line process: freed memory kept for reuse.

A replay allocates and frees the step's activations and gradients over and over (the op-level
replay, the per-sample replays, the fix's verification). With glibc's defaults every CPU tensor
of 32 MiB or more is a fresh ``mmap`` and every smaller one above the trim threshold goes back to
the kernel when freed, so each replay touches new pages and pays a page fault per 4 KiB of them.
:func:`keep_freed_memory` tells glibc's ``malloc`` (``mallopt(3)``: ``M_MMAP_MAX``,
``M_TRIM_THRESHOLD``, ``M_TOP_PAD``) to serve every allocation from its heap and keep what is
freed, as the tuning guides for PyTorch on CPU do with a caching allocator (jemalloc, tcmalloc).
Not every freed block is reused (an aligned allocation does not always fit the block a freed one
left), but most are. Measured on a 42M-parameter GPT bundle (``/usr/bin/time nanreplay replay B
--json``, 2 threads, 3 runs each): page faults 0.73-0.77M -> 0.41-0.42M and system time 2.3-2.5 s
-> 1.5-1.75 s, the peak resident memory unchanged (1.72-1.74 GB).

Only the CLI calls it, for its own process; the library never changes the allocator of a user's
training process. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h
_KEEP_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int): in effect, never trim
_TOP_PAD = 256 * 2**20  # grow the heap 256 MiB at a time (fewer brk calls)


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` keep freed memory for reuse (see the module docstring).

    Returns:
        ``True`` when glibc accepted all three settings; ``False`` elsewhere (not Linux, no
        glibc, a ``mallopt`` that refused a setting), where nothing changed or the defaults
        partly stay: never an error.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_BYTES), (_M_TOP_PAD, _TOP_PAD)):
        ok = bool(mallopt(param, value)) and ok
    logger.debug("nanreplay: malloc keeps freed memory: %s", ok)
    return ok
