"""The recorder's cheap modes are still correct: host reads per step in the default mode, the
sync-free mode (``check_every``) still bundles the failing step's own evidence, and recycled
snapshot slots hold the right values. Timing lives in bench/overhead.py, never here."""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

import models
from scenarios import poisoned_step
from nanreplay import replay, NonFiniteGradientError, Recorder, open_bundle
from nanreplay.core.digest import grads_nonfinite
from nanreplay.capture import check as check_module

_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextmanager
def count_host_reads():
    """Count calls, made by nanreplay's own code, of the Tensor methods that would block the host
    on a CUDA device (a host sync). The optimizer's own reads (Adam reads its CPU step counters
    with ``.item()``) are not the recorder's and are not counted."""
    counter = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def wrap(orig):
        def wrapper(t, *a, **k):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("nanreplay"):
                counter["n"] += 1
            return orig(t, *a, **k)

        return wrapper

    for name, orig in saved.items():
        setattr(torch.Tensor, name, wrap(orig))
    try:
        yield counter
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)


def _train_step(model, opt, x, rec=None):
    out = model(x)
    loss = out.pow(2).mean()
    if rec is not None:
        rec.log_loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_default_mode_reads_the_device_at_most_once_per_step(out_dir, monkeypatch):
    monkeypatch.setattr(check_module, "CPU_READS_EACH", False)  # the device's path, on the CPU
    model = models.make_dropout_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [torch.randn(4, 8) for _ in range(6)]
    with Recorder(model, opt, out_dir=out_dir) as rec:
        _train_step(model, opt, xs[0], rec)  # the optimizer creates its state: not counted
        with count_host_reads() as reads:
            for x in xs[1:]:
                _train_step(model, opt, x, rec)
    assert reads["n"] <= len(xs) - 1


def test_sync_free_mode_reads_the_device_once_per_check(out_dir):
    model = models.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, opt, out_dir=out_dir, check_every=4) as rec:
        for _ in range(2):  # step 0 creates the optimizer state, step 1 sees its layout change once
            _train_step(model, opt, torch.randn(4, 8), rec)
        with count_host_reads() as reads:
            for _ in range(12):
                _train_step(model, opt, torch.randn(4, 8), rec)
        assert rec.nonfinite_steps == []
    assert reads["n"] <= 3
    assert all(r.finite for r in rec.ring if r.grad_norm is not None)


def _poisoned_run(out_dir, *, action, k=5, n=4, steps=12, fused=False):
    """Train an MLP with dropout and AdamW (``fused``: torch's fused kernel, whose update the
    sync-free mode skips on the device from the first non-finite step); the batch of step k
    holds an Inf. Returns the recorder, the raised error, and what the loop knew at the start of
    step k."""
    torch.manual_seed(0)
    model = models.make_dropout_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
    seen = {}
    err = None
    rec = Recorder(model, opt, out_dir=out_dir, check_every=n, action=action, capacity=2)
    with rec:
        for i in range(steps):
            x = torch.randn(4, 8)
            if i == k:
                x[1, 3] = float("inf")
                seen = {
                    "x": x.clone(),
                    "rng": torch.get_rng_state(),
                    "params": {nm: p.detach().clone() for nm, p in model.named_parameters()},
                    "opt": copy.deepcopy(opt.state_dict()),
                }
            try:
                _train_step(model, opt, x, rec)
            except NonFiniteGradientError as e:
                err = e
                seen["raised_at"] = i
                break
    return rec, err, seen, model, opt


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_sync_free_mode_bundles_the_failing_steps_own_state(out_dir, fused):
    rec, err, seen, model, opt = _poisoned_run(out_dir, action="raise", k=5, n=4, fused=fused)
    assert rec._lagged is None or rec._lagged.freeze == fused
    # the host learns at the check that covers steps 4..7, made at step 8's (before its own verdict
    # is pushed: the values of 4..7 are on the host by then), and blames step 5, not step 7
    assert err is not None and seen["raised_at"] == 8
    assert err.step == 5 and rec.nonfinite_steps == [5]
    with open_bundle(err.bundle_path) as b:
        assert b.failing_step == 5
        assert 5 in b.steps
        step5 = b.step(5)
        (args, kwargs) = step5.forwards[0].inputs
        assert torch.equal(args[0], seen["x"])
        assert torch.equal(step5.rng.torch_cpu, seen["rng"])
        state = b.state()
        for nm, w in seen["params"].items():
            assert torch.equal(state.params[nm], w), nm
        for pid, entries in seen["opt"]["state"].items():
            for key, v in entries.items():
                assert torch.equal(state.optimizer["state"][pid][key], v), (pid, key)
        grads = b.grads()
        assert grads and grads_nonfinite(grads)
    # the replay of step 5 from that evidence reproduces the recorded gradients
    assert err.diagnosis is not None and err.diagnosis["phase"] == "input"  # answered in process without a replay
    assert replay(err.bundle_path, model=models.make_dropout_mlp())["reproduction"]["verdict"].startswith("reproduced")
    # "raise" leaves the live model at step 5's pre-step weights and optimizer state
    for nm, p in model.named_parameters():
        assert torch.equal(p, seen["params"][nm]), nm
    live = opt.state_dict()["state"]
    for pid, entries in seen["opt"]["state"].items():
        for key, v in entries.items():
            assert torch.equal(live[pid][key], v), (pid, key)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_sync_free_skip_goes_on_from_the_failing_steps_weights(out_dir, fused):
    rec, err, seen, model, opt = _poisoned_run(out_dir, action="skip", k=5, n=4, steps=9, fused=fused)
    assert not hasattr(opt, "found_inf")  # the flag lives for one optimizer step
    verdicts = {row[0]: row[4] for row in rec._history.rows}  # step 8, the check's, is in the history, unjudged
    assert [verdicts[i] for i in range(4, 9)] == [True, False, None, None, None]
    assert err is None and rec.nonfinite_steps == [5] and len(rec.bundles) == 1
    for nm, p in model.named_parameters():  # step 8 was the check (of steps 4..7): it was skipped too
        assert torch.equal(p, seen["params"][nm]), nm
    _train_step(model, opt, torch.randn(4, 8), rec)  # recorder closed; training goes on finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_close_checks_the_steps_still_on_the_device(out_dir, fused):
    rec, err, seen, model, opt = _poisoned_run(out_dir, action="raise", k=5, n=8, steps=7, fused=fused)
    assert err is None  # the check was not due yet when the loop ended
    assert rec.nonfinite_steps == [5] and len(rec.bundles) == 1
    with open_bundle(rec.bundles[0]) as b:
        assert b.failing_step == 5
        for nm, w in seen["params"].items():
            assert torch.equal(b.state().params[nm], w), nm


def test_with_a_fused_optimizer_the_latch_copies_only_the_gradients(out_dir):
    """A fused optimizer skips its own update on the device under ``found_inf`` (as under a
    GradScaler): the sync-free mode gives it the latch's flag instead of copying the weights and
    optimizer state every step, so the weights stop moving at the first non-finite step and stay
    there until the host reads the verdicts; with ``action="warn"`` (nothing is put back) the
    update is left alone and the latch copies everything."""
    torch.manual_seed(0)
    model = models.make_dropout_mlp()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for action, freeze in (("raise", True), ("warn", False)):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        with Recorder(m, opt, out_dir=out_dir, check_every=4, action=action, diagnose=False) as rec:
            weights = []
            for i in range(3):
                x = torch.randn(4, 8)
                if i == 1:
                    x[0, 0] = float("nan")
                _train_step(m, opt, x, rec)
                weights.append({n: p.detach().clone() for n, p in m.named_parameters()})
                assert not hasattr(opt, "found_inf")
            latch = rec._lagged.latch
            assert latch.freeze is freeze
            assert latch.nbytes() == (grad_bytes if freeze else 2 * grad_bytes + sum(t.nbytes for t in latch.opt))
            moved = [any(not torch.equal(a[n], b[n]) for n in a) for a, b in zip(weights, weights[1:])]
            if freeze:  # step 1 (NaN) and step 2 left the weights as they were after step 0
                assert moved == [False, False]
                assert all(torch.isfinite(p).all() for p in m.parameters())
            else:  # warn keeps the update: the weights took the NaN step
                assert not all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_sync_free_skip_puts_back_the_failing_steps_buffers(out_dir, fused):
    """BatchNorm's running stats move in every forward, also in the steps that ran after the
    non-finite one before the host read its verdict (with a fused optimizer the weights stay
    frozen meanwhile, the buffers do not): ``"skip"`` puts them back to the failing step's start."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    seen = {}
    with Recorder(model, opt, out_dir=out_dir, check_every=4, action="skip", diagnose=False) as rec:
        for i in range(9):
            x = torch.randn(8, 8)
            if i == 5:
                x[0, 0] = float("inf")
                seen = {n: b.clone() for n, b in model.named_buffers()}
            _train_step(model, opt, x, rec)
            if i == 7:
                assert not torch.isfinite(model[1].running_mean).all()  # the Inf went through BatchNorm's stats
    assert rec.nonfinite_steps == [5]
    for n, b in model.named_buffers():
        assert torch.equal(b, seen[n]), n


@pytest.mark.parametrize("change", ["load_state_dict", "state_dict_hook"])
def test_the_latch_follows_a_changed_optimizer_state(out_dir, change):
    """The latch walks the module tree and the optimizer's state dict only when the state's
    tensors changed: an optimizer reloaded between checks (new tensors) is followed, and one
    whose ``state_dict()`` hands out copies (a post-hook) is walked every step; either way the
    bundle holds the failing step's own optimizer state."""
    torch.manual_seed(0)
    model = models.make_dropout_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if change == "state_dict_hook":
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "state": copy.deepcopy(sd["state"])})
    seen, err = {}, None
    with Recorder(model, opt, out_dir=out_dir, check_every=4, diagnose=False) as rec:
        for i in range(10):
            if change == "load_state_dict" and i == 3:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            x = torch.randn(4, 8)
            if i == 5:
                x[0, 0] = float("inf")
                seen = copy.deepcopy(opt.state_dict()["state"])
            try:
                _train_step(model, opt, x, rec)
            except NonFiniteGradientError as e:
                err = e
                break
    assert err is not None and err.step == 5
    with open_bundle(err.bundle_path) as b:
        got = b.state().optimizer["state"]
        for pid, entries in seen.items():
            for key, v in entries.items():
                assert torch.equal(got[pid][key], v), (pid, key)


def test_recycled_snapshot_slots_hold_each_steps_own_weights(out_dir):
    model = models.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    starts = {}
    with Recorder(model, opt, out_dir=out_dir, snapshot_every=1, capacity=3) as rec:
        for i in range(7):
            starts[i] = {nm: p.detach().clone() for nm, p in model.named_parameters()}
            _train_step(model, opt, torch.randn(4, 8), rec)
        held = [r for r in rec.ring if r.snapshot is not None]
        assert [r.step for r in held] == [4, 5, 6]
        for r in held:
            for nm, w in r.snapshot.params.items():
                assert torch.equal(w, starts[r.step][nm]), (r.step, nm)
        ptrs = {r.snapshot.params["fc1.weight"].data_ptr() for r in held}
        assert len(ptrs) == 3  # three distinct slots, none aliasing the live weights
        assert model.fc1.weight.data_ptr() not in ptrs


def test_check_every_is_validated():
    with pytest.raises(ValueError, match="check_every must be >= 1 step"):
        Recorder(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), check_every=0)


def test_sync_free_mode_refuses_what_it_does_not_support():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"check_every=4 \(the sync-free check\) does not yet combine with check_update=True"):
        Recorder(model, opt, check_every=4, check_update=True)
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # nothing left registered


def test_tensor_learning_rates_are_not_read_on_the_host_per_step(out_dir):
    """A tensor lr (fused/capturable optimizers, some schedulers) stays a device value in the ring
    buffer: float() of a CUDA tensor would be a host sync every step. The bundle gets floats."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        for i in range(2):
            model(torch.randn(4, 8)).sum().backward()
            if i == 1:
                err = poisoned_step(opt, model.fc1.weight)
            else:
                opt.step()
                assert isinstance(rec.ring[-1].lrs[0], torch.Tensor)  # kept as a device value
                opt.zero_grad()
    with open_bundle(err.bundle_path) as b:
        assert b.step(0).lrs == [pytest.approx(0.1)] and b.step(1).lrs == [pytest.approx(0.1)]


def test_on_the_cpu_the_check_reads_each_norm_and_agrees_with_the_device_path(out_dir, monkeypatch):
    """The CPU's shortcut (each per-tensor norm read as a float) and the device's path (one
    stacked read) give the same grad norm and loss, within float32 rounding."""
    seen = {}
    for each in (True, False):
        monkeypatch.setattr(check_module, "CPU_READS_EACH", each)
        torch.manual_seed(0)
        model = models.make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with Recorder(model, opt, out_dir=out_dir) as rec:
            for _ in range(3):
                _train_step(model, opt, torch.ones(4, 8), rec)
        seen[each] = [(r.grad_norm, r.loss) for r in rec.ring]
    for (g1, l1), (g2, l2) in zip(seen[True], seen[False]):
        assert g1 == pytest.approx(g2, rel=1e-6) and l1 == l2
    assert len(seen[True]) == 3


def test_a_cuda_model_on_the_per_step_check_is_told_of_the_sync_free_mode(caplog):
    """One INFO line where the sync-free mode could run and would spare the GPU's queue; none on
    the CPU, in the sync-free mode itself, or where it cannot run (a GradScaler)."""
    import logging
    from types import SimpleNamespace

    from nanreplay.capture.config import RecorderConfig
    from nanreplay.capture.lagged import advise

    def model_on(kind):
        return SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device(kind))]))

    told = []
    for kind, options, scaler in (("cuda", {}, None), ("cpu", {}, None), ("cuda", {"check_every": 8}, None), ("cuda", {}, object())):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanreplay"):
            advise(RecorderConfig(**options), model_on(kind), scaler=scaler)
        told.append(any("check_every=8" in r.getMessage() for r in caplog.records))
    assert told == [True, False, False, False]
