"""Bundle.state(lazy_optimizer=True): the optimizer state is read at first use, so a replay whose
diagnosis never replays the optimizer update does not read (or checksum) its bytes."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from nanreplay import open_bundle, replay
from nanreplay.errors import BundleFormatError
from nanreplay.format.container import FlatBundle
from helpers import fail_once


def mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


@pytest.fixture
def adam_bundle(out_dir):
    """An Adam step that overflows (a weight of 3e38; the NaN is born in the loss): the update is not replayed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 1)}
    for _ in range(2):  # Adam state exists at the failing step
        opt.zero_grad()
        mse(model, batch).backward()
        opt.step()
    with torch.no_grad():
        model[0].weight[0, 0] = 3e38
    opt.zero_grad()
    return fail_once(model, opt, batch, mse, out_dir, diagnose=False).bundle_path


def _leaves(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def test_lazy_optimizer_state_equals_the_eager_one(adam_bundle):
    with open_bundle(adam_bundle) as b:
        eager, lazy = b.state(), b.state(lazy_optimizer=True)
        assert set(lazy.params) == set(eager.params) and all(torch.equal(lazy.params[k], eager.params[k]) for k in eager.params)
        got, want = _leaves(lazy.optimizer), _leaves(eager.optimizer)
        assert len(got) == len(want) > 0 and all(torch.equal(g, w) for g, w in zip(got, want))
        assert lazy.optimizer is lazy.optimizer  # read once
        assert lazy.nbytes() == eager.nbytes()
        lazy.optimizer = None  # setting it replaces what would have been read
        assert lazy.optimizer is None


def test_a_forward_birth_replay_reads_no_optimizer_state(adam_bundle, monkeypatch):
    read: list[str] = []
    real_get = FlatBundle.get
    monkeypatch.setattr(FlatBundle, "get", lambda self, key, **kw: read.append(key) or real_get(self, key, **kw))
    diag = replay(adam_bundle)
    assert diag["phase"] in ("forward", "loss") and diag["reproduction"]["verdict"].startswith("reproduced")
    assert any(k.startswith("state/params/") for k in read)
    assert not [k for k in read if k.startswith("state/optimizer/")]


def test_a_damaged_optimizer_tensor_is_a_format_error_at_first_use(adam_bundle):
    with h5py.File(adam_bundle, "r+") as f:
        name = next(n for n in f["tensors"] if "optimizer" in n and f["tensors"][n].size > 1)
        data = f["tensors"][name][...]
        f["tensors"][name][...] = np.ones_like(data) * 7  # the manifest's checksum no longer matches
    with open_bundle(adam_bundle) as b:
        lazy = b.state(lazy_optimizer=True)  # the parameters are intact
        with pytest.raises(BundleFormatError, match="checksum"):
            lazy.optimizer
        with pytest.raises(BundleFormatError, match="checksum"):
            b.state()
