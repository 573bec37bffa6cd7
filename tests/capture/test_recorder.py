"""The Recorder in a live loop: detection, actions, hooks, capture semantics."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import models
from scenarios import hook_count, poisoned_step
from nanreplay import NonFiniteGradientError, Recorder, RecorderConfig, open_bundle
from nanreplay.core.digest import digests_of


def _poison_step(model: nn.Module, opt, rec: Recorder, x, *, bad: bool):
    out = model(x)
    loss = out.pow(2).mean() * (float("nan") if bad else 1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _opt_state(opt) -> dict:
    return copy.deepcopy(opt.state_dict())


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key, v in a["state"][k].items():
            w = b["state"][k][key]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), (k, key)
            else:
                assert v == w


def test_close_removes_every_hook_and_training_goes_on_unwatched(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_count(model, opt)
    rec = Recorder(model, opt, out_dir=out_dir)
    assert hook_count(model, opt) > before
    _poison_step(model, opt, rec, torch.randn(4, 8), bad=False)
    rec.close()
    rec.close()  # idempotent
    assert hook_count(model, opt) == before
    _poison_step(model, opt, None, torch.randn(4, 8), bad=True)  # no recorder any more: the NaN step goes through
    assert not torch.isfinite(model.fc1.weight).all()
    assert not out_dir.exists() and rec.nonfinite_steps == []


def test_hooks_removed_when_the_loop_raises(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError):
        with Recorder(model, opt, out_dir=out_dir, diagnose=False):
            _poison_step(model, opt, None, torch.randn(4, 8), bad=True)
    assert hook_count(model, opt) == 0


def test_raise_dumps_and_leaves_weights_uncorrupted(out_dir):
    model = models.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    with Recorder(model, opt, out_dir=out_dir) as rec:
        for _ in range(3):
            _poison_step(model, opt, rec, x, bad=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = _opt_state(opt)
        with pytest.raises(NonFiniteGradientError) as info:
            _poison_step(model, opt, rec, x, bad=True)
    err = info.value
    assert err.step == 3
    assert err.bundle_path is not None and err.bundle_path.endswith(".h5")
    assert "step 3" in str(err) and err.bundle_path in str(err)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    _assert_same_state(state, opt.state_dict())
    with open_bundle(err.bundle_path) as b:
        assert b.failing_step == 3
        assert b.steps == [0, 1, 2, 3]
        saved = b.state().params
        for n in before:
            assert torch.equal(saved[n], before[n])
        assert all(g.nonfinite for g in digests_of(b.grads()).values())


def test_skip_leaves_weights_and_optimizer_state_bit_identical(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    x = torch.randn(4, 8)
    with Recorder(model, opt, out_dir=out_dir, action="skip", max_consecutive=2) as rec:
        for _ in range(2):
            _poison_step(model, opt, rec, x, bad=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = _opt_state(opt)
        _poison_step(model, opt, rec, x, bad=True)  # skipped, no raise
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        _assert_same_state(state, opt.state_dict())
        assert len(rec.bundles) == 1
        _poison_step(model, opt, rec, x, bad=True)  # second consecutive skip: still allowed
        with pytest.raises(NonFiniteGradientError, match="consecutive"):
            _poison_step(model, opt, rec, x, bad=True)
        assert len(rec.bundles) == 1  # dumped once, on the first occurrence
    # a finite step after a skip trains normally
    model2 = models.make_mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with Recorder(model2, opt2, out_dir=out_dir, action="skip", diagnose=False) as rec2:
        _poison_step(model2, opt2, rec2, x, bad=True)
        w = model2.fc1.weight.detach().clone()
        _poison_step(model2, opt2, rec2, x, bad=False)
        assert not torch.equal(w, model2.fc1.weight)
        assert rec2.skipped == 0


def test_warn_lets_the_step_proceed(out_dir, caplog):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, action="warn", diagnose=False) as rec:
        _poison_step(model, opt, rec, torch.randn(4, 8), bad=True)
        assert len(rec.bundles) == 1
        assert rec.nonfinite_steps == [0]
    assert not torch.isfinite(model.fc1.weight).all()  # the step went ahead, as asked
    assert "action='warn'" in caplog.text


def test_out_dir_is_checked_when_the_recorder_is_built(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"out_dir=.*file'.*: it is a file"):
        Recorder(model, opt, out_dir=blocker)
    with pytest.raises(ValueError, match=r"its ancestor .*file' is a file"):
        Recorder(model, opt, out_dir=blocker / "sub")
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # nothing attached


def test_failed_dump_is_logged_once_and_training_goes_on(tmp_path, caplog):
    out = tmp_path / "bundles"
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out, action="warn", diagnose=False) as rec:
        out.write_text("the directory became a file after the Recorder was built")
        for _ in range(3):
            _poison_step(model, opt, rec, torch.randn(4, 8), bad=True)
    assert rec.bundles == [] and rec.nonfinite_steps == [0, 1, 2] and rec.step == 3, "training went on"
    assert caplog.text.count("could not write the bundle") == 1, "a failed dump is not retried on every following step"


def test_loss_only_nonfinite_is_detected(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        out = model(torch.randn(4, 8))
        loss = out.mean()
        rec.log_loss(loss * float("inf"))  # a loss the loop logs, while grads stay finite
        loss.backward()
        with pytest.raises(NonFiniteGradientError, match="non-finite loss"):
            opt.step()


def test_gradient_accumulation_captures_every_micro_batch(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(2, 8) for _ in range(3)]
    with Recorder(model, opt, out_dir=out_dir) as rec:
        for x in xs:
            model(x).pow(2).mean().backward()
        torch.no_grad()(model)(torch.randn(5, 8))  # an evaluation forward is not part of the step
        err = poisoned_step(opt, model.fc1.weight)
    with open_bundle(err.bundle_path) as b:
        rec0 = b.step(0)
        assert len(rec0.forwards) == 3
        for fw, x in zip(rec0.forwards, xs):
            args, kwargs = fw.inputs
            assert torch.equal(args[0], x) and kwargs == {}
            assert fw.cotangent is not None and fw.cotangent.shape == (2, 4)


@pytest.mark.parametrize("wide", [False, True])
def test_the_cotangent_is_the_gradient_wrt_the_output_small_or_large(out_dir, wide):
    """A small output keeps its cotangent by retain_grad (no Python in the backward pass), a large
    one (over RETAIN_MAX_BYTES) by a pre-hook of its node: either way the ring holds exactly the
    gradient of the loss w.r.t. the model's output, as its own tensor, and the loop's output.grad
    is what torch gives it (None on an output it did not retain)."""
    from nanreplay.capture.forward import RETAIN_MAX_BYTES

    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = RETAIN_MAX_BYTES // (4 * 4) + 1 if wide else 3  # float32 outputs of 4 features
    loss = lambda o: (o.sin() * 3).sum()  # noqa: E731
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        for step in range(3):
            out = model(torch.randn(rows, 8))
            want = 3 * out.detach().cos()  # d/d out of sum(3 sin(out))
            loss(out).backward()
            opt.step()
            opt.zero_grad()
            got = {r.step: r for r in rec.ring}[step].forwards[0].cotangent
            assert torch.allclose(got, want)
            assert (out.numel() * 4 > RETAIN_MAX_BYTES) is wide
            assert out.retains_grad is not wide
            if not wide:
                assert torch.equal(out.grad, got) and got is not out.grad


class _PassThrough(nn.Module):
    """A model whose output is its input scaled by a weight, or, with ``leaf``, a leaf tensor itself."""

    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.leaf = leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w if self.leaf else x * self.w


@pytest.mark.parametrize("leaf", [False, True])
def test_a_leaf_output_keeps_its_cotangent_by_a_tensor_hook_and_an_output_without_grad_keeps_none(out_dir, leaf):
    """An output that is a leaf tensor (no node made it) keeps its cotangent through a tensor hook,
    the same gradient retain_grad would keep; an output that needs no gradient keeps none."""
    model = _PassThrough(leaf)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        out = model(torch.randn(3, 4))
        want = 3 * out.detach().cos()  # d/d out of sum(3 sin(out)), before the step moves the weight
        (out.sin() * 3).sum().backward()
        assert out.is_leaf is leaf and out.retains_grad is not leaf  # a leaf's .grad is its own: a tensor hook keeps it
        opt.step()
        assert torch.allclose(rec.ring[0].forwards[0].cotangent, want)
        opt.zero_grad()
        with torch.no_grad():
            model.w.requires_grad_(False)
        out = model(torch.randn(3, 4))  # a step whose output needs no gradient (a frozen model): no cotangent
        assert not out.requires_grad
        rec.check_step()
        rec.end_step()
        assert rec.ring[-1].forwards[0].cotangent is None


@pytest.mark.parametrize("wide", [False, True])
def test_two_backward_passes_through_one_output_keep_the_sum_of_their_cotangents(out_dir, wide):
    """Two losses backpropagated through one output in a step (retain_graph=True) both add to the
    parameters' gradients: the step's cotangent is the sum of the two, small output or large."""
    from nanreplay.capture.forward import RETAIN_MAX_BYTES

    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = RETAIN_MAX_BYTES // (4 * 4) + 1 if wide else 3
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        out = model(torch.randn(rows, 8))
        want = 3 * out.detach().cos() + 2 * out.detach()  # d/d out of sum(3 sin(out)), then of sum(out^2)
        (out.sin() * 3).sum().backward(retain_graph=True)
        (out * out).sum().backward()
        opt.step()
        assert torch.allclose(rec.ring[0].forwards[0].cotangent, want)


def test_an_output_modified_in_place_after_the_forward_switches_to_the_pre_hook(out_dir, caplog):
    """An output the loop scales in place holds, under retain_grad, the gradient of its new value:
    that step keeps no cotangent (said once, at INFO), and the later steps keep the gradient w.r.t.
    what the model returned, by the pre-hook of its node."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda o: (o * o).sum()  # noqa: E731
    with caplog.at_level("INFO", logger="nanreplay"), Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        for step in range(3):
            x = torch.randn(3, 8)
            out = model(x)
            want = 8 * out.detach().clone()  # d/d out of (2 out)^2
            out.mul_(2)  # a temperature the loop applies after the forward
            loss(out).backward()
            opt.step()
            opt.zero_grad()
            got = {r.step: r for r in rec.ring}[step].forwards[0].cotangent
            if step == 0:
                assert got is None
            else:
                assert torch.allclose(got, want)
    said = [r.getMessage() for r in caplog.records if "modified the model's output in place" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("nanreplay: step 0:")


def test_in_place_change_of_a_batch_tensor_switches_to_copies(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    buf = torch.randn(4, 8)  # a loop that refills one input buffer, as CUDA-graph loops do
    firsts = []
    with Recorder(model, opt, out_dir=out_dir, diagnose=False, capacity=8) as rec:
        for i in range(4):
            buf.copy_(torch.full((4, 8), float(i)))
            firsts.append(buf.clone())
            model(buf).sum().backward()
            opt.step()
            opt.zero_grad()
        held = {r.step: r.forwards[0].inputs[0][0] for r in rec.ring}
    for step in (1, 2, 3):  # copied from the moment the reuse was seen
        assert torch.equal(held[step], firsts[step]), step


def test_memory_budget_is_never_exceeded(out_dir):
    model = models.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    one_snapshot = 3 * sum(p.numel() * 4 for p in model.parameters())
    with Recorder(model, opt, out_dir=out_dir, snapshot_every=1, capacity=10, memory_budget=2 * one_snapshot + 4096, copy_batch=True) as rec:
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        held = sum(r.snapshot.nbytes() for r in rec.ring if r.snapshot is not None)
        assert held <= rec.config.memory_budget
        assert sum(r.snapshot is not None for r in rec.ring) >= 1


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match=r"action must be one of .* got 'explode'"):
        RecorderConfig(action="explode")
    with pytest.raises(ValueError, match="capacity must be >= 1 step, got 0"):
        RecorderConfig(capacity=0)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Recorder(object(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))


def test_inputs_overwritten_before_the_switch_to_copies_are_marked_stale(out_dir):
    """Step 0 is kept by reference; step 1 refills the same buffer, so step 0's stored input is
    no longer what it saw. The recorder cannot recover it, but must say so."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    buf = torch.randn(4, 8)
    with Recorder(model, opt, out_dir=out_dir, capacity=4) as rec:
        for i in range(2):
            buf.copy_(torch.full((4, 8), float(i)))
            model(buf).sum().backward()
            if i == 1:
                err = poisoned_step(opt, model.fc1.weight)
            else:
                opt.step()
                opt.zero_grad()
    with open_bundle(err.bundle_path) as b:
        assert b.step(0).stale_inputs is True
        assert b.step(1).stale_inputs is False  # copied: the reuse was seen when it was captured
        assert torch.equal(b.step(1).forwards[0].inputs[0][0], torch.full((4, 8), 1.0))


def test_buffers_first_changed_after_step_0_are_saved_at_step_start(out_dir):
    """BatchNorm writes its running stats without bumping the version counter; a BatchNorm in a
    branch step 0 did not take must still be saved as it was at the start of the failing step."""
    model = models.Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, diagnose=False) as rec:
        model(torch.randn(8, 4)).sum().backward()  # step 0: the branch is not taken
        opt.step()
        opt.zero_grad()
        model.use_aux = True
        before = model.aux.running_mean.clone()
        x = torch.randn(8, 4) * 5
        x[0, 0] = float("nan")
        model(x).sum().backward()  # step 1: NaN enters the running stats
        assert not torch.isfinite(model.aux.running_mean).all()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    with open_bundle(info.value.bundle_path) as b:
        assert torch.equal(b.state().buffers["aux.running_mean"], before)


class _DecayEverything(torch.optim.SGD):
    """An optimizer that decays every parameter, with or without a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.mul_(0.99)
        return super().step(closure)


def test_skip_names_an_optimizer_that_changes_weights_without_gradients(out_dir, caplog):
    model = models.make_mlp()
    opt = _DecayEverything(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, action="skip", diagnose=False):
        _poison_step(model, opt, None, torch.randn(4, 8), bad=True)
    assert "updates parameters without gradients" in caplog.text and "_DecayEverything" in caplog.text
    caplog.clear()
    model2 = models.make_mlp()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)  # torch's own: skips params without .grad
    with Recorder(model2, opt2, out_dir=out_dir, action="skip", diagnose=False):
        _poison_step(model2, opt2, None, torch.randn(4, 8), bad=True)
    assert "updates parameters without gradients" not in caplog.text


@dataclasses.dataclass
class ImageBatch:
    image: torch.Tensor
    label: torch.Tensor


def test_dataclass_batch_tensors_are_copied_and_sliced_like_any_other(out_dir):
    """pytree sees a dataclass as one opaque leaf: capture must still copy its tensors once the
    loop is seen reusing buffers, and per-sample replay must slice them."""
    from nanreplay.core.batch import take_rows

    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    buf = torch.zeros(4, 8)
    with Recorder(model, opt, out_dir=out_dir, diagnose=False, copy_batch=True, capacity=4) as rec:
        for i in range(2):
            buf.fill_(float(i))
            batch = ImageBatch(image=buf, label=torch.arange(4))
            rec.record(batch)
            model(batch.image).sum().backward()
            opt.step()
            opt.zero_grad()
        kept = [r.batches[0] for r in rec.ring]
    assert all(isinstance(b, ImageBatch) for b in kept)
    assert kept[0].image is not buf and torch.equal(kept[0].image, torch.zeros(4, 8))  # a copy, not the refilled buffer
    sliced = take_rows(kept[1], [1, 3], 4)
    assert isinstance(sliced, ImageBatch) and sliced.image.shape == (2, 8) and torch.equal(sliced.label, torch.tensor([1, 3]))


def _storage_bytes_held(rec: Recorder, model: nn.Module) -> int:
    """Counted here, independently of ``Recorder.held_bytes``: the bytes of every storage the
    Recorder keeps alive beyond the live parameters and buffers (each storage once; a view keeps
    its whole storage): the ring's batches, forward inputs, cotangents, step-start buffers and
    snapshots, the recycled snapshot slot, the free spares, the sync-free latch and the check_update copy."""
    from torch.utils import _pytree as pytree

    seen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    total = 0

    def add(tree) -> None:
        nonlocal total
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()

    for r in rec.ring:
        add([r.batches, r.buffers, [(fw.inputs, fw.cotangent) for fw in r.forwards]])
        if r.snapshot is not None:
            add([r.snapshot.params, r.snapshot.buffers, r.snapshot.optimizer, r.snapshot.extra])
    add([s.tensors for s in rec.ring.pool._free])
    add([t for free in rec.ring.spares._free.values() for t in free])  # the free spares (a ring of 16 steps or more)
    pre = rec.ring._kept.get("check_update")  # the copy's only owner is the ring
    if pre is not None:
        add([pre.params, pre.buffers, pre.optimizer])
    if rec._lagged is not None:
        add([rec._lagged.latch.slot, list(rec._lagged.latch.history.values())])
    return total


@pytest.mark.parametrize("opts", [dict(), dict(check_update=True), dict(check_every=3)], ids=["plain", "check_update", "check_every"])
def test_memory_budget_holds_after_every_step_counting_storages(out_dir, opts, caplog):
    """Batches are views of one large loader tensor (64 KiB each storage), weight snapshots every
    step (about 3x the parameters for Adam): with a budget of a few steps, the storage bytes the
    Recorder holds stay within the budget at every step, counted here storage by storage."""
    model = models.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = sum(p.numel() * 4 for p in model.parameters())
    budget = 3 * (4 * 16 * 256 * 4) + 2 * 3 * params  # three steps' batch storages, two snapshots
    loaders = [torch.randn(256, 16, 4).unbind(2)[0] for _ in range(12)]  # non-contiguous (256, 16) views: 64 KiB storages
    peaks = []
    with Recorder(model, opt, out_dir=out_dir, snapshot_every=1, capacity=8, memory_budget=budget, diagnose=False, **opts) as rec:
        for i in range(12):
            batch = loaders[i][:4, :8]  # 128 bytes of elements, a 64 KiB storage behind them
            rec.record(batch)
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
            held = _storage_bytes_held(rec, model)
            peaks.append(held)
            assert held <= budget, (i, held, budget)
            assert rec.held_bytes() >= held - 4096, (i, rec.held_bytes(), held)  # what the Recorder counts is what it holds
        assert len(rec.ring) < 8  # steps were evicted to honour the budget, not only by capacity
    assert max(peaks) > budget // 2  # the budget was the binding limit


def test_a_snapshot_larger_than_the_budget_is_refused_once_with_a_warning(out_dir, caplog):
    model = models.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    one_snapshot = 3 * sum(p.numel() * 4 for p in model.parameters())
    budget = one_snapshot // 2
    with Recorder(model, opt, out_dir=out_dir, snapshot_every=1, capacity=4, memory_budget=budget, diagnose=False) as rec:
        for i in range(6):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            assert _storage_bytes_held(rec, model) <= budget, i
        assert all(r.snapshot is None for r in rec.ring)
        assert rec.ring.snapshots_refused
    warnings = [r for r in caplog.records if "does not fit in memory_budget" in r.getMessage()]
    assert len(warnings) == 1


MiB = 1 << 20


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128))  # 98,688 params: 0.38 MiB in float32


def _train_and_measure(model, opt, rec, steps: int, *, rows: int = 256, nan_at: int = -1) -> list[int]:
    """Train ``steps`` steps with a fresh (rows, 256) batch each (256 KiB for 256 rows, plus a
    (rows, 128) cotangent); after each, the bytes held counted storage by storage."""
    held = []
    for i in range(steps):
        x = torch.randn(rows, 256)
        rec.record(x)
        loss = model(x).pow(2).mean() * (float("nan") if i == nan_at else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        held.append(_storage_bytes_held(rec, model))
    return held


@pytest.mark.parametrize("opts", [dict(), dict(check_update=True), dict(check_every=4), dict(check_every=8)],
                         ids=["plain", "check_update", "check_every=4", "check_every=8"])
def test_memory_budget_is_a_cap_in_every_mode(out_dir, opts, caplog):
    """4 MiB, 16 steps of capacity, 384 KiB of batch and cotangent per step, Adam: without the cap
    the ring would hold 6 MiB plus the mode's copy (check_update: 1.1 MiB; check_every: the latch,
    1.5 MiB, and up to 8 unchecked steps, 3 MiB). Counted storage by storage after every step,
    the Recorder holds at most the budget, and every mode stays on (check_every=8: the unchecked
    steps are read early when they alone keep the ring over budget)."""
    model = _wide_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with Recorder(model, opt, out_dir=out_dir, capacity=16, memory_budget=4 * MiB, diagnose=False, **opts) as rec:
        held = _train_and_measure(model, opt, rec, 20)
        assert max(held) <= 4 * MiB, [h / MiB for h in held]
        assert rec.held_bytes() == held[-1]  # what the Recorder counts is what it holds
        assert 3 * MiB < max(held) and len(rec.ring) < 16  # the budget, not the capacity, was the binding limit
        assert (rec._update is not None and rec._update.on) == opts.get("check_update", False)
        assert (rec._lagged is not None) == ("check_every" in opts)
    assert not [r for r in caplog.records if "memory_budget" in r.getMessage()]


@pytest.mark.parametrize("mode, need, fix", [
    (dict(check_update=True), 394752, "use check_update=False"),
    (dict(check_every=4), 789504, "use check_every=1"),
], ids=["check_update", "check_every"])
def test_a_mode_whose_copy_cannot_fit_is_refused_at_construction(out_dir, mode, need, fix):
    model = _wide_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    name = "check_update=True" if "check_update" in mode else "check_every=4"
    what = ("one copy of the weights, buffers and optimizer state" if "check_update" in mode
            else "one device-side copy of the weights, optimizer state and gradients")
    with pytest.raises(ValueError) as e:
        Recorder(model, opt, out_dir=out_dir, memory_budget=300_000, **mode)
    assert str(e.value) == (
        f"memory_budget=300000 bytes (0.29 MiB) cannot hold what {name} keeps: {what}, {need} bytes ({need / MiB:.2f} MiB) "
        f"for this model and optimizer (more once the optimizer creates its state); raise memory_budget to at least "
        f"{need} bytes ({need / MiB:.2f} MiB), or {fix}"
    )
    Recorder(model, opt, out_dir=out_dir, memory_budget=need, **mode).close()  # the minimum it names is enough to start


@pytest.mark.parametrize("mode", [dict(check_update=True), dict(check_every=4)], ids=["check_update", "check_every"])
def test_a_copy_that_outgrows_the_budget_turns_its_mode_off_once_and_the_check_goes_on(out_dir, mode, caplog):
    """Adam creates its state at its first step: the copy then needs 3x (check_update) or 4x
    (check_every) the parameter bytes, past the 1 MiB budget that passed at construction. The
    mode is turned off at that step with one warning naming the budget it needs, the cap holds,
    and a later non-finite gradient is still caught at its own step."""
    model = _wide_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with Recorder(model, opt, out_dir=out_dir, memory_budget=MiB, diagnose=False, **mode) as rec:
        with pytest.raises(NonFiniteGradientError) as e:
            _train_and_measure(model, opt, rec, 6, rows=16, nan_at=4)
        assert e.value.step == 4 and rec.nonfinite_steps == [4]
        assert (rec._update is None or not rec._update.on) and rec._lagged is None
        assert _storage_bytes_held(rec, model) <= MiB
    warnings = [r.getMessage() for r in caplog.records if "cannot hold beside the step in progress" in r.getMessage()]
    assert len(warnings) == 1 and "Raise memory_budget to at least" in warnings[0], warnings


def test_step_offset_numbers_steps_as_the_trainer_does(out_dir):
    # resumed at global step 1000: the failing step is 1000 in the error, the bundle and its diagnosis
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    x[1, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, out_dir=out_dir, step_offset=1000, diagnose=False) as rec:
            assert rec.step == 1000
            rec.record((x,))
            model(x).sum().backward()
            opt.step()
    assert ei.value.step == 1000 and open_bundle(ei.value.bundle_path).failing_step == 1000
    with pytest.raises(ValueError, match=r"step_offset must be an int >= 0 .* got -1"):
        RecorderConfig(step_offset=-1)


def test_a_long_ring_copies_its_batches_into_recycled_tensors_and_its_bundle_replays_exactly(out_dir):
    """capacity >= RECYCLE_FROM: each small batch tensor is copied into a spare made in one burst
    (the loop's own tensor is not held), the copies of a step that left the ring are reused by
    later steps, and a bundle written from such a ring replays its failing step exactly."""
    from nanreplay import replay
    from nanreplay.capture.ring import RECYCLE_FROM

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capacity, bad = RECYCLE_FROM, RECYCLE_FROM * 2 + 5
    seen: set[int] = set()
    reused = False
    with Recorder(model, opt, out_dir=out_dir, capacity=capacity, action="warn", diagnose=False) as rec:
        for step in range(bad + 1):
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
            if step == bad:
                x[1, 3] = float("inf")
            rec.record((x, y))
            kept_x, kept_y = rec.ring.current.batches[-1]
            assert kept_x is not x and torch.equal(kept_x, x) and torch.equal(kept_y, y)  # a copy, not the loop's tensor
            reused |= kept_x.data_ptr() in seen
            seen.add(kept_x.data_ptr())
            loss = nn.functional.cross_entropy(model(x), y)
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert reused  # a copy of a step that left the ring was written into again
        assert len(rec.ring) == capacity and rec.held_bytes() == rec.ring.recount()
    [path] = rec.bundles
    d = replay(path)
    assert d["step"] == bad and d["reproduction"]["verdict"] == "reproduced exactly"
