"""The program is exported at the failing step by default; with ``export_early=True`` at the first
finite step, and re-embedded by the failing step's dump (:mod:`nanreplay.capture.program_cache`),
without changing the run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanreplay
from nanreplay import NonFiniteGradientError, Recorder, open_bundle
from nanreplay.capture.program_cache import model_signature


class TinyGPT(nn.Module):
    """Embedding, one attention + MLP block with dropout (draws from the CPU generator), tied head."""

    def __init__(self, vocab: int = 32, d: int = 16, ctx: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return self.head(x + self.mlp(x))


def step_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y, w = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / w.sum()


def batches(n: int, *, zero_at: int = -1, ctx_at: dict | None = None):
    g = torch.Generator().manual_seed(3)
    for i in range(n):
        t = (ctx_at or {}).get(i, 8)
        ids = torch.randint(0, 32, (4, t + 1), generator=g)
        w = torch.zeros(4) if i == zero_at else torch.ones(4)
        yield ids[:, :-1], ids[:, 1:], w


def train(steps: int, recorder: dict | None, **batch_kw) -> tuple[list[torch.Tensor], nn.Module, object]:
    """Losses of a run (global RNG seeded, dropout drawing from it), with or without a Recorder."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model, opt, loss_fn=step_loss, **recorder) if recorder is not None else None
    losses = []
    try:
        for batch in batches(steps, **batch_kw):
            if rec is not None:
                rec.record(batch)
            loss = step_loss(model, batch)
            losses.append(loss.detach().clone())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return losses, model, rec


def test_early_export_leaves_training_bit_identical(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    plain, m_plain, _ = train(5, None)
    rng_plain = torch.get_rng_state()
    recorded, m_rec, rec = train(5, {"out_dir": tmp_path, "export_early": True})
    rng_rec = torch.get_rng_state()
    assert rec._dump.programs.step == 0 and rec._dump.programs.verified, "exported (and verified) at the first finite step"
    assert "exported the loss program at step 0" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded)), "the same losses, bit for bit"
    assert all(torch.equal(a, b) for a, b in zip(m_plain.state_dict().values(), m_rec.state_dict().values()))
    assert torch.equal(rng_plain, rng_rec), "the user's CPU generator is where it would be without nanreplay"


def test_failing_step_reembeds_the_early_program_and_it_replays(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    with pytest.raises(NonFiniteGradientError) as e:
        train(5, {"out_dir": tmp_path, "export_early": True}, zero_at=3)
    log = caplog.text
    assert "exported the loss program at step 0" in log
    assert "embedding step 3's program: the one exported at step 0 fits" in log
    assert "embedding step 3's program in the bundle (torch.export" not in log, "no export on the failing step"
    with open_bundle(e.value.bundle_path) as b:
        prog = b.meta["program"]
        recorded = b.diagnosis
    assert prog["kind"] == "loss" and prog["exported_at_step"] == 0
    diag = nanreplay.replay(e.value.bundle_path)  # the embedded program, no model code given
    assert diag["model_source"] == "the program embedded in the bundle (forward and loss)"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["summary"] == recorded["summary"]


def test_program_is_exported_again_when_the_input_shapes_change(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    with pytest.raises(NonFiniteGradientError) as e:  # a longer sequence at the failing step: the position arange changes
        train(4, {"out_dir": tmp_path, "export_early": True}, zero_at=2, ctx_at={2: 6})
    assert "does not fit step 2" in caplog.text
    with open_bundle(e.value.bundle_path) as b:
        assert b.meta["program"]["kind"] == "loss" and "exported_at_step" not in b.meta["program"]
    assert nanreplay.replay(e.value.bundle_path)["reproduction"]["verdict"] == "reproduced exactly"


class Branchy(nn.Module):
    """Python control flow on a tensor value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * 2 if float(h.detach().sum()) > 0 else h


def test_a_failed_early_export_is_recorded_and_not_retried(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, batch):
        x, w = batch
        return m(x).pow(2).sum() / w.sum()

    with Recorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path, diagnose=False, export_early=True) as rec:
        with pytest.raises(NonFiniteGradientError) as e:
            for i in range(3):
                batch = (torch.randn(2, 4), torch.zeros(2) if i == 2 else torch.ones(2))
                rec.record(batch)
                loss = loss_fn(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert "could not export the model's program at step 0" in caplog.text
    assert "training goes on" in caplog.text
    assert caplog.text.count("exporting the model's program") == 1, "one export tried in the run, at step 0"
    assert "program in the bundle (torch.export" not in caplog.text, "the dump re-embeds the recorded failure, no second export"
    # the failure says what the model did, where, in the model's own terms
    assert "the code reads a tensor's value to decide what to run" in caplog.text and f"test_program_cache.py:{Branchy.forward.__code__.co_firstlineno + 2} in forward" in caplog.text
    with open_bundle(e.value.bundle_path) as b:
        assert b.meta["program"]["kind"] is None and b.meta["program"]["error"]


def test_by_default_the_program_is_exported_at_the_failing_step_only(tmp_path, caplog):
    """A run that never fails never exports; the failing step exports, says so, and the program
    it embeds is verified against that step and replays."""
    caplog.set_level(logging.WARNING, logger="nanreplay")
    _, _, rec = train(3, {"out_dir": tmp_path, "diagnose": False})
    assert not rec._dump.programs.tried or rec._dump.programs.step is None
    assert "export" not in caplog.text and not list(tmp_path.iterdir())
    with pytest.raises(NonFiniteGradientError) as e:
        train(3, {"out_dir": tmp_path, "diagnose": False}, zero_at=2)
    assert "at step 0" not in caplog.text
    assert "embedding step 2's program in the bundle, now that a step failed (torch.export" in caplog.text
    assert "embedded step 2's loss program in" in caplog.text
    with open_bundle(e.value.bundle_path) as b:
        assert b.meta["program"]["kind"] == "loss" and "exported_at_step" not in b.meta["program"]
    assert nanreplay.replay(e.value.bundle_path)["reproduction"]["verdict"] == "reproduced exactly"


def test_model_signature_sees_modes_shapes_and_the_loss_function():
    model = TinyGPT()
    sig = model_signature(model, step_loss)
    assert model_signature(model, step_loss) == sig
    model.mlp.eval()
    assert model_signature(model, step_loss) != sig
    model.train()
    assert model_signature(model, step_loss) == sig
    assert model_signature(model, lambda m, b: step_loss(m, b)) != sig
    model.qkv = nn.Linear(16, 48, bias=False)
    assert model_signature(model, step_loss) != sig


class StraightThrough(torch.autograd.Function):
    """round() forward, identity backward: a backward an exported program does not carry."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class Quantised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StraightThrough.apply(self.fc(x) * 4)


def _two_finite_steps(model: nn.Module, opt, out_dir) -> Recorder:
    """Two finite steps of ``model`` on random (8, 4) batches under a Recorder (loss: mean square)."""

    def loss_fn(m, batch):
        return m(batch).pow(2).mean()

    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, diagnose=False, export_early=True) as rec:
        for _ in range(2):
            x = torch.randn(8, 4)
            rec.record(x)
            loss = loss_fn(model, x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rec


def test_an_unfaithful_program_is_not_taken_as_verified_at_a_finite_step(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nanreplay")
    torch.manual_seed(0)
    model = Quantised()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    rec = _two_finite_steps(model, opt, tmp_path)
    programs = rec._dump.programs
    assert programs.step == 0
    assert not programs.verified, "finite gradients that differ in value fail the early check"
    assert "the dump verifies it against the failing step" in caplog.text


class Spike(torch.autograd.Function):
    """A spiking neuron's step function with a surrogate gradient (sigmoid'): the traced forward
    (a comparison) has no derivative, so an exported program gives ``fc`` no gradient at all."""

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        return (u > 0).to(u.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (u,) = ctx.saved_tensors
        s = torch.sigmoid(u)
        return grad * s * (1 - s)


class Spiking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(Spike.apply(self.fc(x)))


def test_a_program_that_loses_a_gradient_is_not_taken_as_verified(tmp_path, caplog):
    """The gradients the program does give match exactly; the ones it does not give (``fc``'s)
    must fail the early check all the same."""
    caplog.set_level(logging.INFO, logger="nanreplay")
    torch.manual_seed(0)
    model = Spiking()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    rec = _two_finite_steps(model, opt, tmp_path)
    assert model.fc.weight.grad is not None and bool(model.fc.weight.grad.ne(0).any())
    programs = rec._dump.programs
    assert programs.step == 0
    assert not programs.verified, "a nonzero recorded gradient absent in the program's replay fails the early check"
    assert "the dump verifies it against the failing step" in caplog.text


def test_a_failed_export_that_changed_the_model_leaves_it_exactly_usable(tmp_path, monkeypatch, caplog):
    """An export that fails half-way after swapping a parameter's storage, replacing a parameter
    and a buffer object, flipping a training flag and leaving a hook (what a wrapper's own hooks did
    under FSDP1's fake-tensor trace) is undone: the run is bit-identical to the plain one."""
    import nanreplay.engine.program as program

    caplog.set_level(logging.WARNING, logger="nanreplay")
    seen: dict = {}

    def broken(model, rec, loss_fn, **kw):
        seen["ids"] = [id(p) for p in model.parameters()]
        model.qkv.weight.data = torch.zeros_like(model.qkv.weight)  # another storage under the same Parameter
        model.ln._parameters["bias"] = nn.Parameter(torch.full_like(model.ln.bias, 7.0))
        model.mlp[0].register_buffer("stray", torch.ones(1))
        model.mlp.training = False
        model.register_forward_hook(lambda *a: None)
        raise RuntimeError("DispatchStub: unsupported device typemeta")

    monkeypatch.setattr(program, "program_content", broken)
    plain, m_plain, _ = train(4, None)
    recorded, m_rec, rec = train(4, {"out_dir": tmp_path, "export_early": True})
    assert "ids" in seen  # the export ran, and failed
    assert [id(p) for p in m_rec.parameters()] == seen["ids"]
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert all(torch.equal(a, b) for a, b in zip(m_plain.state_dict().values(), m_rec.state_dict().values()))
    assert m_rec.state_dict().keys() == m_plain.state_dict().keys() and m_rec.mlp.training
    assert not m_rec._forward_hooks and not m_rec._forward_pre_hooks  # the stray hook is gone; close() removed the Recorder's
    assert "the program export changed the model" in caplog.text


def test_a_program_that_does_not_reproduce_the_failing_step_is_dropped_from_the_bundle(tmp_path, caplog):
    """The export at the failing step is verified against it before the bundle is written again; a
    program whose replay does not reproduce the step (here: no gradient reaches ``fc`` through the
    traced spike) is left out, and the bundle says why."""
    caplog.set_level(logging.WARNING, logger="nanreplay")
    torch.manual_seed(0)
    model = Spiking()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(m, batch):
        x, w = batch
        return m(x).pow(2).mean() * w

    with Recorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path, diagnose=False) as rec:
        with pytest.raises(NonFiniteGradientError) as e:
            for i in range(3):
                batch = (torch.randn(8, 4), torch.tensor(float("nan") if i == 2 else 1.0))
                rec.record(batch)
                loss = loss_fn(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert "embedding step 2's program in the bundle, now that a step failed" in caplog.text
    assert "could not embed step 2's program (the exported program does not reproduce the step's gradients" in caplog.text
    with open_bundle(e.value.bundle_path) as b:
        assert b.meta["program"]["kind"] is None
        assert b.meta["program"]["error"].startswith("the exported program does not reproduce the step's gradients")
        assert not [k for k in b.keys() if k.startswith("program/")]


def test_a_step_whose_recording_does_not_reproduce_keeps_a_program_that_agrees_with_the_model(tmp_path):
    """A NaN written into a gradient after the backward pass (as a device fault would) does not
    reproduce on any replay; the program exported at that step is then compared with an eager
    replay of the step on the live model, kept, and replays the bundle without the model's code."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Recorder(model, opt, loss_fn=step_loss, out_dir=tmp_path, diagnose=False) as rec:
        with pytest.raises(NonFiniteGradientError) as e:
            for i, batch in enumerate(batches(3)):
                rec.record(batch)
                loss = step_loss(model, batch)
                opt.zero_grad()
                loss.backward()
                if i == 2:
                    model.qkv.weight.grad[3, 5] = float("nan")  # after the backward pass: not the model's doing
                opt.step()
    with open_bundle(e.value.bundle_path) as b:
        program = b.meta["program"]
        assert program["kind"] == "loss", program.get("error")
        assert program["verified_against"].startswith("an eager replay of the step")
    diag = nanreplay.replay(e.value.bundle_path)
    assert diag["model_source"].startswith("the program embedded")
    assert diag["reproduction"]["verdict"] == "not reproduced"
    assert diag["classification"]["cause"] == "transient"
