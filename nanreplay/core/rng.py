"""RNG state as a small object with capture / restore, the way torchsnapshot treats it
(``torchsnapshot/rng_state.py``): one value holding every generator a training step can draw from.

Generators covered:

* Python's ``random`` module (Mersenne Twister, 625 words),
* NumPy's legacy global generator (``np.random.get_state``, MT19937),
* torch's default CPU generator (``torch.get_rng_state``, a uint8 tensor),
* torch's CUDA generators, one per device, captured only when CUDA is already initialised
  (capturing must never initialise CUDA as a side effect).

Capture never synchronises a GPU (the CUDA state is the Philox seed and offset, kept on the
host) and only reads: no generator advances. :meth:`RNGState.capture` copies every state (about
35 µs, most of it NumPy's ``get_state``, which copies its 624 words one by one in Python);
:class:`RNGReader`, the Recorder's per-step reader, copies a state only when it changed since its
last read, and otherwise hands back the very objects it read then (about 1.3 µs in a tight loop,
about 5 in a training step whose own work has pushed the states out of the caches; no memory per
step for a generator the loop does not draw from).

:class:`ReplayRNG` is how nanreplay's own random work (replays, the dropout of an in-process
diagnosis, the check of an exported program) draws from recorded states without consuming or
rewinding the generators the user's threads draw from (see its docstring for the limits).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import struct
import sys
import threading
import weakref
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
import torch

__all__ = ["RNGState", "RNGReader", "PythonState", "ReplayRNG", "sole_thread", "without_private_generators"]


@dataclass
class RNGState:
    """Every RNG state one training step may draw from.

    Attributes:
        python: ``random.getstate()`` (version, 625-tuple of ints, gauss_next).
        numpy: ``np.random.get_state()`` as a tuple (name, uint32[624] keys, pos, has_gauss, cached_gaussian).
        torch_cpu: the CPU generator state, a uint8 tensor on the CPU.
        torch_cuda: one uint8 CPU tensor per CUDA device, or empty when CUDA was not initialised.
    """

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls) -> "RNGState":
        """Snapshot every generator now. Never initialises CUDA; never syncs a device."""
        cuda: list[torch.Tensor] = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = list(torch.cuda.get_rng_state_all())
        return cls(
            python=random.getstate(),
            numpy=np.random.get_state(),
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
        )

    def restore(self) -> None:
        """Put every generator back to this state, so the next draw equals the draw that
        followed :meth:`capture`. CUDA states are restored for as many devices as were
        captured and are present now.

        Raises:
            ValueError: a CUDA state was captured but this process has fewer CUDA devices.
        """
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() < len(self.torch_cuda):
                found = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise ValueError(
                    f"the RNG state holds {len(self.torch_cuda)} CUDA generator(s) but this process "
                    f"has {found} CUDA device(s); replay on a machine with at least "
                    f"{len(self.torch_cuda)} GPU(s), or pass --device cpu to replay without them "
                    "(dropout on CUDA will then draw different masks)"
                )
            torch.cuda.set_rng_state_all(self.torch_cuda)

    def without_cuda(self) -> "RNGState":
        """This state without its CUDA generators, for a replay that runs on another device (a
        CUDA bundle replayed on the CPU): such a replay draws nothing from them, and restoring them
        would need the GPUs the recording had (and would initialise CUDA for nothing). What the step
        drew on the GPU (dropout of a CUDA model) then comes from the CPU generator: other numbers."""
        return RNGState(python=self.python, numpy=self.numpy, torch_cpu=self.torch_cpu)

    # -- serialisation: tensors + JSON, never pickle ---------------------------------------

    def to_flat(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Split into tensors (keys under ``prefix``) and a JSON-able dict.

        Tensors: ``{prefix}python`` int64[625], ``{prefix}numpy`` uint32 keys as int64[624],
        ``{prefix}torch_cpu`` uint8, ``{prefix}cuda/{i}`` uint8 per device.
        """
        version, words, gauss_next = self.python
        name, keys, pos, has_gauss, cached = self.numpy
        tensors = {
            f"{prefix}python": torch.tensor(list(words), dtype=torch.int64),
            f"{prefix}numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            f"{prefix}torch_cpu": self.torch_cpu.clone(),
        }
        for i, s in enumerate(self.torch_cuda):
            tensors[f"{prefix}cuda/{i}"] = s.clone()
        meta = {
            "python_version": int(version),
            "python_gauss_next": gauss_next,
            "numpy_name": str(name),
            "numpy_pos": int(pos),
            "numpy_has_gauss": int(has_gauss),
            "numpy_cached_gaussian": float(cached),
            "cuda_devices": len(self.torch_cuda),
        }
        return tensors, meta

    @classmethod
    def from_flat(cls, get: Callable[[str], torch.Tensor], meta: Mapping[str, Any], prefix: str) -> "RNGState":
        """Inverse of :meth:`to_flat`. ``get(key)`` returns a stored tensor. The states are
        checked by restoring them into scratch generators (never the process's own), so a damaged
        state fails here, not in the middle of a replay.

        Raises:
            ValueError: the stored state has the wrong length, dtype or values (hand-edited or
                damaged bundle).
        """
        words = get(f"{prefix}python")
        keys = get(f"{prefix}numpy")
        cpu = get(f"{prefix}torch_cpu")
        if words.shape != (625,) or keys.shape != (624,) or words.dtype != torch.int64 or keys.dtype != torch.int64 or cpu.dtype != torch.uint8 or cpu.dim() != 1:
            raise ValueError(
                f"RNG state under {prefix!r} is malformed: expected python int64[625], numpy int64[624], "
                f"torch_cpu uint8[N]; found {words.dtype} {tuple(words.shape)}, {keys.dtype} {tuple(keys.shape)}, {cpu.dtype} {tuple(cpu.shape)}"
            )
        gauss = meta.get("python_gauss_next")
        if gauss is not None and not isinstance(gauss, (int, float)):
            raise ValueError(f"RNG state under {prefix!r}: python_gauss_next must be a number or null, found {gauss!r}")
        python = (int(meta["python_version"]), tuple(int(w) for w in words.tolist()), None if gauss is None else float(gauss))
        if int(keys.min()) < 0 or int(keys.max()) >= 2**32:
            raise ValueError(f"RNG state under {prefix!r}: the NumPy MT19937 keys must be uint32 values")
        numpy_state = (
            str(meta["numpy_name"]),
            keys.numpy().astype(np.uint32),
            int(meta["numpy_pos"]),
            int(meta["numpy_has_gauss"]),
            float(meta["numpy_cached_gaussian"]),
        )
        cuda = [get(f"{prefix}cuda/{i}") for i in range(int(meta.get("cuda_devices", 0)))]
        if any(c.dtype != torch.uint8 or c.dim() != 1 for c in cuda):
            raise ValueError(f"RNG state under {prefix!r}: CUDA generator states must be 1-D uint8 tensors")
        try:
            random.Random().setstate(python)
            np.random.RandomState().set_state(numpy_state)
            torch.Generator().set_state(cpu)
        except (ValueError, TypeError, OverflowError, RuntimeError) as e:
            raise ValueError(f"RNG state under {prefix!r} cannot be restored: {type(e).__name__}: {e}") from e
        return cls(python=python, numpy=numpy_state, torch_cpu=cpu, torch_cuda=cuda)


# -- reading the states every step, copying only what changed ---------------------------------------

#: bytes of a Mersenne Twister's state as CPython's ``_random.Random`` and NumPy's ``MT19937`` hold
#: it in C: a 4-byte position and 624 32-bit words (in that order for Python, the other for NumPy)
_MT_BYTES = 4 + 624 * 4


class _RawMT:
    """The raw bytes of one Mersenne Twister's C state, read in place (a ctypes array over that
    memory, made once; its ``raw`` copies the 2.5 KiB into a bytes object, about 0.1 µs, and ``==``
    compares them in C: no foreign call, nothing allocated per word): a fingerprint that is the
    whole state, so equal bytes mean an equal generator. ``address`` is where the state lives (the
    owner is kept alive by the reader); ``check(raw)`` says whether those bytes agree with the
    public ``getstate`` API, and is asked once: a layout that does not (another interpreter or
    NumPy build) turns the reader off, and the public API is read instead."""

    def __init__(self, owner: Any, address: Optional[int], check: Callable[[bytes], bool]) -> None:
        self.owner = owner
        self.ok = False
        #: a ctypes array over the state's memory (its ``raw`` is a copy of the bytes as they are now)
        self.view: Any = None
        #: the bytes at the reader's last read of this Twister: what the next read is compared with
        self.last = b""
        if address is None:  # a layout this reader does not know: never touch that memory
            return
        try:
            self.view = (ctypes.c_char * _MT_BYTES).from_address(address)
            self.ok = bool(check(self.read()))
        except Exception:  # noqa: BLE001 - any surprise: fall back to the public API
            self.ok = False

    def read(self) -> bytes:
        """The state's bytes now (compared with :attr:`last`, which the reader sets)."""
        return self.view.raw


class PythonState(Sequence):
    """``random.getstate()``'s value ``(version, 625 words, gauss_next)`` kept as the generator's
    raw C state (2.5 KiB: a tuple of 625 Python ints is 25 KiB, held by every step of the ring
    buffer whose Python generator moved): the tuple is built each time it is read, the same tuple
    ``getstate()`` returned (:func:`_python_raw` checked the layout). ``random.setstate`` and
    unpacking take it as they take the tuple."""

    __slots__ = ("raw", "gauss_next", "version")

    def __init__(self, raw: bytes, gauss_next: Optional[float], version: int) -> None:
        self.raw, self.gauss_next, self.version = raw, gauss_next, version

    def _value(self) -> tuple:
        index, *words = struct.unpack("=i624I", self.raw)
        return (self.version, (*words, index), self.gauss_next)

    def __getitem__(self, i: Any) -> Any:
        return self._value()[i]

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[Any]:
        return iter(self._value())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, PythonState)) else other)

    def __hash__(self) -> int:
        return hash(self._value())

    def __repr__(self) -> str:
        return f"PythonState(version={self.version}, gauss_next={self.gauss_next!r}, 625 words)"


def _python_raw() -> _RawMT:
    """CPython's ``random`` module generator: ``RandomObject {PyObject_HEAD; int index; uint32_t
    state[624];}``, the bytes just after the object header (``getstate()`` returns the same words,
    then the index)."""
    import _random

    inst = random.getstate.__self__
    head = object.__basicsize__

    def check(raw: bytes) -> bool:
        index, *words = struct.unpack("=i624I", raw)
        return random.getstate()[1] == (*words, index)

    known = _random.Random.__basicsize__ >= head + _MT_BYTES and isinstance(inst, _random.Random)
    return _RawMT(inst, id(inst) + head if known else None, check)


def _numpy_raw() -> _RawMT:
    """NumPy's legacy global generator: its ``MT19937`` bit generator's ``mt19937_state {uint32_t
    key[624]; int pos;}`` at ``bit_generator.ctypes.state_address`` (public API)."""
    legacy = np.random.mtrand._rand
    bitgen = legacy._bit_generator

    def check(raw: bytes) -> bool:
        name, key, pos, _, _ = np.random.get_state()
        return raw == np.asarray(key, dtype=np.uint32).tobytes() + struct.pack("=i", pos)

    known = isinstance(bitgen, np.random.MT19937) and getattr(np.random.get_state, "__self__", None) is legacy
    return _RawMT(bitgen, bitgen.ctypes.state_address if known else None, check)


#: bytes of torch's CPU generator kept in place (``at::mt19937``'s data: seed, position flags and
#: 624 32-bit words, 2,520 bytes; then the cached normal samples, ``optional<float>`` and
#: ``optional<double>``, 24 bytes), from the engine's first field on
_TORCH_CPU_BYTES = 2520 + 24
#: how far into the ``CPUGeneratorImpl`` object the engine's first field is looked for
_TORCH_CPU_SEARCH = 256


class _RawTorchCPU:
    """Whether a torch CPU generator moved since the last look, from its C++ state read in place
    (2.5 KiB copied into a bytes object and compared with the last copy, in C: no tensor made, no
    foreign call), instead of ``get_state()``'s 5 KiB tensor and a copy of its bytes to compare every
    step.

    The engine's place in the ``CPUGeneratorImpl`` object is found once, on a private generator:
    the bytes ``get_state()`` starts with (seed, position, flags) and its first state words, in the
    object's first :data:`_TORCH_CPU_SEARCH` bytes; then that generator draws (uniform, normal
    with and without a cached sample, integers, a whole Twister period, bernoulli, permutations)
    and every change ``get_state()`` shows must show in place too, and a state put back must read
    the same bytes. Any surprise (another torch's layout) leaves :attr:`ok` false, and the caller
    reads ``get_state()`` as before."""

    def __init__(self, gen: torch.Generator) -> None:
        self.ok = False
        #: the engine's bytes in place (a ctypes array), the copy they are compared with, and the
        #: generator's C++ object pointer read in place (``impl_view``) with its value then (``impl``);
        #: the reader inlines :meth:`same_impl` and :meth:`moved`, once a step
        self.view: Any = None
        self.last = b""
        if type(gen) is not torch.Generator or gen.device.type != "cpu":
            return
        try:
            offset = _engine_offset(torch.Generator())
            if offset is None:
                return
            self._gen = gen  # kept alive: its object holds the pointer read below
            self.impl_view = ctypes.c_void_p.from_address(id(gen) + object.__basicsize__)
            self.impl = self.impl_view.value
            self.view = (ctypes.c_char * _TORCH_CPU_BYTES).from_address(self.impl + offset)
            self.last = self.view.raw
            self.ok = _state_words(gen.get_state()) == self.last[20:20 + 624 * 4]
        except Exception:  # noqa: BLE001 - any surprise: the caller reads get_state()
            self.ok = False

    def same_impl(self) -> bool:
        """Whether the generator still holds the C++ object found at construction (torch gives a
        CPU generator no way to swap it; checked each step all the same, before reading its
        memory): when not, :attr:`ok` turns off for good."""
        if self.impl_view.value != self.impl:
            self.ok = False
        return self.ok

    def moved(self) -> bool:
        """Whether the generator's state differs from the one at the last call (or construction);
        the kept copy is brought up to date."""
        now = self.view.raw
        if now == self.last:
            return False
        self.last = now
        return True


def _impl_address(gen: torch.Generator) -> int:
    """The address of the C++ ``GeneratorImpl`` behind ``gen`` (``THPGenerator``: the object
    header, then ``at::Generator``, one pointer)."""
    return ctypes.c_void_p.from_address(id(gen) + object.__basicsize__).value or 0


def _state_words(state: torch.Tensor) -> bytes:
    """The 624 Twister words of a CPU generator's ``get_state()`` (stored there as 64-bit words,
    after the seed, position and flags: 24 bytes), as the engine holds them (32-bit)."""
    words = struct.unpack_from("=624Q", state.numpy().tobytes(), 24)
    return struct.pack("=624I", *(w & 0xFFFFFFFF for w in words))


def _engine_offset(gen: torch.Generator) -> Optional[int]:
    """Where the Twister's data starts in the ``CPUGeneratorImpl`` of the private CPU generator
    ``gen``, checked by drawing from it (:class:`_RawTorchCPU`); ``None`` when not found or when
    a change of ``get_state()`` does not show there."""
    gen.manual_seed(20240601)
    impl = _impl_address(gen)
    if not impl:
        return None
    state = gen.get_state()
    seed, left = struct.unpack_from("=Qi", state.numpy().tobytes(), 0)
    head = struct.pack("=Qi", seed, left)
    found = ctypes.string_at(impl, _TORCH_CPU_SEARCH).find(head)
    if found < 0 or ctypes.string_at(impl + found + 20, 624 * 4) != _state_words(state):
        return None
    draws = (lambda: torch.rand(1, generator=gen), lambda: torch.randn(1, generator=gen), lambda: torch.randn(1, generator=gen),
             lambda: torch.randn(1, dtype=torch.float64, generator=gen), lambda: torch.randn(1, dtype=torch.float64, generator=gen),
             lambda: torch.empty(1).normal_(generator=gen), lambda: torch.empty(3).normal_(generator=gen),
             lambda: torch.randint(0, 10, (624,), generator=gen), lambda: torch.randn(100, generator=gen),
             lambda: torch.bernoulli(torch.full((5,), 0.5), generator=gen), lambda: torch.randperm(10, generator=gen))
    at = impl + found
    before, raw = gen.get_state(), ctypes.string_at(at, _TORCH_CPU_BYTES)
    for draw in draws:
        draw()
        now = gen.get_state()
        if not torch.equal(now, before) and ctypes.string_at(at, _TORCH_CPU_BYTES) == raw:
            return None  # a change get_state() sees and the bytes in place do not
        before, raw = now, ctypes.string_at(at, _TORCH_CPU_BYTES)
    return found


class RNGReader:
    """Reads :class:`RNGState` once per step for one Recorder, copying a generator's state only
    when it changed since the last read (a loop that never draws from Python's ``random`` pays
    nothing for it, and the steps of the ring buffer share one copy instead of one each).

    How each generator is known to be unchanged, exactly:

    * Python ``random`` and NumPy's global generator: the raw bytes of their Mersenne Twister (624
      words and the position, read in place: :class:`_RawMT`) and, for Python, ``gauss_next``.
      A changed Python state is kept as those bytes (:class:`PythonState`), not as
      ``getstate()``'s tuple of 625 ints.
      NumPy's legacy generator also caches one Gaussian (``has_gauss``), which it can consume
      without touching the Twister: after a read that saw a cached Gaussian, the next read copies
      the state whatever the bytes say. (One case is not seen: ``np.random.set_state`` putting back,
      between two reads, a cached Gaussian over the same Twister bytes.)
    * torch's CPU generator: ``torch.get_rng_state()`` (a 5 KiB copy, under 1 µs) compared with
      the last one by ``torch.equal``; the last one is kept when equal. CUDA generators likewise
      (16 bytes each: the Philox seed and offset).

    When the bytes cannot be read in place (an interpreter or NumPy whose layout differs from the
    one checked once at construction), the public ``getstate`` / ``get_state`` are read every step.

    ``spare(like)``: a tensor of ``like``'s shape to copy a moved CPU generator state into, or
    ``None`` (the ring buffer's :class:`~nanreplay.capture.ring.Spares`: a state of a step that
    left it), so that a run whose generator moves every step keeps no new allocation per step.
    """

    def __init__(self, *, spare: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None) -> None:
        self._spare = spare
        self._last: Optional[RNGState] = None
        self._py_inst = random.getstate.__self__
        self._py_gauss: Any = None  # Python's gauss_next at the last read (its Twister's bytes are _py_raw.last)
        self._torch_key: Optional[bytes] = None
        self._py_raw = _python_raw()
        self._np_raw = _numpy_raw()
        self._torch_raw = _RawTorchCPU(torch.default_generator)

    def capture(self) -> RNGState:
        """The states now; parts unchanged since the last call are the same objects as then (and
        the whole state is the last one when nothing moved). Python's and NumPy's Twisters, read in
        place, are read inline (no call per generator: this runs once a step)."""
        last = self._last
        py_raw, np_raw = self._py_raw, self._np_raw
        if last is None or not (py_raw.ok and np_raw.ok):
            return self._capture_each(last)
        # each Twister's bytes now (one copy into a bytes object) compared with those of the last read
        inst = self._py_inst
        gauss = inst.gauss_next
        now = py_raw.view.raw
        if now == py_raw.last and gauss == self._py_gauss:
            py = last.python
        else:
            py_raw.last, self._py_gauss = now, gauss
            py = PythonState(now, gauss, inst.VERSION)
        now = np_raw.view.raw
        if now == np_raw.last and not last.numpy[3]:  # no Gaussian cached at the last read
            np_ = last.numpy
        else:
            np_raw.last = now
            np_ = np.random.get_state()
        raw = self._torch_raw
        cpu = (last.torch_cpu if raw.ok and raw.impl_view.value == raw.impl and raw.view.raw == raw.last
               else self._torch_cpu(last))  # same_impl() and not moved(), inline
        cuda = self._cuda(last) if last.torch_cuda or torch.cuda.is_initialized() else last.torch_cuda
        if py is last.python and np_ is last.numpy and cpu is last.torch_cpu and cuda is last.torch_cuda:
            return last  # nothing moved: the same object (states are never modified in place)
        self._last = RNGState(py, np_, cpu, cuda)
        return self._last

    def _state(self, last: Optional[RNGState], py: Any, np_: Any, cpu: torch.Tensor, cuda: list[torch.Tensor]) -> RNGState:
        """The last state when no part moved (the same object: states are never modified in place), else a new one."""
        if last is not None and py is last.python and np_ is last.numpy and cpu is last.torch_cpu and cuda is last.torch_cuda:
            return last
        self._last = RNGState(py, np_, cpu, cuda)
        return self._last

    def _capture_each(self, last: Optional[RNGState]) -> RNGState:
        """:meth:`capture`, one generator at a time (the first read, or a Twister that cannot be read in place)."""
        return self._state(last, self._python(last), self._numpy(last), self._torch_cpu(last), self._cuda(last))

    def _python(self, last: Optional[RNGState]) -> Any:
        if not self._py_raw.ok:
            return random.getstate()
        py_raw, gauss = self._py_raw, self._py_inst.gauss_next
        raw = py_raw.read()
        if last is not None and raw == py_raw.last and gauss == self._py_gauss:
            return last.python
        py_raw.last, self._py_gauss = raw, gauss
        return PythonState(raw, gauss, self._py_inst.VERSION)  # no getstate(): its 625 ints are built when read

    def _numpy(self, last: Optional[RNGState]) -> Any:
        if not self._np_raw.ok:
            return np.random.get_state()
        np_raw = self._np_raw
        raw = np_raw.read()
        if last is not None and raw == np_raw.last and not last.numpy[3]:  # no Gaussian cached at the last read
            return last.numpy
        np_raw.last = raw
        return np.random.get_state()

    def _torch_cpu(self, last: Optional[RNGState]) -> torch.Tensor:
        if self._torch_raw.ok and self._torch_raw.same_impl():
            if not self._torch_raw.moved() and last is not None:
                return last.torch_cpu
            now = torch.default_generator.get_state()
        else:
            now = torch.default_generator.get_state()  # torch.get_rng_state(), without its Python frame
            raw = ctypes.string_at(now.data_ptr(), now.numel())  # a 5 KiB copy and a memcmp: cheaper than torch.equal's dispatch
            if last is not None and raw == self._torch_key:
                return last.torch_cpu
            self._torch_key = raw
        kept = self._spare(now) if self._spare is not None else None
        return kept.copy_(now) if kept is not None else now

    @staticmethod
    def _cuda(last: Optional[RNGState]) -> list[torch.Tensor]:
        if not torch.cuda.is_initialized():  # never initialises CUDA (nor asks the driver, every step)
            return last.torch_cuda if last is not None and not last.torch_cuda else []
        now = list(torch.cuda.get_rng_state_all())
        if last is not None and len(last.torch_cuda) == len(now) and all(torch.equal(a, b) for a, b in zip(now, last.torch_cuda)):
            return last.torch_cuda
        return now


# -- replaying recorded states without touching another thread's generators -----------------------

#: the name of the thread that draws ``nanreplay.cli``'s status line on a terminal
STATUS_THREAD_NAME = "nanreplay-status"
#: names of threads known to draw no random numbers: nanreplay's status line, and the thread
#: that reads results from inductor's compile subprocesses (``torch._inductor.compile_worker``)
INERT_THREAD_NAMES = frozenset({STATUS_THREAD_NAME, "InductorSubproc"})


def _draws_nothing(thread: threading.Thread) -> bool:
    """A thread known to draw no random numbers: one of :data:`INERT_THREAD_NAMES`, tqdm's
    monitor (``tqdm._monitor.TMonitor``: it sleeps and reads its bars' timestamps), or a worker of
    inductor's compile thread pool (:func:`_inductor_compile_worker`). tqdm starts its monitor with
    the first progress bar made, even a disabled one, and ``torch.fx.Interpreter.run`` makes one
    at every run; inductor's pool (one thread per core, up to 32) stays alive after the first
    compile on a machine with more than a few cores: without this, every process that had
    replayed an embedded program or compiled a model once counted as shared."""
    if thread.name in INERT_THREAD_NAMES:
        return True
    cls = type(thread)
    return (cls.__name__ == "TMonitor" and cls.__module__ == "tqdm._monitor") or _inductor_compile_worker(thread)


def _inductor_compile_worker(thread: threading.Thread) -> bool:
    """Whether ``thread`` is a worker of ``torch._inductor.async_compile.AsyncCompile.pool()``
    (a ``ThreadPoolExecutor`` whose jobs generate and build kernels' code: no random draw). Read
    from the worker's first argument (a weak reference to its executor); the pool is looked up
    only when inductor is imported and has made it (never created here)."""
    mod = sys.modules.get("torch._inductor.async_compile")
    args = thread.__dict__.get("_args") or ()
    if mod is None or not args or not isinstance(args[0], weakref.ReferenceType):
        return False
    try:
        pool = mod.AsyncCompile.pool
        return pool.cache_info().currsize > 0 and args[0]() is pool()
    except Exception:  # noqa: BLE001 - another torch version's layout: counted as a thread that may draw
        return False


def sole_thread() -> bool:
    """Whether the calling thread is the only Python thread alive that may draw random numbers
    (threads known not to are not counted: :func:`_draws_nothing`). Then nothing else in the
    process draws from the process-wide generators while it works, so setting them and putting
    them back is safe."""
    me = threading.current_thread()
    return all(t is me or _draws_nothing(t) for t in threading.enumerate())


class ReplayRNG:
    """Context manager: a scope in which nanreplay draws random numbers (a replayed step's
    dropout, random ops of a model or loss function) from recorded states, and after which every
    generator another thread uses is as if nanreplay had never run: not consumed, not rewound.

    * Alone in the process (:func:`sole_thread` on entry): :meth:`load` sets the process-wide
      generators (Python ``random``, NumPy's global one, torch CPU and CUDA) to the recorded
      state, and exit puts back the states found on entry. Exact for every generator.
    * With other threads alive: the process-wide generators are never set. Torch random ops
      called in this thread without an explicit ``generator=`` (``bernoulli_`` under CPU dropout,
      ``randn``, ``rand_like``, ``normal_``, ...) are routed by a thread-local dispatch mode to
      private ``torch.Generator`` objects, one per device, that :meth:`load` sets to the recorded
      state (and that start as copies of the live states otherwise). Other threads are not seen by
      the mode: their draws keep going to the shared generators, undisturbed.

    Limits with other threads alive: Python's ``random`` and NumPy's global generator are
    process-wide objects with no per-thread redirection, so they are not set to the recorded
    state; a model or loss function that draws from them in ``forward`` replays with other numbers
    and advances the shared stream (:attr:`untouched` lists them). On CUDA, kernels that draw
    without a generator argument (fused ``native_dropout`` is routed to an unfused ``bernoulli_``
    on the private generator, so its masks differ from training's; the flash / memory-efficient
    attention kernels' dropout is not routed at all and draws from the device's shared generator).
    """

    def __init__(self, *, private: bool | None = None) -> None:
        # private=None: private generators exactly when other threads are alive; False: always the
        # process-wide ones, set and put back (a torch.compile'd replay: Dynamo does not trace
        # under a Python dispatch mode, so the private routing would make it run eagerly)
        self.private = private
        self.shared = False                 # other threads alive: private generators
        self._saved: RNGState | None = None
        self._mode: _PrivateGenerators | None = None
        self.untouched: tuple[str, ...] = ()

    def __enter__(self) -> "ReplayRNG":
        self.shared = (not sole_thread()) if self.private is None else self.private
        if self.shared:
            self._mode = _PrivateGenerators()
            self._mode.__enter__()
            self.untouched = ("python random", "numpy global")
        else:
            self._saved = RNGState.capture()
        return self

    def load(self, state: RNGState) -> None:
        """Draw from ``state`` from now on within this scope (see the class docstring)."""
        if self._mode is not None:
            self._mode.load(state)
        else:
            state.restore()

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)
        elif self._saved is not None:
            saved, self._saved = self._saved, None
            saved.restore()


def _device_key(device: torch.device) -> str | None:
    """``"cpu"``, ``"cuda:N"``, or ``None`` for devices left alone (meta, others)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return None


_PLANS: dict[Any, Any] = {}


def _plan(func: Any) -> Any:
    """How to give ``func`` (an aten overload) a generator: ``("arg", index)`` for an op with a
    ``generator`` argument, ``("overload", other)`` for an op with a twin overload that takes one
    (``randn`` / ``randn.generator``), ``("dropout",)`` for ``native_dropout``, ``None`` for an op
    that draws nothing. Cached per overload."""
    if func in _PLANS:
        return _PLANS[func]
    names = [a.name for a in func._schema.arguments]
    plan: Any = None
    if "generator" in names:
        plan = ("arg", names.index("generator"))
    elif func is torch.ops.aten.native_dropout.default:
        plan = ("dropout",)
    else:
        packet = func.overloadpacket
        for name in packet.overloads():
            other = getattr(packet, name)
            other_names = [a.name for a in other._schema.arguments]
            if "generator" in other_names and [n for n in other_names if n != "generator"] == names:
                plan = ("overload", other, other_names.index("generator"))
                break
    _PLANS[func] = plan
    return plan


def _op_device(args: tuple, kwargs: dict) -> torch.device:
    for x in (*args, kwargs.get("out"), kwargs.get("self")):
        if isinstance(x, torch.Tensor):
            return x.device
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    return torch.get_default_device()


try:
    from torch.utils._python_dispatch import TorchDispatchMode as _Mode
except ImportError:  # pragma: no cover - torch always has it since 2.0
    _Mode = object  # type: ignore[assignment,misc]


class _PrivateGenerators(_Mode):  # type: ignore[misc,valid-type]
    """A thread-local dispatch mode giving every CPU / CUDA random op without an explicit
    generator a private generator of its device."""

    def __init__(self) -> None:
        super().__init__()
        self._gens: dict[str, torch.Generator] = {}

    def load(self, state: RNGState) -> None:
        g = torch.Generator()
        g.set_state(state.torch_cpu)
        self._gens["cpu"] = g
        if state.torch_cuda and torch.cuda.is_available():
            for i, s in enumerate(state.torch_cuda[: torch.cuda.device_count()]):
                g = torch.Generator(device=f"cuda:{i}")
                g.set_state(s)
                self._gens[f"cuda:{i}"] = g

    def _gen(self, key: str) -> torch.Generator:
        g = self._gens.get(key)
        if g is None:  # a copy of the live state: reading it consumes nothing
            if key == "cpu":
                g = torch.Generator()
                g.set_state(torch.get_rng_state())
            else:
                g = torch.Generator(device=key)
                g.set_state(torch.cuda.get_rng_state(torch.device(key)))
            self._gens[key] = g
        return g

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        plan = _plan(func)
        if plan is None:
            return func(*args, **kwargs)
        key = _device_key(_op_device(args, kwargs))
        if key is None:
            return func(*args, **kwargs)
        if plan[0] == "dropout":
            x, p, train = (list(args) + [kwargs.get("p"), kwargs.get("train")])[:3] if len(args) < 3 else args[:3]
            if not train or p == 0 or x.numel() == 0:
                return func(*args, **kwargs)
            keep = 1.0 - p
            mask = torch.empty_like(x).bernoulli_(keep, generator=self._gen(key))
            return x * mask * (1.0 / keep if keep > 0 else 0.0), mask.bool()
        if plan[0] == "overload":
            func, index = plan[1], plan[2]
        else:
            index = plan[1]
        kwarg_only = func._schema.arguments[index].kwarg_only
        if not kwarg_only and index < len(args):
            if args[index] is None:
                args = args[:index] + (self._gen(key),) + args[index + 1:]
        elif kwargs.get("generator") is None:
            kwargs["generator"] = self._gen(key)
        return func(*args, **kwargs)


@contextlib.contextmanager
def without_private_generators() -> Iterator[bool]:
    """For a ``torch.compile``'d replay inside a :class:`ReplayRNG` scope with private generators
    (an in-process diagnosis while other threads are alive, inductor's compile workers among
    them): Dynamo does not trace under a Python dispatch mode, so the compiled code would silently
    run eagerly. Take nanreplay's private-generator modes off the dispatch-mode stack for the
    block and put them back after; the block's own ``ReplayRNG(private=False)`` then sets the
    process-wide generators and puts them back. Yields ``True`` when no dispatch mode is left
    active, ``False`` when one that is not nanreplay's is (it stays: the block would run eagerly)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        while _get_current_dispatch_mode_stack() and isinstance(_get_current_dispatch_mode_stack()[-1], _PrivateGenerators):
            stack.enter_context(_pop_mode_temporarily())
        yield not _get_current_dispatch_mode_stack()
