"""A birth's operand description (``probes._operand``) counts zeros, negatives, NaN, +Inf and -Inf
and gives the finite values' range as their definitions say, for every float dtype, finite or
not, strided or not."""

from __future__ import annotations

import math

import pytest
import torch

from nanreplay.engine import probes


def _by_definition(d: torch.Tensor) -> dict:
    vals = d.flatten().tolist()
    finite = [v for v in vals if math.isfinite(v)]
    out = {"zeros": sum(v == 0 for v in vals), "negatives": sum(v < 0 for v in vals), "nan": sum(math.isnan(v) for v in vals),
           "posinf": sum(v == math.inf for v in vals), "neginf": sum(v == -math.inf for v in vals)}
    if finite:
        nonzero = [abs(v) for v in finite if v != 0]
        out.update(min=min(finite), max=max(finite), absmin_nonzero=min(nonzero) if nonzero else None)
    return out


def _cases(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 30, generator=g).to(dtype)
    x[::7] = 0
    mixed = x.clone()
    mixed[1, 2], mixed[3, 4], mixed[5, 6] = math.nan, math.inf, -math.inf
    yield x
    yield mixed
    yield mixed[::3, 1::2]                       # strided
    yield torch.full((6,), math.nan, dtype=dtype)  # nothing finite
    yield torch.zeros(5, dtype=dtype)             # no non-zero value
    yield torch.tensor([-0.0, 2.0, math.inf], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_operand_counts_and_range_follow_their_definitions(dtype):
    for t in _cases(dtype):
        got = probes._operand(t, "self", frozenset({"weights"}), "mm", frozenset())
        want = _by_definition(t)
        assert {k: got.get(k) for k in want} == want
        assert set(got) - set(want) <= {"name", "shape", "dtype", "numel", "prov", "producer"}


def test_each_operand_counts_its_zeros_where_the_output_went_non_finite():
    """The kernel of log's derivative, ``grad / x``: the incoming gradient is 0 at most positions
    and ``x`` (an underflowed probability) at one; 0 / 0 is NaN only there. Counted at the
    output's non-finite positions (the operand broadcast to the output), the divisor holds that
    zero and the gradient's zeros elsewhere do not count."""
    grad = torch.zeros(2, 4)
    grad[:, 1] = -0.5  # the target class of each row
    x = torch.tensor([[0.2, 0.7, 0.0, 0.1], [0.3, 0.3, 0.2, 0.2]])
    out = grad / x
    desc = probes.operands(torch.ops.aten.div.Tensor, (grad, x), {}, [grad, x], [(frozenset(), "", frozenset(), None)] * 2, output=out)
    g, d = desc["tensors"]
    assert (g["name"], g["zeros"], g["zeros_where_born"]) == ("self", 6, 1)  # its zeros: six, one of them at the NaN
    assert (d["name"], d["zeros"], d["zeros_where_born"], d["negatives_where_born"]) == ("other", 1, 1, 0)
    scalar = probes.operands(torch.ops.aten.div.Tensor, (grad, x[0, 2]), {}, [grad, x[0, 2]], [(frozenset(), "", frozenset(), None)] * 2,
                             output=grad / x[0, 2])
    assert scalar["tensors"][1]["zeros_where_born"] == 8  # a 0-dim divisor of 0, broadcast: at each of the 8 NaN and -Inf
    wide = probes.operands(torch.ops.aten.div.Tensor, (grad, x), {}, [grad, x], [(frozenset(), "", frozenset(), None)] * 2)
    assert "zeros_where_born" not in wide["tensors"][0]  # without the output: not counted
