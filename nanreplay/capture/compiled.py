"""The recording's compile state: did the model run under ``torch.compile``, with which backend
and mode, and which of its modules were compiled (``meta["compile"]``, docs/bundle-format.md).

A replay runs eagerly; a NaN that only compiled code produces (fused kernels, reordered
reductions) does not reproduce there. With the compile state in the bundle, a replay that does
not reproduce eagerly replays compiled the way training ran
(:mod:`nanreplay.diagnosis.api`, :func:`nanreplay.engine.compiled.compile_check`).

The state is read, never changed, from the objects ``torch.compile`` leaves: an
``OptimizedModule`` wrapper (``torch.compile(module)``; around the model or any submodule) or a
module's ``_compiled_call_impl`` (``module.compile()``). Its backend is the name the compiler
wrapper carries (``inductor``, ``aot_eager``, ``eager``, ...) or, for a backend given as a
callable, that callable's import path; the inductor mode is the named mode whose options
(``torch._inductor.list_mode_options``) the wrapper's config equals, else ``None``, and then the
config itself is kept as ``options`` (its JSON values: booleans, numbers, strings); ``dynamic`` and
``fullgraph`` are the ``torch.compile`` arguments Dynamo's context (``OptimizeContext``) keeps.
A replay compiles the same target with the same settings
(:func:`nanreplay.engine.compiled.recorded_compile` says which of them a bundle may set).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterator, Optional

import torch

from ..core.callables import callable_path
from .forward import is_tap_call

logger = logging.getLogger(__name__)

__all__ = ["compile_state"]

#: the modules listed at most (a model compiling every block of a deep stack)
MAX_MODULES = 256


def _optimized_module_type() -> Optional[type]:
    mod = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(mod, "OptimizedModule", None) if mod is not None else None


def _closure_values(obj: Any) -> Iterator[Any]:
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:
            continue


def _dynamo_parts(obj: Any, depth: int = 0) -> tuple[Any, Any]:
    """``(Dynamo's OptimizeContext or None, its callback)`` of a compiled object: an
    ``OptimizedModule``'s ``dynamo_ctx``, or, for a function ``torch.compile`` returned
    (``module.compile()`` stores one as ``_compiled_call_impl``), the context (or the bare
    callback) in its closure; a function wrapping such a function (the forward tap's eager call)
    is looked through. ``(None, None)`` when not found."""
    ctx = getattr(obj, "dynamo_ctx", None)
    if ctx is not None:
        return ctx, getattr(ctx, "callback", None)
    values = list(_closure_values(obj))
    for v in values:
        if type(v).__name__ == "OptimizeContext":
            return v, getattr(v, "callback", None)
    for v in values:
        if hasattr(v, "_torchdynamo_orig_backend"):
            return None, v
    for v in _closure_values(obj) if depth < 2 else ():
        if callable(v) and hasattr(v, "_torchdynamo_orig_callable"):
            return _dynamo_parts(v, depth + 1)
    return None, None


def _json_options(config: Any) -> dict:
    """The inductor options of a compiler wrapper's ``config`` that are JSON values (a bundle is
    data: a callable or a tuple among them is left out)."""
    if not isinstance(config, dict):
        return {}
    return {str(k): v for k, v in config.items() if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and v != v)}


def _settings(obj: Any) -> dict:
    """``{"backend", "mode", "options", "dynamic", "fullgraph"}`` of a compiled object (each
    ``None`` when not found). Walks the ``_torchdynamo_orig_backend`` chain as
    ``torch._dynamo.eval_frame.innermost_backend`` does, stopping at the first object that names
    its compiler."""
    ctx, fn = _dynamo_parts(obj)
    out: dict[str, Any] = {"backend": None, "mode": None, "options": None, "dynamic": None, "fullgraph": None}
    if ctx is not None:
        dyn, full = getattr(ctx, "_dynamic", None), getattr(ctx, "fullgraph", None)
        out.update(dynamic=dyn if isinstance(dyn, bool) else None, fullgraph=full if isinstance(full, bool) else None)
    for _ in range(16):
        if fn is None:
            break
        name = getattr(fn, "compiler_name", None)
        if isinstance(name, str):
            out["backend"] = name
            if name == "inductor":
                out["mode"] = _inductor_mode(fn)
                out["options"] = {} if out["mode"] is not None else _json_options(getattr(fn, "config", None))
                dyn = getattr(fn, "dynamic", None)
                out["dynamic"] = dyn if isinstance(dyn, bool) else out["dynamic"]
            return out
        nxt = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "__wrapped__", None)
        if nxt is None or nxt is fn:
            break
        fn = nxt
    if fn is not None and callable(fn):  # a backend given as a callable: its import path
        out["backend"] = callable_path(fn) or getattr(fn, "__name__", type(fn).__name__)
    return out


def _inductor_mode(wrapper: Any) -> Optional[str]:
    config = getattr(wrapper, "config", None)
    if not isinstance(config, dict):
        return None
    try:
        from torch._inductor import list_mode_options

        for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            if list_mode_options(mode) == config:
                return mode
    except Exception as e:  # noqa: BLE001 - a torch whose inductor lacks the lookup: the mode is unknown
        logger.debug("nanreplay: the inductor mode could not be read (%s)", e)
    return None


def compile_state(wrapper: torch.nn.Module, model: torch.nn.Module, extra: Optional[torch.nn.Module] = None) -> dict:
    """What ``torch.compile`` did to the model the Recorder watches.

    Args:
        wrapper: what the user gave the Recorder (possibly an ``OptimizedModule`` or a DDP
            wrapper around one).
        model: the unwrapped model (names are its FQNs).
        extra: an ``OptimizedModule`` found around the model after the Recorder attached
            (``torch.compile(model)`` called later), when the forward tap found one.

    Returns:
        ``{"compiled": bool, "backend": str or None, "mode": str or None, "modules": [FQN, ...],
        "options": dict or None, "dynamic": bool or None, "fullgraph": bool or None}``:
        ``modules`` lists the compiled modules, ``""`` for the model itself, at most 256;
        ``backend`` / ``mode`` / ``options`` / ``dynamic`` / ``fullgraph`` are the first compiled
        module's (``mode`` and ``options`` only for inductor: ``options`` is ``{}`` when the
        config is a named mode's, else the config's JSON values). Never raises: what cannot be
        read is ``None``.
    """
    found: list[tuple[str, Any]] = []
    try:
        opt = _optimized_module_type()
        if opt is not None:
            m: Any = wrapper
            for _ in range(8):  # the wrapper chain above the model: DDP, OptimizedModule, ...
                if isinstance(m, opt):
                    found.append(("", m))
                inner = getattr(m, "_orig_mod", None) or getattr(m, "module", None)
                if not isinstance(inner, torch.nn.Module) or inner is m:
                    break
                m = inner
            if extra is not None and isinstance(extra, opt) and not any(o is extra for _, o in found):
                found.append(("", extra))
        for name, mod in model.named_modules():
            impl = mod.__dict__.get("_compiled_call_impl")
            if impl is not None and not is_tap_call(impl):  # the Recorder's own fast call runs the model eagerly
                found.append((name, impl))
            elif opt is not None and name and isinstance(mod, opt):
                found.append((name, mod))
            if len(found) > MAX_MODULES:
                break
    except Exception as e:  # noqa: BLE001 - the compile state is informative: never fail the dump for it
        logger.debug("nanreplay: the compile state could not be read (%s)", e)
    names = list(dict.fromkeys(n for n, _ in found))[:MAX_MODULES]
    settings = _settings(found[0][1]) if found else {"backend": None, "mode": None, "options": None, "dynamic": None, "fullgraph": None}
    return {"compiled": bool(found), "modules": names, **settings}
