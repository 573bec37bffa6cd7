"""The embedded program proven within bounds before it runs: layer 1 of its defence.

An embedded program (:mod:`nanreplay.engine.program`) is data from a file someone handed you, and
its operators are C++ kernels that trust their arguments: an allowlisted view op given crafted
sizes and strides reads and writes the process's heap, a factory given a large stride allocates
gigabytes for a few elements. So before a single kernel runs on real data, the program is run once
on fake tensors (``torch._subclasses.FakeTensorMode``, torch's own shape propagation: every op's
meta kernel or decomposition, the machinery ``torch.export`` traced the program with), starting
from the real tensors it is given (weights, buffers, constants and the call's inputs: their real
shapes, dtypes, strides and storage sizes, never what the bundle declares), and every aten op is
checked as it runs (a ``TorchDispatchMode`` above the fake mode, the technique of
``torch.utils.flop_counter.FlopCounterMode``):

* **storage bounds**: every tensor an op returns lies inside its storage: storage offset plus
  ``sum((size - 1) * stride)`` elements, times the element size, within the storage's bytes, no
  negative stride reaching below it. A view op (``OpOverload.is_view``, or an in-place view such as
  ``squeeze_``) is also run on plain meta tensors mirroring its inputs, outside the fake mode: the
  geometry its own C++ kernel computes is the one checked, not a decomposition's (torch's fake
  ``_reshape_alias`` is a checked ``view``; its real kernel takes any strides);
* **bytes alive**: the bytes of the storages the program created that are alive after each op
  (views keep their base's whole storage alive; a value dies after its last use, exactly as in the
  real run, because the fake run *is* that run: the same interpreter frees the same values and
  autograd keeps the same saved tensors), plus the op's workspace (:data:`WORKSPACE`), stay within
  :attr:`Budget.bytes`;
* **work**: the element-operations of all ops (``torch.utils.flop_counter``'s formulas for
  matrix products, convolutions and attention; dense factorisations, sorting and ``cdist`` by
  their own growth, :data:`_EXTRA_WORK`; elements read and written for the rest; views free) stay
  within :attr:`Budget.work`;
* **argument contracts** its kernels omit (:data:`SHAPE_CONTRACTS`: a fused attention kernel's key
  and value of one length, batch normalisation's one weight per channel) hold before the op runs;
* **in-place writes** land only in storages the program created or in the model's buffers:
  followed through every alias (``detach``, views, a ``to`` that copies nothing, ``alias``), since
  aliases share their storage, never into the batch, a parameter or a constant;
* **declared shapes**: a size the program's metadata declares as a plain integer equals the size
  the op computes (metadata that lies is a damaged bundle).

The forward pass is proven; the backward pass runs torch's own derivative formulas on the tensors
the forward saved (counted), with gradients the sizes of tensors already counted. The budgets
come only from the real tensors (:meth:`Budget.of`). A size that depends on tensor
values (``nonzero``) counts at its upper bound (torch's value ranges); one with no bound is
refused. What fake tensors cannot see, the values of index tensors, is checked while the program
runs (:mod:`nanreplay.engine.guards`, layer 2). A refusal is a
:class:`~nanreplay.engine.program_check.ProgramRefused` (CLI exit 5) naming the node, its
operator, the limit and the numbers; nothing of the program ran.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..errors import BundleFormatError
from .deadline import check_deadline
from .program_check import ProgramRefused

__all__ = ["Budget", "Proof", "verify_bounds", "op_arguments", "WORKSPACE", "SHAPE_CONTRACTS", "OUTPUT_COUNTS", "MAX_OUTPUTS", "BYTES_FACTOR", "BYTES_ALLOWANCE", "WORK_FACTOR", "WORK_ALLOWANCE"]

#: bytes the program may keep alive (its storages and workspaces, beyond the real tensors): this
#: many times the bytes of the real tensors it is given ...
BYTES_FACTOR = 64
#: ... plus this allowance (256 MiB), so that small models with normal batches need no thought
BYTES_ALLOWANCE = 1 << 28
#: element-operations the program may do: this many times (elements of all real tensors) x
#: (elements of the call's inputs), a training step's work being about weights x positions ...
WORK_FACTOR = 64
#: ... plus this allowance (2**34, seconds of one CPU core)
WORK_ALLOWANCE = 1 << 34


def _mib(n: float) -> str:
    """Bytes for a person: ``512 bytes``, ``12.0 KiB``, ``256.0 MiB``, ``2.00 GiB``."""
    if n < 1 << 10:
        return f"{int(n)} bytes"
    if n < 1 << 20:
        return f"{n / (1 << 10):,.1f} KiB"
    return f"{n / (1 << 20):,.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


@dataclass(frozen=True)
class Budget:
    """What one call of a program may use, from the real tensors it is given.

    Attributes:
        real_bytes: bytes of the distinct storages of the real tensors (weights, buffers,
            constants, the call's inputs; a tied weight once).
        real_elements, input_elements: elements of all real tensors, and of the call's inputs.
        bytes: the most bytes of storages the program created (and workspaces) alive at once:
            ``BYTES_FACTOR * real_bytes + BYTES_ALLOWANCE``.
        work: the most element-operations in all:
            ``WORK_FACTOR * real_elements * max(input_elements, 1) + WORK_ALLOWANCE``.
    """

    real_bytes: int
    real_elements: int
    input_elements: int
    bytes: int
    work: int

    @classmethod
    def of(cls, state: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor]) -> "Budget":
        """The budget of a call on ``inputs`` of a program holding ``state`` (real tensors)."""
        seen: set[int] = set()
        nbytes = elements = in_elements = 0
        for group, tensors in (("state", state), ("inputs", inputs)):
            for t in tensors:
                n = t.numel()
                elements += n
                in_elements += n if group == "inputs" else 0
                key = t.untyped_storage().data_ptr() or id(t)
                if key not in seen:
                    seen.add(key)
                    nbytes += t.untyped_storage().nbytes()
        return cls(real_bytes=nbytes, real_elements=elements, input_elements=in_elements,
                   bytes=BYTES_FACTOR * nbytes + BYTES_ALLOWANCE, work=WORK_FACTOR * elements * max(in_elements, 1) + WORK_ALLOWANCE)

    def describe_bytes(self) -> str:
        return f"{_mib(self.bytes)} = {BYTES_FACTOR} x {_mib(self.real_bytes)} of real tensors + {_mib(BYTES_ALLOWANCE)}"

    def describe_work(self) -> str:
        return (f"{self.work:,} = {WORK_FACTOR} x {self.real_elements:,} elements of real tensors x {max(self.input_elements, 1):,} "
                f"of inputs + {WORK_ALLOWANCE:,}")


@dataclass(frozen=True)
class Proof:
    """What the verifier found for a program it accepted: ``nodes`` run, the ``peak_bytes`` of
    storages it created alive at once (workspaces included; an upper bound unless ``exact``),
    its ``work`` (element-operations), the ``budget``, and the verifier's own ``seconds``."""

    nodes: int
    peak_bytes: int
    work: int
    budget: Budget
    seconds: float


# -- workspaces: kernels that allocate more than their outputs ---------------------------------

def _conv_workspace(a: dict, out: Any) -> int:
    """``aten.convolution`` / ``_convolution`` on the CPU without a vendor library lowers to an
    unfolded input (``im2col``: ``slow_conv2d``'s ``finput``, ``slow_conv3d``'s, conv1d through
    conv2d): batch x input channels x kernel volume x output positions elements; a transposed
    convolution's ``columns`` (output channels x kernel volume x input positions). An upper bound
    of what oneDNN's paths allocate too."""
    x, w = a.get("input"), a.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 3:
        return 0
    kernel = math.prod(w.shape[2:])
    spatial_in = math.prod(x.shape[2:])
    spatial_out = math.prod(out.shape[2:]) if isinstance(out, torch.Tensor) and out.dim() >= 3 else spatial_in
    n = x.shape[0]
    if a.get("transposed"):
        cols = n * w.shape[1] * int(a.get("groups") or 1) * kernel * spatial_in
    else:
        cols = n * x.shape[1] * kernel * spatial_out
    return cols * x.element_size()


def _inputs_times(k: int) -> Callable[[dict], int]:
    """A workspace of ``k`` times the bytes of the op's tensor arguments (sorting copies its input,
    LAPACK and FFT plans work on copies)."""
    def ws(a: dict, out: Any) -> int:
        return k * sum(t.numel() * t.element_size() for t in a.values() if isinstance(t, torch.Tensor))
    return ws


#: aten op (overload packet name, as the dispatch mode sees it) -> bytes of workspace its kernel
#: allocates beyond its outputs, from its arguments by name and its output. From torch's CPU
#: kernels: ``aten/src/ATen/native/ConvolutionMM2d.cpp`` (``finput``), ``NaiveConvolutionTranspose2d.cpp``
#: (``columns``), ``Sorting.cpp``, ``BatchLinearAlgebra.cpp``, ``mkl/SpectralOps.cpp``. An op absent
#: allocates only its outputs.
WORKSPACE: dict[str, Callable[[dict, Any], int]] = {
    **dict.fromkeys(("convolution", "_convolution", "_slow_conv2d_forward", "slow_conv3d_forward",
                     "slow_conv_transpose2d", "slow_conv_transpose3d", "slow_conv_dilated2d", "slow_conv_dilated3d"), _conv_workspace),
    **dict.fromkeys(("sort", "topk", "kthvalue", "median", "nanmedian", "mode", "_unique2", "unique_dim", "unique_consecutive",
                     "msort", "argsort", "multinomial", "_cdist_forward", "index_put", "index_put_", "_index_put_impl_",
                     "scatter_reduce", "index_reduce", "_fft_r2c", "_fft_c2r", "_fft_c2c"), _inputs_times(2)),
    **dict.fromkeys(("_linalg_svd", "_linalg_eigh", "linalg_qr", "_linalg_det", "linalg_inv_ex", "_linalg_solve_ex",
                     "linalg_cholesky_ex", "_linalg_slogdet", "linalg_matrix_exp", "linalg_lu_factor_ex", "linalg_eig"),
                    _inputs_times(4)),
}


def _sdpa_cpu_work(a: dict) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    q, k, v = a.get("query"), a.get("key"), a.get("value")
    return sdpa_flop_count(q.shape, k.shape, v.shape) if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)) else 0


def _matrix_work(k: int) -> Callable[[dict], int]:
    """A dense factorisation of ``[..., m, n]`` matrices: ``k * batch * m * n * min(m, n)``."""
    def work(a: dict) -> int:
        x = a.get("A", a.get("self"))
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return 0
        m, n = x.shape[-2], x.shape[-1]
        return k * math.prod(x.shape[:-2]) * m * n * min(m, n)
    return work


def _sort_work(a: dict) -> int:
    """Sorting along a dimension: ``numel * log2(its size)``."""
    x = a.get("self")
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return 0
    return x.numel() * max(1, int(math.log2(max(x.shape, default=1) or 1)) + 1)


def _cdist_work(a: dict) -> int:
    x1, x2 = a.get("x1"), a.get("x2")
    if not isinstance(x1, torch.Tensor) or not isinstance(x2, torch.Tensor) or x1.dim() < 2:
        return 0
    return x1.numel() * x2.shape[-2]  # batch x P x M x R


#: work formulas torch's flop counter lacks (CPU kernels whose cost grows faster than the elements
#: they read and write), by overload packet name
_EXTRA_WORK: dict[str, Callable[[dict], int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu_work,
    **dict.fromkeys(("_linalg_svd", "_linalg_eigh", "linalg_qr", "_linalg_det", "linalg_inv_ex", "_linalg_solve_ex", "linalg_cholesky_ex",
                     "_linalg_slogdet", "linalg_lu_factor_ex", "linalg_eig"), _matrix_work(4)),
    "linalg_matrix_exp": _matrix_work(40),  # scaling and squaring: up to about 20 matrix products
    **dict.fromkeys(("sort", "topk", "kthvalue", "median", "nanmedian", "mode", "_unique2", "unique_dim", "unique_consecutive", "msort",
                     "argsort"), _sort_work),
    "_cdist_forward": _cdist_work,
    "_pdist_forward": lambda a: _cdist_work({"x1": a.get("self"), "x2": a.get("self")}),
}


# -- argument contracts its kernels do not check ----------------------------------------------------

def _attention_shapes(a: dict) -> Optional[str]:
    """Fused attention kernels index the value by the key's positions and the key by the query's
    channels, trusting the caller (``scaled_dot_product_attention`` passes a key of 9 positions
    and a value of 4 to its CPU kernel, which reads past the value)."""
    q, k, v = a.get("query"), a.get("key"), a.get("value")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if not q.dim() == k.dim() == v.dim() == 4:
        return f"takes a query, key and value of {q.dim()}, {k.dim()} and {v.dim()} dimensions, expected 4 each"
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        return f"takes a query {list(q.shape)}, key {list(k.shape)} and value {list(v.shape)} of different batch or head counts"
    if k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        return (f"takes a key {list(k.shape)} and a value {list(v.shape)} of different lengths, or a query {list(q.shape)} of other "
                "channels than the key")
    return None


def _per_channel(*names: str) -> Callable[[dict], Optional[str]]:
    """Batch normalisation's per-channel tensors have one element per channel (dimension 1 of the
    input): its CPU kernel reads ``weight[c]`` and ``running_mean[c]`` for every channel unchecked."""
    def check(a: dict) -> Optional[str]:
        x = a.get("input")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None
        bad = [f"{n} of {a[n].numel()}" for n in names if isinstance(a.get(n), torch.Tensor) and a[n].numel() != x.shape[1]]
        return f"takes {', '.join(bad)} elements for {x.shape[1]} channels" if bad else None
    return check


_BN = _per_channel("weight", "bias", "running_mean", "running_var")

#: aten op (overload packet name, as the dispatch mode sees it) -> a check of its arguments' shapes
#: that its kernel omits, ``(args by name) -> None or what is wrong``: found by calling allowlisted
#: ops with mismatched shapes (a kernel that raises is fine; one that returns read outside a tensor).
#: Checked before the op runs on fake tensors.
SHAPE_CONTRACTS: dict[str, Callable[[dict], Optional[str]]] = {
    **dict.fromkeys(("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"), _attention_shapes),
    **dict.fromkeys(("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                     "_native_batch_norm_legit_functional"), _BN),
}


def _dim_size(a: dict) -> int:
    x, dim = a.get("self"), a.get("dim", 0)
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or not -x.dim() <= dim < max(x.dim(), 1):
        return 0  # the op's own kernel refuses it
    return x.shape[dim] if x.dim() else 0


def _split_count(a: dict) -> Any:
    size, step = _dim_size(a), a.get("split_size")
    if isinstance(step, (list, tuple)):  # split.sizes: one tensor per size the program lists
        return len(step)
    return (size + step - 1) // step if isinstance(step, int) and step > 0 else 1


def _sections_count(a: dict) -> Any:
    sections = a.get("sections")  # tensor_split.sections; .indices makes one more than its indices
    return sections if isinstance(sections, int) else len(a.get("indices") or ()) + 1


def _chunk_count(a: dict) -> Any:
    chunks, size = a.get("chunks"), _dim_size(a)
    if not isinstance(chunks, int):
        return 1
    return chunks if isinstance(size, int) and size == 0 else min(chunks, size)  # an empty dimension: ``chunks`` empty tensors


#: aten op (overload packet name) -> how many tensors it returns, from its arguments, for the ops
#: whose count of outputs an argument or a size sets (a zero-element tensor may have a dimension of
#: 2**40; ``tensor_split`` takes any count of sections), or a list the program holds (``split.sizes``,
#: ``tensor_split.indices``): one tensor object each, on the fake run too, so the count is bounded
#: before the op runs (:meth:`_Check.outputs`). The other ops that return lists (``split_with_sizes``,
#: ``meshgrid``, ``broadcast_tensors``, ``where``) return as many as the program's JSON lists or the
#: input has dimensions.
OUTPUT_COUNTS: dict[str, Callable[[dict], Any]] = {
    "split": _split_count,
    "unsafe_split": _split_count,
    "chunk": _chunk_count,
    "unbind": _dim_size,
    "tensor_split": _sections_count,
}

#: the most tensors one op may return when the program does not declare how many
MAX_OUTPUTS = 1 << 16


# -- the check ------------------------------------------------------------------------------------

class _Unbounded(Exception):
    """A size that depends on tensor values and has no upper bound."""


class _Damaged(Exception):
    """The program's metadata contradicts what its ops compute."""


def op_arguments(func: Any, args: tuple, kwargs: dict) -> dict:
    """An aten op's arguments (as a dispatch mode receives them) by their schema names."""
    out = dict(kwargs)
    for a, v in zip(func._schema.arguments, args):
        out[a.name] = v
    return out


def _tensors(x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


class _Check:
    """The state of one verification: the live storages, the work, the current node."""

    def __init__(self, budget: Budget, shape_env: Any, names: dict[int, str], writable: set[int], exact: bool) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.budget = budget
        self.shape_env = shape_env
        self.real = set(names)  # storage keys of the real tensors
        self.names = names  # real storage key -> what it is, for messages
        self.writable = writable  # real storage keys the program may write (the model's buffers)
        self.live: dict[int, tuple[Any, int]] = {}  # created storage key -> (weak ref, bytes)
        self.total = 0  # bytes of self.live (dead entries included until pruned)
        self.peak = 0
        self.work = 0
        self.nodes = 0
        self.node: Any = None
        self.exact = exact

    # -- numbers -----------------------------------------------------------------------------
    def upper(self, x: Any) -> int:
        """An int, or the upper bound of a symbolic int (a size that depends on tensor values)."""
        if isinstance(x, int):
            return x
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            if not expr.free_symbols:
                return int(expr)
            up = self.shape_env.bound_sympy(expr).upper
            if getattr(up, "is_Integer", False):
                return int(up)
            raise _Unbounded()
        return int(x)

    def refuse(self, func: Any, why: str, *, budget: bool = False) -> ProgramRefused:
        """The refusal at the current node: its name, its operator (and the aten op it ran, when
        another), why; over a ``budget``, the way on for a genuine program that large."""
        node = self.node
        target = str(getattr(node, "target", "?")).replace("torch.ops.", "")
        running = str(func) if func is not None else None
        ran = f", running {running}" if running and running != target and not target.startswith(running + ".") else ""
        python = "model_factory='module:function'"
        cli = "--model-factory module:function"
        if budget:
            python += ", or trust=True for a bundle whose source you trust (its program then runs without these limits)"
            cli += ", or --trust for a bundle whose source you trust (its program then runs without these limits)"
        return ProgramRefused(
            f"the embedded program's node {getattr(node, 'name', '?')!r} ({target}{ran}) {why}: nanreplay proves every op of an "
            f"untrusted program in bounds before running it (docs/security.md), and this program was not run. Replay with your own "
            f"model code: {python}"
        ).with_cli_fix(python, cli)

    # -- the checks of one op ------------------------------------------------------------------
    def geometry(self, func: Any, t: torch.Tensor, what: str) -> None:
        """``t`` (sizes, strides, offset) lies inside its storage."""
        sizes = [self.upper(s) for s in t.shape]
        if 0 in sizes:
            return
        strides = [self.upper(s) for s in t.stride()]
        offset = self.upper(t.storage_offset())
        hi = offset + sum((n - 1) * s for n, s in zip(sizes, strides) if s > 0)
        lo = offset + sum((n - 1) * s for n, s in zip(sizes, strides) if s < 0)
        nbytes = self.upper(t.untyped_storage().nbytes())
        if lo < 0 or (hi + 1) * t.element_size() > nbytes:
            raise self.refuse(func, (
                f"{what} sizes {sizes}, strides {strides} and storage offset {offset}: it reaches elements {lo:,} to {hi:,} of "
                f"{t.dtype}, bytes {lo * t.element_size():,} to {(hi + 1) * t.element_size():,} of a storage of {nbytes:,} bytes "
                "(a view outside its storage reads and writes other memory)"))

    def mirror(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Run a view op on plain meta tensors with its inputs' geometry, outside the fake mode:
        its own kernel's sizes and strides, checked against the storage."""
        from torch.utils._python_dispatch import _disable_current_modes

        def meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                store = torch.UntypedStorage(self.upper(x.untyped_storage().nbytes()), device="meta")
                return torch.empty(0, dtype=x.dtype, device="meta").set_(
                    store, self.upper(x.storage_offset()), [self.upper(s) for s in x.shape], [self.upper(s) for s in x.stride()])
            if isinstance(x, (list, tuple)):
                return type(x)(meta(v) for v in x)
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x

        with _disable_current_modes():
            try:
                out = func(*meta(args), **{k: meta(v) for k, v in kwargs.items()})
            except Exception as e:  # noqa: BLE001 - the op's own kernel refuses its arguments: so does nanreplay
                raise self.refuse(func, f"makes a view its own kernel refuses ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
            for t in _tensors(out):
                self.geometry(func, t, "makes a view (in its own kernel) with")

    def inplace(self, func: Any, a: dict) -> None:
        """Written arguments (``Tensor(a!)``) alias only storages the program created, or buffers."""
        for arg in func._schema.arguments:
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            for t in _tensors(a.get(arg.name)):
                key = t.untyped_storage()._cdata
                if key in self.real and key not in self.writable:
                    raise self.refuse(func, (
                        f"writes in place into {self.names[key]} (through {arg.name!r}), which is neither a tensor the program created "
                        "nor a buffer of the model (an alias such as detach, a view or a no-copy to() shares its storage)"))

    def alive(self, func: Any, outs: list, workspace: int) -> None:
        """Register the storages ``outs`` created; the bytes alive plus ``workspace`` stay within
        the budget."""
        for t in outs:
            st = t.untyped_storage()
            key = st._cdata
            if key in self.real or key in self.live:
                continue
            n = self.upper(st.nbytes())
            self.live[key] = (self._weak(st), n)
            self.total += n
        if self.exact or self.total + workspace > self.budget.bytes:
            self.prune()
        self.peak = max(self.peak, self.total + workspace)
        if self.total + workspace > self.budget.bytes:
            ws = f" and a workspace of {_mib(workspace)}" if workspace else ""
            raise self.refuse(func, (
                f"would hold {_mib(self.total)} of storages alive{ws}, more than the program's budget of {self.budget.describe_bytes()} "
                f"(the largest: {_mib(max((n for _, n in self.live.values()), default=0))})"), budget=True)

    def prune(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.total -= self.live.pop(k)[1]

    def account(self, func: Any, a: dict, call: tuple, out: Any, outs: list) -> None:
        """Add the op's work (``call``: its positional and keyword arguments); stay within the budget."""
        from torch.utils.flop_counter import flop_registry

        packet = func.overloadpacket
        name = packet.__name__
        if packet in flop_registry:
            work = self.upper(flop_registry[packet](*call[0], **call[1], out_val=out))
        elif name in _EXTRA_WORK:
            work = _EXTRA_WORK[name](a)
        elif func.is_view:
            work = 0
        else:
            work = sum(self.upper(t.numel()) for t in _tensors(list(a.values())) + outs)
        self.work += work
        if self.work > self.budget.work:
            raise self.refuse(func, f"would bring the program's work to {self.work:,} element-operations, more than its budget of "
                                    f"{self.budget.describe_work()}", budget=True)

    def outputs(self, func: Any, a: dict) -> None:
        """An op that returns a list returns at most as many tensors as its node declares (or
        :data:`MAX_OUTPUTS`): counted from its arguments before the node runs
        (:data:`OUTPUT_COUNTS`), since a composite op (``tensor_split``, ``chunk``) reaches the
        dispatch mode only as the views it makes, one call each."""
        counter = OUTPUT_COUNTS.get(func.overloadpacket.__name__)
        if counter is None:
            return
        try:
            count = counter(a)
        except Exception:  # noqa: BLE001 - a size torch cannot compare yet (data-dependent): the op's fake kernel refuses it
            return
        try:
            n = self.upper(count)
        except _Unbounded:
            raise self.refuse(func, "returns a number of tensors that depends on tensor values without a bound nanreplay can prove") from None
        val = self.node.meta.get("val") if self.node is not None else None
        declared = len(val) if isinstance(val, (list, tuple)) else None
        limit = declared if declared is not None else MAX_OUTPUTS
        if n > limit:
            said = f"the program declares {declared}" if declared is not None else f"at most {MAX_OUTPUTS:,} are allowed"
            raise self.refuse(func, f"would return {n:,} tensors; {said} (each is an object in memory, even of no elements)")

    def op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One aten op on fake tensors, checked."""
        check_deadline()
        a = op_arguments(func, args, kwargs)
        self.inplace(func, a)
        contract = SHAPE_CONTRACTS.get(func.overloadpacket.__name__)
        problem = contract(a) if contract is not None else None
        if problem:
            raise self.refuse(func, f"{problem}: its kernel would read outside its tensors")
        out = func(*args, **kwargs)
        outs = _tensors(out)
        try:
            for t in outs:
                self.geometry(func, t, "makes a tensor with")
            if func.is_view or torch.Tag.inplace_view in func.tags:
                self.mirror(func, args, kwargs)
            ws = WORKSPACE.get(func.overloadpacket.__name__)
            workspace = self.upper(ws(a, out)) if ws is not None else 0
            self.alive(func, outs, workspace)
            self.account(func, a, (args, kwargs), out, outs)
        except _Unbounded:
            raise self.refuse(func, "makes a tensor whose size depends on tensor values without a bound nanreplay can prove") from None
        return out


def _declared_shape(node: Any) -> Optional[list]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [d if isinstance(d, int) else None for d in val.shape]
    return None


class _Interpreter(torch.fx.Interpreter):
    """Runs the program's graph, naming the current node for :class:`_Check`, following the
    subgraphs of ``wrap_with_set_grad_enabled`` and ``wrap_with_autocast`` (under their grad
    mode and autocast) and both branches of ``cond``."""

    def __init__(self, gm: torch.fx.GraphModule, check: _Check) -> None:
        super().__init__(gm)
        self.check = check
        self.extra_traceback = False  # our messages name the node themselves

    def run_node(self, n: Any) -> Any:
        self.check.node = n
        self.check.nodes += 1
        out = super().run_node(n)
        want = _declared_shape(n) if n.op in ("call_function", "placeholder") else None
        if want is not None and isinstance(out, torch.Tensor):
            got = list(out.shape)
            if len(got) != len(want) or any(w is not None and isinstance(g, int) and g != w for w, g in zip(want, got)):
                shown = [g if isinstance(g, int) else "?" for g in got]
                what = (f"input {n.name!r} is declared as {want} (None: symbolic) but the real tensor is {shown}" if n.op == "placeholder" else
                        f"node {n.name!r} ({str(n.target).replace('torch.ops.', '')}) is declared as {want} (None: symbolic) but computes {shown}")
                raise _Damaged(what)
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        name = getattr(target, "_name", None) if isinstance(target, torch._ops.HigherOrderOperator) else None
        if name == "wrap_with_set_grad_enabled":
            enabled, sub, *rest = args
            with torch.set_grad_enabled(enabled):
                return self._sub(sub, rest)
        if name == "wrap_with_autocast":
            device_type, dtype, enabled, cache_enabled, sub, *rest = args
            with torch.autocast(device_type, dtype, enabled, cache_enabled):
                return self._sub(sub, rest)
        if name == "cond":
            pred, true_fn, false_fn, operands = args
            if isinstance(pred, (bool, int)):
                return self._sub(true_fn if pred else false_fn, list(operands))
            self._sub(false_fn, list(operands))  # the branch taken depends on data: both are proven
            return self._sub(true_fn, list(operands))
        if isinstance(target, torch._ops.OpOverload):
            self.check.outputs(target, op_arguments(target, args, kwargs))
        return super().call_function(target, args, kwargs)

    def _sub(self, gm: Any, args: list) -> Any:
        node = self.check.node
        try:
            return _Interpreter(gm, self.check).run(*args)
        finally:
            self.check.node = node


def verify_bounds(gm: torch.fx.GraphModule, inputs: Sequence[Any], *, names: Sequence[str], writable: Iterable[int],
                  user: Iterable[int], exact: bool = False) -> Proof:
    """Run the flat graph ``gm`` of an exported program (``ExportedProgram.graph_module``: its
    placeholders are the weights, buffers and constants, then the call's inputs) on fake tensors
    made from the real ``inputs`` (one per placeholder, in order), checking every op (see the
    module doc). The current grad mode and autocast apply, as in the real run. Nothing real is
    allocated or read, and no random generator advances.

    Args:
        names: what each input is, for messages (``"the parameter 'fc.weight'"``).
        writable: the positions of the inputs the program may write in place (the buffers).
        user: the positions of the call's inputs (:attr:`Budget.input_elements`); the others are
            the program's state.
        exact: prune dead storages after every op, so that ``Proof.peak_bytes`` is exact (for
            ``bench/opset.py``); otherwise only when the count nears the budget.

    Returns:
        a :class:`Proof`.

    Raises:
        ProgramRefused: the first op out of bounds, over a budget, writing into a real tensor,
            or that cannot run on fake tensors (the message names the node, the op and the numbers).
        BundleFormatError: a size the program declares differs from the one its op computes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    t0 = time.perf_counter()
    user = set(user)
    budget = Budget.of([x for i, x in enumerate(inputs) if i not in user and isinstance(x, torch.Tensor)],
                       [x for i, x in enumerate(inputs) if i in user and isinstance(x, torch.Tensor)])
    shape_env = ShapeEnv()
    writable = set(writable)
    with _disable_current_modes(), contextlib.ExitStack() as stack:
        quiet = logging.getLogger("torch._subclasses.fake_tensor")  # logs the op failures this function reports itself
        if not logging.getLogger("nanreplay").isEnabledFor(logging.DEBUG) and not quiet.disabled:
            quiet.disabled = True
            stack.callback(setattr, quiet, "disabled", False)
        fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
        fakes, keys, wkeys = [], {}, set()
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                f = fake_mode.from_tensor(x, static_shapes=True)
                key = f.untyped_storage()._cdata
                keys.setdefault(key, names[i])
                if i in writable:
                    wkeys.add(key)
                fakes.append(f)
            else:
                fakes.append(x)
        check = _Check(budget, shape_env, keys, wkeys, exact)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                return check.op(func, args, kwargs or {})

        stack.enter_context(fake_mode)
        stack.enter_context(_Mode())
        try:
            out = _Interpreter(gm, check).run(*fakes)
            del out
        except (ProgramRefused, BundleFormatError):
            raise
        except _Damaged as e:
            raise BundleFormatError(
                f"the embedded program's metadata contradicts its own ops: {e}; the bundle was hand-edited or damaged: record it again"
            ) from None
        except _Unbounded:
            raise check.refuse(None, "makes a size that depends on tensor values without a bound nanreplay can prove") from None
        except Exception as e:  # noqa: BLE001 - an op that cannot run on shapes alone is not run on data either
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise check.refuse(None, f"failed while running on fake tensors ({type(e).__name__}: {first}): the program is damaged or "
                                     f"does not run under torch {torch.__version__}") from None
    return Proof(nodes=check.nodes, peak_bytes=check.peak, work=check.work, budget=budget, seconds=time.perf_counter() - t0)
