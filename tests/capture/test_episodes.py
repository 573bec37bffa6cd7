"""Episodes and rollback plans that restore a healthy state (issue 35): the plan covers every step of
a non-finite episode, restores only a state known finite (a held snapshot, or a checkpoint
registered finite before the first non-finite update), the early warning sees a learning-rate
restart at once and stays quiet on a loss near zero and on a one-cycle schedule, and
``should_rollback`` / ``weights_corrupted`` mean what KempnerForge's flag means."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanreplay import NonFiniteGradientError, Recorder, open_bundle
from nanreplay.capture.early import EarlyWarning
from nanreplay.capture.episode import EpisodeLog


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _shard_run(tmp_path, rec_kw: dict, *, steps: int, bad: range, ckpt_every: int = 0, register: bool = True):
    """A plain loop on a small MLP; the batches of ``bad`` steps come from a bad shard (a NaN input).
    Every ``ckpt_every`` steps a checkpoint is saved (its weights' finiteness kept as ground truth)
    and registered with ``note_checkpoint`` (or, ``register=False``, only reported through
    ``extra_meta["last_checkpoint_step"]``, as the README used to say). Returns (recorder, error or
    None, {checkpoint step: weights finite})."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    w = torch.randn(8, 1, generator=g)
    saved: dict[int, bool] = {}
    err = None
    rec = Recorder(m, opt, **{"out_dir": tmp_path, "diagnose": False, "embed_program": False, **rec_kw})
    with rec:
        try:
            for step in range(steps):
                if ckpt_every and step and step % ckpt_every == 0:
                    path = tmp_path / f"ckpt-{step}.pt"
                    torch.save(m.state_dict(), path)
                    saved[step] = all(bool(torch.isfinite(p).all()) for p in m.parameters())
                    if register:
                        rec.note_checkpoint(step, path)
                    else:
                        rec.extra_meta["last_checkpoint_step"] = rec.step
                x = torch.randn(16, 8, generator=g)
                y = x @ w
                if step in bad:
                    x[3, 2] = float("nan")
                rec.record((x, y))
                loss = F.mse_loss(m(x), y)
                rec.log_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
        except NonFiniteGradientError as e:
            err = e
    return rec, err, saved


def test_warn_mode_never_names_a_checkpoint_saved_after_the_first_nonfinite_update(tmp_path):
    """action="warn", a bad shard at steps 120..125, checkpoints every 50 steps: the update of step
    120 made the weights NaN, so ckpt-150 and ckpt-200 hold NaN weights. The plan restores ckpt-100
    and says why the later ones are not restore points; the bundle (written at 120) is brought up
    to date on close()."""
    rec, err, saved = _shard_run(tmp_path, {"action": "warn"}, steps=210, bad=range(120, 126), ckpt_every=50)
    assert err is None and saved == {50: True, 100: True, 150: False, 200: False}
    assert rec.nonfinite_steps[0] == 120 and rec.weights_corrupted
    plan = rec.rollback_plan()
    assert (plan["restore_step"], plan["source"], plan["path"]) == (100, "checkpoint", str(tmp_path / "ckpt-100.pt"))
    assert plan["first_abnormal_step"] == 120 and plan["skip_steps"] == list(range(120, 210))
    assert plan["weights_corrupted"] is True
    assert plan["episode"]["weights_corrupted_at"] == 120 and plan["episode"]["steps"] == 90
    assert plan["episode"]["runs"] == [{"first": 120, "last": 209, "nonfinite": "gradients and loss", "update": "applied"}]
    assert {(r["step"], r["why"]) for r in plan["rejected"]} == {
        (200, "saved after the first abnormal step 120"), (150, "saved after the first abnormal step 120")}
    assert rec.roll_back(plan) is None  # a checkpoint: loading it is the loop's job
    with open_bundle(rec.bundles[0]) as b:  # written at step 120, brought up to date by close()
        stored = b.meta["reason"]["rollback"]
    assert b.failing_step == 120 and stored["skip_steps"] == list(range(120, 210)) and stored["restore_step"] == 100
    assert stored["rejected"] == plan["rejected"]


def test_a_checkpoint_registered_with_nonfinite_weights_is_refused_and_none_healthy_is_said(tmp_path):
    rec, err, saved = _shard_run(tmp_path, {"action": "warn", "max_dumps": 0}, steps=160, bad=range(30, 32), ckpt_every=50)
    assert saved == {50: False, 100: False, 150: False} and rec.weights_corrupted
    plan = rec.rollback_plan()
    assert plan["restore_step"] is None and plan["source"] is None
    assert plan["note"].startswith("no held snapshot or registered checkpoint is known healthy (checkpoint of step 150: ")
    reasons = {r["step"]: r["why"] for r in plan["rejected"]}
    assert reasons[50] == "saved after the first abnormal step 30"
    # registered while the weights were already NaN: the Recorder checked them, it did not assume
    assert [c["finite"] for c in rec._watch.log.checkpoints] == [False, False, False]


def test_a_reported_checkpoint_step_is_not_trusted_blindly(tmp_path):
    """The README's old advice (extra_meta["last_checkpoint_step"] only): the last one, step 200, is
    after the first non-finite update; the plan does not name it."""
    rec, err, saved = _shard_run(tmp_path, {"action": "warn", "max_dumps": 0}, steps=210, bad=range(120, 126), ckpt_every=50, register=False)
    plan = rec.rollback_plan()
    assert rec.extra_meta["last_checkpoint_step"] == 200 and not saved[200]
    assert plan["restore_step"] is None
    assert plan["rejected"] == [{"step": 200, "source": "checkpoint", "path": None, "why": "saved after the first abnormal step 120"}]


def test_skip_mode_covers_the_episode_and_restores_the_snapshot_of_its_first_step(tmp_path):
    """action="skip", max_consecutive=3, snapshot_every=10, the bad shard at 120..125: the Recorder
    gives up at step 123 after skipping 120..122; the plan covers 120..123, restores step 120's
    snapshot (the same healthy weights: every update was skipped), and the bundle says so."""
    rec, err, _ = _shard_run(tmp_path, {"action": "skip", "max_consecutive": 3, "snapshot_every": 10}, steps=200, bad=range(120, 126),
                             ckpt_every=50)
    assert err is not None and err.step == 123
    plan = err.rollback
    assert (plan["first_abnormal_step"], plan["skip_steps"]) == (120, [120, 121, 122, 123])
    assert (plan["restore_step"], plan["source"]) == (120, "snapshot")
    assert plan["episode"] == {"first_step": 120, "last_step": 123, "steps": 4, "consecutive": 4, "weights_corrupted_at": None,
                               "runs": [{"first": 120, "last": 123, "nonfinite": "gradients and loss", "update": "skipped"}]}
    assert ("4 consecutive non-finite steps 120..123 (gradients and loss, update skipped), weights untouched by non-finite values "
            "since step 120") in str(err)
    assert rec.should_rollback and not rec.weights_corrupted
    with open_bundle(rec.bundles[0]) as b:
        assert b.failing_step == 120
        assert b.meta["reason"]["rollback"]["skip_steps"] == [120, 121, 122, 123]
        assert b.meta["reason"]["rollback"]["restore_step"] == 120
    before = [p.detach().clone() for p in rec.model.parameters()]
    assert rec.roll_back(plan) == 120
    snap = rec.snapshot_at(120)
    assert all(torch.equal(p, snap.params[n]) for n, p in rec.model.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, rec.model.parameters()))  # the skipped updates left them alone


def test_should_rollback_is_the_consecutive_count_and_weights_corrupted_its_own_flag(tmp_path):
    """KempnerForge's flag: true once the consecutive non-finite steps reach max_consecutive, not
    at the first skipped step; a finite step resets it."""
    seen = []
    torch.manual_seed(0)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with Recorder(m, opt, out_dir=tmp_path, action="skip", max_consecutive=3, diagnose=False, embed_program=False) as rec:
        for step in range(12):
            x = torch.randn(16, 8, generator=g)
            if step in (4, 5, 6):
                x[0, 0] = float("nan")
            loss = m(x).pow(2).mean()
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append((rec.should_rollback, rec.weights_corrupted))
    assert [s for s, _ in seen] == [False] * 6 + [True] + [False] * 5
    assert not any(c for _, c in seen)


def _restart_run(tmp_path, *, steps: int = 200, restart: int = 150, high: float = 3.0):
    """A cosine decay from 0.05 to 0.001 over ``restart`` steps, then a warm restart that jumps the
    learning rate to ``high``; training goes on (action="warn") until the first non-finite step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    w = torch.randn(8, 1, generator=g)
    with Recorder(m, opt, out_dir=tmp_path, action="warn", diagnose=False, embed_program=False, max_dumps=0, snapshot_every=10,
                  capacity=16) as rec:
        for step in range(steps):
            lr = 0.001 + 0.5 * (0.05 - 0.001) * (1 + math.cos(math.pi * step / restart)) if step < restart else high
            for group in opt.param_groups:
                group["lr"] = lr
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(m(x), x @ w + 0.1 * torch.randn(16, 1, generator=g))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rec.nonfinite_steps:
                break
    return rec


def test_a_warm_restart_of_the_learning_rate_warns_at_the_jump_and_the_plan_restores_before_it(tmp_path):
    rec = _restart_run(tmp_path)
    first = rec.spikes[0]
    assert (first["step"], first["signal"], first["kind"]) == (150, "lr", "jump")  # at the jump, whatever the band learnt
    assert first["baseline"] == pytest.approx(0.001, rel=1e-2) and first["score"] == pytest.approx(3000, rel=1e-2)
    assert rec.nonfinite_steps, "the restart to 3 diverges"
    bad = rec.nonfinite_steps[0]
    assert bad > 150
    plan = rec.rollback_plan()
    assert plan["step"] == bad and plan["first_abnormal_step"] == 150  # the jump is still in force at the NaN
    assert plan["lr_jump"] == {"step": 150, "lr": 3.0, "previous": pytest.approx(0.001, rel=1e-2)}
    assert plan["restore_step"] == 150 and plan["source"] == "snapshot"  # weights from before the first update at lr 3


def test_the_same_rate_after_a_constant_schedule_is_no_jump():
    ew = EarlyWarning()
    for k in range(200):
        ew.observe(k, loss=1.0 + 0.01 * (k % 3), grad_norm=1.0, lrs=[0.01 * (1 + k / 400)])  # a slow ramp: 0.5 % a step
    assert ew.spikes == [] and ew.lr_jump is None


def _near_zero_losses(seed: int = 0) -> list[float]:
    """A loss that falls from 1 to 1e-28 as the model fits its task, then sits at rounding noise:
    log-uniform between 1e-32 and 1e-25 (what float rounding of a fitted model gives)."""
    g = torch.Generator().manual_seed(seed)
    fall = [10.0 ** (-0.5 * k) for k in range(56)]
    noise = [10.0 ** float(-32 + 7 * torch.rand((), generator=g)) for _ in range(244)]
    return fall + noise


def test_a_loss_near_zero_raises_no_alarm(tmp_path):
    """The loss given to log_loss sits at 1e-25..1e-32 for 240 steps of a run that never fails: no
    warning. Without the floor (its precision set to 0), the same values alarm: the floor is what
    keeps it quiet."""
    losses = _near_zero_losses()
    torch.manual_seed(0)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    with Recorder(m, opt, out_dir=tmp_path, action="warn", diagnose=False, embed_program=False) as rec:
        for value in losses:
            x = torch.randn(16, 8, generator=g)
            out = m(x).mean() * 0.0
            rec.log_loss(out.detach().double() + value)  # a float64 loss: its own precision sets the floor
            out.backward()
            opt.step()
            opt.zero_grad()
    assert rec.nonfinite_steps == [] and rec.spikes == []
    bare = EarlyWarning()
    bare.eps["loss"] = 1e-300
    for k, value in enumerate(losses):
        bare.observe(k, loss=value, grad_norm=1.0, lrs=[1e-3])
    assert [s["kind"] for s in bare.spikes][:1] == ["drift"]


def test_a_loss_that_climbs_back_from_near_zero_is_still_judged():
    ew = EarlyWarning()
    for k, value in enumerate(_near_zero_losses()[:120]):
        ew.observe(k, loss=value, grad_norm=1.0, lrs=[1e-3])
    assert ew.spikes == []
    rows = ew.observe(120, loss=0.5, grad_norm=1.0, lrs=[1e-3])  # half the initial loss: far above the floor
    assert [(r["signal"], r["kind"]) for r in rows] == [("loss", "spike")]


def test_a_one_cycle_schedule_raises_no_alarm(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=300)
    w = torch.randn(8, 1, generator=g)
    with Recorder(m, opt, out_dir=tmp_path, action="warn", diagnose=False, embed_program=False) as rec:
        for _ in range(300):
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(m(x), x @ w + 0.3 * torch.randn(16, 1, generator=g))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    lrs = [r[3][0] for r in rec._history.rows]
    assert max(lrs) / lrs[0] > 20  # the rate rose 25x and fell again
    assert rec.nonfinite_steps == [] and rec.spikes == []


def test_the_early_warning_judges_the_norm_before_clipping(tmp_path):
    """Under clip_grad_norm_(1.0) the gradients the optimizer sees have a norm of 1 at most: a
    divergence (lr x1000 from step 60) shows only in the norm clip_grad_norm_ returns. Given with
    log_grad_norm, it is judged, kept in the scalar history and in the ring's records."""
    def run(feed: bool):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(6)
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        w = torch.randn(8, 1, generator=g)
        with Recorder(m, opt, out_dir=tmp_path / str(feed), action="warn", diagnose=False, embed_program=False, max_dumps=0) as rec:
            for step in range(90):
                for group in opt.param_groups:
                    group["lr"] = 0.01 * (1000.0 if step >= 60 else 1.0)
                x = torch.randn(16, 8, generator=g)
                loss = F.mse_loss(m(x), x @ w)
                rec.log_loss(loss)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                if feed:
                    rec.log_grad_norm(norm)
                opt.step()
                opt.zero_grad()
        return rec

    fed, plain = run(True), run(False)
    assert all(r[2] <= 1.0 + 1e-5 for r in plain._history.rows if r[2] is not None and r[4])  # the check's own norm: clipped
    assert not [s for s in plain.spikes if s["signal"] == "grad_norm"]
    pre = [r[6] for r in fed._history.rows]
    assert all(v is not None for v in pre) and max(pre) > 100
    assert [s for s in fed.spikes if s["signal"] == "grad_norm"]
    assert fed.ring[-1].grad_norm_pre_clip == pytest.approx(pre[-1])


def test_the_episode_log_rule_on_its_own():
    log = EpisodeLog(attach_step=0)
    log.note_checkpoint(50, "a", True, now=50)
    for s in (60, 61):
        log.routine_skip(s)
    log.finite()  # a finite step: routine skips discarded
    for s in (70, 71):
        log.routine_skip(s)
    ep = log.nonfinite(72, "gradients", "skipped by the scaler")
    assert (ep.first_step, ep.count, ep.consecutive) == (70, 3, 3)  # the skips before the failure are its first steps
    log.nonfinite(73, "gradients and loss", "applied", corrupts=True)
    assert log.weights_corrupted and log.corrupted_since == 73
    log.note_checkpoint(80, "b", False, now=80)
    assert log.why_unhealthy(80, first_abnormal=70) == "saved after the first abnormal step 70"
    assert log.why_unhealthy(74, first_abnormal=None) == "saved after the non-finite update of step 73"
    assert log.why_unhealthy(73, first_abnormal=None) is None  # the state before the corrupting update
    assert log.restore_point([], {}, first_abnormal=70)["restore_step"] == 50
    log.rolled_back(now=90)
    assert not log.weights_corrupted and log.why_unhealthy(95, first_abnormal=None) is None
    assert log.why_unhealthy(85, first_abnormal=None) == "saved after the non-finite update of step 73"


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_the_trainer_callbacks_register_the_trainers_checkpoints(tmp_path, framework):
    """The Lightning and Hugging Face callbacks register every checkpoint the trainer saves (the HF
    Trainer's with its path), checked finite, not only its step."""
    from types import SimpleNamespace

    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    if framework == "lightning":
        from nanreplay.integrations.lightning import NanReplayCallback
    else:
        from nanreplay.integrations.transformers import NanReplayCallback
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    cb = NanReplayCallback(out_dir=tmp_path)
    with Recorder(m, opt, out_dir=tmp_path, step_offset=5) as rec:
        cb.recorder = rec
        if framework == "lightning":
            cb.on_save_checkpoint(SimpleNamespace(global_step=5), None, {})
        else:
            cb.on_save(SimpleNamespace(output_dir=str(tmp_path / "hf")), SimpleNamespace(global_step=5), None)
        loss = m(torch.randn(4, 8)).pow(2).mean()  # one step: the Recorder's step 6 begins
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            m[0].weight[0, 0] = float("nan")  # weights gone bad outside any step the Recorder checked
        if framework == "lightning":
            cb.on_save_checkpoint(SimpleNamespace(global_step=6), None, {})
        else:
            cb.on_save(SimpleNamespace(output_dir=str(tmp_path / "hf")), SimpleNamespace(global_step=6), None)
        cb.recorder = None
    def path(step: int):
        return str(tmp_path / "hf" / f"checkpoint-{step}") if framework == "transformers" else None

    assert rec._watch.log.checkpoints[0] == {"step": 5, "path": path(5), "finite": True}
    assert rec._watch.log.checkpoints[1] == {"step": 6, "path": path(6), "finite": False}  # built per step: the tmp dir may hold "-5"
    assert rec.extra_meta["last_checkpoint_step"] == 6 and rec.extra_meta["last_checkpoint_global_step"] == 6


@pytest.mark.parametrize("action,update", [("warn", "applied"), ("skip", "undone")])
def test_a_nonfinite_update_joins_the_episode(tmp_path, action, update):
    """check_update=True, a NaN learning rate at step 5 (finite gradients, NaN update): under warn
    the update is kept and the weights are corrupted from it on; under skip it is undone."""
    torch.manual_seed(0)
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    with Recorder(m, opt, out_dir=tmp_path, action=action, check_update=True, diagnose=False, embed_program=False, max_dumps=0) as rec:
        for step in range(6):
            for group in opt.param_groups:
                group["lr"] = float("nan") if step == 5 else 0.01
            x = torch.randn(16, 8, generator=g)
            loss = m(x).pow(2).mean()
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        plan = rec.rollback_plan()
    assert plan["episode"]["runs"] == [{"first": 5, "last": 5, "nonfinite": "update", "update": update}]
    assert rec.weights_corrupted is (action == "warn")
    assert plan["episode"]["weights_corrupted_at"] == (5 if action == "warn" else None)
