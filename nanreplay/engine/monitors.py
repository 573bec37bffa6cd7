"""The replay's monitors: what each module and each aten op did with non-finite values.

* :class:`OpMonitor`: a ``TorchDispatchMode`` that sees every aten op of the replayed step
  (forward, loss, backward kernels and the optimizer update), with
  ``torch.utils.module_tracker.ModuleTracker`` for the module context in both passes. For each
  op it keeps, per output tensor, a few *facts* (:class:`Facts`): whether it holds NaN or Inf,
  its provenance (which sources it derives from: batch leaves by path, weights, buffers by FQN,
  constants, RNG), the op that produced it, and its taint (the births its non-finite values come
  from). An op whose output holds a non-finite value its inputs do not explain is a *birth*: NaN
  in the output while no input holds NaN, or Inf while every input is finite (:func:`born`);
  the evidence is observed at that moment (:mod:`nanreplay.engine.probes`).
* :class:`ModuleMonitor`: module hooks record each module's output in forward completion order
  (finite or the NaN/Inf counts, and the largest finite magnitude), and in the backward pass the
  cotangent at each module's output and each parameter's gradient.

Both are lean on the common path: one ``aminmax`` reduction per floating output gives
finiteness and magnitude at once, and a tensor's flags are computed once and cached; the full
counts (:class:`~nanreplay.core.numerics.Health`) are computed only where a value is born. The
module monitor's own reductions run outside the replay's dispatch modes, so the op monitor sees
only the step's ops; and once the first birth is in the forward pass or the loss and reaches the
losses, the op monitor *settles* (:meth:`OpMonitor.settle`): the backward ops run unchecked,
since nothing they do can change the origin.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.module_tracker import ModuleTracker
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

from ..core.allowlist import Allowlist
from ..core.numerics import as_real, is_float, tensor_health
from ..core.tree import tensor_leaves
from . import probes
from .deadline import check_deadline

__all__ = ["born", "Facts", "Fact", "ModuleMonitor", "OpMonitor", "RootTracker", "flags_of", "LOSS_OPS"]

# ops whose output is uninitialised memory: never a birth, never checked
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "empty_permuted"})
# ops that draw from a random generator (besides any op whose schema takes a Generator)
_RANDOM = frozenset({"native_dropout", "bernoulli", "bernoulli_", "rand", "randn", "randint", "randperm", "normal", "normal_", "uniform_",
                     "multinomial", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "rand_like", "randn_like",
                     "randint_like", "poisson", "_fused_dropout", "_standard_gamma"})


#: aten loss kernels: loss code wherever it runs (a cross-entropy computed inside a model's forward,
#: HF-style, is the loss phase even when no loss module is left to see, as in an exported program)
LOSS_OPS = frozenset({
    "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd", "cross_entropy_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "ctc_loss", "soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss_forward", "poisson_nll_loss", "margin_ranking_loss", "hinge_embedding_loss",
    "cosine_embedding_loss", "triplet_margin_loss",
})


def born(in_nan: bool, in_nonfinite: bool, out_nan: bool, out_inf: bool) -> bool:
    """The producer rule: NaN in the output while no input holds NaN, or Inf (either sign) in the
    output while every input is finite."""
    return (out_nan and not in_nan) or (out_inf and not out_nan and not in_nonfinite)


def flags_of(t: torch.Tensor) -> tuple[bool, bool, float]:
    """``(has_nan, has_inf, absmax)`` of a tensor with one reduction and one host read: the
    largest magnitude is NaN when any element is NaN and Inf when any is infinite (``has_inf`` is
    only known when there is no NaN). Non-float tensors are finite; ``absmax`` is 0 for them."""
    if not is_float(t) or t.numel() == 0:
        return False, False, 0.0
    x = t.detach()
    if x.is_complex():  # the largest modulus
        m = float(x.abs().amax())
        return math.isnan(m), math.isinf(m), m
    lo, hi = _extremes(x)
    m = max(abs(lo), abs(hi)) if not (math.isnan(lo) or math.isnan(hi)) else math.nan
    return math.isnan(m), math.isinf(m), m


def _extremes(x: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of a non-empty floating tensor (of the real and imaginary parts of a complex
    one) in one pass and one host read, with no ``|x|`` temporary (about twice as fast as
    ``abs().amax()``); both are NaN when any element is."""
    lo, hi = torch.stack(torch.aminmax(torch.view_as_real(x.resolve_conj()) if x.is_complex() else x)).tolist()
    return lo, hi


class Fact:
    """What the op monitor knows about one tensor of the replay."""

    __slots__ = ("nan", "inf", "absmax", "prov", "producer", "taint", "allowed", "masked_by", "row_groups")

    def __init__(self, nan: bool, inf: bool, absmax: float, prov: frozenset, producer: str, taint: frozenset = frozenset(),
                 allowed: bool = False, masked_by: frozenset = frozenset(), row_groups: Optional[tuple[int, int]] = None) -> None:
        self.nan, self.inf, self.absmax = nan, inf, absmax
        self.prov = prov            # sources: "batch:<path>", "weights", "buffer:<fqn>", "const", "rng"
        self.producer = producer    # the op (or source) that made it
        self.taint = taint          # birth indices its non-finite values come from
        self.allowed = allowed      # its non-finite values were written on purpose (allowlisted)
        self.masked_by = masked_by  # provenance of what decided where allowlisted masks wrote -Inf
        self.row_groups = row_groups  # (n, k): a reshape merged leading dims, row r of dim 0 is row r // k of an n-row tensor

    @property
    def nonfinite(self) -> bool:
        return self.nan or self.inf


class Facts:
    """Facts of the replay's tensors, keyed weakly by tensor (a tensor freed by the replay leaves
    the table)."""

    def __init__(self) -> None:
        self._d: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def seed(self, t: torch.Tensor, source: str) -> None:
        """Declare ``t`` a source (a batch leaf, a weight, a buffer)."""
        nan, inf, m = flags_of(t)
        self._d[t] = Fact(nan, inf, m, frozenset((source,)), source)

    def get(self, t: torch.Tensor) -> Fact:
        """The facts of ``t``; a tensor never seen before (a constant built outside the replay's
        ops, e.g. a plain tensor attribute of a module) is computed now and counted a constant."""
        f = self._d.get(t)
        if f is None:
            nan, inf, m = flags_of(t)
            f = Fact(nan, inf, m, frozenset(("const",)), "const")
            self._d[t] = f
        return f

    def peek(self, t: torch.Tensor) -> Optional[Fact]:
        return self._d.get(t)

    def set(self, t: torch.Tensor, fact: Fact) -> None:
        self._d[t] = fact


#: aten ops that read entries of their first operand (a table) at positions their other operands give
_LOOKUPS = frozenset({"index", "index_select", "gather", "embedding", "take", "take_along_dim", "_embedding_bag", "embedding_bag"})


def _provenance(func: Any, name: str, in_facts: list[Fact]) -> frozenset:
    """The sources an op's outputs come from: its inputs' (``const`` for an op without tensor
    inputs), plus ``rng`` for a random op (:data:`_RANDOM`, or one taking a ``Generator``), plus
    ``lookup`` for a lookup (:data:`_LOOKUPS`) of a table of the code (constants, buffers: neither
    the batch nor the weights) at positions the batch gives (``alphas_cumprod[t]`` for a sampled
    timestep ``t``): the batch chose a valid entry, the table's values are the code's."""
    prov: frozenset = frozenset().union(*(f.prov for f in in_facts)) if in_facts else frozenset(("const",))
    if name in _RANDOM or any("Generator" in str(a.type) for a in getattr(getattr(func, "_schema", None), "arguments", ())):
        prov = prov | {"rng"}
    table = in_facts[0].prov if in_facts else frozenset()
    if name in _LOOKUPS and len(in_facts) > 1 and not _from_batch(table) and "weights" not in table and any(_from_batch(f.prov) for f in in_facts[1:]):
        prov = prov | {"lookup"}
    return prov


def _from_batch(prov: frozenset) -> bool:
    return any(p.startswith("batch:") for p in prov)


#: aten ops that only reshape: their output holds the input's elements in the same (row-major) order
_RESHAPES = frozenset({"view", "_unsafe_view", "reshape", "view_copy", "_reshape_alias", "flatten"})


def row_groups(name: str, ins: list[torch.Tensor], in_facts: list[Fact], out: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(n, k)`` when ``out`` is a reshape whose dimension 0 merges its input's leading
    dimensions (``[B, T, d] -> [B * T, d]``, as ``F.linear`` of a 3-d input and multi-head
    attention's ``[B, H, T, D] -> [B * H, T, D]`` do): row ``r`` of ``out`` holds only elements of
    row ``r // k`` of an ``n``-row tensor, the input's own dimension 0 (or what that was merged
    from, through chained reshapes). Row-major order makes it exact for any reshape whose
    dimension 0 is a multiple of its input's. ``None`` for other ops."""
    if name not in _RESHAPES or not ins or ins[0].dim() == 0 or out.dim() == 0:
        return None
    n_in, n_out = ins[0].shape[0], out.shape[0]
    if n_in == 0 or n_out <= n_in or n_out % n_in:
        return in_facts[0].row_groups if n_out == n_in else None
    n, k = in_facts[0].row_groups or (n_in, 1)
    return n, k * (n_out // n_in)


def _merged_rows(ins: list[torch.Tensor], in_facts: list[Fact], outs: list[torch.Tensor], batch: Optional[int]) -> Optional[int]:
    """Rows per sample along dimension 0 of an op's first floating output, when an operand of the
    same dimension 0 merges the batch's rows (:func:`row_groups` ``(batch, k)``: ``addmm`` of
    ``x.view(B * T, d)``); else ``None``. It outranks a later dimension that only has the
    batch's length (``d_out == B``)."""
    t = next((t for t in outs if is_float(t) and t.dim() >= 1), None)
    if batch is None or t is None:
        return None
    return next((f.row_groups[1] for x, f in zip(ins, in_facts)
                 if f.row_groups is not None and f.row_groups[0] == batch and x.dim() and x.shape[0] == t.shape[0]), None)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op's args/kwargs/outputs (tuples, lists and dicts, as aten passes them),
    without the general pytree walk."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class RootTracker(ModuleTracker):
    """torch's ``ModuleTracker``, which also enters the backward pass of a module whose output is
    where a backward pass starts.

    ``ModuleTracker`` enters a module's backward pass from a multi-grad hook on the module's
    outputs, and torch never calls that hook on a tensor ``backward()`` starts from: the loss a
    criterion or a loss head returns (``model.loss_head(...)`` called from the loss function, a
    ``model.criterion`` submodule), or a model output the replay drives with its recorded
    cotangent. The backward ops of such a module then ran outside every module, where its forward
    ops are named. A pre-hook on the root's autograd node does fire: this tracker keeps, weakly,
    the modules that returned each output, and :meth:`enter_roots` (called just before the
    backward pass) enters them from such a pre-hook. Their input hooks leave them, as
    ``ModuleTracker``'s own do; every hook is removed on exit with ``ModuleTracker``'s.
    """

    def __init__(self) -> None:
        super().__init__()
        self._returned: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:
        super()._fw_post_hook(mod, input, output)
        name = self._get_mod_name(mod)
        for t in _tensors(output):
            if t.requires_grad and t.grad_fn is not None:
                self._returned.setdefault(t, []).append(name)

    def enter_roots(self, roots: Iterable[torch.Tensor]) -> None:
        """Enter, as the backward pass from ``roots`` starts, the modules that returned them."""
        for t in roots:
            names = self._returned.get(t) if isinstance(t, torch.Tensor) else None
            if names and t.grad_fn is not None:
                self._hooks.append(t.grad_fn.register_prehook(self._entering(names)))

    def _entering(self, names: list[str]) -> Callable:
        enter = [self._get_append_fn(n, True) for n in names]

        def hook(grads: Any) -> None:
            for fn in enter:
                fn()

        return hook


class ModuleMonitor:
    """Forward outputs of every module, in completion order, and backward events: the cotangent
    at each module's output and each parameter's gradient. Each event holds ``summary`` (a small
    dict: ``nan``, ``posinf``, ``neginf``, ``numel``, ``absmax`` of the finite values, ``dtype``,
    ``shape``); counts are computed only for non-finite forward outputs and output cotangents
    (parameter gradients carry 0/1 flags: past a birth nearly every gradient is non-finite, and
    nothing reads their counts).

    Args:
        backward: also record the backward events (output cotangents, parameter gradients).
        counts: count NaN/+Inf/-Inf elements of non-finite outputs; ``False`` (a lean replay that
            only asks *whether* something is non-finite, e.g. per-sample replays) gives 0/1 flags
            instead, which costs one reduction per output.
    """

    def __init__(self, model: torch.nn.Module, *, backward: bool = True, counts: bool = True) -> None:
        self.fqn = {id(m): n for n, m in model.named_modules()}
        self.classes = {n: type(m).__name__ for n, m in model.named_modules()}
        self.events: list[dict] = []
        self._stack: list[bool] = []
        self._handles: list[Any] = []
        self.phase = "forward"
        self.counts = counts
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        if backward:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook(name, name.rpartition(".")[0])))
        self._backward = backward

    def _pre(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with _unseen():
            self._stack.append(all(not _nonfinite(t) for t in _tensors((args, kwargs))))

    def _post(self, mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        check_deadline()
        with _unseen():
            self._record_output(mod, out)

    def _record_output(self, mod: torch.nn.Module, out: Any) -> None:
        inputs_finite = self._stack.pop() if self._stack else True
        outs = [t for t in tensor_leaves(out) if is_float(t)]
        summary = _summary(outs, counts=self.counts)
        name = self.fqn.get(id(mod), "?")
        self.events.append({"phase": self.phase, "module": name, "class": type(mod).__name__, "inputs_finite": inputs_finite,
                            "output": summary, "born": inputs_finite and summary is not None and _summary_nonfinite(summary)})
        if self._backward:
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._cot_hook(name, type(mod).__name__))

    def _cot_hook(self, name: str, cls: str) -> Callable:
        def hook(g: torch.Tensor) -> None:  # counted: the report's module strip shows them
            with _unseen():
                self.events.append({"phase": "backward", "kind": "output cotangent", "module": name, "class": cls,
                                    "output": _summary([g], counts=self.counts)})

        return hook

    def _param_hook(self, pname: str, owner: str) -> Callable:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                with _unseen():
                    self.events.append({"phase": "backward", "kind": "parameter gradient", "module": owner, "param": pname,
                                        "output": _summary([p.grad], counts=False)})

        return hook

    def forward_events(self) -> list[dict]:
        return [e for e in self.events if e["phase"] == "forward"]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _unseen() -> Any:
    """Around the module monitor's own reductions: the dispatch modes of the replay (the op
    monitor, the RNG scope) do not see them, so they are neither checked as ops of the step nor
    counted in its op indices and propagated ops."""
    return _disable_current_modes()


def _nonfinite(t: torch.Tensor) -> bool:
    nan, inf, _ = flags_of(t)
    return nan or inf


def _summary(ts: list[torch.Tensor], *, counts: bool = True) -> Optional[dict]:
    """The small health summary of module events: counts only when something is non-finite, and
    only with ``counts`` (else ``nan``/``posinf``/``neginf`` are 0/1 flags; a tensor holding NaN
    may hold an Inf its flags do not show). The counts and the largest finite magnitude are
    those of :func:`~nanreplay.core.numerics.tensor_health` (a complex element counts as two),
    computed in fewer passes (:func:`_counts`)."""
    ts = [t for t in ts if isinstance(t, torch.Tensor) and is_float(t)]
    if not ts:
        return None
    absmax, nan, posinf, neginf = 0.0, False, False, False
    flags: list[tuple[torch.Tensor, bool, bool, bool, float]] = []
    for t in ts:
        if t.numel() == 0:
            continue
        lo, hi = _extremes(t.detach())  # one pass per output: its flags, and its largest magnitude when finite
        t_nan, t_pos, t_neg = math.isnan(lo) or math.isnan(hi), hi == math.inf, lo == -math.inf
        nan, posinf, neginf = nan or t_nan, posinf or t_pos, neginf or t_neg
        flags.append((t, t_nan, t_pos, t_neg, max(-lo, hi)))
        if not (t_nan or t_pos or t_neg):
            absmax = max(absmax, float(t.detach().abs().amax()) if t.is_complex() else max(-lo, hi))
    bad = nan or posinf or neginf
    if not bad or not counts:
        return {"nan": int(nan), "posinf": int(posinf), "neginf": int(neginf), "numel": sum(t.numel() for t in ts), "absmax": absmax,
                "dtype": str(ts[0].dtype).replace("torch.", ""), "shape": list(ts[0].shape)}
    nan_n = pos_n = neg_n = nfin = 0
    absmax = 0.0
    for t, t_nan, t_pos, t_neg, m in flags:
        n, p, q, a = _counts(t, t_nan, t_pos, t_neg) if (t_nan or t_pos or t_neg) else (0, 0, 0, m)
        nan_n, pos_n, neg_n, nfin = nan_n + n, pos_n + p, neg_n + q, nfin + as_real(t).numel() - n - p - q
        absmax = max(absmax, a)
    numel = sum(as_real(t).numel() for t in ts)  # as tensor_health counts: a complex element is two
    return {"nan": nan_n, "posinf": pos_n, "neginf": neg_n, "numel": numel, "absmax": absmax if nfin else None,
            "dtype": str(ts[0].dtype).replace("torch.", ""), "shape": list(ts[0].shape)}


def _counts(t: torch.Tensor, has_nan: bool, has_pos: bool, has_neg: bool) -> tuple[int, int, int, float]:
    """``(NaN count, +Inf count, -Inf count, largest finite magnitude)`` of one non-empty
    floating tensor (of its real and imaginary parts for a complex one; the magnitude is 0 when
    no element is finite), given its flags from :func:`_extremes` (without NaN they tell exactly
    which kinds of Inf it holds, so only those are counted), with one host read and no copy of
    the finite values; a tensor holding NaN reads its NaN count first and stops there when every
    element is NaN (a second host read otherwise)."""
    x = as_real(t.detach())
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    # count_nonzero: on CPU 3-14x faster than summing a mask's bytes, 10-30x faster than a boolean sum
    nan = torch.count_nonzero(torch.isnan(x)) if has_nan else zero
    if has_nan and int(nan) == x.numel():  # NaN everywhere (the common case once it has spread): nothing else to count
        return x.numel(), 0, 0, 0.0
    pos = torch.count_nonzero(torch.isposinf(x)) if has_nan or has_pos else zero
    neg = torch.count_nonzero(torch.isneginf(x)) if has_nan or has_neg else zero
    big = torch.nan_to_num_(x.abs(), nan=0.0, posinf=0.0).amax()  # |x| of the finite elements (0 in place of NaN and +-Inf)
    n, p, q, m = torch.stack([nan.double(), pos.double(), neg.double(), big.double()]).tolist()
    return int(n), int(p), int(q), m


def _summary_nonfinite(s: dict) -> bool:
    return bool(s["nan"] or s["posinf"] or s["neginf"])


class OpMonitor(TorchDispatchMode):
    """Watches every aten op of a replay and records each birth of a non-finite value.

    Args:
        tracker: the ``ModuleTracker`` entered around the replay (module context).
        model: the replayed model (module FQNs; the root module's forward tells the forward pass
            from the loss computed around it).
        allow: legitimate non-finite values (default: -Inf written by attention masking).
        max_births: births recorded in full (the rest are counted).
        watch: only these aten ops (overload packet names, e.g. ``{"div"}``) are checked; every
            other op runs untouched (no health read, no provenance). Births of a watched op are
            still exact (its inputs' health is read at the op), but taint does not flow through
            unwatched ops, so :meth:`taint_of` knows nothing: for a counterfactual replay that
            only asks whether one birth happens again.

    Attributes:
        births: one dict per birth, in execution order (see ``docs/report.md``, "A birth"); after
            :meth:`settle`, those of the forward pass and the loss only.
        allowed: births the allowlist matched (never the origin, never a taint).
        propagated: ops that only passed non-finite values on.
        facts: the per-tensor :class:`Facts`.
        run_phase: set by the replay: ``forward`` (the model's forward calls), ``loss_fn`` (the
            user's loss function, the model's forward inside it), ``backward``, ``optimizer``.
        micro_batch, batch_size: which recorded batch / forward call is replaying, and its size.
        settled: the forward origin is settled (:meth:`settle`) and backward ops run unchecked.
        checked, passed: how many ops were checked, and how many ran unchecked.

    Technique: ``TorchDispatchMode`` sees functional ops and backward kernels alike, which module
    hooks miss; ``ModuleTracker`` supplies the module context in both passes.
    """

    def __init__(self, tracker: ModuleTracker, model: Optional[torch.nn.Module], *, allow: Optional[Allowlist] = None, max_births: int = 32,
                 watch: Optional[frozenset] = None) -> None:
        super().__init__()
        self.watch = watch
        self.tracker = tracker
        self.allow = allow if allow is not None else Allowlist()
        self.max_births = max_births
        self.births: list[dict] = []
        self.allowed: list[dict] = []
        self.propagated = 0
        self.facts = Facts()
        self.run_phase = "forward"
        self.micro_batch: Optional[int] = None
        self.batch_size: Optional[int] = None   # of the micro-batch replaying: the rows of a birth are along it
        self.index = 0
        self._root = type(model).__name__ if model is not None else None
        self._modules: dict[str, torch.nn.Module] = {}
        self._ids: dict[int, str] = {}
        self._methods = (getattr(model, "program_meta", None) or {}).get("method_of")  # an embedded program's, see node_method_of
        if model is not None:
            self._modules = {n: m for n, m in model.named_modules()}
            self._ids = {id(m): n for n, m in self._modules.items()}
            try:  # name every module by its FQN now, whatever runs first (the loss may call a submodule first)
                tracker._get_mod_name(model)
            except Exception:  # noqa: BLE001 - a ModuleTracker without the private namer: names come on first call
                pass
        self._n_births = itertools.count()
        self.settled = False  # the forward origin is settled: backward ops run unchecked (:meth:`settle`)
        self.checked = 0      # ops whose outputs were checked
        self.passed = 0       # ops run unchecked (unwatched, or backward ops once settled)

    def settle(self, products: Iterable[torch.Tensor]) -> bool:
        """Called as the backward pass starts, with what the step has produced so far (losses, or
        model outputs fed by recorded cotangents): when the first birth recorded is in the
        forward pass or the loss and its values reach ``products``, it is the origin whatever
        the backward pass does (the origin rule, :mod:`nanreplay.diagnosis.origin`, takes the
        first reaching birth of the forward pass and the loss before any backward one, and no
        earlier forward birth exists), so the backward ops from here on run unchecked: no health
        reads, no provenance, no backward births recorded (``births``, ``allowed`` and
        ``propagated`` then hold the forward pass and the loss only). Never with ``watch``
        (taint is not tracked). Returns whether the monitor is settled."""
        if self.settled or self.watch is not None or not self.births:
            return self.settled
        first = self.births[0]
        self.settled = first["phase"] in ("forward", "loss") and first["birth"] in self.taint_of(products)
        return self.settled

    # -- where an op runs -----------------------------------------------------------------
    def _active(self) -> list[str]:
        """FQNs of the model's modules running now (forward, or backward in the backward pass),
        outermost first; names of modules outside the model are kept as their class names."""
        out = []
        for p in self.tracker.parents:
            if p == "Global":
                continue
            head, _, rest = p.partition(".")
            out.append(rest if head == self._root and rest else ("" if p == self._root else p))
        return sorted(out, key=lambda n: -1 if n == "" else n.count("."))

    def where(self, op: str = "") -> tuple[str, Optional[str]]:
        """(phase, module FQN) of the op ``op`` running now. Phase: ``optimizer``, ``backward``,
        ``forward`` (inside the model's forward call) or ``loss`` (the loss function's own code,
        including submodules of the model it calls, e.g. ``model.criterion(...)``, any
        ``torch.nn`` loss module and any aten loss kernel, :data:`LOSS_OPS`). Module: the
        innermost model module running, ``""`` for the root, ``None`` outside every model module."""
        if self.run_phase == "optimizer":
            return "optimizer", None
        active = self._active()
        model_mods = [n for n in active if n in self._modules]
        inner = max(model_mods, key=lambda n: -1 if n == "" else n.count("."), default=None)
        if self.run_phase == "backward" or self.tracker.is_bw:
            return "backward", inner
        loss_module = op.strip("_") in LOSS_OPS or any(isinstance(self._modules.get(n), torch.nn.modules.loss._Loss) for n in active) or any(
            n not in self._modules and n.endswith("Loss") for n in active)
        in_forward = self._root is not None and "" in active
        if loss_module or (self.run_phase == "loss_fn" and not in_forward):
            return "loss", inner
        return "forward", inner

    # -- the op hook ------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        check_deadline()
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in _UNINITIALISED or (self.watch is not None and name not in self.watch) or (self.settled and self.run_phase == "backward"):
            self.passed += 1
            return func(*args, **kwargs)
        self.checked += 1
        ins = [t for t in _tensors((args, kwargs))]
        in_facts = [self.facts.get(t) for t in ins]  # before the op: an in-place op overwrites its input
        mutating = bool(getattr(getattr(func, "_schema", None), "is_mutable", False))
        before = [(f.nan, f.inf) for f in in_facts] if mutating else None
        out = func(*args, **kwargs)
        self.index += 1
        outs = list(_tensors(out))
        if outs:
            self._label_outputs(func, name, args, kwargs, ins, in_facts, before, outs, mutating)
        return out

    def _label_outputs(self, func: Any, name: str, args: tuple, kwargs: dict, ins: list[torch.Tensor], in_facts: list[Fact],
                       before: Optional[list[tuple[bool, bool]]], outs: list[torch.Tensor], mutating: bool) -> None:
        """Set the :class:`Fact` of each output of one op: its provenance (:func:`_provenance`) and,
        for a non-finite output, its descent (:meth:`_descent`). ``before``: the inputs' (nan, inf)
        flags read before a mutating op ran, else ``None``."""
        prov = _provenance(func, name, in_facts)
        out_flags = [flags_of(t) for t in outs]
        out_nan = any(n for n, _, _ in out_flags)
        out_inf = any(i for _, i, _ in out_flags)
        if before is None:
            before = [(f.nan, f.inf) for f in in_facts]
        taint, allowed, masked_by = self._descent(func, name, args, kwargs, ins, in_facts, before, outs, mutating, out_nan, out_inf)
        groups = row_groups(name, ins, in_facts, outs[0])
        for t, (n, i, m) in zip(outs, out_flags):
            bad = n or i
            self.facts.set(t, Fact(n, i, m, prov, name, taint if bad else frozenset(), allowed and bad, masked_by if bad else frozenset(), groups))

    def _descent(self, func: Any, name: str, args: tuple, kwargs: dict, ins: list[torch.Tensor], in_facts: list[Fact],
                 before: list[tuple[bool, bool]], outs: list[torch.Tensor], mutating: bool, out_nan: bool, out_inf: bool) -> tuple[frozenset, bool, frozenset]:
        """(taint, allowed, masked_by) of an op's non-finite outputs: the births they descend from
        (this op's own when it is a birth, :func:`born`, recorded by :meth:`_record_birth`), whether
        they are an allowlisted mask (or only carry one on), and what decided where a mask went.
        Counts an op that only propagated non-finite values."""
        in_nan = any(n for n, _ in before)
        in_bad = any(n or i for n, i in before)
        bad_facts = [f for f in in_facts if f.nonfinite] if in_bad else []
        taint = frozenset().union(*(f.taint for f in bad_facts))
        masked_by = frozenset().union(*(f.masked_by for f in bad_facts))
        if not (out_nan or out_inf):
            return taint, False, masked_by
        if not born(in_nan, in_bad, out_nan, out_inf):
            self.propagated += 1
            return taint, bool(in_facts) and all(f.allowed for f in in_facts if f.nonfinite), masked_by
        b = self._record_birth(func, name, args, kwargs, ins, in_facts, outs, mutating)
        if b is not None:
            return taint | {b}, False, masked_by
        # allowlisted: non-finite on purpose, taints nothing; what decided where the mask went is
        # its boolean/integer operands and the non-finite ones it copied
        return taint, True, masked_by.union(*(f.prov for t, f in zip(ins, in_facts) if not is_float(t) or f.nonfinite))

    def _record_birth(self, func: Any, name: str, args: tuple, kwargs: dict, ins: list[torch.Tensor], in_facts: list[Fact],
                      outs: list[torch.Tensor], mutating: bool) -> Optional[int]:
        """Describe one birth and return its index, or ``None`` when the allowlist matches it."""
        phase, module = self.where(name)
        h_out = tensor_health(outs)
        rule = self.allow.match(module, name, h_out)
        if rule is not None:
            if len(self.allowed) < self.max_births:
                self.allowed.append({"phase": phase, "op": name, "module": module, "op_index": self.index, "rule": str(rule), "output": h_out})
            return None
        k = next(self._n_births)
        if len(self.births) >= self.max_births:
            return k
        b: dict = {"birth": k, "phase": phase, "op": name, "aten": str(func), "module": module, "op_index": self.index,
                   "micro_batch": self.micro_batch, "inputs": tensor_health(ins), "output": h_out}
        if phase == "backward":
            node, fwd_src = probes.current_node()
            b["node"] = node
            b["forward_op"] = probes.node_forward_op(node)
            b["source"] = fwd_src
        else:
            b["node"] = b["forward_op"] = None
            b["source"] = probes.user_frame_now()
        if module is None and phase in ("loss", "forward"):
            # e.g. model.compute_loss(...) or training_step: a method, not a forward (from the export's table in a program)
            owner = probes.calling_module(self._ids)
            b["method_of"] = owner if owner is not None else probes.node_method_of(self._methods)
        b["wider"] = None if mutating else probes.wider_recompute(func, args, kwargs, outs)
        b["operands"] = probes.operands(func, args, kwargs, ins, [(f.prov, f.producer, f.masked_by, f.row_groups) for f in in_facts],
                                        output=outs[0] if outs else None)
        b["rows"] = probes.nonfinite_rows(outs, self.batch_size, _merged_rows(ins, in_facts, outs, self.batch_size),
                                          nan_only=any(f.inf for f in in_facts))  # Inf in, NaN born: the NaN rows
        self.births.append(b)
        return k

    def taint_of(self, tensors: Iterable[torch.Tensor]) -> frozenset:
        """The births the non-finite values of ``tensors`` come from."""
        out: frozenset = frozenset()
        for t in tensors:
            f = self.facts.peek(t)
            if f is not None and f.nonfinite:
                out = out | f.taint
        return out
