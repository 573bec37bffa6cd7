"""Mixed precision: GradScaler skips are counted, real failures are dumped, and replay restores
the scaler and the autocast of the step. fp16 and bf16 autocast on the CPU."""

from __future__ import annotations

import pytest
import torch

import models
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay
from nanreplay.report.text import render_report


def _amp_step(model, opt, scaler, rec, batch, *, dtype=torch.float16, bypass=False):
    rec.record(batch)
    with torch.autocast("cpu", dtype=dtype):
        loss = models.mse_loss(model, batch)
    opt.zero_grad()
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    if bypass:  # a loop that unscales and then steps the optimizer itself, skipping the scaler's check
        scaler.unscale_(opt)
        opt.step()
    else:
        scaler.step(opt)
    scaler.update()


def _batch(g, scale=1.0):
    return torch.randn(16, 8, generator=g) * scale, torch.randn(16, 4, generator=g)


def test_scaler_skips_are_counted_not_dumped(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # too large: the first steps overflow fp16
    g = torch.Generator().manual_seed(0)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir, capacity=16) as rec:
        for _ in range(12):
            _amp_step(model, opt, scaler, rec, _batch(g))
        skipped = [r.step for r in rec.ring if r.scaler_skipped]
        assert rec.scaler_skips >= 4
        assert rec.step == 12  # skipped steps are steps too
        assert rec.bundles == [] and rec.nonfinite_steps == []
        assert scaler.get_scale() < 2.0**24
        assert rec.ring[-1].autocast == {"device_type": "cpu", "dtype": "float16"}
        assert len(skipped) == rec.scaler_skips and skipped[:4] == [0, 1, 2, 3]
        assert all(r.finite is (not r.scaler_skipped) for r in rec.ring)
    assert "update" not in vars(scaler)  # close() gave the scaler its own update back


def _overflowing_mlp():
    model = models.make_mlp()
    with torch.no_grad():
        model.fc1.weight.fill_(0.25)  # 8 inputs of 5e4: 1e5 per output, beyond fp16's 65504
    return model


def test_a_forward_overflow_is_a_failure_at_once_and_replays_with_the_scaler(out_dir):
    """fc1 overflows float16 in the forward pass: the loss is non-finite, which no loss scale
    explains (the forward pass is not scaled). Before, the scaler absorbed five skips first."""
    model = _overflowing_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.full((16, 8), 5e4), torch.randn(16, 4)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for _ in range(10):
                _amp_step(model, opt, scaler, rec, (x.clone(), y))  # the loss reaches the Recorder through scaler.scale()
    err = info.value
    assert err.step == 0 and rec.scaler_skips == 1
    assert str(err).startswith("non-finite loss under the GradScaler: the loss is ")
    assert "no routine overflow" in str(err) and "its scale was 256" in str(err)
    with open_bundle(err.bundle_path) as b:
        assert b.state().extra["scaler"]["scale"] == 256.0  # the scale the failing step ran with
        reason = b.meta["reason"]
        assert reason["scaler_failure"] == "nonfinite loss" and reason["nonfinite_loss"] is True
        assert reason["scaler"]["skipped"] is True and reason["scaler"]["grads_unscaled"] is True
        assert reason["scaler"]["scale_before"] == 256.0 and reason["scaler"]["scale_after"] == 128.0
        assert b.step(0).autocast == {"device_type": "cpu", "dtype": "float16"}
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "fc1"  # the fp16 overflow
    assert diag["loss_scale"] == {"skipped": True, "scale": 256.0, "scale_after": 128.0, "history": [[0, 256.0]], "consecutive_skips": 1,
                                  "failure": "nonfinite loss"}
    assert "  loss scale:    256 (128 after the step); failure: nonfinite loss; history 256 (step 0)" in render_report(diag)
    assert "float32's largest" not in (diag["classification"].get("fix") or {}).get("description", "")


def test_a_forward_overflow_under_the_scaler_without_a_loss_function_embeds_its_program_and_diagnoses_in_process(out_dir, caplog):
    """The same overflow with no loss function: the replay runs on the recorded (scaled) cotangent
    and unscales the replayed gradients with the restored scaler, which never saw ``scale()``
    there. The program's verifying replay and the in-process diagnosis stopped on GradScaler's
    'Attempted unscale_ but _scale is None' before, so the bundle had no program. The inputs
    themselves pass float16's range here: autocast's cast of them is the birth, and its advice
    names float16's range, not the float32 of the values cast."""
    model = _overflowing_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.full((16, 8), 1e5), torch.randn(16, 4)
    with Recorder(model, opt, scaler=scaler, out_dir=out_dir) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            rec.record((x, y))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    err = info.value
    assert "could not embed" not in caplog.text and "stopped" not in caplog.text
    with open_bundle(err.bundle_path) as b:
        assert b.meta.get("program") and b.meta["reason"]["scaler"]["grads_unscaled"] is True
    assert err.diagnosis is not None and err.diagnosis["origin"]["module"] == "fc1"
    diag = replay(err.bundle_path)
    assert diag["mode"] == "cotangent" and diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "fc1" and diag["origin"]["op"] == "_to_copy"
    fix = diag["classification"]["fix"]["description"]
    assert "float16's largest is 6.55e+04" in fix and "float32's largest" not in fix  # the dtype that overflowed


class _SqrtAbs(torch.nn.Module):
    """A bias-free linear layer under sqrt(|.|): a zero input row gives an exact 0, whose
    gradient is inf * 0 = NaN, while the loss stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).abs().sqrt()


def _sqrt_run(rec_kw: dict, scaler, *, steps: int, bad_from: int):
    """fp16 steps of :class:`_SqrtAbs`; from ``bad_from`` every batch has a zero row (NaN gradients,
    finite loss). Returns the Recorder and the error raised (or ``None``)."""
    torch.manual_seed(0)
    model = _SqrtAbs()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    err = None
    rec = Recorder(model, opt, scaler=scaler, diagnose=False, embed_program=False, **rec_kw)
    with rec:
        try:
            for step in range(steps):
                x = torch.randn(8, 8, generator=g) + 2.0
                if step >= bad_from:
                    x[3] = 0.0
                rec.record((x,))
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        except NonFiniteGradientError as e:
            err = e
    return rec, err


def test_nonfinite_gradients_are_a_failure_once_the_scale_reaches_its_floor_and_the_episode_starts_at_the_first_skip(out_dir):
    """Finite loss, NaN gradients from step 10: the scaler backs off 16 -> 8 -> 4 -> 2 (routine
    while the scale falls), and at scale 1 (the floor, min_scale=1) no scale can help: the
    failure is step 14, but the episode, and the bundle's plan, start at step 10."""
    rec, err = _sqrt_run({"out_dir": out_dir, "snapshot_every": 5, "capacity": 8}, torch.amp.GradScaler("cpu", init_scale=2.0**4),
                         steps=30, bad_from=10)
    assert err is not None and err.step == 14 and rec.scaler_skips == 5
    assert ("non-finite gradients that no loss scale fixes: they are still non-finite after unscaling at a loss scale of 1, at or "
            "below the floor 1 (min_scale), after 5 skip(s) in a row") in str(err)
    assert rec.nonfinite_steps == [14]
    with open_bundle(err.bundle_path) as b:
        reason = b.meta["reason"]
        assert reason["scaler_failure"] == "scale collapsed"
        assert reason["scaler"]["scale_history"] == [[0, 16.0], [11, 8.0], [12, 4.0], [13, 2.0], [14, 1.0]]
        assert b.meta["scalar_history"]["scale"][:10] == [16.0] * 10  # followed every step, read with the check
        plan = reason["rollback"]
    assert plan["first_abnormal_step"] == 10 and plan["skip_steps"] == list(range(10, 15))
    assert plan["episode"]["runs"] == [{"first": 10, "last": 14, "nonfinite": "gradients", "update": "skipped by the scaler"}]
    assert plan["episode"]["consecutive"] == 5 and plan["episode"]["weights_corrupted_at"] is None
    assert (plan["restore_step"], plan["source"]) == (10, "snapshot")  # the scaler skipped every update: step 10's weights are healthy
    assert rec.should_rollback and not rec.weights_corrupted


def test_a_scaler_pinned_at_its_own_minimum_is_judged_at_that_floor(out_dir):
    class Pinned(torch.amp.GradScaler):
        min_scale = 4.0  # the scaler's own floor (as DeepSpeed's and Megatron's dynamic scalers have)

        def update(self, new_scale=None):
            super().update(new_scale)
            if self._scale is not None and float(self._scale) < self.min_scale:
                self._scale.fill_(self.min_scale)

    rec, err = _sqrt_run({"out_dir": out_dir}, Pinned("cpu", init_scale=2.0**4), steps=20, bad_from=2)
    assert err is not None and err.step == 4  # scales 16, 8 routine; 4 is the floor
    assert "at a loss scale of 4, at or below the floor 4" in str(err)


def test_a_scale_that_stops_falling_is_a_failure_past_max_scaler_skips(out_dir):
    class Stuck(torch.amp.GradScaler):  # hysteresis that never backs off
        def update(self, new_scale=None):
            super().update(float(self._scale) if new_scale is None and self._scale is not None else new_scale)

    rec, err = _sqrt_run({"out_dir": out_dir, "max_scaler_skips": 3}, Stuck("cpu", init_scale=2.0**10), steps=20, bad_from=2)
    assert err is not None and err.step == 5  # skips 2, 3, 4 at 1024 are tolerated; the fourth is not
    assert "skipped 4 consecutive steps without lowering its scale (1024), more than max_scaler_skips=3" in str(err)
    assert rec.episode["first_step"] == 2


def test_megatron_initial_scale_on_a_clean_run_raises_nothing(out_dir):
    """GradScaler(init_scale=2**32), fp16 autocast, a healthy run: the scale backs off over about
    twenty consecutive skips, all routine; no bundle, no alarm, no episode."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**32)
    g = torch.Generator().manual_seed(5)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir, capacity=4) as rec:
        for _ in range(40):
            _amp_step(model, opt, scaler, rec, _batch(g))
        assert rec.scaler_skips >= 11  # more than the old max_scaler_skips=10 raised at
        assert rec.bundles == [] and rec.nonfinite_steps == [] and rec.episode is None
        assert not rec.should_rollback and rec.rollback_plan()["step"] is None
        scales = [r[5] for r in rec._history.rows]
    assert scales[0] == 2.0**32 and scales[-1] <= 2.0**17  # the scale the Recorder followed fell step by step
    assert all(a > b for a, b in zip(scales, scales[1:rec.scaler_skips]))


def test_one_nan_batch_is_not_absorbed_by_the_scaler(out_dir):
    """A NaN input at step 12 under the default scale: the scaler skips it, but the loss it was
    given is NaN, which loss scaling cannot cause: a bundle and a warning at step 12."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(6)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir, action="warn", diagnose=False,
                  embed_program=False) as rec:
        for step in range(20):
            x, y = _batch(g)
            if step == 12:
                x[0, 0] = float("nan")
            _amp_step(model, opt, scaler, rec, (x, y))
        assert rec.nonfinite_steps == [12] and [p.name for p in rec.bundles] == ["nanreplay-step12.h5"]
        episode = rec.rollback_plan()["episode"]
        assert episode["first_step"] == 12 and episode["runs"] == [{"first": 12, "last": 12, "nonfinite": "gradients and loss",
                                                                     "update": "skipped by the scaler"}]
        assert not rec.weights_corrupted  # the scaler skipped the update
        assert rec.episode is None  # over: more than EPISODE_GAP finite steps followed


def test_a_persistent_nan_input_under_the_scaler_gives_up_with_the_whole_episode(out_dir):
    """NaN inputs from step 10, action="skip", max_consecutive=3: steps 10..13 are non-finite at
    once (their loss is NaN), the fourth gives up; the error's plan and the bundle (written at
    step 10, brought up to date) cover 10..13 and restore step 10's snapshot."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(7)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir, action="skip", max_consecutive=3,
                  snapshot_every=5, capacity=8, diagnose=False, embed_program=False) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for step in range(30):
                x, y = _batch(g)
                if step >= 10:
                    x[2, 1] = float("nan")
                _amp_step(model, opt, scaler, rec, (x, y))
    err = info.value
    assert err.step == 13 and rec.nonfinite_steps == [10, 11, 12, 13]
    plan = err.rollback
    assert (plan["first_abnormal_step"], plan["skip_steps"], plan["restore_step"], plan["source"]) == (10, [10, 11, 12, 13], 10, "snapshot")
    assert "4 consecutive non-finite steps 10..13 (gradients and loss, update skipped by the scaler)" in str(err)
    with open_bundle(rec.bundles[0]) as b:
        assert b.failing_step == 10
        assert b.meta["reason"]["rollback"]["skip_steps"] == [10, 11, 12, 13]
        assert b.meta["reason"]["rollback"]["episode"]["steps"] == 4


def test_nonfinite_after_unscale_without_skip_is_dumped(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    g = torch.Generator().manual_seed(2)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        for _ in range(2):
            _amp_step(model, opt, scaler, rec, _batch(g), bypass=True)
        x, y = _batch(g)
        x[1, 0] = float("inf")
        with pytest.raises(NonFiniteGradientError) as info:
            _amp_step(model, opt, scaler, rec, (x, y), bypass=True)
    err = info.value
    assert err.step == 2 and rec.scaler_skips == 0
    assert str(err).startswith("non-finite gradients after unscaling, and the GradScaler did not skip the step at step 2")
    with open_bundle(err.bundle_path) as b:
        assert b.meta["reason"]["scaler"] == {**b.meta["reason"]["scaler"], "skipped": False, "grads_unscaled": True}
        assert b.state().extra["scaler"]["scale"] == 2.0**4
    diag = replay(err.bundle_path)  # scales the replayed loss by 16, unscales the gradients
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_bf16_nonfinite_is_a_real_failure_and_replays_under_autocast(out_dir):
    model = models.make_ratio()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_ratio, out_dir=out_dir) as rec:
        with pytest.raises(NonFiniteGradientError) as info:
            for step in range(4):
                x = torch.randn(6, 8, generator=g)
                if step == 2:
                    x[0] = 0.0
                rec.record({"x": x})
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = models.mean_loss(model, {"x": x})
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert err.step == 2
    with open_bundle(err.bundle_path) as b:
        assert b.step(2).autocast == {"device_type": "cpu", "dtype": "bfloat16"}
        assert "scaler" not in b.meta["reason"]
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "norm"


def test_scaler_must_be_a_gradscaler(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match=r"scaler must be a torch.amp.GradScaler \(expected a method update\(\)\), got object"):
        Recorder(model, opt, scaler=object(), out_dir=out_dir)


def test_following_the_scale_adds_no_host_read_to_an_ordinary_step(out_dir):
    """The scale each step ran with is read in the check's one host read (with the grad norm and
    the loss the scaler was given): an ordinary fp16 step under the scaler reads the device once."""
    from test_overhead_modes import count_host_reads

    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(8)
    with Recorder(model, opt, scaler=scaler, loss_fn=models.mse_loss, out_dir=out_dir) as rec:
        _amp_step(model, opt, scaler, rec, _batch(g))  # the first step exports the program: not counted
        with count_host_reads() as reads:
            for _ in range(5):
                _amp_step(model, opt, scaler, rec, _batch(g))
        assert rec.scaler_skips == 0
        assert [r[5] for r in rec._history.rows][-5:] == [256.0] * 5  # the scale of each step
        assert all(r[1] is not None for r in rec._history.rows)  # the loss the loop gave scaler.scale(), read in the same host read
    assert reads["n"] <= 5

