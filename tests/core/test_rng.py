"""RNG state: the draw after restore equals the draw after capture, for each generator."""

import random

import numpy as np
import pytest
import torch

from nanreplay.core.rng import RNGState


def _draws():
    return random.random(), np.random.rand(3), torch.rand(3), torch.randn(2)


def _flat_roundtrip(s: RNGState) -> RNGState:
    tensors, meta = s.to_flat("rng/")
    return RNGState.from_flat(tensors.__getitem__, meta, "rng/")


@pytest.mark.parametrize("through_bundle_layout", [False, True])
def test_draw_after_restore_equals_draw_after_capture(through_bundle_layout):
    random.gauss(0, 1)  # leave a cached gaussian in python's generator
    np.random.randn()
    s = RNGState.capture()
    first = _draws()
    second = _draws()
    assert first[0] != second[0]  # the generators moved on
    (_flat_roundtrip(s) if through_bundle_layout else s).restore()
    again = _draws()
    assert first[0] == again[0]
    assert np.array_equal(first[1], again[1])
    assert torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])


def test_dropout_mask_after_restore():
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    s = RNGState.capture()
    a = drop(x)
    assert not torch.equal(a, drop(x))
    s.restore()
    assert torch.equal(a, drop(x))


def test_malformed_state_is_rejected():
    t, m = RNGState.capture().to_flat("")
    t["python"] = t["python"][:10]
    with pytest.raises(ValueError, match="malformed"):
        RNGState.from_flat(t.__getitem__, m, "")


@pytest.mark.gpu
def test_cuda_generator_roundtrip():
    torch.zeros(1, device="cuda")
    s = RNGState.capture()
    assert len(s.torch_cuda) == torch.cuda.device_count()
    a = torch.rand(4, device="cuda")
    _flat_roundtrip(s).restore()
    assert torch.equal(a, torch.rand(4, device="cuda"))
