"""Bundles that keep the failing step's gradients as digests (Recorder(store_grads=...)): what
they hold, the verdict read from them, and the schema check of a tampered digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanreplay import open_bundle, replay
from nanreplay.core.digest import GradDigest
from nanreplay.errors import BundleFormatError
from nanreplay.format.container import read_flat, write_flat
from helpers import fail_once


def _grad_keys(b) -> list[str]:
    return [k for k in b.keys() if k.startswith("grads/")]


def mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def inf_in_one_sample(out_dir, **opts):
    """A +Inf in one feature of sample 1 of 4: the first Linear's weight gradient is NaN in the
    rows that sample reaches and finite elsewhere (partly non-finite: packed masks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    x, y = torch.randn(4, 64), torch.randn(4, 1)
    x[1, 3] = float("inf")
    return fail_once(model, torch.optim.Adam(model.parameters()), {"x": x, "y": y}, mse, out_dir, diagnose=False, **opts).bundle_path


@pytest.fixture
def digest_bundle(out_dir):
    """Kept as digests (the default, store_grads="auto", on non-finite gradients)."""
    return inf_in_one_sample(out_dir)


def test_auto_keeps_digests_of_non_finite_gradients_and_the_replay_reproduces_them_exactly(digest_bundle):
    with open_bundle(digest_bundle) as b:
        grads = b.grads()
        assert _grad_keys(b) == [] and sorted(b.grads_digested) == sorted(grads)
        assert all(isinstance(g, GradDigest) for g in grads.values())
        assert grads["0.weight"].nan > 0 and sorted(grads["0.weight"].masks) == ["nan"]
        params = b.state().params
        assert all(grads[n].shape == tuple(p.shape) for n, p in params.items() if n in grads)
    d = replay(digest_bundle)
    assert d["reproduction"]["verdict"] == "reproduced exactly"
    assert d["phase"] == "input"


def test_full_keeps_whole_gradients_and_the_two_bundles_agree(out_dir, tmp_path, digest_bundle):
    full = inf_in_one_sample(tmp_path / "full", store_grads="full")
    with open_bundle(full) as f, open_bundle(digest_bundle) as d:
        assert f.grads_digested == [] and len(_grad_keys(f)) == len(d.grads_digested)
        whole, digests = f.grads(), d.grads()
        assert all(digests[n].same_values(GradDigest.from_meta(d.meta["grad_digests"][n], digests[n].masks)) for n in digests)
        from nanreplay.core.digest import digest_of

        assert all(digest_of(whole[n]).same_values(digests[n]) for n in whole)
        # the whole gradients cost their bytes; the digests a few hundred bytes each
        grad_bytes = sum(g.numel() * g.element_size() for g in whole.values())
        assert f.path.stat().st_size - d.path.stat().st_size >= grad_bytes * 0.9
    assert replay(full)["reproduction"]["verdict"] == replay(digest_bundle)["reproduction"]["verdict"] == "reproduced exactly"


def test_store_grads_is_validated():
    from nanreplay.capture.config import RecorderConfig

    with pytest.raises(ValueError, match="store_grads must be 'auto', 'full' or 'digest', got 'none'"):
        RecorderConfig(store_grads="none")


def _tamper(path, tmp_path, edit):
    """A copy of the bundle whose metadata ``edit`` changed (every tensor kept)."""
    with read_flat(path) as f:
        tensors = {k: f.get(k) for k in f.keys()}
        meta = json.loads(json.dumps(f.manifest["meta"]))
    edit(meta, tensors)
    return write_flat(tmp_path / f"tampered{path.suffix}", tensors, meta)


def _first(meta):
    return next(iter(meta["grad_digests"].values()))


@pytest.mark.parametrize("edit, where", [
    (lambda m, t: _first(m).update(sha256="../../etc"), "sha256"),
    (lambda m, t: _first(m).update(nan=10 ** 9), ".nan"),
    (lambda m, t: _first(m).update(dtype="object"), ".dtype"),
    (lambda m, t: _first(m).update(shape=[1, 2, 3]), ".shape"),
    (lambda m, t: _first(m).update(masks=["posinf"]), ".masks"),
    (lambda m, t: _first(m).update(absmax=None), ".absmax"),  # a digest always has it: null was a TypeError in grads()
    (lambda m, t: _first(m).update(sum=None), ".sum"),
    (lambda m, t: m["grads"].append(next(iter(m["grad_digests"]))), "meta.grads"),
    (lambda m, t: m.update(grad_digests=[1]), "meta.grad_digests"),
])
def test_a_tampered_digest_is_a_format_error_naming_where(digest_bundle, tmp_path, edit, where):
    bad = _tamper(Path(digest_bundle), tmp_path, edit)
    with pytest.raises(BundleFormatError, match="invalid metadata") as info:
        open_bundle(bad)
    assert where in str(info.value)


def test_a_missing_mask_tensor_is_a_format_error(digest_bundle, tmp_path):
    """A partly non-finite gradient's mask is a tensor the metadata refers to."""

    def drop(meta, tensors):
        tensors.pop("gradmask/nan/0.weight")

    bad = _tamper(Path(digest_bundle), tmp_path, drop)
    with pytest.raises(BundleFormatError, match="gradmask/nan/0.weight"):
        open_bundle(bad)


def test_finite_values_that_differ_are_reported_by_their_norms(out_dir):
    """A gradient changed after backward, its non-finite pattern kept: the verdict is
    `reproduced`, and with digests the report gives the 2-norms' difference, not a made-up max."""
    from nanreplay import NonFiniteGradientError, Recorder
    from nanreplay.report.text import render_report

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(4, 64), torch.randn(4, 1)
    x[1, 3] = float("inf")
    with Recorder(model, opt, loss_fn=mse, out_dir=out_dir, diagnose=False) as rec:
        rec.record({"x": x, "y": y})
        mse(model, {"x": x, "y": y}).backward()
        with torch.no_grad():
            g = model[0].weight.grad.view(-1)  # NaN where sample 1's +Inf reaches, finite elsewhere
            g[int(torch.isfinite(g).nonzero()[0])] += 0.5  # after backward: no replay produces it
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    d = replay(info.value.bundle_path)
    r = d["reproduction"]
    assert r["verdict"] == "reproduced" and r["max_abs_diff"] is None
    assert 0.0 < r["norm_diff"] <= 0.5  # | |g + 0.5 e_i| - |g| | <= 0.5
    assert "finite gradient 2-norms differ by up to" in render_report(d)


def test_a_nan_loss_with_finite_gradients_keeps_digests_and_reproduces_exactly(out_dir):
    """Cross-entropy over a batch whose every target is padding: the mean over no targets is NaN,
    its gradients are finite zeros. "auto" keeps digests, since the replay recomputes them."""
    from nanreplay import NonFiniteGradientError, Recorder

    def ce(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    opt = torch.optim.Adam(model.parameters())
    batch = (torch.randn(4, 8), torch.full((4,), -100))
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=ce, out_dir=out_dir, diagnose=False) as rec:
            rec.record(batch)
            loss = ce(model, batch)
            rec.log_loss(loss)
            loss.backward()
            assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
            opt.step()
    with open_bundle(ei.value.bundle_path) as b:
        assert b.meta["reason"]["nonfinite_loss"] and not b.meta["reason"]["nonfinite_grad"]
        assert _grad_keys(b) == [] and sorted(b.grads_digested) == ["bias", "weight"]
    d = replay(ei.value.bundle_path)
    assert d["phase"] == "loss" and d["reproduction"]["verdict"] == "reproduced exactly"
