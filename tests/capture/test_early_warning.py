"""The early warning (capture.early): spikes before the NaN, none on clean noisy runs, the spike
actions, the scalar history in every bundle and in the diagnosis, the rollback plan."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from nanreplay import Recorder, open_bundle
from nanreplay.capture.early import EarlyWarning
from nanreplay.errors import SpikeError
from nanreplay.format.meta import MetaError


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _run(rec_kw: dict, *, steps: int, bs: int = 16, lr: float = 0.01, ramp_from: int | None = None, ramp: float = 1.5,
         adam: bool = False, cosine: bool = False, seed: int = 0, stop_on_nonfinite: bool = True):
    """Train a small MLP on a noisy regression; from ``ramp_from`` the learning rate grows ``ramp``x a
    step (an LR range test). Returns (recorder, first non-finite step or None, model)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    m = _mlp()
    opt = torch.optim.Adam(m.parameters(), lr=lr) if adam else torch.optim.SGD(m.parameters(), lr=lr, momentum=0.0)
    w = torch.randn(8, 1, generator=g)
    first_bad = None
    rec = Recorder(m, opt, **{"action": "warn", "diagnose": False, "embed_program": False, **rec_kw})
    with rec:
        for step in range(steps):
            mult = ramp ** max(0, step - ramp_from + 1) if ramp_from is not None else 1.0
            sched = (min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))) if cosine else 1.0
            for group in opt.param_groups:
                group["lr"] = lr * mult * sched
            x = torch.randn(bs, 8, generator=g)
            y = x @ w + 0.5 * torch.randn(bs, 1, generator=g)
            loss = F.mse_loss(m(x), y)
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rec.nonfinite_steps and first_bad is None:
                first_bad = rec.nonfinite_steps[0]
                if stop_on_nonfinite:
                    break
    return rec, first_bad, m


def test_a_diverging_lr_ramp_is_warned_steps_before_the_first_nonfinite_step(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        rec, first_bad, _ = _run({"out_dir": tmp_path, "max_dumps": 0}, steps=200, ramp_from=40)
    assert first_bad is not None
    assert rec.spikes, "no spike before the NaN"
    first = rec.spikes[0]
    assert set(first) >= {"step", "signal", "value", "baseline", "score"}
    assert first["step"] <= first_bad - 1  # at least one step of lead
    assert first["score"] > 0 and first["value"] > first["baseline"]
    # one log line per episode: the warning names the step, the signal and how far out
    lines = [r.getMessage() for r in caplog.records if "early warning at step" in r.getMessage()]
    assert len(lines) == len({s["episode"] for s in rec.spikes})
    assert f"early warning at step {first['step']}: {first['signal']}" in lines[0]
    assert "rollback plan" in lines[0]


@pytest.mark.parametrize("bs,adam", [(4, True), (4, False), (64, True)])
def test_a_clean_noisy_run_gets_no_warning(tmp_path, bs, adam):
    rec, first_bad, _ = _run({"out_dir": tmp_path}, steps=300, bs=bs, lr=3e-3 if adam else 0.01, adam=adam, cosine=True, seed=bs)
    assert first_bad is None
    assert rec.spikes == []


def test_on_spike_none_turns_it_off(tmp_path):
    rec, first_bad, _ = _run({"out_dir": tmp_path, "on_spike": None, "max_dumps": 0}, steps=200, ramp_from=40)
    assert first_bad is not None and rec.spikes == []


def test_on_spike_dump_writes_a_spike_bundle_that_opens_and_training_goes_on(tmp_path):
    rec, first_bad, _ = _run({"out_dir": tmp_path, "on_spike": "dump", "max_dumps": 1}, steps=200, ramp_from=40)
    spike_step = rec.spikes[0]["step"]
    spikes = sorted(tmp_path.glob("nanreplay-spike-step*.h5"))
    assert [p.name for p in spikes] == [f"nanreplay-spike-step{spike_step}.h5"]
    assert first_bad is not None and first_bad > spike_step  # it carried on to the NaN
    assert (tmp_path / f"nanreplay-step{first_bad}.h5").exists()  # the NaN still gets its own bundle
    with open_bundle(spikes[0]) as b:
        assert b.failing_step == spike_step
        assert b.meta["reason"]["spike"][0]["signal"] == rec.spikes[0]["signal"]
        h = b.meta["scalar_history"]
        assert h["step"][-1] == spike_step and len(h["step"]) == spike_step + 1  # from step 0, not just the ring
        assert len(b.steps) <= 4


def test_on_spike_skip_leaves_the_weights_of_a_spike_step_alone(tmp_path):
    torch.manual_seed(0)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    with Recorder(m, opt, out_dir=tmp_path, on_spike="skip", diagnose=False) as rec:
        for step in range(40):
            x = torch.randn(16, 8, generator=g)
            y = x.sum(1, keepdim=True) * (1000.0 if step == 30 else 1.0)  # one outlier batch
            before = [p.detach().clone() for p in m.parameters()]
            loss = F.mse_loss(m(x), y)
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 30:
                assert [s["step"] for s in rec.spikes] and rec.spikes[0]["step"] == 30
                assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert {s["step"] for s in rec.spikes} == {30}


def test_on_spike_raise_raises_before_the_update_with_the_rollback_plan(tmp_path):
    with pytest.raises(SpikeError) as ei:
        _run({"out_dir": tmp_path, "on_spike": "raise", "snapshot_every": 5, "capacity": 8}, steps=200, ramp_from=40)
    e = ei.value
    assert e.spikes and e.spikes[0]["step"] == e.step
    plan = e.rollback
    assert plan["source"] == "snapshot" and plan["restore_step"] < e.step and plan["restore_step"] % 5 == 0
    assert plan["skip_steps"] == [e.step]
    assert "early warning at step" in str(e) and "on_spike='warn'" in str(e)


def test_should_rollback_and_the_plan_for_a_hand_written_loop(tmp_path):
    rec, first_bad, _ = _run({"out_dir": tmp_path, "snapshot_every": 4, "capacity": 16, "max_dumps": 0, "max_consecutive": 1}, steps=200,
                             ramp_from=40)
    assert rec.should_rollback  # one non-finite step reaches max_consecutive=1
    assert rec.weights_corrupted  # action="warn" let the non-finite update through
    plan = rec.rollback_plan()
    assert plan["step"] == first_bad
    assert plan["first_abnormal_step"] == rec.spikes[0]["step"]
    assert plan["skip_steps"] == list(range(plan["first_abnormal_step"], first_bad + 1))
    assert plan["source"] == "snapshot" and plan["restore_step"] < plan["first_abnormal_step"]
    assert rec.snapshot_at(plan["restore_step"]) is not None


def test_the_sync_free_mode_warns_when_it_reads_the_verdicts(tmp_path):
    rec, first_bad, _ = _run({"out_dir": tmp_path, "check_every": 4, "max_dumps": 0}, steps=200, ramp_from=40)
    assert rec.spikes and rec.spikes[0]["step"] < (first_bad if first_bad is not None else 10**9)


def test_the_scalar_history_outlives_the_ring_and_tells_explosion_from_overflow(tmp_path):
    """The issue's LR range test with the default ring (capacity 4): the diagnosis sees the grad
    norm's growth over the long history, not only the last four (already huge) steps."""
    rec, first_bad, _ = _run({"out_dir": tmp_path, "diagnose": True, "on_spike": None}, steps=200, ramp_from=40)
    assert first_bad is not None
    with open_bundle(rec.bundles[0]) as b:
        assert len(b.steps) == 4
        h = b.meta["scalar_history"]
        assert h["step"] == list(range(first_bad + 1))
        assert h["finite"][-1] is False
    hist = rec.last_diagnosis["history"]
    assert hist["exploding"] is True
    assert hist["grad_norms"][0][0] == 0  # from the scalar history, not the ring
    assert rec.last_diagnosis["rollback"]["step"] == first_bad
    assert len(rec.last_diagnosis["timeline"]) == first_bad + 1


def test_a_bad_scalar_history_is_refused_with_where_expected_found():
    from nanreplay.format.meta import _Checker, _scalar_history

    c = _Checker(lambda k: None)
    with pytest.raises(MetaError) as ei:
        _scalar_history(c, {"step": [0, 1], "loss": [1.0], "grad_norm": [1.0, 2.0], "lrs": [[0.1], [0.1]], "finite": [True, True]})
    assert str(ei.value).startswith("meta.scalar_history.loss")
    assert "2 entries" in str(ei.value)


def test_the_band_ignores_noise_and_flags_a_jump():
    ew = EarlyWarning()
    g = torch.Generator().manual_seed(0)
    for k in range(100):
        noise = float(torch.randn((), generator=g)) * 0.3
        assert ew.observe(k, loss=math.exp(noise), grad_norm=math.exp(noise), lrs=[0.1]) == []
    rows = ew.observe(100, loss=1.0, grad_norm=1e3, lrs=[0.1])
    assert [r["signal"] for r in rows] == ["grad_norm"] and ew.new_episode


def test_the_plan_names_the_last_checkpoint_when_no_snapshot_is_held(tmp_path):
    """The integrations put the last checkpoint's step in extra_meta; without snapshots the plan
    falls back to it, and says so."""
    torch.manual_seed(0)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with Recorder(m, opt, out_dir=tmp_path, on_spike="skip", diagnose=False, embed_program=False) as rec:
        g = torch.Generator().manual_seed(3)
        for step in range(40):
            if step == 20:
                rec.extra_meta["last_checkpoint_step"] = rec.step  # what on_save / on_save_checkpoint write
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(m(x), x.sum(1, keepdim=True) * (1000.0 if step == 30 else 1.0))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    plan = rec.rollback_plan()
    assert (plan["step"], plan["restore_step"], plan["source"], plan["skip_steps"]) == (30, 20, "checkpoint", [30])
    assert rec.roll_back(plan) is None  # loading a checkpoint is the loop's job


def test_band_take_is_floored_then_score_then_update():
    """Band.take (one call per signal and step) judges as floored, score and update do one by one."""
    import random

    from nanreplay.capture.early import Band, EPS_FLOAT32

    rnd = random.Random(3)
    one, parts = Band(), Band()
    for k in range(300):
        y = math.log(math.exp(rnd.gauss(0, 0.2)) * (1e4 if k % 97 == 50 else 1.0) * (1e-9 if k % 131 == 70 else 1.0))
        floored = parts.floored(y, EPS_FLOAT32)
        expected = parts.score(floored)
        parts.update(floored)
        assert one.take(y, math.log(EPS_FLOAT32)) == expected
        assert vars(one) == vars(parts)


def test_a_long_episode_makes_its_plan_and_message_once_and_the_plan_when_read(tmp_path, monkeypatch):
    """A diverging run is out of band at every step of its episode: only the episode's first step
    makes a rollback plan and a log line (one per episode); the later steps' rows are still in
    ``spikes``, and ``rollback_plan()`` makes the plan of the last alarm when read."""
    from nanreplay.capture.early import SpikeWatch

    plans = []
    original = SpikeWatch.plan
    monkeypatch.setattr(SpikeWatch, "plan", lambda self, step=None: plans.append(step) or original(self, step))
    rec, first_bad, _ = _run({"out_dir": tmp_path, "max_dumps": 0}, steps=200, ramp_from=40)
    episodes = {s["episode"] for s in rec.spikes}
    alarmed = sorted({s["step"] for s in rec.spikes})
    assert first_bad is not None and len(alarmed) > len(episodes)  # several out-of-band steps in an episode
    assert len([p for p in plans if p is not None]) == len(episodes)  # the alarms' own (close() makes the final one)
    plan = rec.rollback_plan()
    assert plan["step"] >= alarmed[-1] and plan["first_abnormal_step"] <= alarmed[0]  # the NaN step may be the last alert
