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


TORCH_DRAWS = [
    lambda: torch.rand(1),
    lambda: torch.randn(1),   # makes two normals, caches one: the next randn(1) leaves the Twister alone
    lambda: torch.randn(1),
    lambda: torch.randn(1, dtype=torch.float64),
    lambda: torch.randint(0, 10, (624,)),  # a whole Twister period
    lambda: torch.nn.functional.dropout(torch.ones(16), 0.5),
    lambda: torch.randperm(7),
]


@pytest.mark.parametrize("in_place", [True, False])
def test_the_reader_sees_every_move_of_torchs_cpu_generator_and_only_those(monkeypatch, in_place):
    """RNGReader (in place: the engine's bytes compared with their last copy; else get_state() compared) hands back
    the last state object exactly when torch's CPU generator did not move, and a state equal to
    torch.get_rng_state() otherwise, cached normal samples included."""
    from nanreplay.core import rng as rng_module

    if not in_place:
        monkeypatch.setattr(rng_module, "_engine_offset", lambda gen: None)  # a layout it does not know
    reader = rng_module.RNGReader()
    assert reader._torch_raw.ok is in_place
    last = reader.capture()
    for draw in TORCH_DRAWS:
        assert reader.capture() is last  # nothing drawn since
        draw()
        now = reader.capture()
        assert now is not last and torch.equal(now.torch_cpu, torch.get_rng_state())
        last = now
    torch.set_rng_state(torch.get_rng_state())  # set to the state it has (its padding bytes may change: then a copy)
    assert torch.equal(reader.capture().torch_cpu, last.torch_cpu)


def test_the_in_place_layout_is_checked_on_a_private_generator():
    """Finding the engine's bytes draws only from a private generator: the process's own stream
    is where it was."""
    from nanreplay.core import rng as rng_module

    before = torch.get_rng_state()
    assert rng_module._engine_offset(torch.Generator()) is not None
    assert torch.equal(torch.get_rng_state(), before)


def test_the_in_place_reader_stops_reading_memory_it_no_longer_knows():
    """Should the generator ever hold another C++ object than the one found at construction, the
    reader stops reading that memory and reads get_state() from then on, still exactly."""
    from nanreplay.core import rng as rng_module

    reader = rng_module.RNGReader()
    assert reader._torch_raw.ok
    last = reader.capture()
    reader._torch_raw.impl += 64  # as if the pointer had changed since
    torch.rand(1)
    now = reader.capture()
    assert not reader._torch_raw.ok
    assert now is not last and torch.equal(now.torch_cpu, torch.get_rng_state())
    assert reader.capture() is now  # unchanged, through get_state()
