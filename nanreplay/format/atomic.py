"""Atomic bundle writes and the positional file I/O under them.

Every file is written to a hidden ``.<name>.<random>.partial`` file in the same directory (locked
while it is written), flushed, fsync'ed and renamed onto its final name with :func:`os.replace`,
so readers only ever see complete files (:func:`atomic_write`). A failed write (a full disk) is
reported as the ``OSError`` it is; the HDF5 library never sees it (:class:`_GuardedWriter`), so it
is never left with a half-closed file. A killed writer's temporary file is removed by the next
write into that directory (:func:`_remove_stale_partials`).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pathlib
import re
import secrets
import stat
import time
from typing import Any, Callable, Optional

__all__ = ["STALE_PARTIAL_SECONDS", "atomic_write"]

logger = logging.getLogger(__name__)

#: A temporary ``.partial`` file untouched for this long is removed by the next write into its
#: directory even where file locks cannot tell whether its writer is alive.
STALE_PARTIAL_SECONDS = 3600
#: ...and one younger than this is never touched (its writer may be between create and lock).
_PARTIAL_MIN_AGE = 60
_MAX_IO = 1 << 30
_PARTIAL_RE = re.compile(r"\..+\.[0-9a-f]{12}\.partial")


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


def atomic_write(path: pathlib.Path, write: Callable[[int], None], *, fsync: bool = True) -> None:
    """Create ``path`` through ``write(fd)`` on a locked temporary file beside it, then
    ``os.replace`` it onto ``path``: ``path`` is either the old file, absent, or the complete new
    one. On any failure the temporary file is removed and the exception re-raised unchanged.
    Temporary files of earlier writes into the same directory whose writer is gone are removed
    first. ``fsync`` flushes the file before the rename and the directory after it."""
    tmp, fd = _create_tmp(path)
    try:
        _remove_stale_partials(path.parent, tmp)
        write(fd)
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
