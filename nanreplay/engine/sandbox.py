"""The sandbox: a stranger's embedded program replays in a child process that can hurt nothing
outside itself. The one place in nanreplay that forks.

The first two walls (the checks of ``docs/security.md`` at open and at load, the size and index
guards while it runs) are meant to stop a hostile program before any kernel sees it. This one
assumes they missed something, the way a browser runs its renderer in a sandbox although its
code was reviewed: when a replay would run the embedded program of a bundle that is not trusted
(not in the trust store, no ``--trust``) and the user did not name their own code
(``--model-factory``), the whole replay (monitors, diagnosis, fix verification: the same code as
in-process, called in the child) runs in a process forked for it, and only validated data comes
back.

The child, before it runs anything of the bundle's:

* leaves the terminal's session (``setsid``), dies with its parent (``PR_SET_PDEATHSIG``), points
  its standard streams at ``/dev/null`` (torch's own warnings and tracebacks never reach the
  user's terminal: log records of the replay travel to the parent, which shows them through its
  own handlers) and closes every inherited descriptor open for writing but its result pipe;
* takes the resource limits of :class:`SandboxLimits`: address space (``RLIMIT_AS``), CPU
  seconds (``RLIMIT_CPU``), no file growth (``RLIMIT_FSIZE`` = 0), no core file, and a task
  count (``RLIMIT_NPROC``: the user's tasks now plus room for intra-op threads; not enforced for
  root);
* loads a seccomp filter (libseccomp through ``pyseccomp``; ``PR_SET_NO_NEW_PRIVS`` is set by the
  load) that answers ``EPERM`` to :data:`DENIED` and to the conditional rules below, and lets
  everything else through: reading files stays possible (torch imports modules lazily, the
  bundle is read), writing any file does not.

The parent waits on the pipe with a wall-clock limit (``--timeout``, default
:data:`DEFAULT_TIMEOUT` seconds) and kills the child past it. What comes back is framed, bounded
(:data:`JSON_MAX_BYTES` of JSON, :data:`BLOB_MAX_BYTES` of file bytes) and checked by the caller
against the result's JSON Schema (``core.schema.conforms``) before anything uses it; files a
command writes (``export --repro``) are written by the parent from validated data. A child that
dies (a signal, a limit, out of memory, the time limit) becomes :class:`~nanreplay.errors.SandboxError`
(exit 5, one sentence); where seccomp is unavailable an untrusted program is refused with
:class:`~nanreplay.errors.SandboxUnavailableError` (exit 7) that says to pass ``--trust``.

Fork, not spawn: the child is the parent's copy, so it pays no ``import torch`` (1 to 2 s) and
runs the very functions the parent would have. A fork after OpenMP has started its thread pool
can deadlock the child's first parallel region (GNU libgomp is not fork-safe), so the child keeps
torch's intra-op threads only where the parent is known not to have run a parallel op yet (the
``nanreplay`` command's own process, :func:`fresh_process`); elsewhere (a notebook, a test
runner) it runs one intra-op thread, as torch's DataLoader workers do. A CUDA context does not
survive a fork and a GPU driver needs its device files opened for writing, so the sandboxed
replay runs on the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import json
import logging
import math
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from ..core.jsonable import fnum
from ..errors import BundleFormatError, DiagnosisTimeout, ModelMismatchError, NanReplayError, ReplayError, SandboxError, SandboxUnavailableError

logger = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "SandboxPlan", "sandbox_plan", "conforming", "contained_call", "unavailable", "fresh_process", "computed", "DEFAULT_TIMEOUT", "MEMORY_ALLOWANCE",
           "MEMORY_PER_BUNDLE_BYTE", "JSON_MAX_BYTES", "BLOB_MAX_BYTES", "DENIED"]

#: seconds a sandboxed replay may take by default (``--timeout``)
DEFAULT_TIMEOUT = 600.0
#: address space a sandboxed replay may add to its parent's, by default: this many bytes ...
MEMORY_ALLOWANCE = 3 << 29  # 1.5 GiB
#: ... plus this many times the bundle file's size (``--memory-limit`` replaces the sum)
MEMORY_PER_BUNDLE_BYTE = 8
#: the largest JSON result (a diagnosis, a bisect result) the parent reads, in bytes
JSON_MAX_BYTES = 64 << 20
#: the most file bytes (``export --repro``'s tensors) the parent reads, in bytes
BLOB_MAX_BYTES = 1 << 30
#: progress messages and log records relayed per run (more are dropped)
RELAY_MAX = 10_000

#: system calls the filter answers with EPERM whatever their arguments: making or changing files
#: (by path or descriptor), running programs, new processes, sockets, other processes' memory and
#: descriptors, io_uring (its operations bypass seccomp), System V / POSIX IPC objects shared with
#: other processes, and the privileged calls (mounts, modules, keys, BPF, user and group ids ...)
DENIED: tuple[str, ...] = (
    "creat", "openat2", "open_by_handle_at", "name_to_handle_at",
    "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "mkdir", "mkdirat", "link", "linkat", "symlink", "symlinkat",
    "mknod", "mknodat", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "truncate", "ftruncate",
    "utime", "utimes", "utimensat", "futimesat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "execve", "execveat", "fork", "vfork",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    "tkill", "setrlimit", "setpriority", "migrate_pages", "move_pages",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_timedsend",
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr",
    "kexec_load", "kexec_file_load", "bpf", "perf_event_open", "userfaultfd", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "sethostname", "setdomainname", "unshare", "setns", "keyctl", "add_key", "request_key",
    "acct", "quotactl", "iopl", "ioperm", "modify_ldt", "clock_settime", "settimeofday", "adjtimex", "clock_adjtime", "syslog",
    "lookup_dcookie", "fanotify_init", "personality", "vhangup",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
)

_CLONE_THREAD = 0x00010000
_TIOCSTI = 0x5412
_PR_SET_PDEATHSIG = 1

#: the exceptions a child's error frame may name, re-raised as themselves in the parent
_RELAYED: dict[str, type[BaseException]] = {
    "BundleFormatError": BundleFormatError, "ModelMismatchError": ModelMismatchError, "ReplayError": ReplayError,
    "DiagnosisTimeout": DiagnosisTimeout, "SandboxError": SandboxError, "FileNotFoundError": FileNotFoundError,
}
_MESSAGE_MAX = 8000  # characters of a relayed message kept

#: frame kinds: progress, log record, result (JSON), file bytes, error
_PROGRESS, _LOG, _RESULT, _BLOB, _ERROR = b"p", b"l", b"r", b"b", b"e"
_HEADER = struct.Struct("<cQ")

_FRESH = False


def fresh_process() -> None:
    """Say that this process has run no parallel torch op yet and will fork its sandboxed replays
    before it does: their children keep torch's intra-op threads. The ``nanreplay`` command calls
    it first thing; a process that says nothing gets one-thread children (safe after any fork)."""
    global _FRESH
    _FRESH = True


def computed() -> None:
    """Say that this process may have started OpenMP's pool since :func:`fresh_process` (the
    sharded-run merge copies tensors): its sandboxed children run one intra-op thread."""
    global _FRESH
    _FRESH = False


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """The limits of a sandboxed replay.

    Attributes:
        timeout: wall-clock seconds before the child is killed (``--timeout``).
        memory: bytes of address space the child may add to what it inherits (``RLIMIT_AS`` is
            set to the parent's size at the fork plus this); ``None``: :data:`MEMORY_ALLOWANCE` +
            :data:`MEMORY_PER_BUNDLE_BYTE` x the bundle file's bytes (``--memory-limit``).
        cpu: CPU seconds of the child, all its threads together (``RLIMIT_CPU``); ``None``: the
            timeout times the intra-op threads, plus 10 s.
    """

    timeout: float = DEFAULT_TIMEOUT
    memory: Optional[int] = None
    cpu: Optional[float] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"SandboxLimits.timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.memory is not None and not (isinstance(self.memory, int) and self.memory > 0):
            raise ValueError(f"SandboxLimits.memory must be a positive number of bytes or None, got {self.memory!r}")

    def memory_for(self, bundle_bytes: int) -> int:
        """The address space (bytes) the child may add for a bundle file of ``bundle_bytes``."""
        return self.memory if self.memory is not None else MEMORY_ALLOWANCE + MEMORY_PER_BUNDLE_BYTE * max(0, bundle_bytes)


# ------------------------------------------------------------------------------ availability

_UNAVAILABLE: Optional[list[Optional[str]]] = None


def unavailable() -> Optional[str]:
    """Why this machine cannot run the sandbox (``None`` when it can): not Linux, ``pyseccomp``
    not installed, libseccomp not found, or a kernel without seccomp filters. Checked once per
    process; loads no filter (a filter cannot be taken back)."""
    global _UNAVAILABLE
    if _UNAVAILABLE is None:
        _UNAVAILABLE = [_why_unavailable()]
    return _UNAVAILABLE[0]


def _why_unavailable() -> Optional[str]:
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"seccomp filters exist only on Linux (this is {sys.platform})"
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # RuntimeError: "Unable to find libseccomp"
        return f"the seccomp binding cannot be loaded ({type(e).__name__}: {e}; pip install pyseccomp, and the system's libseccomp2)"
    try:
        with open("/proc/self/status") as f:
            if not any(line.startswith("Seccomp:") for line in f):
                return "this kernel has no seccomp support (/proc/self/status names none)"
    except OSError as e:
        return f"the kernel's seccomp support cannot be checked ({e})"
    return None


# ------------------------------------------------------------------------------ the plan

@dataclasses.dataclass
class SandboxPlan:
    """A replay that must run in the sandbox (:func:`sandbox_plan`).

    Attributes:
        path: the bundle. meta: its metadata (read in the parent, for what the caller returns).
        request: the :class:`~nanreplay.engine.state.ReplayRequest` the child replays with (the
            CPU as its device). bundle_bytes: the file's size (the default memory allowance).
    """

    path: Path
    meta: dict
    request: Any
    bundle_bytes: int

    def run(self, work: Callable[[Any, Callable[[Any], None]], Any], *, progress: Optional[Callable[[Any], None]] = None,
            limits: Optional[SandboxLimits] = None, encode: Callable[[Any], tuple[Any, dict[str, bytes]]] = lambda v: (v, {}),
            ) -> tuple[Any, dict[str, bytes]]:
        """Run ``work(request, say)`` in a sandboxed child and return what it returned, as
        ``encode`` turned it into JSON data and file bytes in the child (default: the value is
        JSON data and there are no files). ``say(value)`` in the child calls ``progress(value)``
        here (a string or an int). The caller checks the data against its schema.

        Raises:
            SandboxError: the child died (a signal, a limit, out of memory), ran past
                ``limits.timeout``, or sent more or other than a result.
            the error the replay raised in the child: ``BundleFormatError``, ``ReplayError``,
                ``ModelMismatchError``, ``DiagnosisTimeout``, ``FileNotFoundError`` as
                themselves; any other as a :class:`~nanreplay.errors.ReplayError` naming it.
        """
        limits = limits or SandboxLimits()
        return _run_child(lambda say: encode(work(self.request, say)), progress=progress, limits=limits,
                          memory=limits.memory_for(self.bundle_bytes), label=str(self.path))


@contextlib.contextmanager
def sandbox_plan(bundle: Any, request: Any, *, optimizer: bool = False) -> Iterator[tuple[Any, Optional[SandboxPlan]]]:
    """Open ``bundle`` for a replay with ``request`` and say where it runs: yields the open
    :class:`~nanreplay.format.bundle.Bundle` (a path is opened here and closed on exit, an open one
    is viewed) and the sandbox plan, or ``None`` when this process may run it: the bundle is
    trusted (trust store or ``request.trust``), or the replay would not run its embedded program
    (the user's model or factory, or the recorded factory of a trusted bundle). The caller replays
    the yielded bundle either way (a forked child inherits it), so it is opened once. The trust
    rule is checked here, before anything is forked::

        with sandbox_plan(path, request) as (b, plan):
            if plan is None:
                return work(b, request, progress)
            data, files = plan.run(lambda req, say: work(b, req, say))

    Raises:
        UntrustedBundleError: the replay would import code the untrusted bundle names.
        SandboxUnavailableError: the program needs the sandbox and this machine has none
            (:func:`unavailable`); the message says to pass ``--trust``.
        ReplayError: ``request.device`` names another device than the CPU (the sandbox replays
            on the CPU).
        FileNotFoundError, BundleFormatError: the bundle cannot be read.
    """
    from ..format.bundle import Bundle, open_bundle

    own = not isinstance(bundle, Bundle)
    b = open_bundle(bundle, trust=request.trust) if own else bundle.view(trust=request.trust)
    try:
        yield b, _plan(b, request, optimizer)
    finally:
        if own:
            b.close()


def _plan(b: Any, request: Any, optimizer: bool) -> Optional[SandboxPlan]:
    from .state import runs_untrusted_program

    if not runs_untrusted_program(b, request, optimizer=optimizer):
        return None
    why = unavailable()
    if why is not None:
        raise SandboxUnavailableError(b.path, why)
    dev = request.device
    if dev is not None and str(dev).split(":")[0] != "cpu":
        raise ReplayError(f"device {dev}: the program of an untrusted bundle replays only inside nanreplay's sandbox, on the CPU; "
                          f"pass --trust (Python: trust=True) to replay it on {dev} in this process, after reviewing `nanreplay inspect`")
    try:
        size = Path(b.path).stat().st_size
    except OSError:
        size = 0
    return SandboxPlan(Path(b.path), dict(b.meta), dataclasses.replace(request, device="cpu"), size)


def conforming(data: Any, schema: Union[str, dict], path: Any) -> Any:
    """``data`` (a sandboxed replay's result) when it conforms to the JSON Schema ``schema`` (a
    shipped schema's name, ``"diagnosis"`` or ``"bisect"``, or a schema), else
    :class:`~nanreplay.errors.SandboxError` naming the first difference."""
    from ..core.schema import conforms, shipped_schema

    errors = conforms(data, shipped_schema(schema) if isinstance(schema, str) else schema)
    if errors:
        raise SandboxError(f"the sandboxed replay of {path} returned a result that does not follow its schema ({errors[0]}); "
                           "a damaged or hostile bundle; nothing outside the sandbox was touched")
    return data


# ------------------------------------------------------------------------------ the parent

#: modules a replay of a program imports whose import writes a file or probes a writable
#: directory (Dynamo's cache directory asks ``tempfile.gettempdir()``, which writes a test file):
#: imported in the parent before the fork, so the confined child has them
PREIMPORTS = ("torch._export.serde.serialize", "torch.export", "torch._dynamo")


def _warm() -> None:
    """What the child must find ready: the temporary directory resolved (``tempfile`` caches it;
    resolving it writes a probe file) and :data:`PREIMPORTS` imported."""
    import importlib
    import tempfile

    tempfile.gettempdir()
    if "torch" in sys.modules:
        for name in PREIMPORTS:
            importlib.import_module(name)


def _run_child(work: Callable[[Callable[[Any], None]], tuple[Any, dict[str, bytes]]], *, progress: Optional[Callable[[Any], None]],
               limits: SandboxLimits, memory: int, label: str) -> tuple[Any, dict[str, bytes]]:
    _warm()
    threads = _child_threads()
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12: "use of fork() may lead to deadlocks" (handled: see the module doc)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(r)
        _child(work, w, limits=limits, memory=memory, threads=threads)
    os.close(w)
    try:
        return _collect(pid, r, progress=progress, limits=limits, memory=memory, label=label)
    finally:
        os.close(r)
        _reap(pid)


def _child_threads() -> int:
    """The intra-op threads of the child: torch's own count in a fresh process, else 1."""
    if not _FRESH or "torch" not in sys.modules:
        return 1
    import torch

    return max(1, torch.get_num_threads())


class _Frames:
    """The parent's reader of the child's frames: ``(kind, payload)`` as they complete, with the
    byte budgets enforced before a payload is read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.json_bytes = 0
        self.blob_bytes = 0
        self.eof = False

    def read(self) -> None:
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.eof = True
        self.buf += chunk

    def frames(self) -> Iterator[tuple[bytes, bytes]]:
        while len(self.buf) >= _HEADER.size:
            kind, n = _HEADER.unpack_from(self.buf)
            if kind == _BLOB and n > BLOB_MAX_BYTES - self.blob_bytes:
                raise SandboxError(f"the sandboxed replay sent more than {BLOB_MAX_BYTES} bytes of files; a damaged or hostile bundle")
            if kind != _BLOB and (n > JSON_MAX_BYTES or self.json_bytes + n > 4 * JSON_MAX_BYTES):
                raise SandboxError(f"the sandboxed replay sent more than a replay's result ({n} bytes in one message, "
                                   f"{self.json_bytes} before it; the limit is {JSON_MAX_BYTES}); a damaged or hostile bundle")
            if len(self.buf) < _HEADER.size + n:
                return
            payload = bytes(self.buf[_HEADER.size:_HEADER.size + n])
            del self.buf[:_HEADER.size + n]
            if kind == _BLOB:
                self.blob_bytes += n
            else:
                self.json_bytes += n
            yield kind, payload


def _collect(pid: int, fd: int, *, progress: Optional[Callable[[Any], None]], limits: SandboxLimits, memory: int, label: str
             ) -> tuple[Any, dict[str, bytes]]:
    """Read the child's frames until it closes the pipe, relaying progress and log records, within
    the wall-clock limit; then the result, the error it reported, or why it died."""
    deadline = time.monotonic() + limits.timeout
    frames = _Frames(fd)
    result: Any = _NONE
    error: Optional[dict] = None
    blobs: dict[str, bytes] = {}
    relayed = 0
    try:
        while not frames.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill(pid)
                raise SandboxError(f"the sandboxed replay of {label} ran past its time limit of {limits.timeout:g} s and was stopped; "
                                   "a hostile bundle's program, or a replay that needs longer: --timeout SECONDS (Python: "
                                   "sandbox=SandboxLimits(timeout=...)) gives it more")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            frames.read()
            for kind, payload in frames.frames():
                if kind == _BLOB:
                    name, data = _split_blob(payload)
                    blobs[name] = data
                    continue
                value = _json(payload)
                if kind == _RESULT:
                    result = value
                elif kind == _ERROR:
                    error = value if isinstance(value, dict) else {}
                elif relayed < RELAY_MAX:
                    relayed += 1
                    _relay(kind, value, progress)
    except BaseException:
        _kill(pid)  # an interrupt, a bad frame: the child goes first
        raise
    status = _reap(pid)
    if error is not None:
        raise _relayed_error(error)
    if result is not _NONE and status == 0:
        return result, blobs
    raise SandboxError(_death_sentence(status, label, memory, limits))


_NONE = object()


def _split_blob(payload: bytes) -> tuple[str, bytes]:
    n = int.from_bytes(payload[:2], "little")
    name = payload[2:2 + n].decode("utf-8", "replace")
    return name, payload[2 + n:]


def _json(payload: bytes) -> Any:
    from ..core.safejson import strict_loads  # numpy: imported when a sandbox runs, not with the command line

    try:
        return strict_loads(payload, max_depth=64, max_containers=1 << 22, max_separators=1 << 23)
    except ValueError as e:
        raise SandboxError(f"the sandboxed replay sent malformed data ({e}); a damaged or hostile bundle") from None


def _relay(kind: bytes, value: Any, progress: Optional[Callable[[Any], None]]) -> None:
    """A progress value (a short string or an int) to ``progress``; a log record ``[level, name,
    message]`` to the parent's logger of that name (under ``nanreplay`` only)."""
    if kind == _PROGRESS:
        if progress is not None and (isinstance(value, str) and len(value) <= 500 or type(value) is int):
            progress(value)
    elif kind == _LOG and isinstance(value, list) and len(value) == 3:
        level, name, message = value
        if type(level) is int and isinstance(name, str) and isinstance(message, str) and (name == "nanreplay" or name.startswith("nanreplay.")):
            logging.getLogger(name[:200]).log(min(max(level, logging.DEBUG), logging.CRITICAL), "%s", message[:_MESSAGE_MAX])


def _relayed_error(err: dict) -> BaseException:
    """The exception a child reported, ``{"type", "bases", "message", "cli"}``: the class of
    :data:`_RELAYED` it is or derives from (``ProgramRefused`` is a ``ReplayError``), else a
    ``ReplayError`` naming its type; ``describe(cli=True)`` keeps the child's command-line wording."""
    kind = err.get("type") if isinstance(err.get("type"), str) else "Exception"
    bases = [b for b in err.get("bases") or [] if isinstance(b, str)] if isinstance(err.get("bases"), list) else []
    message = str(err.get("message") or "")[:_MESSAGE_MAX]
    cli = str(err.get("cli") or message)[:_MESSAGE_MAX]
    if kind == "MemoryError":
        return SandboxError(f"the sandboxed replay ran out of memory within its limit ({message or 'MemoryError'}); a hostile bundle's "
                            "program, or a replay that needs more: --memory-limit GIB gives it more")
    cls = next((_RELAYED[k] for k in [kind, *bases] if k in _RELAYED), None)
    if cls is None:
        return ReplayError(f"the sandboxed replay failed: {kind[:80]}: {message}; a damaged or hostile bundle's program, "
                           "or a bug: replay with your own code (--model-factory) to tell")
    e = cls(message)
    if isinstance(e, NanReplayError) and message and cli != message:
        e.with_cli_fix(message, cli)
    return e


def _death_sentence(status: int, label: str, memory: int, limits: SandboxLimits) -> str:
    """The one sentence of a child that ended without a result."""
    tail = "; a damaged or hostile bundle; nothing outside the sandbox was touched"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = _signal_name(sig)
        why = {signal.SIGXCPU: f"its CPU time limit ({limits.cpu or 'the timeout times its threads'} s)",
               signal.SIGXFSZ: "a write to a file (the sandbox allows none)",
               signal.SIGSYS: "a system call the sandbox forbids"}.get(sig)
        if why is None and sig == signal.SIGKILL:
            why = f"killed: out of memory (its limit is {memory / 2**30:.2f} GiB of address space beyond its parent's; --memory-limit GIB) or by another process"
        return (f"the bundle's program crashed the sandboxed replay of {label} (signal {name}"
                + (f": {why}" if why else "") + ")" + tail)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return f"the sandboxed replay of {label} ended (exit status {code}) without a result" + tail


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _reap(pid: int) -> int:
    """Wait for the child (once); its wait status, 0 when it was reaped before."""
    try:
        _, status = os.waitpid(pid, 0)
        return status
    except ChildProcessError:
        return 0


# ------------------------------------------------------------------------------ the child

def _child(work: Callable[[Callable[[Any], None]], tuple[Any, dict[str, bytes]]], w: int, *, limits: SandboxLimits, memory: int,
           threads: int) -> None:  # pragma: no cover - runs in the forked child
    """The child's whole life: confine itself, run ``work``, send its result, ``os._exit``."""
    code = 0
    try:
        out = _Out(w)
        try:
            _confine(w, limits=limits, memory=memory, threads=threads, out=out)
            data, blobs = work(out.progress)
            for name, raw in (blobs or {}).items():
                out.blob(name, raw)
            out.send(_RESULT, _plain(data))
        except BaseException as e:  # noqa: BLE001 - every failure goes to the parent as data
            out.send(_ERROR, _error_data(e))
    except BaseException:  # noqa: BLE001 - the pipe itself failed: the exit status says it
        code = 70
    os._exit(code)


class _Out:
    """The child's writer of frames on the result pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def send(self, kind: bytes, value: Any) -> None:
        raw = json.dumps(value, allow_nan=False, default=str, separators=(",", ":")).encode("utf-8", "surrogatepass")
        with self.lock:
            self._write(_HEADER.pack(kind, len(raw)) + raw)

    def blob(self, name: str, raw: bytes) -> None:
        head = name.encode()
        with self.lock:
            self._write(_HEADER.pack(_BLOB, 2 + len(head) + len(raw)) + len(head).to_bytes(2, "little") + head)
            self._write(raw)

    def progress(self, value: Any) -> None:
        self.send(_PROGRESS, value if isinstance(value, (str, int)) else str(value))


class _Relay(logging.Handler):
    """Log records of the child, sent to the parent as ``[level, name, message]``."""

    def __init__(self, out: _Out) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.out.send(_LOG, [record.levelno, record.name, record.getMessage()])
        except Exception:  # noqa: BLE001 - a log line is never worth the replay
            pass


def _error_data(e: BaseException) -> dict:
    describe = getattr(e, "describe", None)
    message = str(e)
    try:
        cli = describe(cli=True) if callable(describe) else message
    except Exception:  # noqa: BLE001
        cli = message
    return {"type": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__[1:]], "message": message[:_MESSAGE_MAX],
            "cli": str(cli)[:_MESSAGE_MAX]}


def _plain(v: Any, depth: int = 0) -> Any:
    """``v`` for strict JSON: non-finite floats as ``core.jsonable`` writes them (``"nan"``), tuples
    as lists; other values as ``--json`` would print them (``str``)."""
    if isinstance(v, float):
        return fnum(v)
    if depth > 60:
        return str(v)
    if isinstance(v, dict):
        return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    return v


def _confine(w: int, *, limits: SandboxLimits, memory: int, threads: int, out: _Out) -> None:  # pragma: no cover - the child
    """Everything the child does before it runs the replay (see the module docstring)."""
    import faulthandler

    faulthandler.disable()  # it would write into a descriptor about to be closed
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(71)
    with contextlib.suppress(OSError):
        os.setsid()  # away from the terminal: no controlling tty to inject keystrokes into
    _quiet_stdio()
    _close_writable(keep={0, 1, 2, w})
    sys.dont_write_bytecode = True
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_Relay(out))
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
    _limit(memory=memory, cpu=limits.cpu if limits.cpu is not None else limits.timeout * threads + 10, threads=threads)
    _filter().load()


def _quiet_stdio() -> None:  # pragma: no cover - the child
    """Standard streams on ``/dev/null``, with fresh Python objects (a lock another thread held at
    the fork would block the old ones)."""
    rd, wr = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
    os.dup2(rd, 0)
    os.dup2(wr, 1)
    os.dup2(wr, 2)
    os.close(rd)
    os.close(wr)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


def _close_writable(keep: set[int]) -> None:  # pragma: no cover - the child
    """Close every inherited descriptor open for writing (files, pipes, sockets, terminals) but
    ``keep``; descriptors of other kinds (an eventfd, an epoll set) stay."""
    import fcntl
    import stat

    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd in keep:
            continue
        try:
            st = os.fstat(fd)
            writable = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) != os.O_RDONLY
        except OSError:
            continue
        mode = st.st_mode
        if stat.S_ISSOCK(mode) or (writable and (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode))):
            with contextlib.suppress(OSError):
                os.close(fd)


def _user_tasks() -> Optional[int]:  # pragma: no cover - the child
    """The tasks (threads) this user runs now, from ``/proc``; ``None`` when it cannot be read."""
    uid, n = os.getuid(), 0
    try:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                n += int(fields[17])  # num_threads (field 20 of proc(5); 18th after the command)
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return None
    return n


def _limit(*, memory: int, cpu: float, threads: int) -> None:  # pragma: no cover - the child
    """The rlimits (see the module docstring). A hard limit already lower is kept."""

    def cap(res: int, value: int) -> None:
        soft, hard = resource.getrlimit(res)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value if res != resource.RLIMIT_CPU else (value + 5 if hard == resource.RLIM_INFINITY else min(value + 5, hard))))

    cap(resource.RLIMIT_AS, _vm_bytes() + memory)
    cap(resource.RLIMIT_CPU, int(math.ceil(cpu)))
    cap(resource.RLIMIT_FSIZE, 0)
    cap(resource.RLIMIT_CORE, 0)
    tasks = _user_tasks()
    if tasks is not None:
        cap(resource.RLIMIT_NPROC, tasks + threads + 16)


def _vm_bytes() -> int:
    """This process's address space (``VmSize``), bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _filter() -> Any:  # pragma: no cover - the child
    """The seccomp filter (see the module docstring and :data:`DENIED`): allow by default; EPERM
    for :data:`DENIED`, for ``open`` / ``openat`` with any of ``O_WRONLY``, ``O_RDWR``,
    ``O_CREAT``, ``O_TRUNC``, for a ``clone`` that does not make a thread, for a signal sent to
    another process, for setting any resource limit, and for the terminal's ``TIOCSTI``;
    ``ENOSYS`` for ``clone3`` (whose flags a filter cannot read: glibc then makes threads with
    ``clone``). System calls this architecture lacks are skipped. A call of another
    architecture's ABI kills the process (libseccomp's default)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    me = os.getpid()

    def rule(action: int, name: str, *args: Any) -> None:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
            return
        f.add_rule(action, name, *args)

    for name in DENIED:
        rule(eperm, name)
    for name, flags_arg in (("open", 1), ("openat", 2)):
        for bit in (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC):
            rule(eperm, name, sc.Arg(flags_arg, sc.MASKED_EQ, bit, bit))
    rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        rule(eperm, name, sc.Arg(0, sc.NE, me))
    rule(eperm, "prlimit64", sc.Arg(2, sc.NE, 0))
    rule(eperm, "ioctl", sc.Arg(1, sc.EQ, _TIOCSTI))
    return f


def contained_call(fn: Callable[[], Any], *, limits: Optional[SandboxLimits] = None, memory: int = MEMORY_ALLOWANCE) -> Any:
    """``fn()`` run in a sandboxed child exactly as a replay runs there, its JSON result returned
    (``memory``: bytes of address space it may add). The tests of the walls themselves
    (``tests/engine/test_sandbox.py``) and the fuzzer's probes call it; a bundle cannot: a bundle
    is data and names no function.

    Raises:
        SandboxError: the child died or ran past ``limits`` (default: 60 s).
        the error ``fn`` raised, relayed as :meth:`SandboxPlan.run` relays it.
    """
    limits = limits or SandboxLimits(timeout=60)
    data, _ = _run_child(lambda say: (fn(), {}), progress=None, limits=limits, memory=memory, label="a contained call")
    return data
