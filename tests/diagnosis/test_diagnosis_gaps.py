"""Generic gaps of the diagnosis found on real code (issue 10): complex dtypes in the wider-dtype
recompute, the in-process diagnosis (visible, capped, the bundle written first), the evidence
for weights already non-finite at step start."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import models
from corpus import runner
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay
from nanreplay.diagnosis.api import diagnose_live
from nanreplay.engine.probes import wider_recompute
from nanreplay.core.digest import grads_nonfinite


def test_wider_recompute_widens_complex_operands_within_their_kind():
    x = torch.tensor([100 + 0j, 1 + 1j], dtype=torch.complex64)  # |exp(100)| = 2.7e43 > float32 max
    out = torch.exp(x)
    assert not bool(torch.isfinite(out).all())
    wide = wider_recompute(torch.ops.aten.exp.default, (x,), {}, [out])
    assert wide["dtype"] == "complex128" and wide["finite"] is True
    assert wide["absmax"] == pytest.approx(2.688e43, rel=1e-3)
    # a float32 operand of a complex64 op is widened to float64, not to a complex dtype
    y = torch.tensor([3e38, 3e38])
    prod = torch.mul(x, y)
    wide = wider_recompute(torch.ops.aten.mul.Tensor, (x, y), {}, [prod])
    assert wide["dtype"] == "complex128" and wide["finite"] is True


def test_wider_recompute_names_a_value_non_finite_in_the_wider_dtype_too():
    x = torch.tensor([-1.0, 4.0])
    out = torch.log(x)
    wide = wider_recompute(torch.ops.aten.log.default, (x,), {}, [out])
    assert wide == {"dtype": "float64", "finite": False, "absmax": pytest.approx(1.386, rel=1e-3)}


def _fail(out_dir, **opts):
    """A nested MLP whose encoder bias makes one sample's activations 0 -> a 0/0 in the loss."""
    model = models.make_nested()
    with torch.no_grad():
        model.encoder["block"].proj.bias.fill_(-1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8) * 3
    x[2] = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_nested, out_dir=out_dir, **opts) as rec:
            rec.record({"x": x})
            models.mean_loss(model, {"x": x}).backward()
            opt.step()
    return info.value, model, before


def test_the_in_process_diagnosis_says_when_it_starts_how_to_skip_it_and_its_answer(out_dir, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    err, _, _ = _fail(out_dir, embed_program=False)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("nanreplay")]
    start = next(i for i, m in enumerate(messages) if "diagnosing step 0 in process" in m)
    assert "diagnose=False" in messages[start] and "nanreplay replay" in messages[start]
    wrote = next(i for i, m in enumerate(messages) if m.startswith("nanreplay: wrote"))
    assert wrote < start  # the bundle is on disk before the diagnosis begins
    done = next(m for m in messages[start:] if m.startswith("nanreplay: diagnosis of step 0 ("))
    assert err.diagnosis is not None and err.diagnosis["summary"] in done


def test_the_program_export_at_dump_says_what_it_does_and_how_long_it_took(out_dir, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    _fail(out_dir, diagnose=False)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("nanreplay")]
    start = next(i for i, m in enumerate(messages) if "embedding step 0's program" in m)
    assert "embed_program=False" in messages[start]
    assert any(re.match(r"nanreplay: embedded step 0's (loss|forward) program in \d+\.\d s", m) for m in messages[start + 1:]), messages


def test_a_diagnosis_past_its_timeout_stops_keeps_the_bundle_and_leaves_the_model_as_found(out_dir, caplog):
    caplog.set_level(logging.WARNING, logger="nanreplay")
    err, model, before = _fail(out_dir, embed_program=False, diagnose_timeout=1e-9)
    assert err.diagnosis is None
    assert any("stopped (DiagnosisTimeout" in r.getMessage() and "nanreplay replay" in r.getMessage() for r in caplog.records)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # action="raise": the step was not applied, nothing restored wrongly
    with open_bundle(err.bundle_path) as b:
        assert b.diagnosis is None and b.meta["diagnosis_error"].startswith("DiagnosisTimeout: ")
    diag = replay(err.bundle_path)  # the bundle holds everything: replayed later without a cap
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_diagnose_live_reports_progress_and_leaves_the_live_model_unchanged(out_dir):
    err, model, before = _fail(out_dir, diagnose=False, embed_program=False)
    with open_bundle(err.bundle_path) as b:
        content = b.content()
    said: list[str] = []
    diag = diagnose_live(model, content, loss_fn=models.mean_loss, progress=said.append)
    assert said and all(isinstance(m, str) and m for m in said)
    assert diag["phase"] in ("forward", "loss") and diag["reproduction"]["verdict"] == "reproduced exactly"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_non_finite_at_step_start_name_the_update_the_state_key_and_the_hyperparameter(out_dir):
    case = runner.load_case(runner.CASES_DIR / "fp16_adam_eps_underflow_padding_row.py")
    res = runner.record_case(case, out_dir, diagnose=False)
    diag = replay(res["bundle"])
    assert diag["phase"] == "weights" and diag["origin"]["module"] == "emb"
    assert diag["classification"]["cause"] == "optimizer update"
    text = " ".join(diag["classification"]["evidence"])
    assert "the last step whose check passed is 0" in text  # the update of step 0 wrote the NaN
    assert "eps=1e-08 rounds to 0 in float16" in text        # checked without any replay
    with open_bundle(res["bundle"]) as b:  # every evidence line is true of the bundle
        grads_finite = not grads_nonfinite(b.grads())
        state = b.state().optimizer["state"]
    nonfinite_keys = sorted({k for st in state.values() for k, v in st.items() if torch.is_tensor(v) and not bool(torch.isfinite(v).all())})
    assert ("recorded gradients of this step are finite" in text) == grads_finite
    assert ("optimizer state" in text) == bool(nonfinite_keys)
    assert all(k in text for k in nonfinite_keys)


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _eval_bn_model() -> torch.nn.Module:
    return _bn_model().eval()


def _mean_sqrt_loss(model, batch):
    """sqrt of a batch mean that one sample (x[3, 0] = -100) drives negative: a scalar birth
    whose rows cannot show the sample, so samples come from per-sample replay."""
    (x,) = batch
    return model(x).pow(2).mean() + torch.sqrt((model(x)[:, 0] * 0 + x[:, 0]).mean() + 1)


def _pair_loss(model, batch):
    """The same, plus a term that needs two samples (one sample alone raises IndexError)."""
    (x,) = batch
    h = model(x)
    return (h[0] - h[1]).pow(2).mean() + torch.sqrt((h[:, 0] * 0 + x[:, 0]).mean() + 1)


@pytest.mark.parametrize("factory, loss_fn, expect", [
    (_eval_bn_model, _mean_sqrt_loss, [3]),
    (_bn_model, _mean_sqrt_loss, "batch-coupled layers in training mode (1)"),
    (_eval_bn_model, _pair_loss, "alone failed: IndexError"),
], ids=["per-sample replay finds the sample", "BatchNorm in training mode", "a loss that needs two samples"])
def test_per_sample_replay_blames_only_on_evidence(out_dir, factory, loss_fn, expect):
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(6, 4)
    x[3, 0] = -100.0
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=loss_fn, model_factory=factory, out_dir=out_dir, diagnose=False, embed_program=False) as rec:
            rec.record((x,))
            loss_fn(model, (x,)).backward()
            opt.step()
    diag = replay(info.value.bundle_path)
    samples = diag["samples"]
    assert samples["method"] == "per-sample replay" and diag["phase"] == "loss"
    if isinstance(expect, list):
        assert samples["indices"] == expect and "samples [3]" in diag["summary"]
    else:  # no conclusion about samples: none named, the reason given, the sentence names none
        assert samples["indices"] == [] and expect in samples["cannot_tell"]
        assert any(w.startswith("cannot tell per sample: ") for w in samples["warnings"])
        assert "samples [" not in diag["summary"]


def test_per_sample_replays_of_a_forward_or_loss_birth_run_no_backward_pass(out_dir):
    """Which samples give birth in the loss is read from the losses: the per-sample replays stop
    there, and only a backward birth's replays run the backward pass."""
    from nanreplay.diagnosis.api import bundle_step_inputs
    from nanreplay.diagnosis.samples import per_sample_replay
    from nanreplay.format.bundle import open_bundle

    model = _eval_bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(6, 4)
    x[3, 0] = -100.0
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=_mean_sqrt_loss, model_factory=_eval_bn_model, out_dir=out_dir, diagnose=False,
                      embed_program=False) as rec:
            rec.record((x,))
            _mean_sqrt_loss(model, (x,)).backward()
            opt.step()
    backward_calls = []
    with open_bundle(info.value.bundle_path) as b:
        inp = bundle_step_inputs(b, b.state(), _mean_sqrt_loss)
        model2 = _eval_bn_model()
        model2.load_state_dict(dict(inp.state.params, **inp.state.buffers))
        model2[2].register_full_backward_hook(lambda *a: backward_calls.append(1))
        found = per_sample_replay(model2, inp, phase="loss")
        assert found["indices"] == [3] and found["runs"] > 1 and backward_calls == []
        per_sample_replay(model2, inp, phase="backward")
        assert backward_calls  # a backward birth's samples are judged by their gradients
