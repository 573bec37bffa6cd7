"""One replay under a chosen configuration: the recorded settings that a replay can change
(``bisect --over config``).

:data:`TOGGLES` holds, for each setting of :data:`nanreplay.core.settings.SETTINGS` marked
``replay``, how a replay sets it, the device types whose numerics it changes (the TF32 flags do
nothing on a CPU), the value a search without ``--against`` tries (the conservative one:
float32 math, no TF32, deterministic kernels, eager, the math attention kernel, the unfused
optimizer), and which values it accepts (a bundle's value is untrusted: anything else is refused,
never set). A setting acts at one of three places:

* ``process``: a torch flag, set around the replay and put back after (:func:`process_flags`);
* ``step``: the replay itself: the step's autocast dtype, deterministic algorithms, the
  ``torch.compile`` backend, mode and inductor options the step runs under;
* ``update``: the optimizer update after the backward pass (its ``fused`` / ``foreach`` kernels):
  only a failure of the update itself (``check_update``) depends on it.

What no replay can change is not here: a library version, the number of ranks and the dtype
gradients were reduced in (a replay runs one process), environment variables (read when torch
starts). ``nanreplay diff`` lists those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import ReplayError
from ..format.records import StepRecord
from .compiled import BUNDLE_BACKENDS, MODES, CompileSettings, recorded_compile, replayable_options

__all__ = ["Toggle", "TOGGLES", "toggle_for", "Variant", "variant", "process_flags", "NO_REFERENCE", "AUTOCAST_OFF"]

#: a toggle that has no conservative value: a search changes it only towards another run's (``--against``)
NO_REFERENCE = object()

#: the autocast setting's value outside autocast
AUTOCAST_OFF = "off"

_PRECISIONS = ("highest", "high", "medium")


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Toggle:
    """How a replay sets one setting (see the module docstring).

    Attributes:
        pattern: the setting key (``fnmatch`` pattern) of :data:`nanreplay.core.settings.SETTINGS`.
        scope: ``"process"``, ``"step"`` or ``"update"``.
        devices: the device types whose replay it changes.
        reference: the value a search without ``--against`` tries, or :data:`NO_REFERENCE`.
        accepts: whether a value (from a bundle) may be set.
        get, put: a process flag's getter and setter (``scope="process"``).
    """

    pattern: str
    scope: str
    devices: frozenset
    reference: Any
    accepts: Callable[[Any], bool]
    get: Optional[Callable[[], Any]] = None
    put: Optional[Callable[[Any], None]] = None


_CUDA, _ALL = frozenset({"cuda"}), frozenset({"cpu", "cuda", "xpu", "mps"})


def _attr(obj: Callable[[], Any], name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(obj(), name)), (lambda v: setattr(obj(), name, v))


def _flag(pattern: str, devices: frozenset, reference: Any, getset: tuple, accepts: Callable[[Any], bool] = _is_bool) -> Toggle:
    return Toggle(pattern, "process", devices, reference, accepts, getset[0], getset[1])


_be = lambda: torch.backends  # noqa: E731 - read at call time: a torch module is looked up when used
_cuda_matmul = lambda: torch.backends.cuda.matmul  # noqa: E731
_cudnn = lambda: torch.backends.cudnn  # noqa: E731
_sdpa = torch.backends.cuda

#: setting key -> how a replay sets it; ``core.settings.SETTINGS`` marks exactly these ``replay``
TOGGLES: tuple[Toggle, ...] = (
    Toggle("autocast", "step", _ALL, AUTOCAST_OFF, lambda v: v in (AUTOCAST_OFF, "float16", "bfloat16", "float32")),
    _flag("numerics.float32_matmul_precision", _ALL, "highest", (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
          lambda v: v in _PRECISIONS),
    _flag("numerics.tf32_matmul", _CUDA, False, _attr(_cuda_matmul, "allow_tf32")),
    _flag("numerics.cudnn_tf32", _CUDA, False, _attr(_cudnn, "allow_tf32")),
    _flag("numerics.fp16_reduced_precision_reduction", _CUDA, False, _attr(_cuda_matmul, "allow_fp16_reduced_precision_reduction")),
    _flag("numerics.bf16_reduced_precision_reduction", _CUDA, False, _attr(_cuda_matmul, "allow_bf16_reduced_precision_reduction")),
    # scaled dot-product attention: the math kernel is the reference; on a CPU only flash and math exist
    _flag("numerics.sdpa_flash", _ALL, False, (_sdpa.flash_sdp_enabled, _sdpa.enable_flash_sdp)),
    _flag("numerics.sdpa_mem_efficient", _CUDA, False, (_sdpa.mem_efficient_sdp_enabled, _sdpa.enable_mem_efficient_sdp)),
    _flag("numerics.sdpa_math", _ALL, True, (_sdpa.math_sdp_enabled, _sdpa.enable_math_sdp)),
    _flag("numerics.sdpa_cudnn", _CUDA, False, (_sdpa.cudnn_sdp_enabled, _sdpa.enable_cudnn_sdp)),
    _flag("numerics.cudnn_deterministic", _CUDA, True, _attr(_cudnn, "deterministic")),
    _flag("numerics.cudnn_benchmark", _CUDA, False, _attr(_cudnn, "benchmark")),
    _flag("numerics.cudnn_enabled", _CUDA, NO_REFERENCE, _attr(_cudnn, "enabled")),
    _flag("numerics.mkldnn_enabled", frozenset({"cpu"}), NO_REFERENCE, _attr(lambda: torch.backends.mkldnn, "enabled")),
    Toggle("numerics.deterministic_algorithms", "step", _CUDA, True, _is_bool),
    Toggle("compile.compiled", "step", _ALL, False, _is_bool),
    Toggle("compile.backend", "step", _ALL, NO_REFERENCE, lambda v: v in BUNDLE_BACKENDS),
    Toggle("compile.mode", "step", _ALL, "default", lambda v: v is None or v in MODES),
    Toggle("compile.options.*", "step", _ALL, NO_REFERENCE, lambda v: isinstance(v, (bool, int, float)) or v == "(unset)"),
    Toggle("optimizer.fused", "update", _ALL, False, lambda v: v is None or isinstance(v, bool)),
    Toggle("optimizer.foreach", "update", _ALL, False, lambda v: v is None or isinstance(v, bool)),
)

#: the new-API precision flags (torch >= 2.9): put back after the legacy ones, which move them
_FP32_PRECISION = (_attr(_be, "fp32_precision"), _attr(_cuda_matmul, "fp32_precision"), _attr(lambda: torch.backends.cudnn.conv, "fp32_precision"),
                   _attr(lambda: torch.backends.mkldnn.matmul, "fp32_precision"))


def toggle_for(key: str) -> Optional[Toggle]:
    """The :data:`TOGGLES` row of setting ``key``, or ``None`` when a replay cannot set it."""
    return next((t for t in TOGGLES if fnmatch.fnmatchcase(key, t.pattern)), None)


def _try_get(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except Exception:  # noqa: BLE001 - a flag this torch lacks, or one torch refuses to read (mixed TF32 APIs)
        return NO_REFERENCE


@contextlib.contextmanager
def process_flags(values: dict[str, Any]) -> Iterator[None]:
    """Set the ``process`` settings among ``values`` (setting key -> value, each accepted by its
    toggle) for the block; every flag, and torch's newer ``fp32_precision`` flags that the older
    ones move, is put back after, whatever happens.

    Raises:
        ReplayError: this torch refuses to set one of them.
    """
    flags = [t for t in TOGGLES if t.scope == "process" and t.get is not None]
    saved = [(t, _try_get(t.get)) for t in flags]
    saved_new = [(put, _try_get(get)) for get, put in _FP32_PRECISION]
    try:
        for t in flags:  # in table order: the matmul precision before the TF32 flag it implies
            if t.pattern in values and t.put is not None:
                try:
                    t.put(values[t.pattern])
                except Exception as e:  # noqa: BLE001 - this torch refuses the flag: the replay would not run as asked
                    raise ReplayError(f"could not set {t.pattern} = {values[t.pattern]!r} for the replay ({type(e).__name__}: {e}); "
                                      "this torch does not take that setting: replay under the torch that recorded it") from e
        yield
    finally:
        for t, v in saved:
            if v is not NO_REFERENCE and t.put is not None:
                with contextlib.suppress(Exception):
                    t.put(v)
        for put, v in saved_new:
            if v is not NO_REFERENCE:
                with contextlib.suppress(Exception):
                    put(v)


@dataclasses.dataclass
class Variant:
    """What one replay of the failing step runs under (:func:`variant`).

    Attributes:
        record: the step record to replay (its ``autocast`` as chosen).
        deterministic: deterministic algorithms on or off (:func:`nanreplay.engine.run.run_step`).
        compile: the ``torch.compile`` settings and the compiled modules, or ``None`` (eager).
        optimizer: param-group overrides for the update (``fused``, ``foreach``).
        process: the ``process`` settings, for :func:`process_flags`.
    """

    record: StepRecord
    deterministic: bool
    compile: Optional[tuple[CompileSettings, list[str]]]
    optimizer: dict[str, Any]
    process: dict[str, Any]


def variant(record: StepRecord, values: dict[str, Any], compile_state: Optional[dict], device: torch.device) -> Variant:
    """The :class:`Variant` of the failing step ``record`` under ``values`` (setting key -> value,
    each accepted by its toggle; keys absent keep what a plain replay does). ``compile_state``:
    the recording's ``meta["compile"]`` (its backend, mode, options and modules are the base the
    ``compile.*`` values change)."""
    ac = values.get("autocast", AUTOCAST_OFF if record.autocast is None else record.autocast.get("dtype"))
    autocast = None if ac in (AUTOCAST_OFF, "float32") else {"device_type": device.type, "dtype": ac}
    rec = dataclasses.replace(record, autocast=autocast)
    return Variant(record=rec, deterministic=bool(values.get("numerics.deterministic_algorithms", True)),
                   compile=_compile(values, compile_state), optimizer={k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("optimizer.")},
                   process={k: v for k, v in values.items() if _scope(k) == "process"})


def _scope(key: str) -> Optional[str]:
    t = toggle_for(key)
    return t.scope if t is not None else None


def _compile(values: dict[str, Any], state: Optional[dict]) -> Optional[tuple[CompileSettings, list[str]]]:
    """The compile settings ``values`` ask for on top of the recording's, or ``None`` for eager."""
    if not values.get("compile.compiled", False):
        return None
    base, _ = recorded_compile(state if isinstance(state, dict) and state.get("compiled") else {"compiled": True})
    base = base or {"backend": "inductor", "mode": None, "modules": [], "options": None, "dynamic": None, "fullgraph": False}
    backend = values.get("compile.backend", base["backend"])
    mode = values.get("compile.mode", base["mode"])
    options = dict(base["options"] or {})
    for k, v in values.items():
        if k.startswith("compile.options."):
            name = k[len("compile.options."):]
            if v == "(unset)":
                options.pop(name, None)
            else:
                options[name] = v
    options, _ = replayable_options(options) if backend == "inductor" and options else ({}, [])
    settings = CompileSettings(backend=backend, mode=mode if backend == "inductor" and not options else None, options=options or None,
                               dynamic=base["dynamic"], fullgraph=bool(base["fullgraph"]))
    return settings, list(base["modules"] or [])
