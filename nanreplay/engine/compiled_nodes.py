"""Where inside a compiled region a non-finite value is born: the FX node, its aten op, the user's
source line and the samples, found on the graphs the compiler ran.

A compiled replay runs the step as one opaque kernel sequence, so the op monitor sees nothing of it.
Two searches look inside, on the AOT graphs (the aten-level forward, backward or inference graphs
AOTAutograd hands a compiler; every node keeps the user's ``stack_trace``, ``nn_module_stack`` and,
after a decomposition, ``original_aten``):

* **Graph capture** (:func:`first_birth`): the graphs are captured by an ``aot_autograd`` backend
  whose compilers record each graph and the real inputs of its first call and run it eagerly
  (:class:`GraphCapture`: ``aot_eager``'s pipeline, or ``aot_eager_decomp_partition``'s, which adds
  inductor's decompositions and partitioner). Running a captured graph node by node
  (``torch.fx.Interpreter``) names the first node whose output is non-finite while its operands
  are finite: the birth, in eager kernels, of what the capture changed (a decomposition, a
  functionalized op, a branch taken only while tracing).
* **Code generation** (:func:`bisect_kernels`): the graphs inductor receives run eagerly are
  finite, inductor's kernels are not. Each captured graph, in execution order, is compiled alone
  on its recorded inputs (``torch._inductor.compile_fx.compile_fx`` with the recorded options)
  until one gives a non-finite output where its eager run is finite; then prefixes of that graph
  (its first k nodes, every value used after them made an output) are compiled and compared with
  the same prefix run eagerly, bisecting k: the first node whose compiled value is non-finite
  where its eager value is finite is the culprit, with its operands' compiled and eager values at
  the first such position. About ``log2(nodes)`` compilations; the prefixes keep the fusion of
  the culprit with what feeds it (cutting after a node can only add a store).

Both answer with :func:`node_facts`: the aten op (``rsqrt``), the op before decomposition, the
module (FQN from ``nn_module_stack``), the source frame, and the non-finite rows of the culprit's
output along the batch dimension (:func:`nanreplay.engine.probes.nonfinite_rows`). The idea is
that of torch's minifier and ``CompilerBisector`` (``torch/_inductor/compiler_bisector.py``),
which bisect the compiler's passes and lowerings of a whole program with a pass/fail function;
here the bisection is over the nodes of one captured graph, on the step's own values, so that the
answer is a node with its source line and samples.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..core.jsonable import fnum
from ..core.numerics import is_float
from .deadline import check_deadline, seconds_left
from .probes import nonfinite_rows, user_frame_of_traceback

logger = logging.getLogger(__name__)

__all__ = ["GraphCapture", "CapturedGraph", "OutOfTime", "first_birth", "bisect_kernels", "inductor_graph_compiler", "node_facts"]

#: values of a culprit's operands reported at its first non-finite position, at most
MAX_OPERANDS = 4

#: calls of one captured graph whose arguments are kept (a step of several micro-batches calls
#: each graph once per micro-batch; their arguments stay alive until the search ends)
MAX_CALLS = 8


@dataclasses.dataclass
class CapturedGraph:
    """One AOT graph a compiled replay ran: ``kind`` (``"forward"``, ``"backward"``,
    ``"inference"``), the graph, and the arguments of its first :data:`MAX_CALLS` calls (one per
    micro-batch; tensors detached, those the graph writes into cloned first)."""

    kind: str
    gm: torch.fx.GraphModule
    calls: list[list] = dataclasses.field(default_factory=list)
    relabel: Optional[Callable[[str], str]] = None


class GraphCapture:
    """An ``aot_autograd`` backend for ``torch.compile`` that records the graphs it is given and
    runs them eagerly. ``backend(decompose=False)`` is ``aot_eager``'s pipeline (min-cut
    partitioner, inference input mutations kept); ``decompose=True`` is
    ``aot_eager_decomp_partition``'s (inductor's decomposition table and partitioner): the graphs
    inductor would receive, run with eager kernels. ``graphs`` lists them in the order they were
    compiled (the forward before its backward). ``relabel`` reads a module path that
    ``torch.export`` recorded (an embedded program's nodes keep it: paths from the export root)
    as the replayed model's FQN."""

    def __init__(self, relabel: Optional[Callable[[str], str]] = None) -> None:
        self.graphs: list[CapturedGraph] = []
        self.relabel = relabel

    def _compiler(self, kind: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            entry = CapturedGraph(kind, gm, relabel=self.relabel)
            self.graphs.append(entry)
            written = _written_inputs(gm)

            def run(args: list) -> Any:
                if len(entry.calls) < MAX_CALLS:
                    entry.calls.append([(a.detach().clone() if i in written else a.detach()) if isinstance(a, torch.Tensor) else a
                                        for i, a in enumerate(args)])
                return torch.fx.Interpreter(gm).boxed_run(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    def backend(self, *, decompose: bool) -> Callable:
        """The ``torch.compile`` backend (a callable ``(gm, example_inputs) -> compiled``)."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if not decompose:
            return aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"),
                                inference_compiler=self._compiler("inference"), partition_fn=min_cut_rematerialization_partition,
                                keep_inference_input_mutations=True)

        def decomposed(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            from torch._functorch import config as functorch_config
            from torch._inductor.compile_fx import select_decomp_table

            with functorch_config.patch(unlift_effect_tokens=True):
                return aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"),
                                    inference_compiler=self._compiler("inference"), decompositions=select_decomp_table(),
                                    partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))(gm, example_inputs)

        return decomposed


def _written_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the placeholders the graph writes into (``copy_`` of a mutated input, e.g. a
    BatchNorm running statistic): their recorded value must be a copy taken before the call."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(places)}
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            out.update(pos[a] for a in n.args if isinstance(a, torch.fx.Node) and a in pos)
    return out


def _fresh(args: Sequence[Any]) -> list:
    """A copy of a graph's recorded arguments for one more run (a run may write into them)."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _bad(t: Any) -> Optional[torch.Tensor]:
    """The non-finite mask of a floating tensor, ``None`` for anything else."""
    return ~torch.isfinite(t) if isinstance(t, torch.Tensor) and is_float(t) and t.numel() else None


def _finite(values: Sequence[Any]) -> bool:
    return all(m is None or not bool(m.any()) for m in map(_bad, values))


class _Births(torch.fx.Interpreter):
    """Runs a graph and keeps the first ``call_function`` node whose output is non-finite while
    every tensor it reads is finite (a birth, as the op monitor defines it for eager ops)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.found: Optional[tuple[torch.fx.Node, Any, list]] = None

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if self.found is None and n.op == "call_function":
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if not _finite(outs):
                operands = [self.env[a] for a in n.all_input_nodes if a in self.env]
                if _finite(operands):
                    self.found = (n, outs, [(a, self.env[a]) for a in n.all_input_nodes if a in self.env])
        return out


def first_birth(graphs: Sequence[CapturedGraph], batch: Optional[int]) -> Optional[dict]:
    """The first node, over ``graphs`` in execution order (each over its calls: one per
    micro-batch), whose eager output is non-finite from finite operands: :func:`node_facts` plus
    ``graph`` (its kind), ``call`` (which call) and ``operands`` (their values at its first
    non-finite element); ``None`` when every captured graph runs finite."""
    for g in graphs:
        for i, args in enumerate(g.calls):
            check_deadline()
            run = _Births(g.gm)
            with torch.no_grad():
                run.run(*_fresh(args))
            if run.found is not None:
                node, outs, operands = run.found
                value = next((o for o in outs if _bad(o) is not None and bool(_bad(o).any())), outs[0])
                facts = node_facts(node, value, batch, g.kind, relabel=g.relabel)
                facts["operands"] = _operand_values(operands, value, _first_bad(value))
                return dict(facts, graph=g.kind, call=i, calls=len(g.calls))
    return None


def _first_bad(t: Any) -> Optional[tuple]:
    """The index of the first non-finite element of ``t`` (``None`` when there is none)."""
    bad = _bad(t)
    return tuple(int(x) for x in bad.nonzero()[0]) if bad is not None and bool(bad.any()) else None


# -- bisecting inductor's kernels ------------------------------------------------------------------

def inductor_graph_compiler(config: dict) -> Callable[[torch.fx.GraphModule, list], Callable]:
    """``compile(gm, args) -> callable`` with inductor (``compile_fx``) under the recorded
    ``config`` patches (a mode's options and the user's), on a copy of ``gm``, for inference."""

    def compile_graph(gm: torch.fx.GraphModule, args: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with torch.no_grad():
            return compile_fx(copy.deepcopy(gm), _fresh(args), config_patches=dict(config))

    return compile_graph


def _candidates(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes a bisection visits: ``call_function`` nodes with a floating tensor output."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            out.append(n)
    return out


def _prefix(gm: torch.fx.GraphModule, last: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """The graph's nodes up to ``last`` (placeholders kept, so it takes the same arguments), with
    every value used after ``last`` and ``last``'s own operands as its outputs."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    keep = nodes[:nodes.index(last) + 1]
    kept = set(keep)
    outs = [n for n in keep if n.op == "call_function" and (n is last or any(u not in kept for u in n.users))]
    outs += [a for a in last.all_input_nodes if a.op == "call_function" and a not in outs]
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in keep:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in outs))
    sub = torch.fx.GraphModule(gm, g)
    sub.graph.eliminate_dead_code()
    sub.recompile()
    return sub, outs


@dataclasses.dataclass
class _Cut:
    """A prefix compiled and run eagerly, ending at node ``last``: its outputs' values both ways."""

    last: torch.fx.Node
    outs: list[torch.fx.Node]
    compiled: list[Any]
    eager: list[Any]

    def new_nonfinite(self) -> list[int]:
        """Positions of the outputs non-finite compiled where they are finite eagerly."""
        hits = []
        for i, (c, e) in enumerate(zip(self.compiled, self.eager)):
            bc, be = _bad(c), _bad(e)
            if bc is not None and be is not None and c.shape == e.shape and bool((bc & ~be).any()):
                hits.append(i)
        return hits


class OutOfTime(Exception):
    """The diagnosis' deadline would pass during the next compilation: the bisection stops with
    what it has (``lo``, ``hi``: the candidate nodes it narrowed the culprit to)."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class _Clock:
    """Compiles a prefix and runs it, but stops a bisection before a compilation that would run
    past the deadline (:func:`~nanreplay.engine.deadline.seconds_left`), judging by the longest
    one so far."""

    def __init__(self) -> None:
        self.longest = 0.0

    def compile(self, gm: torch.fx.GraphModule, args: list, last: torch.fx.Node, compile_graph: Callable,
                where: str) -> Callable[[list], "_Cut"]:
        """The prefix of ``gm`` ending at ``last``, compiled (``args`` its example inputs):
        ``run(call_args) -> _Cut``."""
        left = seconds_left()
        if left is not None and left < 2 * self.longest:
            raise OutOfTime(where)
        check_deadline()
        t0 = time.monotonic()
        sub, outs = _prefix(gm, last)
        fn = compile_graph(sub, args)
        self.longest = max(self.longest, time.monotonic() - t0)

        def run(call: list) -> _Cut:
            with torch.no_grad():
                return _Cut(last, outs, list(fn(*_fresh(call))), list(sub(*_fresh(call))))

        return run


def bisect_kernels(graphs: Sequence[CapturedGraph], compile_graph: Callable[[torch.fx.GraphModule, list], Callable],
                   batch: Optional[int]) -> tuple[Optional[dict], int]:
    """The first node whose compiled value is non-finite where its eager value is finite, over
    ``graphs`` in execution order (see the module docstring; each graph compiled once, run on
    each of its calls, one per micro-batch, and bisected on the first call that shows it):
    ``(facts, compilations)`` with :func:`node_facts`, ``graph``, ``call``, ``operands`` (each
    operand's compiled and eager value at the culprit's first non-finite position),
    ``eager_value`` and ``compiled_value``; ``(None, n)`` when no graph compiled alone gives a
    non-finite value its eager run does not.

    Raises:
        OutOfTime: the diagnosis' deadline would pass during the next compilation (judged by
            the longest so far); ``DiagnosisTimeout`` once it has passed."""
    compiles, clock = 0, _Clock()
    for g in graphs:
        cands = _candidates(g.gm)
        if not g.calls or not cands:
            continue
        found = None
        for i, shapes in _by_shape(g.calls):  # compiled once per set of shapes, run on each call of that shape
            whole = clock.compile(g.gm, g.calls[i[0]], cands[-1], compile_graph, f"before compiling the {g.kind} graph alone")
            compiles += 1
            found = next(((j, c) for j, c in ((j, whole(g.calls[j])) for j in i) if c.new_nonfinite()), None)
            if found is not None:
                break
        if found is None:
            continue
        call, at_hi = found
        args = g.calls[call]
        lo, hi = 0, len(cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            where = f"with the culprit among nodes {cands[lo].name} to {cands[hi].name} of the {g.kind} graph"
            c = clock.compile(g.gm, args, cands[mid], compile_graph, where)(args)
            compiles += 1
            if c.new_nonfinite():
                hi, at_hi = mid, c
            else:
                lo = mid + 1
        return dict(_culprit(cands[hi], at_hi, batch, g), call=call, calls=len(g.calls)), compiles
    return None, compiles


def _by_shape(calls: list[list]) -> list[tuple[list[int], tuple]]:
    """The calls grouped by their arguments' shapes (a graph compiled for one set of shapes runs
    only those): ``[(call indices, shapes), ...]`` in first-call order."""
    groups: dict[tuple, list[int]] = {}
    for i, args in enumerate(calls):
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        groups.setdefault(key, []).append(i)
    return [(ix, key) for key, ix in groups.items()]


def _culprit(node: torch.fx.Node, cut: _Cut, batch: Optional[int], g: CapturedGraph) -> dict:
    i = cut.outs.index(node)
    value, eager = cut.compiled[i], cut.eager[i]
    facts = node_facts(node, value, batch, g.kind, relabel=g.relabel)
    new = _bad(value) & ~_bad(eager)
    pos = tuple(int(x) for x in new.nonzero()[0]) if bool(new.any()) else None
    vals = {n: (c, e) for n, c, e in zip(cut.outs, cut.compiled, cut.eager)}
    facts["operands"] = _operand_values([(a, vals[a][0]) for a in node.all_input_nodes if a in vals], value, pos,
                                        eager={a: vals[a][1] for a in node.all_input_nodes if a in vals})
    facts.update(graph=g.kind, eager_value=_scalar(eager, pos), compiled_value=_scalar(value, pos))
    return facts


def _scalar(t: Any, pos: Optional[tuple]) -> Any:
    """``t[pos]`` as JSON writes a float (``"nan"``, ``"inf"`` for non-finite values), ``None``
    where ``pos`` is not an index of ``t``."""
    if not isinstance(t, torch.Tensor) or pos is None or t.dim() != len(pos):
        return None
    return fnum(float(t[pos]))


def _operand_values(operands: list[tuple[torch.fx.Node, Any]], out: Any, pos: Optional[tuple], eager: Optional[dict] = None) -> list[dict]:
    """Each floating operand of the culprit: its name and op, and its value at ``pos`` (the
    culprit's first non-finite position, broadcast back to the operand), compiled and eager."""
    rows = []
    for node, val in operands:
        if not (isinstance(val, torch.Tensor) and is_float(val)) or len(rows) >= MAX_OPERANDS:
            continue
        row: dict[str, Any] = {"node": node.name, "op": _op_name(node)}
        at = _broadcast_index(val, out, pos)
        row["compiled"] = _scalar(val, at)
        if eager is not None:
            row["eager"] = _scalar(eager.get(node), at)
        rows.append(row)
    return rows


def _broadcast_index(val: torch.Tensor, out: Any, pos: Optional[tuple]) -> Optional[tuple]:
    """``pos`` (an index of ``out``) as an index of ``val`` where ``val`` broadcasts to ``out``'s
    shape (size-1 dims read index 0); ``None`` where it does not."""
    if pos is None or not isinstance(out, torch.Tensor) or val.dim() > out.dim():
        return None
    lead = out.dim() - val.dim()
    idx = []
    for d, n in enumerate(val.shape):
        if n == out.shape[lead + d]:
            idx.append(pos[lead + d])
        elif n == 1:
            idx.append(0)
        else:
            return None
    return tuple(idx)


# -- what a node says of itself ------------------------------------------------------------------

def _op_name(node: torch.fx.Node) -> str:
    """The op's packet name as the op monitor names eager ops (``aten.rsqrt.default`` -> ``rsqrt``)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    return getattr(t, "__name__", str(t))


def _module_fqn(node: torch.fx.Node, prefix: str, forward: bool, relabel: Optional[Callable[[str], str]]) -> Optional[str]:
    """The FQN of the innermost module the node ran in, from its ``nn_module_stack`` (a backward
    node: its forward node's, ``fwd_nn_module_stack``). Dynamo's paths read
    ``L['self'].blocks.0.attn``, ``L['fn'].__self__.fc`` or ``L['self']._modules['fc']``, relative
    to the compiled module at ``prefix``; a path ``torch.export`` recorded (its types are names,
    not classes: a node of an embedded program) runs from the export root and is read by
    ``relabel``. A forward node without one ran in the compiled module's own code (``prefix``);
    a backward node without one: ``None``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return prefix if forward else None
    path, kind = list(stack.values())[-1][:2]
    path = re.sub(r"^L\[[^\]]*\]", "", str(path))
    path = re.sub(r"\._modules\[['\"]([^'\"]*)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]*)['\"]?\]", r".\1", path)
    fqn = ".".join(x for x in path.split(".") if x and x not in ("_orig_mod", "_inner", "__self__"))
    if isinstance(kind, str) and relabel is not None:
        fqn = relabel(fqn)
    return ".".join(x for x in (prefix, fqn) if x)


def node_facts(node: torch.fx.Node, value: Any, batch: Optional[int], kind: str, prefix: str = "",
               relabel: Optional[Callable[[str], str]] = None) -> dict:
    """What a graph node says of itself: ``{"node", "op", "aten", "original_op", "module",
    "source", "samples", "kinds"}``. ``op``: the op's name (``rsqrt``), ``aten`` its overload
    (``aten.rsqrt.default``), ``original_op`` the op before a decomposition made this node
    (``var_mean``, else ``None``); ``module``: the FQN of the module it ran in (under ``prefix``,
    the compiled submodule's FQN; ``kind`` the graph's, ``"backward"`` or not; ``relabel`` for
    paths ``torch.export`` recorded); ``source``: the user's frame (``{"file", "line", "function",
    "code"}``) from the node's ``stack_trace``; ``samples``: the non-finite rows of ``value``
    along its batch dimension (:func:`~nanreplay.engine.probes.nonfinite_rows`), ``None`` for a
    value with no dimension; ``kinds``: ``NaN``, ``+Inf``, ``-Inf`` in ``value``."""
    orig = node.meta.get("original_aten")
    orig_name = orig._opname if isinstance(orig, torch._ops.OpOverload) else None
    t = value if isinstance(value, torch.Tensor) else None
    return {
        "node": node.name,
        "op": _op_name(node),
        "aten": str(node.target),
        "original_op": orig_name if orig_name and orig_name != _op_name(node) else None,
        "module": _module_fqn(node, prefix, kind != "backward", relabel),
        "source": user_frame_of_traceback([node.meta["stack_trace"]]) if node.meta.get("stack_trace") else None,
        "samples": nonfinite_rows([t], batch) if t is not None and t.dim() >= 1 else None,
        "kinds": _kinds(t),
    }


def _kinds(t: Optional[torch.Tensor]) -> Optional[str]:
    if t is None or not is_float(t):
        return None
    found = [name for name, hit in (("NaN", torch.isnan(t).any()), ("+Inf", torch.isposinf(t).any()), ("-Inf", torch.isneginf(t).any()))
             if bool(hit)]
    return " and ".join(found) or None
