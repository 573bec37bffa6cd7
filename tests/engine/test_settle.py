"""The op monitor settles once a forward origin is known (``run_step(..., settle=True)``, the
diagnosis's op-level replay): backward ops then run unchecked, and the origin is the one a fully
checked replay names. A first birth that does not reach the losses leaves it unsettled."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import models
from helpers import fail_once
from nanreplay import open_bundle
from nanreplay.diagnosis.api import bundle_step_inputs
from nanreplay.diagnosis.origin import find_origin
from nanreplay.engine.monitors import OpMonitor
from nanreplay.engine.run import run_step
from nanreplay.engine.state import load_state


class TinyGPT(nn.Module):
    """Token embedding, pre-LN residual MLP blocks, a final norm and an untied head."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))})
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = x + b["mlp"](b["ln"](x))
        return self.head(self.ln_f(x))


def make_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class MaskedThenLog(nn.Module):
    """Two births: ``sqrt`` of negative values, masked out of the forward output by
    ``torch.where`` but NaN in the gradient (the saved NaN result in ``SqrtBackward``), and then a
    ``log`` of a negative value in the loss, which reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        r = torch.sqrt(h)  # NaN where h < 0
        return torch.where(h > 0, r, torch.zeros_like(r))


def make_masked() -> nn.Module:
    torch.manual_seed(0)
    return MaskedThenLog()


def log_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.log(model(x).sum() - 1e6) + F.mse_loss(model(x), y) * 0  # log of a negative value: NaN born in the loss


def loss_outside_model(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return torch.log(out - out.max() - 1.0).mean() + F.mse_loss(out, y)  # log of values < 0: NaN born outside every module


def _replays(bundle: str, factory, loss_fn, monkeypatch):
    """The step replayed fully checked, then settling; with the op count checked when the
    monitor settled (``at_settle``, ``None`` when it did not)."""
    at_settle: list = []
    settle = OpMonitor.settle

    def spy(self, products):
        done = settle(self, products)
        if done and not at_settle:
            at_settle.append(self.checked)
        return done

    monkeypatch.setattr(OpMonitor, "settle", spy)
    with open_bundle(bundle) as b:
        state = b.state()
        model = factory()
        load_state(model, state)
        inp = bundle_step_inputs(b, state, loss_fn)
        full = run_step(model, inp, ops=True)
        load_state(model, state)
        settled = run_step(model, inp, ops=True, settle=True)
        origins = [find_origin(r, inp, model, optimizer_replay=lambda: None) for r in (full, settled)]
    return full, settled, origins, (at_settle[0] if at_settle else None)


def _signature(b: dict) -> tuple:
    return (b["phase"], b["op"], b["module"], b["op_index"], b["source"], b["output"].nan, b["output"].posinf, b["output"].neginf)


def test_forward_origin_settles_and_backward_ops_are_not_checked(out_dir, monkeypatch):
    model = make_gpt()
    with torch.no_grad():
        model.blocks[1]["mlp"][0].weight[0, :] = 3e38  # block 1's first MLP layer overflows float32
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 32, (2, 9), generator=g)
    err = fail_once(model, opt, (t[:, :-1], t[:, 1:]), lm_loss, out_dir, diagnose=False, embed_program=False)
    full, settled, (o_full, o_settled), at_settle = _replays(str(err.bundle_path), make_gpt, lm_loss, monkeypatch)

    assert not full.ops.settled and settled.ops.settled
    # the same origin: phase, op, module, op index, source line, kinds
    assert (o_full.phase, o_full.origin) == (o_settled.phase, o_settled.origin)
    assert o_settled.phase == "forward" and o_settled.origin["module"] == "blocks.1.mlp.0" and o_settled.origin["op"] == "addmm"
    fwd = [_signature(b) for b in full.births if b["phase"] in ("forward", "loss")]
    assert [_signature(b) for b in settled.births] == fwd
    assert settled.reaching >= {settled.births[0]["birth"]}
    # the same ops ran; none was checked after the monitor settled, and the backward ops were many
    assert settled.ops.checked + settled.ops.passed == full.ops.checked + full.ops.passed
    assert at_settle == settled.ops.checked
    assert settled.ops.passed - full.ops.passed > settled.ops.checked / 2
    # the gradients and the module events do not depend on it
    assert full.grads.keys() == settled.grads.keys()
    for k in full.grads:
        torch.testing.assert_close(settled.grads[k], full.grads[k], rtol=0, atol=0, equal_nan=True)
    assert [e["module"] for e in full.modules.events] == [e["module"] for e in settled.modules.events]


def test_birth_in_the_loss_outside_every_module_settles(out_dir, monkeypatch):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    err = fail_once(model, opt, batch, loss_outside_model, out_dir, diagnose=False, embed_program=False)
    full, settled, (o_full, o_settled), at_settle = _replays(str(err.bundle_path), models.make_mlp, loss_outside_model, monkeypatch)

    assert settled.ops.settled
    assert (o_settled.phase, o_settled.origin["op"], o_settled.origin["module"]) == ("loss", "log", None)
    assert (o_full.phase, o_full.origin) == (o_settled.phase, o_settled.origin)
    assert settled.ops.checked == at_settle < full.ops.checked


def test_backward_origin_does_not_settle(out_dir, monkeypatch):
    """sqrt(0) is finite forward and NaN backward: no forward birth, so every backward op is
    checked as before."""
    model = models.make_sqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    err = fail_once(model, opt, (torch.randn(4, 4), torch.randn(4, 1)), models.mse_loss, out_dir, diagnose=False, embed_program=False)
    full, settled, (o_full, o_settled), at_settle = _replays(str(err.bundle_path), models.make_sqrt, models.mse_loss, monkeypatch)

    assert at_settle is None and not settled.ops.settled
    assert o_settled.phase == "backward"
    assert (o_full.phase, o_full.origin) == (o_settled.phase, o_settled.origin)
    assert [_signature(b) for b in settled.births] == [_signature(b) for b in full.births]
    assert settled.ops.checked == full.ops.checked


def test_first_birth_reaching_only_the_gradients_keeps_the_backward_checked(out_dir, monkeypatch):
    """The first birth (sqrt, masked by torch.where) reaches only the gradients; a later one
    (log in the loss) reaches the loss. The origin is the first: the monitor must not settle on
    the second, and names sqrt as a fully checked replay does."""
    model = make_masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    err = fail_once(model, opt, (torch.randn(8, 4), torch.randn(8, 4)), log_loss, out_dir, diagnose=False, embed_program=False)
    full, settled, (o_full, o_settled), at_settle = _replays(str(err.bundle_path), make_masked, log_loss, monkeypatch)

    assert [b["op"] for b in full.births[:2]] == ["sqrt", "log"]
    assert at_settle is None and not settled.ops.settled
    assert (o_settled.phase, o_settled.origin["op"]) == ("forward", "sqrt")
    assert (o_full.phase, o_full.origin) == (o_settled.phase, o_settled.origin)
    assert [_signature(b) for b in settled.births] == [_signature(b) for b in full.births]


def test_locating_a_forward_birth_stops_at_its_call(out_dir, monkeypatch):
    """The fix's verification locates the birth's call in a plain replay: it names the call a full
    scan of the step names (the first addmm call that gives birth), and stops there instead of
    running the rest of the forward pass and the backward pass."""
    from nanreplay.engine import rewrite

    model = make_gpt()
    with torch.no_grad():
        model.blocks[1]["mlp"][0].weight[0, :] = 3e38
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    err = fail_once(model, opt, (t[:, :-1], t[:, 1:]), lm_loss, out_dir, diagnose=False, embed_program=False)

    class Scan(rewrite._AtOp):  # every call of the step, and the addmm calls that give birth
        def __init__(self) -> None:
            super().__init__()
            self.births: list[int] = []

        def call(self, func, name, n, args, kwargs):
            out = func(*args, **kwargs)
            if name == "addmm" and torch._C._current_autograd_node() is None and rewrite._birth(args, kwargs, out):
                self.births.append(n)
            return out

    modes: list = []
    init = rewrite._Locate.__init__
    monkeypatch.setattr(rewrite._Locate, "__init__", lambda self, target: (init(self, target), modes.append(self))[0])
    with open_bundle(str(err.bundle_path)) as b:
        state = b.state()
        model = make_gpt()
        load_state(model, state)
        inp = bundle_step_inputs(b, state, lm_loss)
        scan, every = Scan(), rewrite._AtOp()  # the scan's own reads are ops it sees too: the step's ops are counted apart
        rewrite._plain(model, inp, None, scan)
        load_state(model, state)
        rewrite._plain(model, inp, None, every)
        load_state(model, state)
        call = rewrite.locate(model, inp, rewrite.OpTarget("addmm"))
    assert call is not None and (call.name, call.occurrence, call.backward_birth) == ("addmm", scan.births[0], False)
    seen, total = sum(modes[0].counts.values()), sum(every.counts.values())
    assert seen < total / 2  # stopped in block 1's MLP: before the later blocks, the loss and the backward pass
