"""The operators an embedded program may call: a reviewed allowlist of exact overloads.

An embedded program (:mod:`nanreplay.engine.program`) is data from a file someone handed you. Torch
has operators that read and write files (``aten.from_file``, ``aten._load*``, ``aten.save``),
allocate what their arguments say (``aten.empty`` of any size), resolve Python callables
(higher-order ops taking an operator name) or write into their ``out=`` argument. None of them is
needed to replay a training step, so the program checker
(:mod:`nanreplay.engine.program_check`) accepts a node only when its target is one of the exact
overloads below, and then checks its arguments (:data:`STRING_ARGS` for the few string
arguments). What the ops then do with their arguments (sizes, strides, bytes, in-place writes) is
proven before the program runs (:mod:`nanreplay.engine.bounds`), and their index values are
checked while it runs (:mod:`nanreplay.engine.guards`).

Private aliasing ops are left out even where torch has them: ``_reshape_alias`` (its kernel builds
a view of any sizes and strides without checking them against the storage, unlike the refused
``as_strided``) and ``_unsafe_view`` (an alias autograd does not track as a view). ``torch.export``
does not emit either for a training program (``python bench/opset.py``: none of its 42 models
uses them); it emits ``reshape``/``view``, whose kernels check their sizes. ``_conj`` stays: the
complex ``stft`` of one corpus model emits it, and it takes no sizes or strides. So are batch
normalisation's kernel entry points (``native_batch_norm``, ``_native_batch_norm_legit*``): their
CPU kernel reads one weight and running statistic per channel without checking their lengths,
and export emits ``batch_norm``, which checks them.

How the list was built (``python bench/opset.py`` re-derives the observed part): the Core ATen
opset (``torch.Tag.core``, minus its ``out`` overload and ``as_strided``), plus the training-IR
operators ``torch.export.export`` emitted for the corpus (``tests/corpus``), the bench models
(``bench/models.py``), the test models, GPT-2 and Llama configurations from ``transformers`` and
compiled models, plus their close relatives that ordinary model code calls (every activation of
``torch.nn.functional``, every loss, the in-place forms ``nn`` modules use). To extend it: add the
exact overload to the group it belongs to, with no ``out`` argument and no ``str`` argument (or a
:data:`STRING_ARGS` entry with the values it may take), and run ``tests/engine/test_program_checks.py``.

Each entry is ``"<op>.<overload>"`` in the ``aten`` namespace, or ``"higher_order.<name>"``.
"""

from __future__ import annotations

import re
from typing import Callable, Union

__all__ = ["OPS", "HIGHER_ORDER", "SYM_FUNCTIONS", "STRING_ARGS", "allowed"]


def _group(*names: str) -> frozenset[str]:
    return frozenset(names)


#: aten overloads, in groups. ``.default`` is spelled out: an entry is one exact overload.
OPS: frozenset[str] = frozenset().union(
    # -- elementwise math, one tensor in, one out
    _group(
        "abs.default", "absolute.default", "neg.default", "negative.default", "positive.default", "sign.default", "sgn.default",
        "signbit.default", "exp.default", "exp2.default", "expm1.default", "log.default", "log2.default", "log10.default",
        "log1p.default", "sqrt.default", "rsqrt.default", "square.default", "reciprocal.default", "sin.default", "cos.default",
        "tan.default", "asin.default", "acos.default", "atan.default", "sinh.default", "cosh.default", "tanh.default",
        "asinh.default", "acosh.default", "atanh.default", "arcsin.default", "arccos.default", "arctan.default",
        "erf.default", "erfc.default", "erfinv.default", "lgamma.default", "digamma.default", "logit.default",
        "floor.default", "ceil.default", "round.default", "round.decimals", "trunc.default", "frac.default", "fix.default",
        "nan_to_num.default", "deg2rad.default", "rad2deg.default", "i0.default", "sinc.default",
    ),
    # -- activations (torch.nn.functional)
    _group(
        "relu.default", "relu6.default", "gelu.default", "silu.default", "mish.default", "elu.default", "selu.default",
        "celu.default", "softplus.default", "softshrink.default", "hardshrink.default",
        "hardtanh.default", "hardsigmoid.default", "hardswish.default", "leaky_relu.default", "rrelu.default", "prelu.default",
        "glu.default", "log_sigmoid.default", "sigmoid.default", "threshold.default", "softmax.int", "log_softmax.int",
        "_softmax.default", "_log_softmax.default", "special_expit.default", "special_logit.default",
    ),
    # -- predicates and comparisons
    _group(
        "isnan.default", "isinf.default", "isfinite.default", "isneginf.default", "isposinf.default", "isreal.default",
        "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor", "le.Scalar",
        "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar", "isclose.default", "allclose.default", "equal.default",
        "logical_not.default", "logical_and.default", "logical_or.default", "logical_xor.default",
        "bitwise_not.default", "bitwise_and.Tensor", "bitwise_and.Scalar", "bitwise_or.Tensor", "bitwise_or.Scalar",
        "bitwise_xor.Tensor", "bitwise_xor.Scalar", "__and__.Tensor", "__and__.Scalar", "__or__.Tensor", "__or__.Scalar",
        "__xor__.Tensor", "__xor__.Scalar",
    ),
    # -- arithmetic on two or three tensors
    _group(
        "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar", "mul.Tensor", "mul.Scalar",
        "div.Tensor", "div.Scalar", "div.Tensor_mode", "div.Scalar_mode", "true_divide.Tensor", "true_divide.Scalar",
        "floor_divide.default", "floor_divide.Scalar", "remainder.Tensor", "remainder.Scalar", "fmod.Tensor", "fmod.Scalar",
        "pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar", "float_power.Tensor_Tensor", "float_power.Tensor_Scalar",
        "float_power.Scalar", "atan2.default", "arctan2.default", "maximum.default", "minimum.default", "fmax.default",
        "fmin.default", "hypot.default", "copysign.Tensor", "copysign.Scalar", "logaddexp.default", "logaddexp2.default",
        "xlogy.Tensor", "xlogy.Scalar_Self", "xlogy.Scalar_Other", "special_xlog1py.default", "lerp.Scalar", "lerp.Tensor",
        "addcmul.default", "addcdiv.default", "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar",
        "clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_min.Tensor", "clamp_max.default", "clamp_max.Tensor",
        "clip.default", "clip.Tensor", "heaviside.default",
    ),
    # -- reductions and scans
    _group(
        "sum.default", "sum.dim_IntList", "nansum.default", "mean.default", "mean.dim", "nanmean.default", "prod.default",
        "prod.dim_int", "amax.default", "amin.default", "aminmax.default", "max.default", "max.dim", "max.other",
        "min.default", "min.dim", "min.other", "argmax.default", "argmin.default", "any.default", "any.dim", "any.dims",
        "all.default", "all.dim", "all.dims", "var.default", "var.dim", "var.correction", "std.default", "std.dim",
        "std.correction", "var_mean.default", "var_mean.dim", "var_mean.correction", "std_mean.default", "std_mean.dim",
        "std_mean.correction", "logsumexp.default", "norm.Scalar", "norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype",
        "linalg_vector_norm.default", "linalg_norm.default", "frobenius_norm.dim", "cumsum.default", "cumprod.default",
        "cummax.default", "cummin.default", "logcumsumexp.default", "count_nonzero.default", "count_nonzero.dim_IntList",
        "median.default", "median.dim", "nanmedian.default", "nanmedian.dim", "mode.default", "kthvalue.default",
        "sort.default", "sort.stable", "argsort.default", "argsort.stable", "topk.default", "diff.default",
        "quantile.default", "quantile.scalar", "nanquantile.default", "nanquantile.scalar",
    ),
    # -- linear algebra
    _group(
        "mm.default", "bmm.default", "matmul.default", "addmm.default", "addbmm.default", "baddbmm.default", "addmv.default",
        "linear.default", "bilinear.default", "einsum.default", "dot.default", "vdot.default", "mv.default", "outer.default",
        "ger.default", "inner.default", "tensordot.default", "kron.default", "t.default", "numpy_T.default", "mT.default",
        "mH.default", "adjoint.default", "cross.default", "linalg_cross.default", "diag.default", "diagonal.default",
        "diag_embed.default", "trace.default", "tril.default", "triu.default", "cdist.default", "_cdist_forward.default",
        "pdist.default", "_pdist_forward.default", "linalg_inv.default", "inverse.default", "linalg_solve.default",
        "linalg_cholesky.default", "cholesky.default", "linalg_det.default", "det.default", "logdet.default",
        "linalg_slogdet.default", "slogdet.default", "linalg_eigh.default", "linalg_eigvalsh.default", "linalg_svd.default",
        "linalg_svdvals.default", "svd.default", "linalg_qr.default", "qr.default", "linalg_pinv.default", "pinverse.default",
        "linalg_matrix_norm.default", "linalg_matrix_exp.default", "matrix_exp.default", "chain_matmul.default",
        "linalg_multi_dot.default",
    ),
    # -- neural-network layers (training IR keeps them whole)
    _group(
        "conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding", "conv3d.padding",
        "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input", "convolution.default",
        "_convolution.default", "batch_norm.default", "instance_norm.default", "layer_norm.default", "group_norm.default",
        "rms_norm.default", "native_layer_norm.default", "native_group_norm.default", "_weight_norm.default",
        "_weight_norm_interface.default", "dropout.default", "native_dropout.default", "feature_dropout.default",
        "alpha_dropout.default", "feature_alpha_dropout.default", "embedding.default", "embedding_bag.default", "embedding_bag.padding_idx",
        "_embedding_bag.default", "scaled_dot_product_attention.default", "max_pool1d.default", "max_pool2d.default",
        "max_pool3d.default", "max_pool1d_with_indices.default", "max_pool2d_with_indices.default",
        "max_pool3d_with_indices.default", "avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default",
        "adaptive_avg_pool1d.default", "adaptive_avg_pool2d.default", "adaptive_avg_pool3d.default",
        "_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default", "adaptive_max_pool1d.default",
        "adaptive_max_pool2d.default", "adaptive_max_pool3d.default", "upsample_nearest1d.vec", "upsample_nearest2d.vec",
        "upsample_nearest3d.vec", "upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_trilinear3d.vec",
        "upsample_bicubic2d.vec", "_upsample_nearest_exact1d.vec", "_upsample_nearest_exact2d.vec",
        "_upsample_nearest_exact3d.vec", "pixel_shuffle.default", "pixel_unshuffle.default", "channel_shuffle.default",
        "pad.default", "constant_pad_nd.default", "reflection_pad1d.default", "reflection_pad2d.default",
        "reflection_pad3d.default", "replication_pad1d.default", "replication_pad2d.default", "replication_pad3d.default",
        "grid_sampler.default", "grid_sampler_2d.default", "affine_grid_generator.default", "one_hot.default",
        "lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input", "lstm_cell.default", "gru_cell.default",
        "rnn_tanh_cell.default", "rnn_relu_cell.default", "col2im.default", "im2col.default",
    ),
    # -- losses and distances
    _group(
        "cross_entropy_loss.default", "nll_loss.default", "nll_loss_nd.default", "nll_loss2d.default", "mse_loss.default",
        "l1_loss.default", "smooth_l1_loss.default", "huber_loss.default", "binary_cross_entropy.default",
        "binary_cross_entropy_with_logits.default", "kl_div.default", "soft_margin_loss.default",
        "margin_ranking_loss.default", "hinge_embedding_loss.default", "cosine_embedding_loss.default",
        "triplet_margin_loss.default", "poisson_nll_loss.default", "ctc_loss.IntList", "ctc_loss.Tensor",
        "multilabel_margin_loss.default", "multi_margin_loss.default", "cosine_similarity.default",
        "pairwise_distance.default",
    ),
    # -- shapes, views, copies, indexing (no allocation beyond the result)
    _group(
        "view.default", "view.dtype", "reshape.default", "flatten.using_ints", "unflatten.int", "squeeze.default", "squeeze.dim", "squeeze.dims", "unsqueeze.default",
        "permute.default", "transpose.int", "swapaxes.default", "swapdims.default", "movedim.int", "movedim.intlist",
        "moveaxis.int", "moveaxis.intlist", "expand.default", "expand_as.default", "broadcast_to.default",
        "broadcast_tensors.default", "contiguous.default", "clone.default", "detach.default", "alias.default",
        "lift_fresh_copy.default", "view_as.default", "type_as.default", "reshape_as.default", "select.int",
        "slice.Tensor", "narrow.default", "index_select.default", "gather.default", "take.default",
        "take_along_dim.default", "index.Tensor", "index_put.default", "index_add.default", "index_copy.default",
        "index_fill.int_Scalar", "index_fill.int_Tensor", "masked_fill.Scalar", "masked_fill.Tensor",
        "masked_select.default", "masked_scatter.default", "scatter.src", "scatter.value", "scatter.reduce",
        "scatter.value_reduce", "scatter_add.default", "scatter_reduce.two", "select_scatter.default",
        "slice_scatter.default", "diagonal_scatter.default", "cat.default", "concat.default", "concatenate.default",
        "stack.default", "hstack.default", "vstack.default", "dstack.default", "split.Tensor", "split.sizes",
        "split_with_sizes.default", "chunk.default", "tensor_split.sections", "tensor_split.indices", "unbind.int",
        "flip.default", "fliplr.default", "flipud.default", "roll.default", "rot90.default", "repeat.default",
        "repeat_interleave.self_int", "repeat_interleave.self_Tensor", "repeat_interleave.Tensor", "tile.default",
        "unfold.default", "to.dtype", "to.dtype_layout", "to.device", "to.other", "_to_copy.default", "copy.default",
        "fill.Scalar", "fill.Tensor", "nonzero.default", "argwhere.default", "where.default", "searchsorted.Tensor",
        "searchsorted.Scalar", "bucketize.Tensor", "bucketize.Scalar", "unique_dim.default", "_unique2.default",
        "unique_consecutive.default", "meshgrid.default", "meshgrid.indexing", "cartesian_prod.default",
        "tril_indices.default", "triu_indices.default", "atleast_1d.default", "atleast_2d.default", "atleast_3d.default",
        "ravel.default", "block_diag.default", "histc.default", "bincount.default",
    ),
    # -- complex numbers and spectra
    _group(
        "real.default", "imag.default", "conj.default", "_conj.default", "conj_physical.default", "resolve_conj.default",
        "resolve_neg.default", "angle.default", "polar.default", "complex.default", "view_as_real.default",
        "view_as_complex.default", "fft_fft.default", "fft_ifft.default", "fft_rfft.default", "fft_irfft.default",
        "fft_fft2.default", "fft_ifft2.default", "fft_rfft2.default", "fft_irfft2.default", "fft_fftn.default",
        "fft_ifftn.default", "fft_rfftn.default", "fft_irfftn.default", "fft_fftshift.default", "fft_ifftshift.default",
        "_fft_r2c.default", "_fft_c2r.default", "_fft_c2c.default", "stft.default", "istft.default",
    ),
    # -- tensor factories: what they allocate is proven within the program's budget (engine.bounds)
    _group(
        "zeros.default", "ones.default", "full.default", "empty.memory_format", "empty_strided.default",
        "scalar_tensor.default", "arange.default", "arange.start", "arange.start_step", "linspace.default",
        "logspace.default", "eye.default", "eye.m", "zeros_like.default", "ones_like.default", "full_like.default",
        "empty_like.default", "rand_like.default", "randn_like.default", "randint_like.default", "randint_like.low_dtype",
        "new_zeros.default", "new_ones.default", "new_full.default", "new_empty.default", "new_empty_strided.default",
        "rand.default", "randn.default", "randint.default", "randint.low", "randperm.default", "bernoulli.default",
        "bernoulli.p", "multinomial.default", "normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor",
        "normal.float_float", "poisson.default",
    ),
    # -- in-place forms that model code and nn modules use (proven to write only into storages
    #    the program created, or into the model's buffers: engine.bounds)
    _group(
        "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar", "div_.Tensor",
        "div_.Scalar", "div_.Tensor_mode", "copy_.default", "fill_.Scalar", "fill_.Tensor", "zero_.default",
        "masked_fill_.Scalar", "masked_fill_.Tensor", "index_put_.default", "index_add_.default", "index_copy_.default",
        "index_fill_.int_Scalar", "scatter_.src", "scatter_.value", "scatter_add_.default", "clamp_.default",
        "clamp_min_.default", "clamp_max_.default", "relu_.default", "sigmoid_.default", "tanh_.default", "exp_.default",
        "neg_.default", "pow_.Scalar", "pow_.Tensor", "sqrt_.default", "abs_.default", "hardtanh_.default",
        "leaky_relu_.default", "elu_.default", "silu_.default", "gelu_.default", "threshold_.default", "detach_.default",
        "clip_.default", "addcmul_.default", "addcdiv_.default", "lerp_.Scalar", "lerp_.Tensor", "uniform_.default",
        "normal_.default", "bernoulli_.float", "dropout_.default", "squeeze_.dim", "unsqueeze_.default",
        "transpose_.default", "t_.default", "tril_.default", "triu_.default", "log_.default", "reciprocal_.default",
        "floor_.default", "round_.default", "mish_.default", "hardswish_.default", "hardsigmoid_.default",
        "nan_to_num_.default", "rsqrt_.default",
    ),
    # -- shape arithmetic and checks export inserts (symbolic sizes, runtime asserts)
    _group(
        "sym_size.int", "sym_numel.default", "sym_stride.int", "sym_storage_offset.default", "_assert_scalar.default",
        "_assert_tensor_metadata.default", "sym_constrain_range_for_size.default", "_local_scalar_dense.default",
        "item.default", "_functional_assert_scalar.default",
    ),
)

#: higher-order operators: their callable arguments must be subgraphs of the same program
#: (``as_graph``); no higher-order op that loops (``while_loop``) or names a Python callable.
HIGHER_ORDER: frozenset[str] = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast", "cond"})

#: call_function targets that compute on symbolic sizes (Python ints), not tensors: torch's own
#: list of the symbolic-shape operators its serializer writes (``torch._export.serde``).
SYM_FUNCTIONS: frozenset[str] = frozenset({
    "_operator.add", "_operator.sub", "_operator.mul", "_operator.floordiv", "_operator.truediv", "_operator.mod",
    "_operator.neg", "_operator.pos", "_operator.pow", "_operator.eq", "_operator.ne", "_operator.lt", "_operator.le",
    "_operator.gt", "_operator.ge", "_operator.and_", "_operator.or_", "_operator.lshift", "_operator.rshift",
    "_operator.getitem", "math.trunc", "torch.sym_float", "torch.sym_int", "torch.sym_ite", "torch.sym_max",
    "torch.sym_min", "torch.sym_not", "torch._sym_sqrt",
})

_Check = Union[frozenset, Callable[[str], bool]]


def _pattern(regex: str) -> Callable[[str], bool]:
    compiled = re.compile(regex)
    return lambda s: compiled.fullmatch(s) is not None


_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "meta"})
_FFT_NORM = frozenset({"backward", "forward", "ortho"})

#: the only ``str`` arguments a program may pass: ``(op, argument name) -> the values allowed``
#: (a set, or a pattern). Any other string argument refuses the program.
STRING_ARGS: dict[tuple[str, str], _Check] = {
    **{(op, "approximate"): frozenset({"none", "tanh"}) for op in ("gelu.default", "gelu_.default")},
    **{(op, "rounding_mode"): frozenset({"trunc", "floor"}) for op in ("div.Tensor_mode", "div.Scalar_mode", "div_.Tensor_mode")},
    **{(op, "reduce"): frozenset({"add", "multiply"}) for op in ("scatter.reduce", "scatter.value_reduce")},
    ("scatter_reduce.two", "reduce"): frozenset({"sum", "prod", "mean", "amax", "amin"}),
    **{(f"conv{k}d.padding", "padding"): frozenset({"same", "valid"}) for k in (1, 2, 3)},
    ("pad.default", "mode"): frozenset({"constant", "reflect", "replicate", "circular"}),
    ("einsum.default", "equation"): _pattern(r"[A-Za-z ,.\->]{1,200}"),
    ("meshgrid.indexing", "indexing"): frozenset({"ij", "xy"}),
    **{(op, "side"): frozenset({"left", "right"}) for op in ("searchsorted.Tensor", "searchsorted.Scalar")},
    **{(op, "UPLO"): frozenset({"L", "U"}) for op in ("linalg_eigh.default", "linalg_eigvalsh.default")},
    ("linalg_svd.default", "driver"): frozenset({"gesvd", "gesvdj", "gesvda"}),
    ("linalg_svdvals.default", "driver"): frozenset({"gesvd", "gesvdj", "gesvda"}),
    **{(op, "mode"): frozenset({"reduced", "complete", "r"}) for op in ("linalg_qr.default",)},
    **{(op, "ord"): frozenset({"fro", "nuc"}) for op in ("linalg_norm.default", "linalg_matrix_norm.default")},
    **{(op, "interpolation"): frozenset({"linear", "lower", "higher", "midpoint", "nearest"})
       for op in ("quantile.default", "quantile.scalar", "nanquantile.default", "nanquantile.scalar")},
    **{(f"fft_{k}.default", "norm"): _FFT_NORM for k in ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2",
                                                         "fftn", "ifftn", "rfftn", "irfftn")},
    ("_assert_scalar.default", "assert_msg"): _pattern(r"[\x20-\x7e]{0,1000}"),
    ("_functional_assert_scalar.default", "assert_msg"): _pattern(r"[\x20-\x7e]{0,1000}"),
    # wrap_with_autocast(device_type, dtype, enabled, cache_enabled, subgraph, *args): positional, unnamed
    ("higher_order.wrap_with_autocast", ""): _DEVICES,
}

def allowed(name: str) -> bool:
    """Whether ``name`` (``"add.Tensor"`` or ``"higher_order.cond"``) is on the allowlist."""
    if name.startswith("higher_order."):
        return name[len("higher_order."):] in HIGHER_ORDER
    return name in OPS


def string_allowed(op: str, arg: str, value: str) -> bool:
    """Whether the ``str`` argument ``arg`` of ``op`` may be ``value`` (see :data:`STRING_ARGS`)."""
    check = STRING_ARGS.get((op, arg))
    if check is None:
        return False
    return value in check if isinstance(check, frozenset) else check(value)
