"""Issue 19 items 4 and 5: the fix at the origin op, verified by a replay that rewrites only that
op call (``classification.fix``), and ``nanreplay export BUNDLE --repro DIR``, a reproducer that
needs only torch."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

from nanreplay import NonFiniteGradientError, Recorder
from nanreplay.cli import main
from nanreplay.diagnosis.api import bundle_step_inputs, replay
from nanreplay.diagnosis.classify import Features
from nanreplay.diagnosis.fix import ADVICE, FIXES, PHASE_ADVICE, propose_fix
from nanreplay.diagnosis.repro import SCRIPT, TENSORS, write_repro
from nanreplay.engine.rewrite import OpCall, OpTarget, locate, replay_rewritten
from nanreplay.engine.state import ReplayRequest, load_state, opened_subject
from nanreplay.errors import ReplayError
from nanreplay.report.text import render_report


class Norm(nn.Module):
    """x / ||x||: NaN for an all-zero row, born in the forward pass at the division."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x / x.norm(dim=1, keepdim=True))


class TwoFaults(nn.Module):
    """log(x) is -Inf at x = 0 and, independently, sqrt(x - 1) is NaN for x < 1: fixing the first
    birth alone leaves the step non-finite."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.log(x) + torch.sqrt(x - 1.0))


class Overflow(nn.Module):
    """A float32 Linear whose first output is 3e38 * x0 + 3e38 * x1: for x = (2, -2) each product
    passes float32's largest value (NaN or Inf, whatever the summation order), while the sum is 0
    in float64."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        with torch.no_grad():
            self.fc.weight[0] = torch.tensor([3e38, 3e38])

    def forward(self, x):
        return self.fc(x)


def _make(cls):
    def factory():
        torch.manual_seed(0)
        return cls()

    return factory


make_norm, make_two_faults, make_overflow = _make(Norm), _make(TwoFaults), _make(Overflow)


def loss_fn(model, batch):
    return model(batch[0]).pow(2).mean()


def _record(factory, x, out_dir):
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=loss_fn, model_factory=factory, out_dir=out_dir, diagnose=False) as rec:
            rec.record((x,))
            loss_fn(model, (x,)).backward()
            opt.step()
    return str(ei.value.bundle_path)


@pytest.fixture(scope="module")
def norm_bundle(tmp_path_factory):
    x = torch.randn(4, 4)
    x[2] = 0.0
    return _record(make_norm, x, tmp_path_factory.mktemp("norm"))


# -- item 4: the fix ---------------------------------------------------------------------------

def test_a_backward_birth_gets_its_fix_verified_by_replay(sqrt_bundle):
    diag = replay(sqrt_bundle)
    fix = diag["classification"]["fix"]
    assert diag["classification"]["cause"] == "numerics"
    assert fix["description"].startswith("sqrt(max(x, 1e-12)) at models.py:")
    assert fix["verified"] is True and fix["op"] == "sqrt.default"
    assert isinstance(fix["loss"], float) and fix["loss"] == fix["loss"]
    assert fix["detail"] == "the step replayed with it produces finite losses, outputs and gradients"  # sqrt's derivative replaced too
    text = render_report(diag)
    assert f"fix verified: with sqrt(max(x, 1e-12)) at models.py:" in text and f"step {diag['step']} replays finite (loss " in text
    pytest.importorskip("matplotlib")
    from nanreplay.report.html import render_html

    page = render_html(diag, meta=None, bundle_name="b.h5")
    assert "<tr><th>fix</th><td>fix verified: with sqrt(max(x, 1e-12)) at models.py:" in page


def test_the_rewrite_changes_only_that_call_and_its_gradient(norm_bundle):
    """The recorded step is non-finite; the same call rewritten as itself still is; rewritten with
    the fix table's row it is finite, gradients included."""
    with opened_subject(norm_bundle, ReplayRequest()) as (b, subject, dev):
        state = b.state()
        load_state(subject.model, state)
        inp = bundle_step_inputs(b, state, subject.loss_fn)
        call = locate(subject.model, inp, OpTarget("div"), device=dev)
        assert call is not None and call.name == "div" and call.occurrence >= 1 and not call.backward_birth
        same, how = replay_rewritten(subject.model, inp, call, lambda func, args, kwargs: func(*args, **kwargs), device=dev)
        assert how["applied"] and same.products_nonfinite()
        row = FIXES["domain"]["div"]
        fixed, how = replay_rewritten(subject.model, inp, call, lambda func, args, kwargs: row.rewrite(func, args, kwargs, 1e-12), device=dev)
        assert how["applied"] and how["backward_replaced"] is None  # x / ||x|| of the batch alone: no autograd node to replace
        assert not fixed.products_nonfinite() and all(bool(torch.isfinite(g).all()) for g in fixed.grads.values())


class TwiceFromOneLine(nn.Module):
    """The same division on one source line runs twice a step (on x, then on 2x); the first call
    is finite, the second gives birth only where x is 0 in a row whose other entries are not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def scale(self, x):
        return x / x.amax(dim=1, keepdim=True)

    def forward(self, x):
        return self.fc(self.scale(x + 1.0) + self.scale(x))


make_twice = _make(TwiceFromOneLine)


@pytest.mark.parametrize("case", ["norm", "twice"])
def test_finding_the_call_in_the_rewriting_replay_rewrites_what_locating_it_first_does(case, norm_bundle, tmp_path):
    """A forward birth's fix is verified in one replay (replay_rewritten(find=...)): the call it
    finds, what it rewrites and the replayed step equal the two-pass verification's (locate, then
    replay_rewritten(call)), with and without the birth's source line (the same line's other calls)."""
    if case == "norm":
        bundle, op = norm_bundle, "div"
    else:
        x = torch.rand(4, 4) + 0.5
        x[1] = 0.0
        bundle, op = _record(make_twice, x, tmp_path), "div"
    row = FIXES["domain"]["div"]
    rewrite = lambda func, args, kwargs: row.rewrite(func, args, kwargs, 1e-12)  # noqa: E731
    with opened_subject(bundle, ReplayRequest()) as (b, subject, dev):
        state = b.state()
        load_state(subject.model, state)
        inp = bundle_step_inputs(b, state, subject.loss_fn)
        origin = replay(b)["origin"]
        line = (origin["source"]["file"], origin["source"]["line"])
        call = locate(subject.model, inp, OpTarget(op), device=dev)
        for where in (None, line):
            two, how2 = replay_rewritten(subject.model, inp, call, rewrite, device=dev, line=where)
            one, how1 = replay_rewritten(subject.model, inp, None, rewrite, device=dev, line=where, find=OpTarget(op))
            assert (how1["call"].name, how1["call"].occurrence) == (call.name, call.occurrence)
            assert {k: how1[k] for k in ("applied", "others", "error", "notes")} == {k: how2[k] for k in ("applied", "others", "error", "notes")}
            assert one.loss_values == two.loss_values and one.products_nonfinite() == two.products_nonfinite()
            assert set(one.grads) == set(two.grads) and all(torch.equal(one.grads[k], two.grads[k]) for k in two.grads)
        if case == "twice":
            assert how1["others"] == 1  # both calls of the line rewritten


def test_replay_rewritten_needs_a_call_or_a_forward_op(norm_bundle):
    with opened_subject(norm_bundle, ReplayRequest()) as (b, subject, dev):
        inp = bundle_step_inputs(b, b.state(), subject.loss_fn)
        with pytest.raises(ValueError, match="find=OpTarget"):
            replay_rewritten(subject.model, inp, None, lambda f, a, k: f(*a, **k), find=OpTarget("div", backward=True))


class MaskedSoftmax(nn.Module):
    """softmax over scores whose row is fully masked (-Inf): NaN born in the forward pass, which
    makes the loss and so the recorded output gradient (the cotangent) NaN at that row; with
    ``head``, a Linear after the softmax, whose backward pass spreads that NaN row into its weight's
    gradient whatever the softmax computes."""

    def __init__(self, head: bool = True):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4) if head else nn.Identity()

    def forward(self, x, pad):
        return self.head(self.fc(x).masked_fill(pad, float("-inf")).softmax(-1))


@pytest.mark.parametrize("head", [True, False], ids=["layer-after-the-op", "op-last"])
def test_a_forward_fix_replayed_on_a_nan_cotangent_is_judged_by_its_forward_pass(tmp_path, head):
    def factory():
        torch.manual_seed(0)
        return MaskedSoftmax(head)

    model, x = factory(), torch.randn(4, 4)
    pad = torch.zeros(4, 4, dtype=torch.bool)
    pad[1] = True  # every position of row 1 masked
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, model_factory=factory, out_dir=tmp_path, diagnose=False) as rec:
            rec.record((x, pad))
            loss = model(x, pad).pow(2).mean()  # no loss function given: the replay runs on the recorded cotangent
            rec.log_loss(loss)
            loss.backward()
            opt.step()
    bundle = str(ei.value.bundle_path)
    diag = replay(bundle)
    fix = diag["classification"]["fix"]
    assert diag["mode"] == "cotangent" and diag["origin"]["op"] == "_softmax"
    assert fix["description"].startswith("a guard for rows with every position masked")
    if head:
        # the guard makes the forward pass finite; the NaN row of the recorded cotangent (made by the failing loss)
        # reaches the head's weight gradient whatever the softmax gives: that neither verifies nor refutes the fix
        assert fix["verified"] is None and fix["loss"] is None
        assert fix["detail"].startswith("the forward pass replays finite with it") and "--loss-fn" in fix["detail"]
        assert "fix (not verified): a guard for rows with every position masked" in render_report(diag)
        assert "its backward pass cannot judge it" in render_report(diag)
    else:
        # the guard's own backward pass stops the NaN row before any weight: every gradient finite, verified
        assert fix["verified"] is True
    # with the loss function the whole step is replayed, the fix included, and verified either way
    whole = replay(bundle, loss_fn=lambda m, batch: m(*batch).pow(2).mean())
    assert whole["mode"] == "loss_fn" and whole["classification"]["fix"]["verified"] is True


def masked_mean_loss(model, batch):
    """A token mean over the kept positions: the count, an integer tensor, is 0 when no position is kept."""
    x, keep = batch
    per = model(x).pow(2).sum(-1)
    return (per * keep).sum() / keep.sum()


def test_a_division_by_an_integer_count_gets_its_fix_verified_through_the_backward_pass(tmp_path):
    """The divisor (``keep.sum()``, int64) takes no gradient, so the division's autograd node has
    two input gradients for one floating input: the rewrite's gradient now goes to the floating
    one. Before, the node's own backward (a division by 0) was left in place and the fix read
    'still replays non-finite'."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(3, 4), torch.zeros(3, dtype=torch.bool))  # nothing kept: 0 / 0
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=masked_mean_loss, model_factory=_make(lambda: nn.Linear(4, 4)), out_dir=tmp_path,
                      diagnose=False) as rec:
            rec.record(batch)
            masked_mean_loss(model, batch).backward()
            opt.step()
    diag = replay(str(ei.value.bundle_path))
    assert diag["phase"] == "loss" and diag["origin"]["op"] == "div"
    fix = diag["classification"]["fix"]
    assert fix["description"].startswith("x / max(y, 1e-12)") and fix["verified"] is True and fix["loss"] == 0.0


class Confident(nn.Module):
    """A linear classifier with large weights: softmax probabilities of the losing classes underflow to 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.mul_(400.0)

    def forward(self, x):
        return self.fc(x)


def log_of_softmax_loss(model, batch):
    """log(softmax(z)) instead of log_softmax: finite at the target class, whose probability does not underflow."""
    x, y = batch
    return -torch.log(torch.softmax(model(x), -1)).gather(1, y[:, None]).mean()


def test_a_backward_birth_blames_the_divisor_of_its_derivative_not_the_incoming_gradient(tmp_path):
    """log's derivative runs ``grad / x``: the gradient flowing in from the gather is 0 at every
    losing class, and ``x`` (an underflowed probability) is 0 at a few of them; 0 / 0 is NaN
    there. The evidence describes ``x``, made by softmax, not the gradient made by gather's
    backward (scatter_add), which it named before."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    model = _make(Confident)()
    y = model(x).argmax(-1)  # each row's target is its winning class: the loss is finite
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=log_of_softmax_loss, model_factory=_make(Confident), out_dir=tmp_path, diagnose=False) as rec:
            rec.record((x, y))
            loss = log_of_softmax_loss(model, (x, y))
            assert torch.isfinite(loss)
            loss.backward()
            opt.step()
    diag = replay(str(ei.value.bundle_path))
    assert diag["phase"] == "backward" and diag["origin"]["op"] == "div"
    cls = diag["classification"]
    ev = "\n".join(cls["evidence"])
    assert "operand other" in ev and "last made by _softmax" in ev and "scatter_add" not in ev + cls["detail"]
    assert cls["fix"]["description"].startswith("log(max(x, 1e-12))") and cls["fix"]["verified"] is True


def test_a_fix_that_does_not_hold_is_not_verified(tmp_path):
    x = torch.rand(4, 4) + 0.5
    x[1, 2] = 0.0  # log(0) = -Inf (the first birth), and sqrt(x - 1) is NaN wherever x < 1
    diag = replay(_record(make_two_faults, x, tmp_path))
    fix = diag["classification"]["fix"]
    assert diag["origin"]["op"] == "log"
    assert fix["description"].startswith("log(max(x, 1e-12))")
    assert fix["verified"] is False and fix["loss"] is None
    assert "fix not verified: with log(max(x, 1e-12))" in render_report(diag)


def test_a_float32_overflow_gets_advice_not_the_op_computed_in_float32_again(tmp_path):
    diag = replay(_record(make_overflow, torch.tensor([[2.0, -2.0]] * 4), tmp_path))
    assert diag["classification"]["cause"] == "overflow" and diag["origin"]["op"] == "addmm"
    assert diag["classification"]["fix"] == {"description": ADVICE["overflow"].replace("{range}", "float32's largest is 3.4e+38"),
                                             "verified": None, "loss": None, "op": None, "detail": "no op rewrite verifies this cause"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_only_a_half_precision_overflow_is_fixed_by_computing_the_op_in_float32(dtype):
    birth = {"op": "mm", "phase": "forward", "operands": {"tensors": [{"dtype": dtype}]}}
    fix = propose_fix(Features(phase="forward", origin={}, birth=birth), "overflow", nn.Linear(2, 2), None, verify=False)  # type: ignore[arg-type]
    assert fix is not None
    if dtype in ("float16", "bfloat16"):
        assert fix["description"].startswith("the op computed in float32 (upcast its inputs, cast the result back)")
        a = torch.tensor([[6e4, 6e4, -6e4, -6e4]], dtype=getattr(torch, dtype))  # the partial sums pass float16's largest value
        out = FIXES["range"]["*"].rewrite(torch.ops.aten.mm.default, (a, torch.ones(4, 1, dtype=a.dtype)), {}, 0.0)
        assert out.dtype == a.dtype and out.tolist() == [[0.0]]
    else:  # the advice names the op's own dtype's range, never another's
        largest = {"float32": "3.4e+38", "float64": "1.8e+308"}[dtype]
        assert fix["description"] == ADVICE["overflow"].replace("{range}", f"{dtype}'s largest is {largest}") and fix["verified"] is None


def test_causes_no_rewrite_verifies_get_the_standard_advice_unverified():
    model = nn.Linear(2, 2)
    fix = propose_fix(Features(phase="input", origin={}), "bad input data", model, None)  # type: ignore[arg-type]
    assert fix == {"description": PHASE_ADVICE["input"], "verified": None, "loss": None, "op": None,
                   "detail": "no op rewrite verifies this cause"}
    assert propose_fix(Features(phase="none", origin={}), "transient", model, None)["description"] == ADVICE["transient"]  # type: ignore[arg-type,index]
    assert propose_fix(Features(phase="none", origin={}), "unknown", model, None) is None  # type: ignore[arg-type]


# -- item 5: the reproducer --------------------------------------------------------------------

def test_export_repro_writes_a_script_that_reproduces_a_backward_birth(sqrt_bundle, tmp_path):
    out = tmp_path / "repro"
    res = CliRunner().invoke(main, ["export", str(sqrt_bundle), "--repro", str(out)])
    assert res.exit_code == 0, res.output
    assert "aten sqrt.default and its derivative (with the recorded output gradient) on its recorded inputs" in res.output
    assert (out / SCRIPT).exists() and 0 < (out / TENSORS).stat().st_size < 1_000_000
    run = subprocess.run([sys.executable, str(out / SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "input gradient 0: torch.float32 [5, 1]: 1 +Inf of 5" in run.stdout and "reproduced: the result holds non-finite values" in run.stdout

    # the same script on inputs with the fix applied (sqrt's input clamped to 1e-12): finite, exit 1
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / TENSORS))
    tensors["arg0"] = tensors["arg0"].clamp_min(1e-12)
    save_file(tensors, str(out / TENSORS))
    run = subprocess.run([sys.executable, str(out / SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "not reproduced: the result is finite" in run.stdout


def test_export_repro_of_a_forward_birth(norm_bundle, tmp_path, capsys):
    out = tmp_path / "repro"
    res = CliRunner().invoke(main, ["export", norm_bundle, "--repro", str(out)])
    assert res.exit_code == 0, res.output
    assert "aten div.Tensor on its recorded inputs (step 0, test_fix_repro.py:" in res.output
    with pytest.raises(SystemExit) as ei:
        runpy.run_path(str(out / SCRIPT), run_name="__main__")
    assert ei.value.code == 0
    said = capsys.readouterr().out
    assert "input 1: torch.float32 [4, 1]: 1 zeros of 4" in said and "output 0: torch.float32 [4, 4]: 4 NaN, " in said


def test_export_repro_refuses_an_op_off_the_allowlist(tmp_path):
    class Func:  # what a program from a hostile bundle could name
        _overloadname = "default"

    for name in ("system", "sqrt'); import os; os.system('true'); ('", "_load"):
        with pytest.raises(ReplayError, match=r"expected an aten op on nanreplay's reviewed allowlist .*; the reproducer is not written"):
            write_repro(OpCall(name, 1, Func(), args=(torch.zeros(2),), kwargs={}), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_export_repro_without_an_op_origin_exits_5(unreproducible_bundle, tmp_path):
    res = CliRunner().invoke(main, ["export", str(unreproducible_bundle), "--repro", str(tmp_path / "r")])
    assert res.exit_code == 5, res.output
    assert "expected an op to give birth to the non-finite value, found none (the replay produced no non-finite value)" in res.output
    assert not (tmp_path / "r").exists()


def test_an_overflow_whose_operands_are_unknown_is_judged_in_its_output_dtype():
    """No float32 advice for a float16 op: without recorded operands, the birth's output dtype
    decides (the scaler's fp16 overflows)."""
    birth = {"op": "mm", "phase": "backward", "output": {"dtype": "float16", "nan": 0, "posinf": 1, "neginf": 0, "numel": 4}}
    fix = propose_fix(Features(phase="backward", origin={}, birth=birth), "overflow", nn.Linear(2, 2), None, verify=False)  # type: ignore[arg-type]
    assert fix is not None and fix["description"].startswith("the op computed in float32 (upcast its inputs, cast the result back)")
    assert "float32's largest" not in fix["description"]
