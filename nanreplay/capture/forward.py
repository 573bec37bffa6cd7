"""Seeing every call of the model's top-level forward, eagerly, whatever wraps or compiles it.

The Recorder needs each forward's inputs before it runs and its outputs after (to keep the
cotangent). Module hooks do that on an eager model. On a compiled model, hooks traced by
TorchDynamo break the graph (they read Python and NumPy RNG states, which Dynamo refuses to trace),
so the tap attaches where the call is still eager:

* ``Recorder(torch.compile(model))``: hooks on the ``OptimizedModule`` wrapper, whose ``__call__``
  runs eagerly around the compiled forward (0 graph breaks);
* ``model.compile()`` (before or after the Recorder is built): the module's compiled call is wrapped
  by an eager function (0 graph breaks); :meth:`ForwardTap.check` notices a later ``compile()``;
* ``Recorder(model)`` then ``torch.compile(model)``: the hooks are marked for Dynamo to skip and,
  when a Dynamo frame callback is active, run their work through ``torch.compiler.disable``, so
  they still run eagerly (:func:`_eager`; a plain eager call pays neither); on the first compiled call the tap finds
  the ``OptimizedModule`` calling the model (a short walk up the Python stack), moves its hooks
  there and takes its own off the model (the post hook after the call in progress returns, so
  that call keeps its cotangent), so Dynamo recompiles once without them.

On an eager model the hooks stay registered, and the model's call goes through the tap's fast
call (``_compiled_call_impl``, the attribute ``model.compile()`` uses): while the tap's hooks are
the only ones the call would run, it calls the callbacks and ``forward`` directly, without
``_call_impl``'s hook machinery (:meth:`ForwardTap._install_fast_call`); otherwise the hooks run.

Names always come from the unwrapped module (:func:`unwrap_model`): no ``_orig_mod.`` or
``module.`` prefix, so a bundle replays on a plain model.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.numerics import is_float
from ..core.tree import flatten_typed
from ..format.records import ForwardRecord

logger = logging.getLogger(__name__)

__all__ = ["unwrap_model", "unwrap_optimizer", "ForwardTap", "is_tap_call", "keep_cotangent", "autocast_state"]


#: torch's package directory: the frames :meth:`ForwardTap._maybe_move_to_caller` searches are in it
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: frames above ``_maybe_move_to_caller`` that are torch's whenever a compiled wrapper called the model
#: (this method, the hook, the model's ``_call_impl`` and ``_wrapped_call_impl``, Dynamo's frame and the
#: wrapper's ``_call_impl`` come first: at least six frames, and the wrapper's caller above them is torch's)
_WRAPPER_DEPTH = 6


def _optimized_module_type() -> Optional[type]:
    """``torch._dynamo.eval_frame.OptimizedModule`` when Dynamo is already imported (a model was
    compiled), else ``None``: looking it up must not import Dynamo."""
    mod = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(mod, "OptimizedModule", None) if mod is not None else None


def _wrapper_chain(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model``, then each module it wraps, outermost first: through ``DistributedDataParallel.module``,
    ``DataParallel.module`` and ``torch.compile``'s ``OptimizedModule._orig_mod``, down to the
    module that holds the parameters (the last one)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    opt = _optimized_module_type()
    while True:
        yield model
        if isinstance(model, wrappers):
            model = model.module
        elif opt is not None and isinstance(model, opt):
            model = model._orig_mod
        else:
            return


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module that holds the parameters under any wrappers: ``DistributedDataParallel.module``,
    ``DataParallel.module``, ``torch.compile``'s ``OptimizedModule._orig_mod``."""
    *_, inner = _wrapper_chain(model)
    return inner


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer``, or the ``torch.optim.Optimizer`` a wrapper holds as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``, which subclasses ``Optimizer`` without its hooks, and
    similar; nested wrappers too).

    Raises:
        TypeError: neither is a ``torch.optim.Optimizer``.
    """
    opt = optimizer
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return opt


def _eager_target(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of the wrapper chain whose ``__call__`` still runs eagerly: the
    outermost ``OptimizedModule`` when there is one (its ``_orig_mod`` runs compiled), else the
    unwrapped module."""
    opt = _optimized_module_type()
    for m in _wrapper_chain(model):
        if opt is not None and isinstance(m, opt):
            return m
    return m


def _dynamo_skip_tools() -> tuple[Optional[Callable], Optional[Callable]]:
    """``(get_eval_frame_callback, skip)`` from Dynamo's internals, or ``(None, None)`` on a torch
    without them (then :func:`_eager` falls back to ``torch.compiler.disable``'s wrapper)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.decorators import skip
    except Exception:  # noqa: BLE001 - another torch's layout, or no working Dynamo
        return None, None
    return get_eval_frame_callback, skip


def _global_hook_dicts() -> Optional[tuple]:
    """torch's module-wide hook registries (``register_module_forward_pre_hook`` and its kin: forward
    pre, forward, backward pre, backward), which every module call runs; ``None`` on a torch that
    keeps them elsewhere (then :meth:`ForwardTap._install_fast_call` installs nothing)."""
    try:
        from torch.nn.modules import module as m

        return m._global_forward_pre_hooks, m._global_forward_hooks, m._global_backward_pre_hooks, m._global_backward_hooks
    except AttributeError:
        return None


def _eager(fn: Callable, plain: Optional[Callable] = None) -> Callable:
    """``fn`` run eagerly even when Dynamo traces its caller, at no cost to an eager call.

    Dynamo neither inlines the returned hook (a graph break at its call site, in torch's module
    call, as for a ``torch.compiler.disable``'d function) nor compiles its frame (``skip``). Called
    while a Dynamo frame callback is active (the eager part of a compiled call), it runs ``fn``
    through ``torch.compiler.disable``'s wrapper, which turns the callback off for ``fn`` and all it
    calls; otherwise (every plain eager forward) it calls ``plain`` (default ``fn``: same
    arguments; what ``fn`` does outside Dynamo) directly: that wrapper sets the eval frame four
    times per call, a few µs a hook in a training step (``bench/overhead.py``)."""
    try:
        disabled = torch.compiler.disable(fn)
    except Exception as e:  # noqa: BLE001 - a torch without a working Dynamo: plain hooks are eager anyway
        logger.debug("nanreplay: torch.compiler.disable unavailable (%s); forward hooks are plain", e)
        return fn
    callback, skip = _dynamo_skip_tools()
    if callback is None or skip is None:
        return disabled
    eager = fn if plain is None else plain

    def hook(*args: Any, **kwargs: Any) -> Any:
        if callback() is None:  # no Dynamo frame callback around this call: plain eager
            return eager(*args, **kwargs)
        return disabled(*args, **kwargs)

    functools.update_wrapper(hook, fn)
    return skip(hook)


def is_tap_call(impl: Any) -> bool:
    """Whether a module's ``_compiled_call_impl`` is a :class:`ForwardTap`'s fast call (the model runs
    eagerly), not a compiled call of ``module.compile()``."""
    return getattr(impl, "nanreplay_tap", False) is True


def _is_eager_hook(code: Any) -> bool:
    """Whether ``code`` is the code of :func:`_eager`'s hooks or of the tap's fast call (frames of
    nanreplay's that sit between a module call and the hook's callbacks)."""
    return code is _EAGER_HOOK_CODE or code is _FAST_CALL_CODE


#: the code of the hook :func:`_eager` makes (a constant of its own code: taken without calling it,
#: which would import Dynamo)
_EAGER_HOOK_CODE = next(c for c in _eager.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "hook")


class ForwardTap:
    """Calls ``pre(module, args, kwargs)`` before and ``post(module, args, kwargs, output)`` after
    every call of the model's top-level forward, eagerly (a forward hook's arguments: on an eager
    model the hooks call them directly). A removable handle: :meth:`remove` undoes everything.

    Args:
        model: what the user gave the Recorder (a module, a DDP/DataParallel wrapper, a compiled
            ``OptimizedModule``, or a module after ``model.compile()``).
        pre, post: the callbacks; their return values are ignored.
    """

    def __init__(self, model: torch.nn.Module, pre: Callable[[Any, tuple, dict], None], post: Callable[[Any, tuple, dict, Any], None]) -> None:
        self.inner = unwrap_model(model)
        self._pre_cb, self._post_cb = pre, post
        self._handles: list[Any] = []
        self._wrapped: Optional[torch.nn.Module] = None   # a module whose _compiled_call_impl we wrap
        self._orig_impl: Any = None
        self._on_wrapper = False
        self._on_wrapper_only = False   # the model's own post hook, kept for the call in progress when the hooks moved, is gone
        self._inner_pre: Any = None
        self._inner_post: Any = None
        #: the ``OptimizedModule`` found calling the model when it was compiled after the Recorder attached
        self.compiled_wrapper: Optional[torch.nn.Module] = None
        self._fast_call: Optional[Callable] = None  # the model's _compiled_call_impl while the tap's fast call is on it
        target = _eager_target(model)
        if target is self.inner and getattr(self.inner, "_compiled_call_impl", None) is not None:
            self._wrap_compiled_call(self.inner)
        else:
            self._on_wrapper = self._on_wrapper_only = target is not self.inner
            self._hook(target)
            # none under DataParallel: its replicas are shallow copies of the module's __dict__, this fast call included
            if not self._on_wrapper and not any(isinstance(m, torch.nn.DataParallel) for m in _wrapper_chain(model)):
                self._install_fast_call(target)

    # -- the three ways to attach ----------------------------------------------------------
    def _hook(self, module: torch.nn.Module) -> None:
        # pre and post run under Dynamo (the eager part of a compiled call: a compiled wrapper may be
        # calling the model, and the hooks may have moved); a plain eager call runs the callbacks alone
        def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._on_wrapper:
                self._maybe_move_to_caller()
            self._pre_cb(mod, args, kwargs)

        def post(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            self._post_cb(mod, args, kwargs, out)
            if self._on_wrapper and not self._on_wrapper_only:
                # the call in progress when the hooks moved has ended: the model's own post hook goes
                self._drop_inner_post()

        pre_h = module.register_forward_pre_hook(_eager(pre, self._pre_cb), with_kwargs=True)
        post_h = module.register_forward_hook(_eager(post, self._post_cb), with_kwargs=True)
        self._handles += [pre_h, post_h]
        if not self._on_wrapper:
            self._inner_pre, self._inner_post = pre_h, post_h

    def _wrap_compiled_call(self, module: torch.nn.Module) -> None:
        impl = module._compiled_call_impl

        def eager_call(*args: Any, **kwargs: Any) -> Any:
            self._pre_cb(module, args, kwargs)
            out = impl(*args, **kwargs)
            self._post_cb(module, args, kwargs, out)
            return out

        self._wrapped, self._orig_impl = module, impl
        module._compiled_call_impl = eager_call

    def _install_fast_call(self, module: torch.nn.Module) -> None:
        """On an eager model with the tap's hooks: its call (``_compiled_call_impl``, which
        ``Module.__call__`` calls when set, and which ``copy.deepcopy`` and ``torch.save`` leave
        out, so a copy of the model, e.g. an EMA, calls plainly) runs the callbacks and
        ``forward`` directly when the tap's two hooks are the only ones that module call would run
        (no other hook on the module, no module-wide hook, no JIT trace, no Dynamo frame callback):
        what ``_call_impl`` does with them, without its hook machinery (about 6 µs a step on a
        small CPU model: ``bench/README.md``). Anything else goes to ``_call_impl``, where the hooks
        run as before: a hook added later, ``torch.compile`` after the Recorder (the hooks then
        find the compiled wrapper and move there, and this goes), ``model.compile()`` after it
        (which replaces it; :meth:`check` then wraps the compiled call). Needs Dynamo's skip marker
        and torch's hook registries; without them nothing is installed, nor under a ``DataParallel``
        given to the Recorder. A ``DataParallel`` wrapped around the model after the Recorder
        was built gives its replicas (shallow copies of the module's ``__dict__``) this fast call
        too; they call it from worker threads, where it sends a call made for another module to
        that module's own ``_call_impl`` (found in the calling frame: only off the thread that
        built the Recorder)."""
        callback, skip = _dynamo_skip_tools()
        registries = _global_hook_dicts()
        if callback is None or skip is None or registries is None:
            return
        fpre, fwd, bpre, bwd = registries
        impl, pre, post, tracing = module._call_impl, self._pre_cb, self._post_cb, torch._C._get_tracing_state
        owner, get_ident = threading.get_ident(), threading.get_ident

        def fast_call(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != owner:
                # another thread, where DataParallel calls its replicas (shallow copies of this module's __dict__, this
                # fast call included): a call of another module goes to that module's own _call_impl (its hooks capture)
                caller = sys._getframe(1).f_locals.get("self")  # Module._wrapped_call_impl's
                if caller is not module and isinstance(caller, torch.nn.Module):
                    return type(caller)._call_impl(caller, *args, **kwargs)
            if (callback() is not None or len(module._forward_pre_hooks) != 1 or len(module._forward_hooks) != 1 or module._backward_hooks
                    or module._backward_pre_hooks or fpre or fwd or bpre or bwd or tracing()):
                return impl(*args, **kwargs)
            pre(module, args, kwargs)
            out = module.forward(*args, **kwargs)
            post(module, args, kwargs, out)
            return out

        fast_call.nanreplay_tap = True  # not a compiled call: is_tap_call (the bundle's compile state looks past it)
        self._fast_call = skip(fast_call)
        module._compiled_call_impl = self._fast_call

    def _remove_fast_call(self) -> None:
        """Take the fast call off the model, if it is still there."""
        if self._fast_call is not None and self.inner.__dict__.get("_compiled_call_impl") is self._fast_call:
            self.inner._compiled_call_impl = None
        self._fast_call = None

    def _unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _maybe_move_to_caller(self) -> None:
        """Inside a forward of the unwrapped model: when an ``OptimizedModule`` wrapping it is the
        caller (the model was compiled after the Recorder attached), move the hooks there."""
        opt = _optimized_module_type()
        if opt is None:
            return
        try:
            # a compiled wrapper's call puts torch frames at least _WRAPPER_DEPTH levels up (its own
            # __call__ / _wrapped_call_impl above its _call_impl, Dynamo's frame and the model's
            # module call below it): code of another kind there (the training loop calling the
            # model), or no frame at all, rules it out without making a frame object per level
            code = sys._getframe(_WRAPPER_DEPTH).f_code
            if not (code.co_filename.startswith(_TORCH_DIR) or _is_eager_hook(code)):
                return
        except ValueError:  # the stack is not that deep
            return
        f = sys._getframe(2)
        for _ in range(16):
            # every frame between the wrapper's call and this hook is torch's own (module calls,
            # Dynamo's frames): the first frame of other code (the training loop) ends the search
            if f is None or not (f.f_code.co_filename.startswith(_TORCH_DIR) or _is_eager_hook(f.f_code)):
                return
            owner = f.f_locals.get("self") if f.f_code.co_name == "_call_impl" else None
            if isinstance(owner, opt) and unwrap_model(owner) is self.inner:
                # the pre hook of the model goes now; its post hook stays for the call in progress
                # (the wrapper's post hooks may already have been passed over for it) and goes
                # when that call ends (or at the wrapper's next call, if it raised)
                self._inner_pre.remove()
                self._remove_fast_call()
                self._on_wrapper = True
                self.compiled_wrapper = owner
                self._hook_wrapper(owner)
                logger.info("nanreplay: the model was compiled after the Recorder attached; its forward hooks moved to the "
                            "compiled wrapper so they run outside the compiled region")
                return
            f = f.f_back

    def _drop_inner_post(self) -> None:
        if self._inner_post is not None:
            self._inner_post.remove()
        self._on_wrapper_only = True

    def _hook_wrapper(self, wrapper: torch.nn.Module) -> None:
        """Hooks on ``wrapper`` from its next call on. Its post hook acts only after its own pre
        hook ran: the call in progress (entered before the hooks existed) is the model's own post
        hook's, which is removed at the first of: that call's end, the wrapper's next call."""
        armed = [False]

        def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._on_wrapper_only:
                self._drop_inner_post()
            armed[0] = True
            self._pre_cb(mod, args, kwargs)

        def post(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if armed[0]:
                armed[0] = False
                self._post_cb(mod, args, kwargs, out)

        self._handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(wrapper.register_forward_hook(post, with_kwargs=True))

    # -- per step and at the end -----------------------------------------------------------
    def check(self) -> None:
        """Called once per step from eager code: a ``model.compile()`` done after the Recorder
        attached moves the tap to the compiled call."""
        impl = getattr(self.inner, "_compiled_call_impl", None)
        if self._wrapped is None and not self._on_wrapper and impl is not None and impl is not self._fast_call:
            self._fast_call = None  # model.compile() replaced it
            self._unhook()
            self._wrap_compiled_call(self.inner)
            logger.info("nanreplay: model.compile() was called after the Recorder attached; its forward capture now wraps the compiled call")

    def remove(self) -> None:
        """Take every hook and wrapper off. Idempotent."""
        self._unhook()
        self._remove_fast_call()
        if self._wrapped is not None:
            if self._wrapped.__dict__.get("_compiled_call_impl") is not None:
                self._wrapped._compiled_call_impl = self._orig_impl
            self._wrapped = None


#: the code of the fast call :meth:`ForwardTap._install_fast_call` makes (a frame of nanreplay's between
#: the model's ``_wrapped_call_impl`` and its ``_call_impl``, when a compiled wrapper calls the model)
_FAST_CALL_CODE = next(c for c in ForwardTap._install_fast_call.__code__.co_consts
                       if isinstance(c, types.CodeType) and c.co_name == "fast_call")


#: the largest single output, in bytes, whose cotangent the capture keeps through
#: ``Tensor.retain_grad()`` (:meth:`~nanreplay.capture.steps.StepStart.forward_post`): autograd's own
#: C++ hook, which copies the gradient, and no Python runs in the backward pass. A Python pre-hook
#: (:func:`keep_cotangent`) copies nothing but is a call into Python in the middle of the backward
#: pass (on a small CPU model about 5 µs a step more in all, ``bench/hostcost.py``); below this size
#: the copy costs less than that call.
RETAIN_MAX_BYTES = 64 << 10


def keep_cotangent(fw: ForwardRecord, output: Any) -> None:
    """Keep the gradient w.r.t. each floating output of a forward in ``fw.cotangent`` (same tree
    as ``output``), through a hook that fires in the backward pass: for a single tensor output, a
    pre-hook of the node that made it (``grad_fn.register_prehook``: it sees the gradient that
    flows into the model, after any tensor hook the loop put on the output); else a tensor hook
    on each floating leaf. (The usual small output keeps it by ``retain_grad()`` instead:
    :meth:`~nanreplay.capture.steps.StepStart.forward_post`.)"""
    if isinstance(output, torch.Tensor):  # the common case, without a tree
        fw.cotangent = None
        if output.requires_grad:  # only floating and complex tensors can require grad
            if output.is_leaf:
                output.register_hook(functools.partial(_keep_leaf_cotangent, fw))
            else:  # a pre-hook of the node that made it: torch's C++ registration, no handle dict
                output.grad_fn.register_prehook(functools.partial(_keep_node_cotangent, fw, output.output_nr))
        return
    leaves, spec = flatten_typed(output)  # dataclass outputs (ModelOutput) included
    # a non-tensor output (a transformers DynamicCache, a flag) has no gradient: None, not the object
    cot: list[Any] = [None] * len(leaves)
    fw.cotangent = pytree.tree_unflatten(cot, spec)

    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.requires_grad and is_float(t):

            def hook(g: torch.Tensor, i: int = i, fw: ForwardRecord = fw) -> None:
                cot[i] = _summed(cot[i], g)
                fw.cotangent = pytree.tree_unflatten(cot, spec)

            t.register_hook(hook)


def _summed(kept: Optional[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """The cotangent kept so far plus ``g``: a second backward pass through the same output in one
    step (``retain_graph=True``, two losses) adds to the parameters' gradients, so the replay's one
    backward pass needs the sum (as ``retain_grad`` keeps it)."""
    return g.detach() if kept is None else kept + g.detach()


def _keep_leaf_cotangent(fw: ForwardRecord, g: torch.Tensor) -> None:
    fw.cotangent = _summed(fw.cotangent, g)


def _keep_node_cotangent(fw: ForwardRecord, nr: int, grad_outputs: tuple) -> None:
    """The pre-hook of the node whose output ``nr`` is the model's output: the gradient it receives
    there (what flows into the model's backward pass, after any tensor hook on the output), summed
    over the step's backward passes, or nothing when that output got none."""
    g = grad_outputs[nr] if nr < len(grad_outputs) else None
    if g is not None:
        fw.cotangent = _summed(fw.cotangent, g)


def autocast_state(other: Optional[str] = None) -> Optional[dict]:
    """``{"device_type", "dtype"}`` of the autocast region the model's forward runs in, or
    ``None`` outside autocast; replay runs the step under the same autocast. The device types
    looked at are the CPU's and ``other``, the inputs' device type when it is not the CPU (as the
    input capture tells it: :meth:`~nanreplay.capture.inputs.InputCapture.device_type`)."""
    kinds = ["cpu"] if other is None else ["cpu", other]
    for dev in reversed(kinds):
        try:
            if torch.is_autocast_enabled(dev):
                return {"device_type": dev, "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", "")}
        except (TypeError, RuntimeError):  # a device type this torch has no autocast for
            continue
    return None
