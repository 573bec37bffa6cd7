"""The failing step's program, embedded in the bundle: replay without the user's model code.

At dump time (once, never per step) :func:`export_program` traces the model's forward (or the
loss function ``loss_fn(model, batch)``, which calls the model) with ``torch.export.export``, the
training IR: ops stay at the level the eager code called them (``aten.linear``, ``aten.dropout``,
``aten.scaled_dot_product_attention``), so running the graph eagerly builds the same autograd
graph and draws the same random numbers as the eager model, and gradients are bit-identical.
:func:`load_program` rebuilds a runnable, trainable module from it: ``torch.export.unflatten``
restores the module hierarchy, so every submodule is a real ``nn.Module`` at its original FQN
(``blocks.3.attn``) and module hooks and ``torch.utils.module_tracker.ModuleTracker`` see it there.

Storage, without pickle. ``torch.export.save`` writes a zip whose graph is JSON (the schema in
``torch/_export/serde/schema.py``) and whose weights, constants and example inputs are
``torch.save`` pickles (``serialize_torch_artifact``). Only the JSON part is kept here
(``serialize(..., serialize_state_dict=False, serialize_constants=False,
serialize_example_inputs=False)``; a torch without those options pickles them in memory and they
are dropped), as a JSON object in the bundle metadata; every weight, buffer
and tensor constant goes into the bundle's tensor dict (or is shared with a tensor the bundle
already holds, such as ``state/params/<fqn>``), and is handed back to the deserializer as a
tensor. Before torch's deserializer reads it, every operator the JSON names is checked against
a reviewed allowlist (:mod:`nanreplay.engine.program_check`); an untrusted program is then proven
in bounds on fake tensors before each new shape of call (:mod:`nanreplay.engine.bounds`) and runs
under an index guard (:mod:`nanreplay.engine.guards`).

How the program is cut: the export root is a small adapter module whose only child is the model,
under the name ``model``. Its inputs are the tensor leaves of the recorded call, flattened the
way nanreplay flattens every tree (:func:`nanreplay.core.tree.flatten_typed`: dataclasses and
namedtuples, Hugging Face ``ModelOutput`` included, become their fields); non-tensor leaves are
constants of the program. Its output is the loss (kind ``"loss"``) or the tensor leaves of the
model's output (kind ``"forward"``). So no pytree type of the user's code is needed to load it, and
the loss function's own ops run outside the model, exactly as in eager code (a NaN born in the
loss is born "outside the model" in a replay of the program too).

Limits (``docs/program.md``): export specialises the program to the recorded call: Python control
flow that depends on tensor values fails the export (the capture then carries ``error`` and no
program), non-tensor arguments are constants, tensor shapes are dynamic where export could prove
it (``dynamic=True``) and fixed otherwise, training/eval behaviour (dropout, BatchNorm) is the one
recorded and ``train()``/``eval()`` on the loaded module do not change it, and the device is baked
into the graph (``load_program(device=...)`` rewrites it).
"""

from __future__ import annotations

import contextlib
import contextvars

import dataclasses
import functools
import json
import logging
import math
import operator
import threading
import time
import warnings
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ..core.batch import batch_dim, batch_size
from ..core.quiet import quiet_loggers
from ..core.tree import decode_value, encode_value, flatten_typed, TypedNode, unflatten_batch
from ..errors import BundleFormatError, NanReplayError, ReplayError
from ..format.meta import MetaError
from ..format.program import validate_program_record
from .program_check import check_program
from .probes import calling_module, custom_function_on_stack, user_frame_of_exception, user_frames_only

logger = logging.getLogger(__name__)

__all__ = [
    "ProgramCapture",
    "ProgramModel",
    "export_program",
    "load_program",
    "program_loss",
    "program_content",
    "program_accepts",
    "model_fqn",
    "build_from_program",
    "PROGRAM_META_KEY",
    "PROGRAM_PREFIX",
]

#: bundle ``meta`` key holding the program record (:attr:`ProgramCapture.meta`)
PROGRAM_META_KEY = "program"
#: bundle tensor-key prefix of the program's own tensors (those not shared with ``state/``)
PROGRAM_PREFIX = "program/"
_FORMAT = "nanreplay.program"
_VERSION = 1
_CHILD = "model"  # the model's name under the export root


# -- capture ----------------------------------------------------------------------------------

@dataclass
class ProgramCapture:
    """What :func:`export_program` produced.

    Attributes:
        meta: JSON-able record to store in the bundle metadata (under :data:`PROGRAM_META_KEY`),
            or ``None`` when the export failed. Holds ``program`` (the serialized ExportedProgram,
            a JSON object), ``kind`` (``"forward"``: the model's forward; ``"loss"``: forward and
            loss function), ``torch`` and ``schema`` versions, ``inputs``/``outputs`` (tree spec,
            non-tensor values, tensor dtypes and shapes, ``null`` for a dynamic dim), ``state``
            (each program tensor name -> its bundle key, kind, ``requires_grad``), ``modules``
            (FQN -> class name), ``training`` (FQNs in training mode), ``device``, ``dynamic``,
            ``export_seconds``, ``json_bytes``.
        tensors: bundle key -> tensor, the program's tensors that are not shared with a tensor
            the bundle already holds (references to live tensors: nothing is copied).
        error: why there is no program (``"<ExceptionType>: <message>"``), else ``None``.
    """

    meta: Optional[dict]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.meta is not None


class _ExportRoot(torch.nn.Module):
    """The export root: ``model`` as its only child; ``forward(*tensors)`` puts the tensors back
    into the recorded call's tree and returns the loss, or the tensor leaves of the output."""

    def __init__(self, model: torch.nn.Module, template: Any, loss_fn: Optional[Callable], sink: Callable[[dict], None]) -> None:
        super().__init__()
        self.model = model
        self._template = template
        self._loss_fn = loss_fn
        self._sink = sink  # export reverts what tracing writes into the module's own attributes

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        tree = _rebuild(self._template, it)
        if self._loss_fn is not None:
            loss = self._loss_fn(self.model, tree)
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"loss_fn returned {type(loss).__name__}; expected a scalar tensor")
            return loss
        args, kwargs = tree
        out = self.model(*args, **kwargs)
        leaves, spec = flatten_typed(out)
        self._sink(_tree_info(leaves, spec))
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))


def _rebuild(obj: Any, it: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensor leaves replaced, in :func:`flatten_typed` order, by ``next(it)``.
    Mirrors :func:`nanreplay.core.tree.to_typed`'s walk, but keeps the real classes."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        import copy

        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if f.init:
                object.__setattr__(new, f.name, _rebuild(getattr(obj, f.name), it))
                if isinstance(new, dict) and f.name in new:  # ModelOutput is also a dict
                    dict.__setitem__(new, f.name, getattr(new, f.name))
        return new
    if pytree.is_namedtuple_instance(obj):
        return type(obj)(*(_rebuild(v, it) for v in obj))
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(v, it) for v in obj)
    if isinstance(obj, dict):
        new = type(obj)(obj.default_factory) if hasattr(obj, "default_factory") else type(obj)()
        for k, v in obj.items():
            new[k] = _rebuild(v, it)
        return new
    return obj


def _tree_info(leaves: list, spec: Any) -> dict:
    """JSON description of a flattened tree: spec, leaf count, non-tensor values, tensor indices."""
    return {
        "spec": pytree.treespec_dumps(spec),
        "n": len(leaves),
        "values": {str(i): encode_value(v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)},
        "tensors": [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)],
    }


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


class _ModelCalls(ReplayError):
    """The program calls the model ``calls`` times; a program holds exactly one call."""

    def __init__(self, calls: list) -> None:
        self.calls = len(calls)
        super().__init__(f"the embedded program calls the model {self.calls} times ({calls[:6]}); one call is supported: replay with --model-factory")


#: why an export failed, said in the terms of the user's code: ``(test on the exception, what the
#: code did)``; the first row that holds decides, then the user's line that led to it is named
EXPORT_FAILURES: tuple[tuple[Callable[[BaseException], bool], Callable[[BaseException], str]], ...] = (
    (lambda e: isinstance(e, _ModelCalls) and e.calls > 1,  # type: ignore[attr-defined]
     lambda e: f"the loss function calls the model {e.calls} times; an embedded program holds exactly one call of the model"),  # type: ignore[attr-defined]
    (lambda e: isinstance(e, _ModelCalls),
     lambda e: "the model's call is inside a block torch.export keeps as one operation (a `torch.cond` or another control-flow "
               "operator), where the program cannot name the model's modules"),
    (lambda e: "data-dependent" in str(e) or "DataDependent" in type(e).__name__,
     lambda e: "the code reads a tensor's value to decide what to run (an `if` on a tensor, `.item()`, `.tolist()`, or a size taken "
               "from `nonzero()` or a mask), which torch.export cannot trace"),
    (lambda e: "pickle" in str(e), lambda e: str(e).split("\n")[0]),
)


def _export_failure(e: BaseException, kind: str) -> str:
    """Why the export of the ``kind`` program failed, in the user's terms: what the code did
    (:data:`EXPORT_FAILURES`; else torch's first line), where (the innermost user frame of the
    trace), and torch's own first line."""
    what = next((say(e) for test, say in EXPORT_FAILURES if test(e)), None)
    frame = user_frame_of_exception(e)
    where = f" at {frame['file']}:{frame['line']} in {frame['function']}" + (f" (`{frame['code']}`)" if frame.get("code") else "") if frame else ""
    if what is None:
        return f"torch.export could not trace the {'loss function and the model' if kind == 'loss' else 'model'}{where}: {_first_line(e)}"[:1000]
    detail = "" if isinstance(e, _ModelCalls) else f" (torch.export: {_first_line(e)})"
    return f"{what}{where}{detail}"[:1000]


def export_program(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    *,
    loss_fn: Optional[Callable] = None,
    batch: Any = None,
    dynamic: bool = False,
    verify: bool = True,
    shared: Optional[dict[int, str]] = None,
    prefix: str = PROGRAM_PREFIX,
) -> ProgramCapture:
    """Export ``model``'s forward on ``(args, kwargs)``, or with ``loss_fn`` the whole
    ``loss_fn(model, batch) -> scalar tensor``, as a pickle-free program (see the module doc).

    Call it at dump time, with the failing step's pre-step weights in the model and the step's
    module modes (``model.training`` flags); it does not change the model, its RNG states,
    buffers or gradients (export traces with fake tensors). Module hooks registered on the model
    run during tracing with fake tensors: a Recorder must keep its own hooks quiet meanwhile.

    Args:
        model: the ``nn.Module`` (unwrapped from DDP / accelerate).
        args, kwargs: one recorded forward call's inputs (trees of tensors and plain values).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; with ``batch``, the loss function
            is exported together with the model's forward (kind ``"loss"``).
        batch: the batch the loss function takes.
        dynamic: let tensor dims vary where export can prove the program does not depend on
            them (``torch.export.Dim.AUTO``; micro-batches of other lengths then replay too);
            falls back to fixed shapes when that export fails. Costs about 3-5x the export
            time of fixed shapes, hence off by default (:func:`program_content` turns it on
            when the step's micro-batches differ in shape).
        verify: deserialize and unflatten the program once before returning it (about as long
            as the export), so a program that cannot be loaded is reported now, not at replay.
        shared: ``id(tensor) -> bundle key`` for tensors the bundle stores anyway (the pre-step
            parameters under ``state/params/<fqn>``): the program refers to them instead of
            storing a second copy.
        prefix: bundle key prefix of the tensors the program stores itself.

    Returns:
        a :class:`ProgramCapture`; on any failure (data-dependent control flow, an operator
        export cannot trace, a non-tensor constant that cannot be stored without pickle) one
        with ``meta=None`` and ``error`` set. It never raises into training.
    """
    t0 = time.perf_counter()
    kind = "loss" if loss_fn is not None else "forward"
    try:
        if loss_fn is not None and batch is None:
            raise ValueError("loss_fn needs the batch it takes (batch=...)")
        template = batch if loss_fn is not None else (tuple(args), dict(kwargs or {}))
        in_leaves, in_spec = flatten_typed(template)
        tensors = tuple(t.detach() for t in in_leaves if isinstance(t, torch.Tensor))
        seen: list[dict] = []
        root = _ExportRoot(model, template, loss_fn, seen.append)
        traced: dict = {}
        ep, dyn = _export(root, tensors, dynamic, traced)
        capture, every = _describe(ep, seen[-1] if seen else None, model, kind, in_leaves, in_spec, dyn, shared or {}, prefix)
        if traced.get("method_of"):  # keyed as the stored program's stack traces are: cut to the user's frames
            capture.meta["method_of"] = {user_frames_only(t): fqn for t, fqn in traced["method_of"].items()}
        if traced.get("custom_functions"):  # their backward is not in the program: replay says so, and prefers the code
            capture.meta["custom_functions"] = sorted(traced["custom_functions"])
        if verify:
            _load(capture.meta, every.__getitem__, None)
        capture.meta["export_seconds"] = round(time.perf_counter() - t0, 3)
        logger.info("nanreplay: exported the %s program in %.2f s (%d bytes of JSON)", kind, capture.meta["export_seconds"], capture.meta["json_bytes"])
        return capture
    except Exception as e:  # never into training: a missing program only means replay needs the factory
        why = _export_failure(e, kind)
        logger.warning("nanreplay: could not export the model's %s program: %s; replay will need the model factory", kind, why)
        logger.debug("export failure", exc_info=True)
        return ProgramCapture(meta=None, error=why)


@contextlib.contextmanager
def _user_stack_traces(module_ids: Optional[dict[int, str]] = None, method_of: Optional[dict[str, str]] = None,
                       functions: Optional[set[str]] = None) -> Iterator[None]:
    """Within the block, nodes traced by ``torch.export`` keep every user frame of their stack
    trace (below the first ``forward``), not only frames named ``forward``: an op of the loss
    function (``class_balanced_bce`` called by ``loss_fn``) keeps its own source line, which the
    replay reports. With ``module_ids`` (``id(module) -> FQN`` of the model), a node traced
    outside every module's ``forward`` but inside a *method* of a model module (a
    LightningModule's ``training_step``, ``model.compute_loss(...)``) is noted in ``method_of``
    (its stack trace -> that module's FQN), read while the Python frames are live, as the eager
    replay reads them (:func:`nanreplay.engine.probes.calling_module`); with ``functions``, the
    custom ``torch.autograd.Function`` classes traced through are added to it (export keeps their
    forward's ops, not their ``backward``). Patches
    ``torch.fx.proxy.TracerBase._filter_traceback_frames`` for the block only (export runs at
    dump time, in the training thread)."""
    from torch.fx.proxy import TracerBase

    orig = TracerBase._filter_traceback_frames

    def keep_user_frames(self: Any, summary: Any) -> Any:
        saved = getattr(self, "_record_forward_stack_traces_only", False)
        self._record_forward_stack_traces_only = False
        try:
            kept = orig(self, summary)
        finally:
            self._record_forward_stack_traces_only = saved
        if module_ids and method_of is not None and kept:
            owner = calling_module(module_ids, outside_forward=True)
            if owner is not None:
                method_of["".join(kept.format()).strip()] = owner  # the node's stack_trace, as create_node sets it
        if functions is not None:
            fn = custom_function_on_stack()
            if fn is not None:
                functions.add(f"{fn.__module__}:{fn.__qualname__}")
        return kept

    TracerBase._filter_traceback_frames = keep_user_frames
    try:
        yield
    finally:
        TracerBase._filter_traceback_frames = orig


#: one torch.export at a time in this process: export sets process-wide state while it runs (its
#: "inside an export" flag, which makes torch.compile a no-op; the tracer's frame filter that
#: ``_user_stack_traces`` swaps), and two training threads dumping at once left it set
_EXPORT_LOCK = threading.Lock()


def _export(root: _ExportRoot, tensors: tuple, dynamic: bool, traced: Optional[dict] = None) -> tuple[Any, bool]:
    with _EXPORT_LOCK:
        return _export_unlocked(root, tensors, dynamic, traced)


def _export_unlocked(root: _ExportRoot, tensors: tuple, dynamic: bool, traced: Optional[dict] = None) -> tuple[Any, bool]:
    """``traced``: filled with what the trace saw beside the graph, ``{"method_of": {...},
    "custom_functions": set()}`` (see :func:`_user_stack_traces`)."""
    ids = {id(m): n for n, m in root.model.named_modules()}
    traced = traced if traced is not None else {}
    with warnings.catch_warnings(), torch.enable_grad(), _user_stack_traces(ids, traced.setdefault("method_of", {}),
                                                                            traced.setdefault("custom_functions", set())):
        warnings.simplefilter("ignore")
        if dynamic and any(t.dim() for t in tensors):
            auto = torch.export.Dim.AUTO
            if dynamic == "batch":  # only the batch dimension varies: what per-sample replays need
                size = batch_size(list(tensors))
                dims = [batch_dim(t, size) if size is not None and size > 1 and t.dim() else None for t in tensors]
                shapes = (tuple({d: auto} if d is not None else None for d in dims),)
            else:
                shapes = (tuple({d: auto for d in range(t.dim())} for t in tensors),)
            try:
                return torch.export.export(root, tensors, dynamic_shapes=shapes), True
            except Exception as e:
                logger.info("nanreplay: export with dynamic shapes failed (%s); exporting with the recorded shapes", _first_line(e))
        return torch.export.export(root, tensors), False


def _lifted(ep: Any, spec: Any) -> tuple[Any, str, str]:
    """The value an input spec of ``ep`` lifts, where torch.export keeps it (``state_dict`` or
    ``constants``) and its kind (``parameter``, ``buffer`` or ``constant``)."""
    from torch.export.graph_signature import InputKind

    name = spec.target
    if spec.kind == InputKind.PARAMETER:
        return ep.state_dict[name], "state_dict", "parameter"
    if spec.kind == InputKind.BUFFER:
        return (ep.state_dict[name], "state_dict", "buffer") if bool(spec.persistent) else (ep.constants[name], "constants", "buffer")
    return ep.constants[name], "constants", "constant"  # CONSTANT_TENSOR: a tensor created in forward (torch.tensor(...)), lifted by export


def _keep_user_frames(node: Any) -> None:
    """Every ``stack_trace`` of a serialized program cut to the user's frames
    (:func:`~nanreplay.engine.probes.user_frames_only`), in place, where the program is exported:
    replayed under another environment (torch installed elsewhere, the model file absent), the
    source line a birth names is still the user's ``model.py:16`` with its code, never
    ``torch/fx/proxy.py``."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "stack_trace" and isinstance(v, str):
                node[k] = user_frames_only(v)
            else:
                _keep_user_frames(v)
    elif isinstance(node, list):
        for v in node:
            _keep_user_frames(v)


def _describe(ep: Any, outputs: Optional[dict], model: torch.nn.Module, kind: str, in_leaves: list, in_spec: Any,
              dyn: bool, shared: dict[int, str], prefix: str) -> tuple[ProgramCapture, dict[str, torch.Tensor]]:
    """The capture, and every tensor the program names by its bundle key (shared ones too)."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch.export.graph_signature import InputKind

    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    state: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    every: dict[str, torch.Tensor] = {}
    own: dict[int, str] = {}  # a tensor under two names (tied weights) is stored once, and tied again on load
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT or spec.kind == InputKind.TOKEN:
            continue
        if spec.kind == InputKind.CUSTOM_OBJ:
            raise TypeError(f"the program holds a script object {spec.target!r}, which cannot be stored without pickle")
        name = spec.target
        t, where, k = _lifted(ep, spec)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the program's {k} {name!r} is a {type(t).__name__}, not a tensor; it cannot be stored without pickle")
        key = shared.get(id(t)) or own.get(id(t))
        if key is None:
            key = own[id(t)] = prefix + name
            tensors[key] = t.detach()
        every[key] = t.detach()
        state[name] = {"key": key, "kind": k, "store": where, "requires_grad": bool(t.requires_grad) if k == "parameter" else False}
    for name, t in ep.constants.items():  # constants not read by an input spec (none today) would be lost
        if name not in state and isinstance(t, torch.Tensor):
            key = prefix + name
            tensors[key] = every[key] = t.detach()
            state[name] = {"key": key, "kind": "constant", "store": "constants", "requires_grad": False}
    user = [placeholders[n] for n in sig.user_inputs]
    inputs = _tree_info(in_leaves, in_spec)
    shapes = []
    for node in user:
        val = node.meta.get("val")
        shapes.append({"dtype": _dtype_name(val.dtype), "shape": [int(s) if isinstance(s, int) else None for s in val.shape]})
    inputs["tensor_meta"] = shapes
    program = json.loads(_program_json(ep))
    _keep_user_frames(program)
    if kind == "forward" and outputs is None:
        raise RuntimeError("the export did not trace the model's output")
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "kind": kind,
        "torch": torch.__version__,
        "schema": list(SCHEMA_VERSION),
        "dynamic": dyn,
        "device": str(dev),
        "inputs": inputs,
        "outputs": outputs,
        "state": state,
        "modules": {n: type(m).__name__ for n, m in model.named_modules()},
        "root_class": f"{type(model).__module__}:{type(model).__qualname__}",
        "training": [n for n, m in model.named_modules() if m.training],
        "json_bytes": len(json.dumps(program)),
        "program": program,
    }
    return ProgramCapture(meta=meta, tensors=tensors), every


def _program_json(ep: Any) -> bytes:
    """The JSON part of torch.export's serialization of ``ep`` (bytes); the pickled parts
    (weights, constants, example inputs) are never kept. Where torch's ``serialize`` cannot be
    told to skip them (``serialize_state_dict=`` and the like are missing, as in torch 2.11), it
    pickles them in memory and they are dropped here: slower and, for the moment, the weights'
    bytes again, never written anywhere."""
    from torch._export.serde.serialize import serialize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            art = serialize(ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
        except TypeError as e:
            if "serialize_state_dict" not in str(e):
                raise
            return serialize(ep).exported_program
    if art.state_dict or art.constants or art.example_inputs:  # the pickled parts must be empty
        raise RuntimeError("torch.export's serializer produced pickled data although asked not to")
    return art.exported_program


# -- safety: only allowlisted operators ----------------------------------------------------------
#
# The record was schema-checked when the bundle was opened (nanreplay.format.program: structure,
# tree specs, symbolic expressions); engine.program_check checks every node's operator and
# arguments against the allowlist (engine.opset) before torch's deserializer reads a single name.
# _check_graph checks the deserialized graph once more; engine.bounds proves what it does before
# an untrusted program runs (_prove), engine.guards checks its index values while it runs.

def _builtin_targets() -> dict[str, Any]:
    from torch._export.serde import serialize as ser

    funcs = set(getattr(ser, "_SYM_OPS", set())) | {operator.getitem}
    return {f"{f.__module__}.{f.__name__}": f for f in funcs}


def _check_graph(gm: torch.fx.GraphModule) -> None:
    allowed = set(_builtin_targets().values())
    from torch._ops import HigherOrderOperator, OpOverload

    for mod in gm.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op == "call_function" and not (isinstance(node.target, (OpOverload, HigherOrderOperator)) or node.target in allowed):
                raise ReplayError(f"the embedded program calls {node.target!r}, not a torch operator available here; replay with --model-factory")


def _drop_metadata_asserts(root: torch.nn.Module) -> None:
    """Remove ``aten._assert_tensor_metadata`` nodes (checks export inserts for ``.to()`` calls:
    the dtype and device seen when recording). They compute nothing, and replay runs the program
    under the recorded autocast and, for the float64 counterfactual, in float64, where they fail."""
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    for mod in root.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph) or target is None:
            continue
        dead = [n for n in graph.nodes if n.op == "call_function" and n.target in (target.default, target) and not n.users]
        for n in dead:
            graph.erase_node(n)
        if dead and hasattr(mod, "recompile"):
            mod.recompile()


# -- context-manager regions: inlined before unflatten --------------------------------------------
#
# torch.export's training IR turns a ``with torch.autocast(...)`` or ``with torch.no_grad()``
# block into one higher-order op whose body is a subgraph: ``wrap_with_autocast(device_type,
# dtype, enabled, cache_enabled, body, *operands)``, ``wrap_with_set_grad_enabled(enabled, body,
# *operands)``. ``torch.export.unflatten`` does not look into those bodies: a loss function that
# calls the model inside its own autocast block left the root graph with no call of the model at
# all (and a model with such a block inside lost its submodules' boundaries). At load, after the
# operator checks, each such op is replaced by its body's nodes between an enter and an exit of
# the same context (:func:`_inline_regions`), the eager code's own structure, which unflatten
# then splits by module as usual. The stored program keeps the higher-order ops (on the operator
# allowlist); the enter/exit calls exist only in memory. They are registered as side-effectful, so
# that no dead-code pass (unflatten runs one) drops them.

_side_effect = getattr(torch.fx.node, "has_side_effect", lambda fn: fn)


@_side_effect
def _autocast_enter(device_type: str, dtype: Any, enabled: bool, cache_enabled: Any) -> Any:
    """Enter ``torch.autocast`` as ``wrap_with_autocast`` does; returns the context to exit."""
    ctx = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    ctx.__enter__()
    return ctx


@_side_effect
def _autocast_exit(ctx: Any) -> None:
    ctx.__exit__(None, None, None)


@_side_effect
def _grad_mode_enter(enabled: bool) -> bool:
    """Set grad mode as ``wrap_with_set_grad_enabled`` does; returns the mode to put back."""
    prev = torch.is_grad_enabled()
    torch.set_grad_enabled(enabled)
    return prev


@_side_effect
def _grad_mode_exit(prev: bool) -> None:
    torch.set_grad_enabled(prev)


def _region_op(node: torch.fx.Node) -> Optional[tuple[Callable, Callable, int]]:
    """``(enter, exit, index of the body argument)`` when ``node`` is a context-manager region."""
    hop = getattr(torch.ops, "higher_order", None)
    if node.op != "call_function" or hop is None:
        return None
    if node.target is getattr(hop, "wrap_with_autocast", None):
        return _autocast_enter, _autocast_exit, 4
    if node.target is getattr(hop, "wrap_with_set_grad_enabled", None):
        return _grad_mode_enter, _grad_mode_exit, 1
    return None


def _inline_regions(gm: torch.fx.GraphModule) -> int:
    """Replace every ``wrap_with_autocast`` / ``wrap_with_set_grad_enabled`` node of ``gm``'s
    graph (nested ones too) by its body's nodes between an enter and an exit call of the same
    context; the body's nodes keep their metadata (module stack, stack trace), the enter and exit
    calls take the region node's. Returns how many regions were inlined."""
    graph, done = gm.graph, 0
    while True:
        node = next((n for n in graph.nodes if _region_op(n) is not None
                     and all(u.op == "call_function" and u.target is operator.getitem for u in n.users)), None)
        if node is None:
            break
        enter, leave, at = _region_op(node)  # type: ignore[misc]
        body_ref, operands = node.args[at], node.args[at + 1:]
        body = getattr(gm, body_ref.target) if isinstance(body_ref, torch.fx.Node) else body_ref
        with graph.inserting_before(node):
            ctx = graph.call_function(enter, tuple(node.args[:at]))
            ctx.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
            env: dict[torch.fx.Node, Any] = dict(zip([p for p in body.graph.nodes if p.op == "placeholder"], operands))
            outs: Any = ()
            for sub in body.graph.nodes:
                if sub.op == "placeholder":
                    continue
                if sub.op == "output":
                    outs = torch.fx.node.map_arg(sub.args[0], lambda x: env[x])
                    continue
                if sub.op == "get_attr":  # a nested region's body: carried over under a fresh name
                    name = f"{body_ref.target if isinstance(body_ref, torch.fx.Node) else 'region'}_{sub.target}"
                    gm.add_submodule(name, getattr(body, sub.target))
                    env[sub] = graph.get_attr(name)
                    continue
                env[sub] = graph.node_copy(sub, lambda x: env[x])
            end = graph.call_function(leave, (ctx,))
            end.meta = dict(ctx.meta)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for user in list(node.users):  # each a getitem of the region's output tuple
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if isinstance(body_ref, torch.fx.Node) and not body_ref.users:
            graph.erase_node(body_ref)
            if not any(n.op == "get_attr" and n.target == body_ref.target for n in graph.nodes):
                gm.delete_submodule(body_ref.target)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


# -- load -------------------------------------------------------------------------------------

class ProgramModel(torch.nn.Module):
    """A model rebuilt from an embedded program (:func:`load_program`): the original module
    hierarchy (each submodule a ``torch.export`` ``InterpreterModule`` relabelled with its original
    class name, at its original FQN), its parameters as ``nn.Parameter`` with the recorded
    ``requires_grad``, its buffers and constants.

    ``model(*args, **kwargs)`` (kind ``"forward"``) runs the recorded forward on inputs of the
    recorded structure and dtypes (and shapes, where the export fixed them) and returns the
    output tree rebuilt without the user's classes: a dataclass or namedtuple output (a Hugging
    Face ``ModelOutput``) comes back as a stand-in of the same name and fields (attribute access,
    ``out["loss"]`` and ``out[0]`` work). :meth:`program_loss` (kind ``"loss"``) runs the loss
    function on a batch. Training behaviour (dropout, BatchNorm statistics) is the recorded one
    whatever ``train()``/``eval()`` say; autocast is not baked in: run it under the recorded
    autocast, as replay does.

    Raises (on call):
        ReplayError: inputs of another structure, dtype or fixed shape than recorded, or a
            forward call on a program exported with its loss function.
    """

    def __init__(self, root: torch.nn.Module, inner: torch.nn.Module, meta: dict) -> None:
        super().__init__()
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_internal", False)
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner.named_parameters(recurse=False):
            self.register_parameter(name, p)
        persistent = set(inner.state_dict(keep_vars=True))
        for name, b in inner.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name in persistent)
        root._modules[_CHILD] = self
        self.kind: str = meta["kind"]
        self.program_meta = {k: v for k, v in meta.items() if k != "program"}
        self._training_fqns = set(meta.get("training", []))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._internal:  # called by the program's own root graph: its internal calling convention
            return self._inner.forward(*args, **kwargs)
        if self.kind != "forward":
            raise ReplayError(
                "this embedded program was exported with its loss function: call program_loss(model, batch) "
                "(replay does, in mode loss_fn); a forward-only or cotangent replay needs --model-factory"
            )
        leaves = _match_inputs(self.program_meta["inputs"], (tuple(args), dict(kwargs)), "the forward call")
        outs = _run_root(self, leaves, direct=True)
        return _rebuild_outputs(self.program_meta["outputs"], list(outs))

    def program_loss(self, batch: Any) -> torch.Tensor:
        """The recorded ``loss_fn(model, batch)`` on this model (kind ``"loss"``): a scalar tensor."""
        if self.kind != "loss":
            raise ReplayError("this embedded program holds only the model's forward; pass the loss function (--loss-fn) or replay without one")
        leaves = _match_inputs(self.program_meta["inputs"], batch, "the batch")
        loss = _run_root(self, leaves, direct=False)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            what = f"a {loss.dtype} tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ReplayError(f"the embedded program's loss function returned {what}, expected a floating scalar: the program is "
                              "damaged; replay with your own model code: model_factory='module:function'"
                              ).with_cli_fix("model_factory='module:function'", "--model-factory module:function")
        return loss

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> "ProgramModel":
        # .to(device) / .double() may replace the root's own buffers (and, with
        # overwrite_module_params_on_conversion, parameters): the graph reads them from the inner module
        super()._apply(fn, *args, **kwargs)
        for name, b in self._buffers.items():
            self._inner._buffers[name] = b
        for name, p in self._parameters.items():
            self._inner._parameters[name] = p
        return self

    def train(self, mode: bool = True) -> "ProgramModel":
        if any((name in self._training_fqns) != mode for name, _ in self.named_modules()):
            logger.info("nanreplay: the embedded program keeps its recorded training/eval behaviour; train(%s) only sets the flags", mode)
        return super().train(mode)


class _Runner(torch.fx.Interpreter):
    """Runs the export root's graph; its call of ``model`` goes to the :class:`ProgramModel`,
    outside the index guard where the model (or a module of it) is compiled: Dynamo does not
    trace under a dispatch mode, so the compiled code would run eagerly."""

    def __init__(self, pm: ProgramModel, direct: bool, guard: Any = None) -> None:
        super().__init__(pm._root, graph=pm._root.graph)
        self.pm, self.direct, self.guard = pm, direct, guard
        self.extra_traceback = False  # errors reach the user as one sentence (_run_root), never with the graph

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target != _CHILD:
            return super().call_module(target, args, kwargs)
        pm = self.pm
        with self.guard.suspended() if self.guard is not None and _compiled_inside(pm) else contextlib.nullcontext():
            if self.direct:  # the caller already went through pm.__call__ (hooks ran once)
                return pm._inner.forward(*args, **kwargs)
            prev = pm._internal
            object.__setattr__(pm, "_internal", True)
            try:
                return pm(*args, **kwargs)
            finally:
                object.__setattr__(pm, "_internal", prev)


def model_fqn(path: str) -> str:
    """A module path ``torch.export`` recorded inside the program (a node's ``nn_module_stack``:
    ``model.blocks.0``, from the export root) as the model's own FQN (``blocks.0``; ``""`` for
    the model itself)."""
    parts = path.split(".") if path else []
    return ".".join(parts[1:] if parts and parts[0] == _CHILD else parts)


def _compiled_inside(pm: ProgramModel) -> bool:
    """Whether the program's model runs compiled: the model's forward replaced by a compiled one
    (:mod:`nanreplay.engine.compiled` compiles ``pm._inner.forward``), or a module of it compiled
    as ``module.compile()`` does (``_compiled_call_impl``)."""
    mods = [pm, pm._inner, *pm.modules()]
    return any("forward" in m.__dict__ or m.__dict__.get("_compiled_call_impl") is not None for m in mods)


def _run_root(pm: ProgramModel, leaves: list, *, direct: bool) -> Any:
    """Run the program; a failure inside it (a damaged program that passed the checks, an operator
    that behaves differently in this torch) is a :class:`ReplayError` (CLI exit 5), not a bug."""
    try:
        return _run_root_unchecked(pm, leaves, direct=direct)
    except NanReplayError:
        raise
    except Exception as e:
        raise ReplayError(
            f"the embedded program failed while running ({_first_line(e)}): it is damaged or does not run under torch "
            f"{torch.__version__} (exported under torch {pm.program_meta.get('torch')}); replay with your own model code: "
            "model_factory='module:function'"
        ).with_cli_fix("model_factory='module:function'", "--model-factory module:function") from e


def _run_root_unchecked(pm: ProgramModel, leaves: list, *, direct: bool) -> Any:
    # preserve_node_meta: each node's recorded stack_trace is the current meta while it runs, so the
    # op monitor can name the user's source line of a birth in the program. An untrusted program is
    # proven in bounds on these inputs first (engine.bounds; eagerly, also under torch.compile) and
    # runs under the index guard (engine.guards; a dispatch mode, which Dynamo does not trace)
    bounds: Optional[_Bounds] = getattr(pm._root, "_nanreplay_bounds", None)
    guard: Any = contextlib.nullcontext()
    if bounds is not None:
        _prove(bounds, pm, leaves)
        if not torch.compiler.is_compiling():
            from .guards import IndexGuard

            guard = IndexGuard()
    with torch.fx.traceback.preserve_node_meta(), guard as active:
        out = _Runner(pm, direct, active).run(*leaves, enable_io_processing=False)
    spec = pm._root.module_call_graph[0].signature.out_spec
    return pytree.tree_unflatten(list(out), spec)


class _Bounds:
    """An untrusted program's flat graph (``ExportedProgram.graph_module``: its placeholders are
    the weights, buffers and constants, then the call's inputs, in ``input_specs`` order) and the
    calls already proven (:func:`_prove`), by the geometry of every tensor and the grad mode and
    autocast they ran under."""

    _KEEP = 16  # proven call shapes remembered (a bisect replays subsets of the batch)

    def __init__(self, ep: Any) -> None:
        self.gm = ep.graph_module
        self.specs = [(spec.kind.name, spec.target) for spec in ep.graph_signature.input_specs]
        self.proven: dict[tuple, Any] = {}


def _state_tensor(pm: ProgramModel, target: str) -> torch.Tensor:
    """The program's live weight, buffer or constant ``target`` (an FQN under the export root):
    the tensor a call reads now (after ``.to()``, ``.double()`` or a state load)."""
    obj: Any = pm._root
    for part in target.split("."):
        nxt = getattr(obj, part, None)
        if nxt is None and obj is pm:
            nxt = getattr(pm._inner, part, None)
        if nxt is None:
            raise ReplayError(f"the embedded program reads {target!r}, which its rebuilt model lacks; replay with --model-factory")
        obj = nxt
    if not isinstance(obj, torch.Tensor):
        raise ReplayError(f"the embedded program reads {target!r}, a {type(obj).__name__}, where it expects a tensor; replay with --model-factory")
    return obj


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes(), t.requires_grad)


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


_KINDS = {"PARAMETER": "parameter", "BUFFER": "buffer", "CONSTANT_TENSOR": "constant"}


def _bounds_inputs(bounds: _Bounds, pm: ProgramModel, leaves: list) -> tuple[list, list, list, list]:
    """What :func:`~nanreplay.engine.bounds.verify_bounds` takes for a call on ``leaves``: the
    real tensor of every placeholder, what each is (for messages), the positions of the buffers
    (writable) and of the call's inputs."""
    inputs: list[torch.Tensor] = []
    names: list[str] = []
    writable: list[int] = []
    user: list[int] = []
    it = iter(leaves)
    for kind, target in bounds.specs:
        if kind == "USER_INPUT":
            x = next(it)
            names.append(f"the call's input {len(user)} (a {_dtype_name(x.dtype)} {list(x.shape)} tensor)")
            user.append(len(inputs))
        elif kind in _KINDS:
            x = _state_tensor(pm, target)
            shown = target[len(_CHILD) + 1:] if target.startswith(_CHILD + ".") else target
            names.append(f"the {_KINDS[kind]} {shown!r}")
            if kind == "BUFFER":
                writable.append(len(inputs))
        else:
            raise ReplayError(f"the embedded program takes an input of kind {kind}, which nanreplay does not replay; replay with --model-factory")
        inputs.append(x)
    return inputs, names, writable, user


def _prove(bounds: _Bounds, pm: ProgramModel, leaves: list) -> Any:
    """Prove the program in bounds on this call's real tensors (:func:`nanreplay.engine.bounds.verify_bounds`),
    once per geometry of the tensors, grad mode and autocast; returns the
    :class:`~nanreplay.engine.bounds.Proof`. Under ``torch.compile`` it runs eagerly (a graph
    break), on the real tensors."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_prove)(bounds, pm, leaves)
    from .bounds import verify_bounds

    inputs, names, writable, user = _bounds_inputs(bounds, pm, leaves)
    key = (tuple(_geometry(x) for x in inputs), torch.is_grad_enabled(), _autocast_state())
    proof = bounds.proven.get(key)
    if proof is None:
        proof = verify_bounds(bounds.gm, inputs, names=names, writable=writable, user=user)
        logger.debug("nanreplay: proved the embedded program in bounds: %s", proof)
        if len(bounds.proven) >= bounds._KEEP:
            bounds.proven.pop(next(iter(bounds.proven)))
        bounds.proven[key] = proof
    return proof


def _match_inputs(info: dict, tree: Any, what: str) -> list:
    """The tensor leaves of ``tree`` after checking it against the recorded inputs."""
    leaves, spec = flatten_typed(tree)
    if len(leaves) != info["n"]:
        raise ReplayError(f"{what} has {len(leaves)} leaves; the embedded program was exported for {info['n']}: pass inputs of the recorded structure")
    if pytree.treespec_dumps(spec) != info["spec"]:
        logger.debug("%s: tree spec differs from the exported one (a dataclass read back as a dict?); the leaves match", what)
    tensors = []
    metas = iter(info.get("tensor_meta", []))
    for i, leaf in enumerate(leaves):
        rec = info["values"].get(str(i))
        if rec is not None:
            want = decode_value(rec)
            same = leaf == want or (isinstance(leaf, float) and isinstance(want, float) and math.isnan(leaf) and math.isnan(want))
            if isinstance(leaf, torch.Tensor) or not same:
                raise ReplayError(f"{what}: leaf {i} is {leaf!r}; the embedded program was exported with the constant {want!r}")
            continue
        if not isinstance(leaf, torch.Tensor):
            raise ReplayError(f"{what}: leaf {i} is a {type(leaf).__name__}; the embedded program expects a tensor there")
        m = next(metas, None)
        if m is not None:
            shape_ok = len(m["shape"]) == leaf.dim() and all(s is None or s == d for s, d in zip(m["shape"], leaf.shape))
            dtype_ok = _dtype_name(leaf.dtype) == m["dtype"] or (_WIDENED.get() and _widened(m["dtype"]) == _dtype_name(leaf.dtype))
            if not dtype_ok or not shape_ok:
                raise ReplayError(
                    f"{what}: tensor leaf {i} is {_dtype_name(leaf.dtype)} {list(leaf.shape)}; the embedded program expects "
                    f"{m['dtype']} {['*' if s is None else s for s in m['shape']]} ('*': any size)"
                )
        tensors.append(leaf)
    return tensors


def program_accepts(meta: dict, tree: Any) -> bool:
    """Whether a program record (:attr:`ProgramCapture.meta`) takes ``tree`` (a batch for kind
    ``"loss"``, ``(args, kwargs)`` for ``"forward"``): the same structure and non-tensor values,
    and tensors of the recorded dtypes and shapes (a dimension exported as dynamic may differ).
    Reads no tensor data."""
    try:
        _match_inputs(meta["inputs"], tree, "the inputs")
    except (ReplayError, KeyError, TypeError):
        return False
    return True


#: set by :func:`widened_inputs`: floating inputs may come in float64 / complex128
_WIDENED: contextvars.ContextVar[bool] = contextvars.ContextVar("nanreplay_program_widened", default=False)


def _widened(dtype: str) -> str:
    return {"float16": "float64", "bfloat16": "float64", "float32": "float64", "complex64": "complex128"}.get(dtype, dtype)


@contextlib.contextmanager
def widened_inputs() -> Iterator[None]:
    """Within the block, a program accepts its floating inputs in float64 (complex128) instead
    of the recorded dtype: the float64 counterfactual replay (:mod:`nanreplay.engine.counterfactual`)."""
    token = _WIDENED.set(True)
    try:
        yield
    finally:
        _WIDENED.reset(token)


_STANDINS: dict[tuple, type] = {}


def _standin(type_path: str, kind: str, names: list[str]) -> type:
    """A class named like the recorded output type (``module:QualName``), with its fields, so the
    output tree flattens exactly as the recorded one and a loss function can use ``out.loss``."""
    key = (type_path, kind, tuple(names))
    cls = _STANDINS.get(key)
    if cls is not None:
        return cls
    module, _, qual = type_path.partition(":")
    short = qual.rsplit(".", 1)[-1] or "Output"
    if kind == "namedtuple":
        cls = namedtuple(short, names)  # type: ignore[misc]
    else:
        def getitem(self: Any, k: Any) -> Any:
            if isinstance(k, str):
                return getattr(self, k)
            return tuple(v for v in (getattr(self, n) for n in names) if v is not None)[k]

        cls = dataclasses.make_dataclass(short, [(n, Any, None) for n in names], namespace={"__getitem__": getitem})
    cls.__module__, cls.__qualname__ = module, qual
    _STANDINS[key] = cls
    return cls


def _materialise(tree: Any) -> Any:
    if isinstance(tree, TypedNode):
        fields = {k: _materialise(v) for k, v in tree.fields.items()}
        cls = _standin(tree.type_path, tree.kind, list(fields))
        return cls(*fields.values()) if tree.kind == "namedtuple" else cls(**fields)
    if type(tree) in (list, tuple):
        return type(tree)(_materialise(v) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _materialise(v)) for k, v in tree.items())
    return tree


def _rebuild_outputs(info: dict, tensors: list) -> Any:
    leaves: list[Any] = [None] * info["n"]
    for i, rec in info["values"].items():
        leaves[int(i)] = decode_value(rec)
    for i, t in zip(info["tensors"], tensors):
        leaves[i] = t
    return _materialise(unflatten_batch(leaves, info["spec"], keep_typed=True))


_RELABELLED: dict[tuple, type] = {}


def _relabel(mod: torch.nn.Module, name: str) -> None:
    """Give an ``InterpreterModule`` (or the :class:`ProgramModel`) its original class name
    (reports name ``Linear``, not ``InterpreterModule``); the behaviour is unchanged (a subclass
    with no new members)."""
    base = type(mod)
    if not name or base.__name__ == name:
        return
    cls = _RELABELLED.get((base, name))
    if cls is None:
        cls = type(name, (base,), {"__module__": __name__, "__qualname__": name})
        _RELABELLED[(base, name)] = cls
    mod.__class__ = cls


def _check_meta(meta: Any) -> None:
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ReplayError(f"expected an embedded program record ({_FORMAT!r}), found {type(meta).__name__}; the bundle holds no usable program")
    if meta.get("version") != _VERSION:
        raise ReplayError(f"the embedded program has format version {meta.get('version')}, this nanreplay reads {_VERSION}: upgrade nanreplay")
    if meta.get("kind") not in ("forward", "loss"):
        raise ReplayError(f"the embedded program's kind is {meta.get('kind')!r}, expected 'forward' or 'loss'")
    try:  # a bundle's record was checked at open; a record handed in directly is checked here
        validate_program_record(meta, lambda key: (None, ()), where="program")
    except MetaError as e:
        raise ReplayError(f"invalid embedded program record: expected {e.expected} at {e.where}, found {e.found}") from None
    from torch._export.serde.schema import SCHEMA_VERSION

    schema = meta.get("schema") or [None]
    if schema[0] != SCHEMA_VERSION[0]:
        raise ReplayError(
            f"the embedded program was serialized by torch {meta.get('torch')} (export schema {schema}); torch {torch.__version__} "
            f"here reads schema {list(SCHEMA_VERSION)}: replay with that torch version, or with --model-factory"
        )


def load_program(meta: dict, get_tensor: Callable[[str], torch.Tensor], *, device: Any = None, trusted: bool = False) -> ProgramModel:
    """Rebuild the model from an embedded program record (:attr:`ProgramCapture.meta`).

    Args:
        meta: the JSON record.
        get_tensor: ``get_tensor(key) -> Tensor`` for the keys the record names (a bundle's
            ``Bundle.tensor``, or the capture's ``tensors`` dict).
        device: where to put the tensors; device constants in the graph (``torch.arange(...,
            device=...)``) are rewritten to its type when it differs from the recorded one.
            Default: the tensors' own device (the CPU for a bundle).
        trusted: the program comes from a trusted bundle or this process's own export. An
            untrusted one (the default) is proven in bounds on fake tensors before each call
            on inputs of a new shape (:mod:`nanreplay.engine.bounds`, a few milliseconds per
            hundred ops, once per shape) and runs under the index guard
            (:mod:`nanreplay.engine.guards`); a trusted one runs bare.

    Returns:
        a :class:`ProgramModel` (FQNs, parameters, buffers as recorded; weights as stored).

    Raises:
        ReplayError: not a program record, another format or export schema version, an
            operator that is not a torch operator, or a program torch cannot deserialize here;
            any other exception of the checks, the deserializer or ``unflatten`` on the record
            becomes one too (a damaged or hostile record is exit 5 with one sentence, never a
            traceback), and torch's own log output is held back meanwhile. On a call of an
            untrusted program: ``ProgramRefused`` (a ``ReplayError``), an op out of bounds, over its
            budget, writing into a tensor it did not create, or indexing out of range.
        BundleFormatError: a tensor the record names cannot be read; metadata that contradicts
            the program's own ops (on a call of an untrusted program).
    """
    try:
        with quiet_loggers(("torch",)):
            root, inner = _load(meta, get_tensor, device, keep_graph=not trusted)
            names = meta.get("modules", {})
            for fqn, mod in inner.named_modules():
                if fqn:
                    _relabel(mod, names.get(fqn, ""))
            pm = ProgramModel(root, inner, meta)
            _relabel(pm, names.get("", ""))
    except NanReplayError:
        raise
    except Exception as e:  # noqa: BLE001 - a record torch's code trips over: the bundle's fault, said in one sentence
        raise ReplayError(f"the embedded program could not be loaded ({_first_line(e)}): a damaged or hostile record; "
                          "replay with --model-factory") from None
    return pm


def _load(meta: dict, get_tensor: Callable[[str], torch.Tensor], device: Any, *, keep_graph: bool = False
          ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unflattened export root, its ``model`` child) of a program record; with ``keep_graph``
    the root keeps the flat graph the verifier runs (``_nanreplay_bounds``)."""
    _check_meta(meta)
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer

    dev = torch.device(device) if device is not None else None
    objs: dict[str, torch.Tensor] = {}
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    for name, ent in meta["state"].items():
        key = ent["key"]
        if key not in objs:
            t = get_tensor(key).detach()
            if dev is not None:
                t = t.to(dev)
            objs[key] = torch.nn.Parameter(t, requires_grad=bool(ent.get("requires_grad"))) if ent["kind"] == "parameter" else t
        (constants if ent["store"] == "constants" else state_dict)[name] = objs[key]
    check_program(meta["program"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            serialized = _schema_object(schema.ExportedProgram, meta["program"])
            ep = ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)
            _check_graph(ep.graph_module)
            if dev is not None and torch.device(meta.get("device", "cpu")).type != dev.type:
                _retarget_devices(ep.graph_module, dev)
            _drop_metadata_asserts(ep.graph_module)
            _inline_regions(ep.graph_module)  # autocast / no_grad blocks: their bodies, for unflatten to see the modules
            root = torch.export.unflatten(ep)
            _drop_metadata_asserts(root)
    except ReplayError:
        raise
    except Exception as e:
        raise ReplayError(
            f"the embedded program (torch {meta.get('torch')}) could not be loaded by torch {torch.__version__}: "
            f"{_first_line(e)}; replay with --model-factory"
        ) from e
    if keep_graph:  # what the verifier runs before each new shape of call (_prove)
        object.__setattr__(root, "_nanreplay_bounds", _Bounds(ep))
    calls = [n.target for n in root.graph.nodes if n.op == "call_module"]
    if calls.count(_CHILD) != 1 or any(c != _CHILD and not c.startswith(_CHILD + ".") for c in calls):
        raise _ModelCalls([c for c in calls if c == _CHILD])
    return root, root.get_submodule(_CHILD)


def _schema_object(cls: Any, data: Any) -> Any:
    """The JSON of an export schema object as the schema's dataclasses
    (``torch/_export/serde/schema.py``), the objects ``ExportedProgramDeserializer`` reads. The
    same conversion as torch's private ``serialize._dict_to_dataclass`` (fields the dataclass does
    not define are ignored, unions hold one member, ``Optional`` may be ``None``), with each
    class's type hints resolved once instead of at every object: 0.25 -> 0.05 s for a 42M GPT's
    program (``typing.get_type_hints`` was four fifths of it). The record was checked by
    :func:`~nanreplay.engine.program_check.check_program` before; a malformed one raises
    ``TypeError``/``KeyError``/``ValueError``, which :func:`_load` reports as a program that cannot
    be loaded."""
    import types
    import typing

    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    if isinstance(cls, typing.ForwardRef):
        cls = cls.__forward_arg__
    if isinstance(cls, str):
        cls = getattr(schema, cls)
    origin = typing.get_origin(cls)
    if origin is typing.Annotated:
        return _schema_object(cls.__origin__, data)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
        return None if data is None else _schema_object(typing.get_args(cls)[0], data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        if not isinstance(data, dict) or len(data) != 1:
            raise ValueError(f"a {cls.__name__} holds exactly one member, found {data!r:.80}")
        (name, value), = data.items()
        return cls.create(**{name: _schema_object(_schema_hints(cls)[name], value)})
    if dataclasses.is_dataclass(cls):
        return cls(**{name: _schema_object(hint, data[name]) for name, hint in _schema_fields(cls) if name in data})
    if isinstance(data, list):
        return [_schema_object(typing.get_args(cls)[0], d) for d in data] if data else data
    if isinstance(data, dict):
        return {k: _schema_object(typing.get_args(cls)[1], v) for k, v in data.items()}
    return float(data) if cls is float else data


@functools.lru_cache(maxsize=None)
def _schema_hints(cls: type) -> dict:
    import typing

    from torch._export.serde import schema

    return typing.get_type_hints(cls, globalns=vars(schema))


@functools.lru_cache(maxsize=None)
def _schema_fields(cls: type) -> tuple:
    hints = _schema_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _retarget_devices(gm: torch.fx.GraphModule, dev: torch.device) -> None:
    def fix(a: Any) -> Any:
        return dev if isinstance(a, torch.device) and a.type != dev.type else a

    for mod in gm.modules():
        graph = getattr(mod, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                node.args = torch.fx.node.map_aggregate(node.args, fix)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)


def program_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss function of a program exported with its loss (kind ``"loss"``), in the
    ``loss_fn(model, batch)`` form replay takes. ``model`` must be the :class:`ProgramModel`.

    Raises:
        TypeError: ``model`` is not a ProgramModel.
    """
    if not isinstance(model, ProgramModel):
        raise TypeError(f"program_loss runs an embedded program's loss; expected the ProgramModel from load_program, got {type(model).__name__}")
    return model.program_loss(batch)


# -- the two ends the recorder and replay need -------------------------------------------------

def program_content(
    model: torch.nn.Module,
    record: Any,
    loss_fn: Optional[Callable] = None,
    *,
    param_prefix: Optional[str] = "state/params/",
    buffer_prefix: Optional[str] = "state/buffers/",
    dynamic: Optional[bool] = None,
    verify: bool = True,
) -> tuple[Optional[dict], dict[str, torch.Tensor]]:
    """What a bundle stores for the failing step ``record`` (a
    :class:`~nanreplay.format.records.StepRecord`): ``(meta, tensors)``, to put under
    ``meta[PROGRAM_META_KEY]`` and into the tensor dict. With ``loss_fn`` and a recorded batch,
    the loss function is exported with the forward on the first batch; if that fails (or there
    is no batch), the forward alone on the first recorded forward call. When both fail ``meta``
    is ``{"error": "...", "kind": null}`` (JSON, so the bundle says why) and ``tensors`` is empty.

    Parameters and buffers are not stored twice: the program refers to
    ``{param_prefix}{fqn}`` / ``{buffer_prefix}{fqn}``, the keys where the bundle holds the
    pre-step weights and step-start buffers (``None``: store them under ``program/``).
    ``dynamic=None`` exports with every dimension dynamic when the step's micro-batches (or
    forward calls) differ in tensor shapes, so that each of them replays, and else with only the
    batch dimension dynamic (:mod:`nanreplay.core.batch`), so that subsets of the batch replay
    (per-sample replays, ``bisect --over samples``); see :func:`export_program`. Call it with the pre-step weights in the model and the Recorder's
    hooks quiet (export runs module hooks with fake tensors). ``verify``: load the program once
    to prove it loads (:func:`export_program`); ``False`` when the caller replays it next anyway
    (:func:`nanreplay.engine.verify.verify_program` loads it), which saves one load.
    """
    shared: dict[int, str] = {}
    if param_prefix is not None:
        shared.update({id(p): f"{param_prefix}{n}" for n, p in model.named_parameters()})
    if buffer_prefix is not None:
        shared.update({id(b): f"{buffer_prefix}{n}" for n, b in model.named_buffers()})
    errors = []
    if loss_fn is not None and record.batches:
        dyn = (True if _shapes_vary(record.batches) else "batch") if dynamic is None else dynamic
        cap = export_program(model, loss_fn=loss_fn, batch=record.batches[0], shared=shared, dynamic=dyn, verify=verify)
        if cap.ok:
            return cap.meta, cap.tensors
        errors.append(f"forward+loss: {cap.error}")
    if record.forwards:
        args, kwargs = record.forwards[0].inputs
        dyn = (True if _shapes_vary([fw.inputs for fw in record.forwards]) else "batch") if dynamic is None else dynamic
        cap = export_program(model, args, kwargs, shared=shared, dynamic=dyn, verify=verify)
        if cap.ok:
            if errors:
                cap.meta["loss_error"] = errors[0]
            return cap.meta, cap.tensors
        errors.append(f"forward: {cap.error}")
    else:
        errors.append("no forward call of the model was recorded in the step")
    return {"format": _FORMAT, "version": _VERSION, "kind": None, "error": "; ".join(errors)}, {}


def _shapes_vary(trees: list) -> bool:
    shapes = {tuple(tuple(t.shape) for t in flatten_typed(tree)[0] if isinstance(t, torch.Tensor)) for tree in trees}
    return len(shapes) > 1


def build_from_program(bundle: Any, *, device: Any = None) -> tuple[ProgramModel, Optional[Callable]]:
    """The model (and loss function) of a bundle's embedded program: ``(model, loss_fn)`` with
    ``loss_fn`` :func:`program_loss` for a program exported with its loss, else ``None``.
    Weights are the stored ones (the pre-step weights when shared with ``state/params``).

    Raises:
        ReplayError: the bundle holds no program (the message gives the recorded export
            error), or it cannot be loaded here.
    """
    meta = bundle.meta.get(PROGRAM_META_KEY)
    if not meta:
        raise ReplayError(f"{bundle.path} holds no embedded program; pass --model-factory module:function")
    if meta.get("error") and meta.get("kind") is None:
        raise ReplayError(f"{bundle.path} holds no embedded program: its export failed when recording ({meta['error']}); pass --model-factory module:function")
    _check_declared_inputs(bundle, meta)
    model = load_program(meta, bundle.tensor, device=device, trusted=bool(getattr(bundle, "trusted", False)))
    return model, (program_loss if model.kind == "loss" else None)


def _check_declared_inputs(bundle: Any, meta: dict) -> None:
    """The program's declared inputs (``inputs.tensor_meta``: dtypes and shapes) against the call
    it was exported from, the failing step's first batch (kind ``"loss"``) or first forward call
    (``"forward"``), read as shapes only: a difference is a damaged bundle.

    Raises:
        BundleFormatError: a leaf count, constant, dtype or fixed size differs.
    """
    batches, forwards = bundle.input_shapes(bundle.failing_step)
    calls = batches if meta.get("kind") == "loss" else forwards
    if not calls:
        return
    try:
        _match_inputs(meta["inputs"], calls[0], "the recorded call")
    except ReplayError as e:
        raise BundleFormatError(
            f"{bundle.path}: the embedded program's declared inputs (meta.program.inputs) do not match the step it was exported from: "
            f"{e}; the bundle was hand-edited or damaged: record it again"
        ) from None

