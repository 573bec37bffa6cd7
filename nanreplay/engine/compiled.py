"""Replaying a step under ``torch.compile`` beside the eager replay: does the non-finite value
appear only in compiled code (a known class of bugs: fused kernels, reordered reductions,
lower-precision intermediates, a compiler bug), which stage of the compiler brings it, and where
in the compiled region is it born?

Every replay runs bare (no module or op monitor: hooks inside the compiled region would break the
graph and change what is compiled), from the same step-start weights and buffers, the same batch
(or forward inputs and cotangents) and the same RNG states, with the same deterministic settings.
Only what the step calls differs: the model's forward (or the submodules the recording compiled,
each as ``module.compile()`` does) compiled with a backend, the rest eager. A program embedded in
the bundle (:mod:`nanreplay.engine.program`) is compiled the same way: its model part
(``pm._inner``, the unflattened module hierarchy at its FQNs), its loss eager, so the compiled
graph has the boundaries training's had (:func:`compiled_as`).

The comparison (:func:`compile_check`) replays the step eagerly, under the main backend (the
recording's, with its mode, options, ``dynamic`` and ``fullgraph``: :func:`recorded_compile`),
under ``aot_eager`` (Dynamo and AOTAutograd, eager kernels) and under any backend asked for, and
names the stage (:data:`STAGES`): the first backend, in the compiler's pipeline order, whose replay
is non-finite. Then :mod:`nanreplay.engine.compiled_nodes` looks inside: for graph capture, the
first node of the captured AOT graphs that is non-finite when run eagerly; for inductor's code
generation, a bisection over the graph's nodes compiled alone. A backend a bundle names runs only
when it is one of :data:`BUNDLE_BACKENDS`; an inductor option only when :func:`replayable_options`
allows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..core.batch import batch_size
from ..core.numerics import any_nonfinite
from ..core.rng import without_private_generators
from ..core.state import load_buffers
from .compare import compare_grads
from .compiled_nodes import GraphCapture, OutOfTime, bisect_kernels, first_birth, inductor_graph_compiler
from .deadline import replay_error
from .program import ProgramModel, model_fqn
from .run import ReplayResult, StepInputs, run_step

logger = logging.getLogger(__name__)

__all__ = ["compile_check", "recorded_compile", "replayable_options", "eager_modules", "compiled_as", "compiled_replay", "CompileSettings", "DEFAULT_BACKEND",
           "REFERENCE_BACKEND", "BUNDLE_BACKENDS", "MODES", "STAGES"]

#: the backend ``torch.compile`` uses by default
DEFAULT_BACKEND = "inductor"

#: the backend every comparison runs beside the main one: Dynamo and AOTAutograd with eager kernels
REFERENCE_BACKEND = "aot_eager"

#: the backends a replay runs because a bundle names them (``meta["compile"]``): torch's own.
#: A bundle is data: a backend name outside this list (a third-party backend registered by an
#: entry point, a callable's import path) is reported, never looked up; ``--compile-backend``
#: runs it when the user names it.
BUNDLE_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition", "eager", "cudagraphs")

#: the inductor modes a bundle may name
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: the compiler's pipeline, in order: each backend, the stage it adds to the ones before, and what
#: that stage does. A non-finite value that first appears under a backend (the earliest row whose
#: replay is non-finite, the eager replay being finite) comes from that row's stage; a backend
#: not listed comes last, as ``"code generation"`` (its own compiler: inductor's kernels).
STAGES: tuple[tuple[str, str, str], ...] = (
    ("eager", "graph capture", "Dynamo's graph capture"),
    ("aot_eager", "graph capture", "AOTAutograd's tracing (functionalization, the joint forward and backward graph)"),
    ("aot_eager_decomp_partition", "graph capture", "inductor's decompositions and partitioner"),
)

#: inductor options a bundle may not set, by prefix: they write files, start processes, reach
#: the network or run tests' hooks (a bundle never changes more than the numerics it replays)
UNSAFE_OPTION_PREFIXES = ("trace", "debug", "aot_inductor", "save", "profil", "benchmark", "cpp.cxx", "compile_threads", "worker",
                          "autotune_in_subproc", "autotune_remote", "remote", "fx_graph_remote", "bundled_autotune", "test_configs",
                          "cuda.cutlass", "output", "write", "force_disable_caches", "freezing_discard")

#: Dynamo recompilations each compiled replay may add to a code object's cache (the user's own
#: compiled forward shares it in process); past the limit Dynamo would run the code eagerly
_EXTRA_RECOMPILES = 16


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How to compile: the ``torch.compile`` arguments a recording used or a user asked for.
    ``backend`` a name or a callable; ``mode`` and ``options`` (inductor's) are exclusive, as in
    ``torch.compile``: ``options`` holds the full config when no named mode matched."""

    backend: Union[str, Callable]
    mode: Optional[str] = None
    options: Optional[dict] = None
    dynamic: Optional[bool] = None
    fullgraph: bool = False

    @property
    def name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", type(self.backend).__name__)

    def compile(self, fn: Callable) -> Callable:
        """``fn`` under ``torch.compile`` with these settings."""
        kw: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic, "fullgraph": self.fullgraph}
        if self.backend == "inductor" and self.mode:
            kw["mode"] = self.mode
        elif self.backend == "inductor" and self.options:
            kw["options"] = dict(self.options)
        return torch.compile(fn, **kw)

    def inductor_config(self) -> dict:
        """The inductor config patches these settings give (a mode's options, or ``options``),
        without CUDA graphs (a graph compiled alone to bisect it is run once)."""
        cfg: dict = {}
        if self.mode and self.mode != "default":
            from torch._inductor import list_mode_options

            cfg.update(list_mode_options(self.mode, self.dynamic))
        cfg.update(self.options or {})
        cfg["triton.cudagraphs"] = False
        return cfg


def replayable_options(options: Any) -> tuple[dict, list[str]]:
    """The inductor options of a bundle that a replay sets, and the names of those it leaves out:
    only boolean and numeric values of an option this torch knows, of the type it has here, and
    not one of :data:`UNSAFE_OPTION_PREFIXES` (a string may name a file or a program to run)."""
    if not isinstance(options, dict) or not options:
        return {}, []
    try:
        from torch._inductor import config

        current = config.get_config_copy()
    except Exception as e:  # noqa: BLE001 - a torch without inductor: no option can be set
        logger.debug("nanreplay: inductor's config is not readable (%s)", e)
        return {}, sorted(map(str, options))
    kept, skipped = {}, []
    for key, val in options.items():
        name = str(key).replace("-", "_")
        here = current.get(name, ...)
        ok = (isinstance(val, (bool, int, float)) and not isinstance(here, str) and here is not ... and type(val) is type(here)
              and not name.startswith(UNSAFE_OPTION_PREFIXES))
        if ok:
            kept[name] = val
        else:
            skipped.append(str(key))
    return kept, skipped


def recorded_compile(state: Optional[dict]) -> tuple[Optional[dict], Optional[str]]:
    """How to replay compiled the way a recording ran, from its ``meta["compile"]``.

    Returns:
        ``(options, None)`` with ``options = {"backend", "mode", "modules", "options", "dynamic",
        "fullgraph", "skipped_options"}`` for :func:`compile_check` (``options``: the inductor
        options :func:`replayable_options` allows, ``skipped_options`` the names of the others);
        ``(None, why)`` when the recording was compiled but its backend is not one a bundle may
        name (:data:`BUNDLE_BACKENDS`); ``(None, None)`` when it was not compiled (or the bundle
        does not say).
    """
    if not isinstance(state, dict) or not state.get("compiled"):
        return None, None
    backend = state.get("backend") or DEFAULT_BACKEND
    if backend not in BUNDLE_BACKENDS:
        return None, (f"the recording compiled with backend {str(backend)[:200]!r}, not one a bundle may name ({', '.join(BUNDLE_BACKENDS)}); "
                      "replay it compiled with --compile-backend NAME")
    inductor = backend == "inductor"
    mode = state.get("mode") if inductor and state.get("mode") in MODES else None
    options, skipped = replayable_options(state.get("options")) if inductor and mode is None else ({}, [])
    modules = [m for m in state.get("modules") or [] if isinstance(m, str)]
    dynamic = state.get("dynamic") if isinstance(state.get("dynamic"), bool) else None
    return {"backend": backend, "mode": mode, "modules": modules, "options": options or None, "dynamic": dynamic,
            "fullgraph": state.get("fullgraph") is True, "skipped_options": skipped}, None


def _nonfinite_parts(result: ReplayResult) -> tuple[list[str], str]:
    """What a replay produced that is non-finite (``["loss", "outputs", "gradients"]``, a subset)
    and the kinds seen (``"NaN"``, ``"NaN and +Inf"``, ...; ``""`` when all are finite)."""
    parts = []
    if any(h is not None and not h.finite for h in result.losses):
        parts.append("loss")
    if any(h is not None and not h.finite for h in result.outputs):
        parts.append("outputs")
    bad_grads = [g for g in result.grads.values() if any_nonfinite(g)]
    if bad_grads:
        parts.append("gradients")
    healths = [h for h in list(result.losses) + list(result.outputs) if h is not None]
    nan = any(h.nan for h in healths) or any(bool(torch.isnan(g).any()) for g in bad_grads)
    posinf = any(h.posinf for h in healths) or any(bool(torch.isposinf(g).any()) for g in bad_grads)
    neginf = any(h.neginf for h in healths) or any(bool(torch.isneginf(g).any()) for g in bad_grads)
    kinds = " and ".join(n for n, on in (("NaN", nan), ("+Inf", posinf), ("-Inf", neginf)) if on)
    return parts, kinds


def _submodules(model: torch.nn.Module, modules: Sequence[str]) -> Optional[list[tuple[str, torch.nn.Module]]]:
    """``(FQN, submodule)`` of ``model`` at ``modules``, or ``None`` when the model itself is to be
    compiled: ``""`` among them, none given, or one that this model lacks."""
    if not modules or "" in modules:
        return None
    try:
        return [(m, model.get_submodule(m)) for m in modules]
    except AttributeError:
        return None


def _root(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward is the model's: an embedded program's model part (its loss stays
    outside), else the model."""
    return model._inner if isinstance(model, ProgramModel) else model


def _keep_program_meta(model: torch.nn.Module) -> None:
    """An embedded program's modules run their graph's generated code under Dynamo
    (``torch.export``'s ``InterpreterModule`` calls ``type(graph_module).forward(self, ...)``),
    which Dynamo does not know for a graph module's: tell it (``code_context["orig_graphmodule"]``,
    as ``torch.compile(graph_module)`` does), so the nodes it traces keep the program's
    ``stack_trace`` (the user's source line), not the generated code's."""
    if not isinstance(model, ProgramModel):
        return
    import weakref

    from torch._dynamo import code_context

    for m in [model._inner, *model.modules()]:
        gm = getattr(m, "graph_module", None)
        if isinstance(gm, torch.fx.GraphModule):
            code_context.get_context(type(gm).forward.__code__)["orig_graphmodule"] = weakref.ref(gm)


def _own_entry(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps its compiled code on the code object of
    the frame it starts at: on this copy, which dies with the replay, not on the model's
    ``forward`` or ``Module._call_impl``, which the user's own compiled model shares (its
    recompilation limit, its cache) in an in-process diagnosis. A bound method is copied with its
    own globals, so that Dynamo's first frame reads the globals of the module that defines it, as
    ``torch.compile(model)`` does (a frame of another module would have Dynamo import the defining
    module by name, which fails for a module that is not in ``sys.modules``); anything else is
    called through a small function of its own."""
    func, owner = getattr(fn, "__func__", None), getattr(fn, "__self__", None)
    if isinstance(func, types.FunctionType) and owner is not None:
        copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
        copy.__dict__.update(func.__dict__)
        return types.MethodType(copy, owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call


@contextlib.contextmanager
def compiled_as(model: torch.nn.Module, settings: CompileSettings, modules: Sequence[str] = ()) -> Iterator[str]:
    """For the block, what the recording compiled runs compiled with ``settings``: the submodules
    at ``modules`` (each as ``module.compile()`` does: its ``_compiled_call_impl``), else the
    model's forward (an embedded program's model part, not its loss). Yields the target in words
    (``"model"``, ``"modules a, b"``); everything is put back after."""
    _keep_program_meta(model)
    subs = _submodules(model, modules)
    if subs:
        saved = [(m, m.__dict__.get("_compiled_call_impl")) for _, m in subs]
        try:
            for _, m in subs:
                m._compiled_call_impl = settings.compile(_own_entry(m._call_impl))
            yield "modules " + ", ".join(n for n, _ in subs)
        finally:
            for m, old in saved:
                m._compiled_call_impl = old
        return
    root = _root(model)
    own = root.__dict__.get("forward")
    try:
        root.forward = settings.compile(_own_entry(root.forward))
        yield "model"
    finally:
        if own is None:
            root.__dict__.pop("forward", None)
        else:
            root.forward = own


@contextlib.contextmanager
def eager_modules(model: torch.nn.Module) -> Iterator[None]:
    """Every module of ``model`` compiled with ``module.compile()`` runs eagerly for the block
    (its ``_compiled_call_impl`` set aside, put back after): a replay is eager unless it says
    otherwise (the live model of an in-process diagnosis, a factory that compiles its model)."""
    saved = [(m, m.__dict__["_compiled_call_impl"]) for m in model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
    try:
        for m, _ in saved:
            m._compiled_call_impl = None
        yield
    finally:
        for m, impl in saved:
            m._compiled_call_impl = impl


@contextlib.contextmanager
def compiled_replay(model: torch.nn.Module, settings: CompileSettings, modules: Sequence[str] = ()) -> Iterator[str]:
    """For the block, a replay of ``model`` runs what the recording compiled compiled
    (:func:`compiled_as`), outside any Python dispatch mode and with room for this replay's
    recompilations; run the step inside with ``run_step(model, inp, ops=False, monitors=False,
    runner=model)``. Yields the target in words.

    Raises:
        RuntimeError: a Python dispatch mode is active (Dynamo would run the code eagerly).
    """
    import torch._dynamo

    limit = torch._dynamo.config.recompile_limit + _EXTRA_RECOMPILES
    with without_private_generators() as bare, torch._dynamo.config.patch(recompile_limit=limit):
        if not bare:
            raise RuntimeError("a Python dispatch mode is active around the replay: Dynamo does not trace under one, "
                               "so the compiled replay would run eagerly")
        with compiled_as(model, settings, modules) as target:
            yield target


def _compiled_replay(model: torch.nn.Module, inp: StepInputs, settings: CompileSettings, modules: Sequence[str],
                     device: Optional[torch.device]) -> tuple[ReplayResult, str]:
    """The step replayed bare with what the recording compiled compiled (:func:`compiled_replay`);
    the step-start buffers are put back after."""
    try:
        with compiled_replay(model, settings, modules) as target:
            return run_step(model, inp, ops=False, device=device, monitors=False, runner=model), target
    finally:
        load_buffers(model, inp.state.buffers)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _row(settings: CompileSettings, role: str) -> dict:
    return {"backend": settings.name, "mode": settings.mode, "role": role, "compiled": None, "nonfinite": None, "kinds": None,
            "reproduction": None, "max_abs_diff": None, "error": None}


def _backend_row(model: torch.nn.Module, inp: StepInputs, settings: CompileSettings, role: str, modules: Sequence[str],
                 device: Optional[torch.device], eager: ReplayResult) -> tuple[dict, Optional[str]]:
    """One compiled replay as a row of the comparison (``backends``), and the target it compiled."""
    row = _row(settings, role)
    try:
        res, target = _compiled_replay(model, inp, settings, modules, device)
    except Exception as e:  # noqa: BLE001 - a backend that cannot compile this model is a finding, not a crash
        replay_error(e)  # the deadline goes through
        logger.info("nanreplay: the compiled replay (backend %s) failed", settings.name, exc_info=True)
        row["error"] = _first_line(e)
        return row, None
    parts, kinds = _nonfinite_parts(res)
    row.update(compiled=bool(parts), nonfinite=parts, kinds=kinds or None, max_abs_diff=compare_grads(eager.grads, res.grads).get("max_abs_diff"))
    if inp.recorded_grads:
        row["reproduction"] = compare_grads(inp.recorded_grads, res.grads)["verdict"]
    return row, target


def _pipeline_index(backend: str) -> int:
    return next((i for i, (b, _, _) in enumerate(STAGES) if b == backend), len(STAGES))


def stage_of(rows: Sequence[dict]) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """``(stage, what it does, backend)`` of the first row, in pipeline order (:data:`STAGES`),
    whose replay is non-finite; ``(None, None, None)`` when none is."""
    for row in sorted((r for r in rows if r.get("compiled")), key=lambda r: _pipeline_index(r["backend"])):
        i = _pipeline_index(row["backend"])
        if i < len(STAGES):
            return STAGES[i][1], STAGES[i][2], row["backend"]
        what = "inductor's kernels (code generation)" if row["backend"] == "inductor" else f"{row['backend']}'s code generation"
        return "code generation", what, row["backend"]
    return None, None, None


def compile_check(model: torch.nn.Module, inp: StepInputs, *, backend: Union[str, Callable] = DEFAULT_BACKEND, mode: Optional[str] = None,
                  modules: Sequence[str] = (), device: Optional[torch.device] = None, options: Optional[dict] = None,
                  dynamic: Optional[bool] = None, fullgraph: bool = False, also: Sequence[str] = (), localize: bool = True) -> dict:
    """Replay the step of ``inp`` on ``model`` (step-start weights loaded) eagerly, under
    ``torch.compile`` with ``backend`` (the main backend: the recording's), under
    ``aot_eager`` and under each backend of ``also``; say which is non-finite, which stage of the
    compiler brings the non-finite value, and where it is born inside the compiled region.

    Args:
        model: the replay model; its weights must hold the step-start state. Its buffers are put
            back to the step-start state after each replay; its ``.grad`` holds the last
            replay's gradients afterwards.
        inp: the step (batch or forward inputs and cotangents, RNG states, loss function).
        backend: the main ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``,
            ``"eager"``, ...).
        mode, options, dynamic, fullgraph: as ``torch.compile`` takes them (``mode`` and
            ``options`` for inductor only, ``mode`` first).
        modules: FQNs of the submodules to compile instead of the model, as the recording did
            (``meta["compile"]["modules"]``); the model when empty, when ``""`` is among them or
            when the model lacks one.
        also: more backends to compare, each a column (``--compile-backend``).
        localize: look inside the compiled region when only the compiled replay is non-finite
            (:mod:`nanreplay.engine.compiled_nodes`: one more replay that captures the graphs,
            then, for inductor's kernels, about ``log2(nodes)`` compilations of parts of a graph).
        device: where the replay runs.

    Returns:
        The diagnosis' ``compile`` entry (``docs/report.md``): the main backend's replay in the
        top-level fields (``backend``, ``compiled``, ``compiled_nonfinite``, ...), every compiled
        replay in ``backends`` (pipeline order), ``stage`` / ``stage_detail`` / ``stage_backend``,
        and ``culprit`` (the node, aten op, module, source line and samples) or
        ``localize_error``::

            {"backend": "inductor", "target": "model", "eager": False, "compiled": True, "only_under_compile": True,
             "stage": "code generation", "culprit": {"op": "rsqrt", "source": {"file": ..., "line": 14, ...},
             "samples": {"indices": [5], ...}, ...}, ...}

    Raises:
        ReplayError: the step cannot be replayed at all (the eager replay fails the same way).
    """
    main = CompileSettings(backend, mode=mode, options=options, dynamic=dynamic, fullgraph=fullgraph)
    eager = run_step(model, inp, ops=False, device=device, monitors=False)
    load_buffers(model, inp.state.buffers)
    e_parts, e_kinds = _nonfinite_parts(eager)
    row, target = _backend_row(model, inp, main, "main", modules, device, eager)
    rows = [row]
    names = [main.name]
    for name, role in [(REFERENCE_BACKEND, "reference")] + [(b, "asked") for b in also]:
        if name not in names:
            names.append(name)
            rows.append(_backend_row(model, inp, CompileSettings(name, dynamic=dynamic, fullgraph=fullgraph), role, modules, device, eager)[0])
    out: dict[str, Any] = {
        "backend": main.name, "target": target or ("modules " + ", ".join(modules) if _submodules(model, modules) else "model"),
        "eager": bool(e_parts), "compiled": row["compiled"], "only_under_compile": bool(row["compiled"]) and not e_parts,
        "eager_nonfinite": e_parts, "compiled_nonfinite": row["nonfinite"], "eager_kinds": e_kinds or None, "compiled_kinds": row["kinds"],
        "compiled_reproduction": row["reproduction"], "max_abs_diff": row["max_abs_diff"], "error": row["error"], "mode": main.mode,
        "automatic": False, "options": main.options, "dynamic": dynamic, "fullgraph": fullgraph,
        "backends": sorted(rows, key=lambda r: _pipeline_index(r["backend"])), "stage": None, "stage_detail": None, "stage_backend": None,
        "culprit": None, "localize_error": None,
    }
    if not e_parts:
        out["stage"], out["stage_detail"], out["stage_backend"] = stage_of(rows)
    if localize and out["only_under_compile"] and out["stage"] is not None:
        _localize(out, model, inp, main, modules, device)
    return out


def _localize(out: dict, model: torch.nn.Module, inp: StepInputs, main: CompileSettings, modules: Sequence[str],
              device: Optional[torch.device]) -> None:
    """Fill ``out["culprit"]`` (or ``localize_error``): capture the AOT graphs of the step, then
    the first eager birth in them (graph capture) or the bisection of inductor's kernels."""
    batch = _batch(inp)
    prefix = next(iter(m for m in modules if m), "") if _submodules(model, modules) and len(modules) == 1 else ""
    codegen = out["stage"] == "code generation"
    if codegen and main.name != "inductor":
        out["localize_error"] = f"the nodes are bisected for inductor's kernels only, not backend {main.name}'s"
        return
    cap = GraphCapture(relabel=model_fqn if isinstance(model, ProgramModel) else None)
    decompose = out["stage_backend"] not in ("eager", "aot_eager")
    settings = CompileSettings(cap.backend(decompose=decompose), dynamic=main.dynamic, fullgraph=main.fullgraph)
    try:
        res, _ = _compiled_replay(model, inp, settings, modules, device)
        if codegen:
            # the graphs inductor receives, with eager kernels: a column of its own
            parts, kinds = _nonfinite_parts(res)
            row = dict(_row(CompileSettings("aot_eager_decomp_partition"), "capture"), compiled=bool(parts), nonfinite=parts, kinds=kinds or None)
            out["backends"] = sorted(out["backends"] + [row], key=lambda r: _pipeline_index(r["backend"]))
            if parts:  # inductor's decompositions already make it: graph capture, found by running the graphs eagerly
                out["stage"], out["stage_detail"], out["stage_backend"] = stage_of(out["backends"])
                codegen = False
        if codegen:
            culprit, compiles = bisect_kernels(cap.graphs, inductor_graph_compiler(main.inductor_config()), batch)
        else:
            culprit, compiles = first_birth(cap.graphs, batch), 0
    except OutOfTime as e:
        out["localize_error"] = (f"the diagnosis' time limit came {e.where}; nanreplay replay BUNDLE (no time limit) finishes the search")
        return
    except Exception as e:  # noqa: BLE001 - the localization adds to the finding, it never replaces it
        replay_error(e)
        logger.info("nanreplay: the compiled region could not be searched", exc_info=True)
        out["localize_error"] = _first_line(e)
        return
    if culprit is None:
        out["localize_error"] = ("no node of the captured graphs gives the non-finite value when "
                                 + ("compiled alone on the step's values" if codegen else "run eagerly on the step's values"))
        return
    if prefix and culprit.get("module") is not None:
        culprit["module"] = ".".join(x for x in (prefix, culprit["module"]) if x)
    culprit.update(stage=out["stage"], compilations=compiles)
    out["culprit"] = culprit


def _batch(inp: StepInputs) -> Optional[int]:
    """The batch size of the step's first micro-batch (or forward call)."""
    rec = inp.record
    trees = rec.batches if inp.uses_loss else [fw.inputs for fw in rec.forwards]
    return batch_size(trees[0]) if trees else None
