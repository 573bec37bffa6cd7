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
