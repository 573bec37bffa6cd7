"""The module monitor's counts of a non-finite output (``monitors._summary``) are those of
``tensor_health``, which they replace on the replay's hot path, for every float dtype the replay
meets, complex included, and for strided, sliced and expanded views."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nanreplay.core.numerics import tensor_health
from nanreplay.engine import monitors


def _health_summary(ts: list) -> dict:
    h = tensor_health(ts)
    return {"nan": h.nan, "posinf": h.posinf, "neginf": h.neginf, "numel": h.numel, "absmax": h.absmax, "dtype": h.dtype, "shape": h.shape}


def _random_tensor(rng: random.Random) -> torch.Tensor:
    dt = rng.choice([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64])
    shape = rng.choice([(0,), (5,), (3, 4), (2, 3, 7)])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dt.is_complex:
        t = torch.randn(shape, dtype=dt, generator=g) * 1e3
    else:
        t = (torch.randn(shape, dtype=torch.float64, generator=g) * 10 ** rng.uniform(-3, 30)).to(dt)  # large ones overflow half
    flat = t.view(-1)
    for _ in range(rng.randint(0, t.numel())):
        flat[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf, 0.0])
    return t


@pytest.mark.parametrize("seed", range(4))
def test_counts_equal_tensor_health(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(100):
        ts = [_random_tensor(rng) for _ in range(rng.randint(1, 3))]
        got = monitors._summary(ts, counts=True)
        if got is None or not (got["nan"] or got["posinf"] or got["neginf"]):
            continue
        assert got == _health_summary(ts), [t.dtype for t in ts]
        checked += 1
    assert checked > 50


def test_counts_of_views_equal_tensor_health():
    base = torch.randn(6, 5) * 1e5
    base.view(-1)[torch.tensor([0, 7, 12, 19, 28])] = torch.tensor([math.nan, math.inf, -math.inf, math.nan, 1.0])
    for v in (base.t(), base[:, ::2], base[:2].expand(3, 2, 5), base.to(torch.bfloat16).t(), torch.complex(base, base.flip(0)).t()):
        got = monitors._summary([v], counts=True)
        assert got["nan"] or got["posinf"] or got["neginf"]
        assert got == _health_summary([v])


def test_all_nonfinite_output_has_no_finite_magnitude():
    t = torch.tensor([math.nan, math.inf, -math.inf])
    assert monitors._summary([t], counts=True) == {"nan": 1, "posinf": 1, "neginf": 1, "numel": 3, "absmax": None, "dtype": "float32",
                                                   "shape": [3]}


def test_counts_of_tensors_that_are_nan_everywhere_equal_tensor_health():
    """The short cut for a tensor whose every element is NaN (once a NaN has spread) counts as the full path does."""
    nan = torch.full((3, 4), math.nan)
    mixed = torch.tensor([1.0, -math.inf, 2.0])
    for ts in ([nan], [nan.to(torch.bfloat16)], [torch.complex(nan, nan)], [nan, mixed], [mixed, nan.t()]):
        assert monitors._summary(ts, counts=True) == _health_summary(ts)
