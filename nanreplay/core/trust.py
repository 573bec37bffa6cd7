"""The per-user trust store: which bundles may name code that replay runs.

A bundle names code: a model factory, a loss function, a model class with JSON arguments
(``model_init``), an optimizer class and the types of typed batch nodes. Replay imports those
only when the user named them or trusts the bundle (``docs/security.md``). The model is
Jupyter's notebook trust: the notebooks a user wrote are trusted through a signature made with
a per-user secret key and kept in a local store; anything else is not, until the user says so.

The store lives in ``$NANREPLAY_HOME`` (default ``~/.nanreplay``), a directory of mode 0700:

* ``secret``: the key, 32 random bytes written as 64 hex digits, mode 0600, created on the first
  signature (never by a check);
* ``trusted/<signature>``: one small file per trusted bundle, named by
  ``HMAC-SHA256(key, b"nanreplay-bundle-trust-v1\\n" + SHA-256(manifest bytes))`` in hex. The file
  holds a JSON note (path, time) for people; only its name matters.

The manifest bytes hold the metadata (every name of code) and every tensor's CRC-32, so any edit
to them makes the bundle untrusted again; copying or renaming the file keeps its trust. The
signature cannot be forged without the key, so a file planted in ``trusted/`` by someone who can
write there but cannot read ``secret`` trusts nothing.

The key and the directory must belong to the current user and be private (no group/other
access to the key, no group/other write to the directories); otherwise every check answers
"not trusted" and logs how to fix the permissions.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["HOME_ENV", "trust_home", "manifest_digest", "is_trusted", "mark_trusted", "revoke_trust"]

#: Environment variable that relocates the trust store (tests point it at a temporary directory).
HOME_ENV = "NANREPLAY_HOME"
_DOMAIN = b"nanreplay-bundle-trust-v1\n"
_KEY_FILE = "secret"
_SIGNATURES = "trusted"
_POSIX = hasattr(os, "getuid")


def trust_home() -> Path:
    """The trust store directory: ``$NANREPLAY_HOME`` when set, else ``~/.nanreplay``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".nanreplay"


def manifest_digest(raw: bytes) -> bytes:
    """SHA-256 of a bundle's manifest bytes (the 32-byte value a signature covers)."""
    return hashlib.sha256(raw).digest()


def _check_private(path: Path, st: os.stat_result, *, directory: bool) -> None:
    """Refuse a store entry another user could have written (or, for the key, read)."""
    if not _POSIX:  # pragma: no cover - Windows: ACLs, not modes; see docs/security.md
        return
    kind = "directory" if directory else "file"
    right_kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not right_kind:
        raise PermissionError(f"{path}: expected a {kind} of the nanreplay trust store, found something else; remove it")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"{path}: the trust store {kind} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            f"point {HOME_ENV} at a directory of your own"
        )
    loose = st.st_mode & (0o022 if directory else 0o077)
    if loose:
        want = "0700" if directory else "0600"
        raise PermissionError(
            f"{path}: the trust store {kind} has mode {stat.S_IMODE(st.st_mode):04o}, which lets other users "
            f"{'write to it' if directory else 'read or change it'}; run `chmod {want} {path}`"
        )


def _private_dir(path: Path, *, create: bool) -> bool:
    """Check (and with ``create``, make, mode 0700) a store directory; False when absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    _check_private(path, st, directory=True)
    return True


def _read_key(path: Path) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        _check_private(path, os.fstat(fd), directory=False)
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise PermissionError(f"{path}: the trust store key is damaged (expected 64 hex digits); delete it (every bundle becomes untrusted)")
    return key


def _key(*, create: bool) -> Optional[bytes]:
    home = trust_home()
    if not _private_dir(home, create=create):
        return None
    path = home / _KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    # Publish a new key only if none exists: write a private temporary file, then hard-link it
    # into place (atomic, fails if another process won the race; then both use the winner's).
    tmp = home / f".{_KEY_FILE}.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, secrets.token_bytes(32).hex().encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError as e:  # a filesystem without hard links: exclusive rename is not available, so copy
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(tmp.read_bytes())
    finally:
        os.unlink(tmp)
    logger.info("created the nanreplay trust key %s", path)
    return _read_key(path)


def _signature(key: bytes, digest: bytes) -> str:
    if len(digest) != 32:
        raise ValueError(f"expected a 32-byte SHA-256 manifest digest, found {len(digest)} bytes")
    return hmac.new(key, _DOMAIN + digest, hashlib.sha256).hexdigest()


def is_trusted(digest: bytes) -> bool:
    """Whether the bundle whose manifest has SHA-256 ``digest`` is in this user's trust store.

    Never creates anything. An absent store means nothing is trusted; a store with loose
    permissions is not used (a warning says how to fix it).
    """
    try:
        key = _key(create=False)
        if key is None:
            return False
        entry = trust_home() / _SIGNATURES / _signature(key, digest)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return False
        _check_private(entry.parent, os.lstat(entry.parent), directory=True)
        return stat.S_ISREG(st.st_mode) and (not _POSIX or st.st_uid == os.getuid())
    except PermissionError as e:
        logger.warning("nanreplay trust store not used: %s", e)
        return False


def mark_trusted(digest: bytes, note: str = "") -> Path:
    """Record the bundle whose manifest has SHA-256 ``digest`` as trusted (creating the store and
    its key on first use). Idempotent.

    Args:
        digest: :func:`manifest_digest` of the manifest bytes.
        note: kept in the entry for people (e.g. the bundle path); never read back.

    Returns:
        the entry's path.

    Raises:
        PermissionError: the store belongs to another user or is not private (the message says
            which ``chmod`` fixes it).
        OSError: the store cannot be written (read-only home, disk full).
    """
    key = _key(create=True)
    assert key is not None
    sig_dir = trust_home() / _SIGNATURES
    _private_dir(sig_dir, create=True)
    entry = sig_dir / _signature(key, digest)
    if entry.exists():
        return entry
    tmp = sig_dir / f".{entry.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, json.dumps({"note": note, "time": time.time()}).encode("utf-8") + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, entry)
    return entry


def revoke_trust(digest: bytes) -> bool:
    """Remove the bundle whose manifest has SHA-256 ``digest`` from the trust store.

    Returns:
        whether it was trusted.
    """
    try:
        key = _key(create=False)
    except PermissionError as e:
        logger.warning("nanreplay trust store not used: %s", e)
        return False
    if key is None:
        return False
    try:
        (trust_home() / _SIGNATURES / _signature(key, digest)).unlink()
    except FileNotFoundError:
        return False
    return True
