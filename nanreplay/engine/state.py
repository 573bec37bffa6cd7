"""Rebuilding what a bundle recorded: the model (from a factory or a recorded class and JSON
hyperparameters), its step-start weights and buffers, the optimizer and the GradScaler.

Code a bundle names (factory, ``model_init`` class, optimizer class) is imported only under the
trust rule of :mod:`nanreplay.engine.gate`: the caller named it, or the bundle is trusted.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from ..core.callables import bind_recorded, import_callable, model_init_names, script_imports
from ..core.state import load_buffers
from ..errors import ModelMismatchError, ReplayError, UntrustedBundleError
from ..format.bundle import Bundle, Types, open_bundle
from ..format.records import Snapshot
from .gate import bundle_types, recorded_callable, require_trust, resolve_optimizer

logger = logging.getLogger(__name__)

__all__ = ["load_state", "build_model", "build_from_init", "build_optimizer", "optimizer_from_info", "recorded_device", "replay_scaler",
           "Subject", "replay_subject", "runs_untrusted_program", "refuse_loss_without_batch",
           "deterministic_cublas", "DETERMINISTIC_CUBLAS"]

#: ``CUBLAS_WORKSPACE_CONFIG`` as torch's deterministic mode asks for it: 8 cuBLAS workspaces of 4096 KiB (32 MiB)
DETERMINISTIC_CUBLAS = ":4096:8"


def load_state(model: torch.nn.Module, state: Snapshot, buffers: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Copy recorded weights and buffers into ``model`` in place.

    Raises:
        ModelMismatchError: missing/unexpected FQNs or a shape/dtype that differs.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(state.params) - set(params))
    unexpected = sorted(set(params) - set(state.params))
    problems = []
    if missing:
        problems.append(f"the bundle has parameters the model lacks: {missing[:8]}")
    if unexpected:
        problems.append(f"the model has parameters the bundle lacks: {unexpected[:8]}")
    for n, t in state.params.items():
        if n in params and (params[n].shape != t.shape or params[n].dtype != t.dtype):
            problems.append(f"{n}: bundle {tuple(t.shape)} {t.dtype}, model {tuple(params[n].shape)} {params[n].dtype}")
    if problems:
        raise ModelMismatchError(
            "the model does not match the bundle: " + "; ".join(problems[:10])
            + ". Pass --model-factory with the factory that built the recorded model."
        )
    with torch.no_grad():
        for n, t in state.params.items():
            params[n].copy_(t)
    load_buffers(model, buffers if buffers is not None else state.buffers)


#: nanreplay's own functions a ``model_init`` entry may name instead of an ``nn.Module`` class:
#: the Hugging Face callback's builder (a transformers model class and its config as JSON)
MODEL_BUILDERS = frozenset({"nanreplay.integrations.transformers:model_from_config"})


def build_from_init(init: Any, *, trusted: bool = False, source: str = "the bundle") -> torch.nn.Module:
    """Build a model from a bundle's ``model_init`` entry, ``{"class": "pkg.mod:Class",
    "kwargs": {...JSON...}}``: ``Class(**kwargs)``, the way Lightning's ``load_from_checkpoint``
    rebuilds a LightningModule from its saved hyperparameters. Only for a trusted bundle, and only
    when the name resolves to a ``torch.nn.Module`` subclass or to one of nanreplay's own model
    builders (:data:`MODEL_BUILDERS`; nothing else is ever called).

    Args:
        trusted: the bundle ``source`` is trusted (see :mod:`nanreplay.engine.gate`).

    Raises:
        UntrustedBundleError: ``trusted`` is false (nothing was imported).
        ReplayError: a malformed entry, a name that cannot be imported or is not an
            ``nn.Module`` subclass, or a constructor error.
    """
    if not isinstance(init, dict) or not isinstance(init.get("class"), str) or not isinstance(init.get("kwargs", {}), dict):
        raise ReplayError(f"the bundle's model_init is {init!r}; expected {{'class': 'pkg.mod:Class', 'kwargs': {{...}}}}: pass --model-factory")
    # --- trust rule (nanreplay.engine.gate): a bundle-named class runs only for a trusted bundle ---
    if not trusted:
        raise UntrustedBundleError(source, model_init_names(init))
    cls = import_callable(init["class"])
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)) and init["class"] not in MODEL_BUILDERS:
        raise ReplayError(f"{source}: model_init names {init['class']!r}, a {type(cls).__name__}, not a torch.nn.Module subclass; pass --model-factory")
    try:
        model = cls(**init.get("kwargs", {}))
    except SystemExit as e:
        raise ReplayError(f"{init['class']}(**{init.get('kwargs')}) called sys.exit({e.code!r}) instead of building the model") from e
    except Exception as e:
        raise ReplayError(
            f"{init['class']}(**{init.get('kwargs')}) raised {type(e).__name__}: {e}; the recorded hyperparameters do not "
            "rebuild the model here: pass --model-factory"
        ) from e
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"{init['class']} built a {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_model(b: Bundle, model_factory: Union[str, Callable, None] = None) -> torch.nn.Module:
    """A fresh model of the recorded architecture from ``model_factory`` (a zero-argument callable
    or its import path), else from the factory recorded in the bundle ``b``, else from its
    ``model_init`` (class and JSON kwargs, see :func:`build_from_init`); the recorded ones only
    when ``b.trusted``. Weights are not loaded.

    Raises:
        UntrustedBundleError: the recorded factory or class would be used and ``b`` is not trusted.
        ReplayError: no factory recorded or given, the factory cannot be imported, raises, calls
            ``sys.exit``, or returns something other than an ``nn.Module``.
    """
    factory = model_factory or b.model_factory
    if factory is None and b.meta.get("model_init"):
        # class + JSON hyperparameters (Lightning)
        return build_from_init(b.meta["model_init"], trusted=b.trusted, source=str(b.path))
    if factory is None:
        raise ReplayError(
            f"{b.path} records no model factory; pass --model-factory module:function "
            "(a zero-argument function returning the model), or give Recorder(model_factory=...) when recording"
        )
    if model_factory:
        fn = import_callable(factory) if isinstance(factory, str) else factory  # the caller named it
    else:
        fn = recorded_callable(b, "model factory", factory)  # trust rule: raises unless b is trusted
    try:
        model = fn()
    except SystemExit as e:  # a factory must not end the process (and so fake a replay's exit code)
        raise ReplayError(f"the model factory {factory!r} called sys.exit({e.code!r}) instead of returning a model") from e
    except Exception as e:
        raise ReplayError(f"the model factory {factory!r} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"the model factory {factory!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_optimizer(b: Bundle, model: torch.nn.Module, state: Optional[dict] = None) -> torch.optim.Optimizer:
    """Rebuild the recorded optimizer over ``model``'s parameters from the bundle's
    ``meta["optimizer"]`` and load ``state`` (an ``optimizer.state_dict()``, e.g. a snapshot's)
    when given; see :func:`optimizer_from_info`.

    Raises:
        ReplayError: the bundle records no optimizer class, or it cannot be imported or built.
        ModelMismatchError: a recorded parameter FQN is not in ``model``, or ``state`` does not
            fit the rebuilt param groups.
    """
    return optimizer_from_info(b.meta.get("optimizer") or {}, dict(model.named_parameters()), state, source=str(b.path), trusted=b.trusted)


def optimizer_from_info(
    info: dict, params: dict[str, torch.Tensor], state: Optional[dict] = None, *, source: str = "the bundle", trusted: bool = False
) -> torch.optim.Optimizer:
    """The recorded optimizer, rebuilt over ``params`` (FQN -> parameter) from a bundle's
    ``meta["optimizer"]`` (class import path, parameter FQNs of each param group, defaults).

    With ``state`` (an ``optimizer.state_dict()``), each group is built with its recorded
    hyperparameters, which also carries values a constructor would refuse (a NaN learning rate
    is exactly what the optimizer-update diagnosis replays), then the state is loaded. Without
    it, the recorded defaults are used.

    The class is resolved under the trust rule (:func:`nanreplay.engine.gate.resolve_optimizer`):
    a ``torch.optim`` optimizer, a class the caller resolved (``info`` an
    :class:`~nanreplay.engine.gate.OptimizerInfo`), or with ``trusted`` any optimizer class.

    Raises:
        ReplayError: no optimizer class recorded, or it cannot be imported or built.
        UntrustedBundleError: the class is not in ``torch.optim`` and ``trusted`` is false.
        ModelMismatchError: a recorded FQN is missing from ``params``, or ``state`` does not fit.
    """
    cls_path = info.get("class")
    cls = resolve_optimizer(info, trusted=trusted, source=source)
    fqn_groups = info.get("param_groups_fqns", [])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]] if state is not None else [{} for _ in fqn_groups]
    if len(hyper) != len(fqn_groups):
        raise ModelMismatchError(f"{source}: the optimizer state has {len(hyper)} param groups, the recorded optimizer {len(fqn_groups)}")
    groups = []
    for fqns, h in zip(fqn_groups, hyper):
        missing = [f for f in fqns if f not in params]
        if missing:
            raise ModelMismatchError(
                f"the recorded optimizer holds parameters {missing[:5]} that the model lacks; "
                "pass --model-factory with the factory that built the recorded model"
            )
        groups.append({**h, "params": [params[f] for f in fqns]})
    defaults = dict(info.get("defaults") or {})
    lr_only = {"lr": float(defaults["lr"])} if isinstance(defaults.get("lr"), (int, float)) else {"lr": 1e-3}
    attempts = ([{}] if state is not None else []) + [defaults, lr_only]
    for i, kwargs in enumerate(attempts):
        try:
            opt = cls(groups, **kwargs)
            break
        except (TypeError, ValueError) as e:  # a default JSON could not carry (repr'd); the state fixes it
            if i == len(attempts) - 1:
                raise ReplayError(f"could not rebuild the optimizer {cls_path}: {type(e).__name__}: {e}") from e
            logger.info("rebuilding %s with %s failed (%s); trying the next way", cls_path, sorted(kwargs) or "its param groups", e)
    if state is not None:
        try:
            opt.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelMismatchError(f"the recorded optimizer state does not fit the rebuilt {cls_path}: {e}") from e
    return opt


def recorded_device(b: Bundle) -> torch.device:
    """The device the recorded parameters lived on when it exists here, else the CPU (with a
    warning). Never fails on what a bundle says: an unknown device type or index means the CPU."""
    devs = [v.get("device", "cpu") for v in (b.meta.get("model") or {}).get("params", {}).values()]
    dev = devs[0] if devs else "cpu"
    try:
        device = torch.device(dev)
        module = getattr(torch, device.type, None) if device.type != "cpu" else None
        available = device.type == "cpu" or bool(module is not None and module.is_available()
                                                   and (device.index is None or device.index < module.device_count()))
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        logger.debug("recorded device %r is not usable here: %s", dev, e)
        available = False
    if not available:
        logger.warning("the bundle was recorded on %s; replaying on the CPU (results may differ)", dev)
        return torch.device("cpu")
    return device


def deterministic_cublas(device: torch.device) -> Optional[str]:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` for a replay on ``device`` when that keeps the recording's
    kernels; return the value set, or ``None`` when nothing was set.

    A replay runs under torch's deterministic algorithms, which ask cuBLAS for a fixed workspace
    setting (``:4096:8`` or ``:16:8``, NVIDIA's cuBLAS guide, "Results reproducibility"); torch
    and cuBLAS read the variable once, at the process's first cuBLAS call. So it is set here,
    before the replay first uses the GPU, when all of these hold: the replay runs on CUDA; the
    variable is unset; this process has not initialised CUDA yet (a fresh ``nanreplay replay``;
    in a process that trained on the GPU it is too late, and the user's environment is not the
    replay's to change); and ``:4096:8`` is the 32 MiB workspace torch gives cuBLAS anyway on
    this GPU (compute capability 9 and newer: Hopper, Blackwell), so the matrix products pick the
    kernels the recording picked and a bit-exact replay stays possible. On older GPUs torch's
    default (``:4096:2:16:8``, about 8 MiB) is neither setting, and another workspace could
    change the kernels; the variable is left alone there, which a replay on one stream does not
    need (its cuBLAS results do not change from run to run), and the replay keeps torch's alert
    about it quiet (:mod:`nanreplay.engine.run`).
    """
    if device.type != "cuda" or os.environ.get("CUBLAS_WORKSPACE_CONFIG") or not torch.cuda.is_available() or torch.cuda.is_initialized():
        return None
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError) as e:  # no such device here: the replay's own error says so
        logger.debug("no compute capability for %s: %s", device, e)
        return None
    if major < 9:
        return None
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS
    logger.debug("set CUBLAS_WORKSPACE_CONFIG=%s for the replay on %s (compute capability %d)", DETERMINISTIC_CUBLAS, device, major)
    return DETERMINISTIC_CUBLAS


def replay_scaler(state: Optional[dict], device: torch.device) -> Any:
    """A ``torch.amp.GradScaler`` on ``device``'s type restored from a bundle's scaler state,
    or ``None`` when the bundle holds none. Its scale tensor is made now (``scale()`` of a 0-dim
    zero; a restored scaler makes it only in its first ``scale()``): a replay driven by the
    recorded cotangent, already scaled, never calls ``scale()`` and still unscales the gradients."""
    if not state:
        return None
    scaler = torch.amp.GradScaler(device.type)
    scaler.load_state_dict(dict(state))
    if scaler.is_enabled():
        scaler.scale(torch.zeros((), device=device))
    return scaler


@dataclass
class Subject:
    """What a replay runs: the model, the loss function (``None``: the recorded cotangent drives
    backward), where the model came from (``source``) and what the user should know about it."""

    model: torch.nn.Module
    loss_fn: Optional[Callable]
    source: str
    notes: list[str] = field(default_factory=list)
    code: str = "recorded"               # the model's code: "given" (the caller's), "program" (embedded) or "recorded" (its factory or class)
    loss_code: Optional[str] = None      # the loss function's: "given", "program", "recorded", or None (no loss function)


def replay_subject(b: Bundle, *, model: Optional[torch.nn.Module] = None, model_factory: Union[str, Callable, None] = None,
                   loss_fn: Union[str, Callable, None] = None, use_loss_fn: bool = True, device: Any = None,
                   types: Types = None, optimizer: bool = False) -> Subject:
    """The model and loss function to replay bundle ``b`` with, in this order: the ``model`` or
    ``model_factory`` the user gives (the way to replay against edited code: "does my fix remove
    the NaN?"); else the program embedded in the bundle (no import of user code at all, see
    :mod:`nanreplay.engine.program`); else the factory recorded in the bundle; else its recorded
    class and JSON hyperparameters (``model_init``). The loss function is the user's, else the
    program's own (a program exported with its loss), else the recorded one.

    The trust rule (:func:`nanreplay.engine.gate.require_trust`) is checked first, for exactly the
    code this choice would import: an embedded program is data and needs no trust; a recorded
    factory, class, loss function or batch type (``types`` covers the caller's own) does. With
    ``optimizer=True`` the caller will also rebuild the recorded optimizer.

    Raises:
        UntrustedBundleError: ``b`` is not trusted and the choice would import code it names
            (nothing was imported).
        ReplayError: nothing here can build the model (the message says what was tried).
    """
    wants_loss = use_loss_fn
    user_loss = loss_fn if use_loss_fn else None
    uses_program, note = _checked_choice(b, own_model=model is not None or model_factory is not None, user_loss=user_loss is not None,
                                         wants_loss=wants_loss, types=types, optimizer=optimizer)
    notes: list[str] = [note] if note else []

    def resolve_loss(recorded_ok: bool) -> Optional[Callable]:
        if user_loss is not None:
            refuse_loss_without_batch(b)
            return import_callable(user_loss) if isinstance(user_loss, str) else user_loss
        if wants_loss and recorded_ok and b.loss_fn:
            # trust rule checked again; a partial's recorded keyword arguments are bound again
            return bind_recorded(recorded_callable(b, "loss function", b.loss_fn), b.loss_fn_kwargs)
        return None

    given = user_loss is not None and not (isinstance(user_loss, str) and user_loss == b.loss_fn)  # the recorded path, named again
    loss_code = "given" if given else ("recorded" if wants_loss and b.loss_fn else None)
    if model is not None:
        return Subject(model, resolve_loss(True), "the given model", notes, code="given", loss_code=loss_code)
    if model_factory is not None:
        return Subject(build_model(b, model_factory), resolve_loss(True), f"the given factory {model_factory if isinstance(model_factory, str) else getattr(model_factory, '__qualname__', model_factory)}",
                       notes, code="given", loss_code=loss_code)
    from .program import build_from_program

    if uses_program:
        pmodel, ploss = build_from_program(b, device=device)
        own_loss = ploss is not None and user_loss is None and wants_loss
        lf = ploss if own_loss else resolve_loss(True)
        return Subject(pmodel, lf, f"the program embedded in the bundle ({'forward and loss' if ploss is not None else 'forward'})", notes,
                       code="program", loss_code="program" if own_loss else loss_code)
    return Subject(build_model(b, None), resolve_loss(True), "the model factory recorded in the bundle" if b.model_factory else "the recorded class and hyperparameters",
                   notes, loss_code=loss_code)


def _checked_choice(b: Bundle, *, own_model: bool, user_loss: bool, wants_loss: bool, types: Types,
                    optimizer: bool) -> tuple[bool, Optional[str]]:
    """Whether the replay of ``b`` runs its embedded program (:func:`_program_choice`), and the
    note that says why not or what the program lacks, after the trust rule
    (:func:`nanreplay.engine.gate.require_trust`) is checked for exactly the code that choice
    would import.

    Args:
        own_model: the caller brings a model or a factory. user_loss: the caller brings a loss
            function. wants_loss: a loss function drives backward (not ``--no-loss-fn``).
    """
    from .program import PROGRAM_META_KEY

    program = b.meta.get(PROGRAM_META_KEY) or {}
    uses_program, note = _program_choice(b, program, own_model=own_model, loss_given=user_loss, wants_loss=wants_loss)
    require_trust(b, model=own_model or uses_program, types=types, optimizer=optimizer,
                  loss=user_loss or not wants_loss or (uses_program and program.get("kind") == "loss"))
    return uses_program, note


def runs_untrusted_program(b: Bundle, request: "ReplayRequest", *, optimizer: bool = False) -> bool:
    """Whether a replay of ``b`` with ``request`` would run the embedded program of a bundle that
    is not trusted: the case :mod:`nanreplay.engine.sandbox` contains. Checks the trust rule
    first, as :func:`replay_subject` does (``optimizer``: the caller rebuilds the recorded
    optimizer).

    Raises:
        UntrustedBundleError: the replay would import code the untrusted bundle names.
    """
    uses, _ = _checked_choice(b, own_model=request.model is not None or request.model_factory is not None,
                           user_loss=request.use_loss_fn and request.loss_fn is not None, wants_loss=request.use_loss_fn,
                           types=request.batch_types, optimizer=optimizer)
    return uses and not b.trusted


def _program_choice(b: Bundle, program: dict, *, own_model: bool, loss_given: bool, wants_loss: bool) -> tuple[bool, Optional[str]]:
    """Whether a replay of ``b`` runs its embedded ``program`` (:func:`replay_subject`'s order),
    and the note that tells the user why not, or what the program lacks."""
    if own_model:
        return False, None
    if not program.get("kind"):
        return False, (f"the bundle holds no program (its export failed when recording: {str(program['error'])[:200]}); "
                       "the recorded model factory rebuilds the model") if program.get("error") else None
    # a program traced through custom autograd Functions holds their forward, not their backward:
    # a trusted bundle that can rebuild the model from code replays the code that ran
    functions = ", ".join(str(f).rpartition(":")[2] for f in program.get("custom_functions") or [])
    if functions and b.trusted and (b.model_factory or b.meta.get("model_init")):
        return False, (f"the model calls custom autograd Functions ({functions}), whose backward the embedded program does not hold: "
                       "the model is rebuilt from its recorded code, so their own backward runs as in training")
    # a program exported with its loss runs only that loss: a given --loss-fn, or a replay driven
    # by the recorded cotangent (--no-loss-fn), needs the model's own forward
    if program.get("kind") == "loss" and (loss_given or not wants_loss):
        return False, "the embedded program runs the recorded loss function: a given --loss-fn or --no-loss-fn replays with the model factory"
    return True, (f"the model calls custom autograd Functions ({functions}): the embedded program replays their backward as autograd's "
                  "derivative of their forward, not their own backward; trust the bundle (or pass --model-factory) to replay the code "
                  "that ran") if functions else None


def refuse_loss_without_batch(b: Bundle) -> None:
    """A loss function the user gives takes a recorded batch (``loss_fn(model, batch)``): refuse
    it, with the reason, when the bundle's failing step holds none, rather than replay without it.

    Raises:
        ReplayError: the failing step holds no batch (the Recorder kept only the model's forward
            inputs: no labels); the message says why and how to record one.
    """
    entry = next((s for s in b.meta.get("steps") or [] if isinstance(s, dict) and s.get("step") == b.failing_step), None)
    if entry is None or entry.get("batches"):
        return
    why = ((b.meta.get("transformers") or {}).get("no_loss_fn_reason") if isinstance(b.meta.get("transformers"), dict) else None)
    raise ReplayError(
        f"the bundle holds no labels: step {b.failing_step} has no recorded batch, only the model's forward inputs"
        + (f" ({why})" if why else "") + "; the loss function given (loss_fn=...) computes the loss from a batch. Record the batch "
        "with Recorder.record(batch) in the loop (the framework callbacks record it), or replay without loss_fn=...: the recorded "
        "gradient of the model's outputs then drives the backward pass"
    ).with_cli_fix("loss_fn=...", "--loss-fn")


@dataclass(frozen=True)
class ReplayRequest:
    """What :func:`nanreplay.replay` and :func:`nanreplay.bisect` replay a bundle with: the
    options they share (each documented there), one object for :func:`opened_subject`.

    Attributes:
        model, model_factory: the user's model, or the function that builds it (else the
            embedded program, else the recorded factory; :func:`replay_subject`).
        loss_fn, use_loss_fn: the user's loss function; ``use_loss_fn=False`` drives backward
            with the recorded cotangent.
        device: where to replay (default :func:`recorded_device`).
        trust: trust the bundle for this call. batch_types: types to rebuild typed batch nodes as.
        import_script: allow importing a factory or loss function from a script.
    """

    model: Optional[torch.nn.Module] = None
    model_factory: Union[str, Callable, None] = None
    loss_fn: Union[str, Callable, None] = None
    use_loss_fn: bool = True
    device: Union[str, torch.device, None] = None
    trust: bool = False
    batch_types: Types = None
    import_script: bool = False


@contextlib.contextmanager
def opened_subject(bundle: Union[str, Path, Bundle], request: ReplayRequest, *, optimizer: bool = False
                   ) -> Iterator[tuple[Bundle, Subject, torch.device]]:
    """Open ``bundle`` for a replay: a path is opened (and closed on exit), an open
    :class:`~nanreplay.format.bundle.Bundle` is viewed (and left open); the model source is
    chosen by :func:`replay_subject` under the trust rule (``optimizer``: the caller also
    rebuilds the recorded optimizer) and the model moved to the device.

    Yields:
        the bundle (trusted per ``request.trust``, reading ``request.batch_types`` and the
        recorded ones), the :class:`Subject`, the device.
    """
    own = not isinstance(bundle, Bundle)
    b = open_bundle(bundle, trust=request.trust) if own else bundle.view(trust=request.trust)
    try:
        dev = torch.device(request.device) if request.device is not None else recorded_device(b)
        deterministic_cublas(dev)  # before anything here uses the GPU
        with script_imports(request.import_script):
            # the trust rule (nanreplay.engine.gate) is checked here, before anything the bundle names is imported
            subject = replay_subject(b, model=request.model, model_factory=request.model_factory, loss_fn=request.loss_fn,
                                     use_loss_fn=request.use_loss_fn, device=dev, types=request.batch_types, optimizer=optimizer)
        b = b.view(types=bundle_types(b, request.batch_types))
        subject.model = subject.model.to(dev)
        yield b, subject, dev
    finally:
        if own:
            b.close()
