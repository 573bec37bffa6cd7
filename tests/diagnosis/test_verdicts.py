"""The verdict around the answer (issue 34): a device fault only on positive evidence (the verdict
ladder, ``diagnosis.fidelity``), a step reproduced from the model's recorded input with every
sample named, and a module for a backward birth in a module the loss function calls."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import models
from helpers import fail_once
from nanreplay import NonFiniteGradientError, Recorder, replay
from nanreplay.cli import main
from nanreplay.core.digest import digest_of
from nanreplay.diagnosis.fidelity import DIFFERENCES, StepReplays, assess
from nanreplay.engine.run import StepInputs
from nanreplay.format.records import Snapshot, StepRecord
from nanreplay.report.html import render_html
from nanreplay.report.text import render_report


def _train(out_dir, *, fault=None, steps: int = 3, bad: int = 2, **opts) -> NonFiniteGradientError:
    """``models.MLP`` trained on MSE with the Recorder as users run it; ``fault(model, when)`` is
    called before the forward pass (``"forward"``) and after backward (``"backward"``) of step ``bad``."""
    torch.manual_seed(0)
    model = models.make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir, **opts) as rec:
        for step in range(steps):
            batch = (torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            rec.record(batch)
            undo = fault(model, "forward") if fault is not None and step == bad else None
            loss = models.mse_loss(model, batch)
            if undo is not None:
                undo()
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            if fault is not None and step == bad:
                fault(model, "backward")
            try:
                opt.step()
            except NonFiniteGradientError as e:
                return e
    raise AssertionError("the run did not fail")


def _flip_grad(model, when):
    """A bit flip in a gradient buffer after backward: fc1.weight[5, 2]'s exponent becomes all ones."""
    if when == "backward":
        bits = model.fc1.weight.grad.view(torch.int32)
        bits[5, 2] = bits[5, 2] | 0x7F800000 | 1  # exponent all ones, a mantissa bit: NaN


def _flip_weight(model, when):
    """A weight element flipped for one forward pass, then put back."""
    if when != "forward":
        return None
    w = model.fc2.weight.data
    saved = w[1, 3].clone()
    w[1, 3] = float("inf")

    def undo():
        w[1, 3] = saved

    return undo


def _divide_grads_by_zero(model, when):
    """Software after backward: every gradient divided by a token count that is 0 in this step."""
    if when == "backward":
        for p in model.parameters():
            p.grad.div_(0.0)


def test_a_flipped_gradient_bit_is_a_device_fault_naming_the_parameter(out_dir):
    err = _train(out_dir, fault=_flip_grad)
    live = err.diagnosis
    diag = json.loads(json.dumps(replay(err.bundle_path), default=str))
    for d in (live, diag):
        fid = d["fidelity"]
        assert d["classification"]["cause"] == "transient" and fid["verdict"] == "device fault"
        assert all(r["holds"] for r in fid["rungs"]) and fid["replays"] == 3 and fid["agree_bitwise"] is True
        first = fid["first_difference"]
        assert (first["quantity"], first["name"]) == ("gradient", "fc1.weight")
        assert "NaN at 1 element(s) in the recording: [5, 2]" in first["detail"] and "every other element bit-equal" in first["detail"]
        # the loss and every gradient before fc1.weight's in the backward pass were reproduced bit for bit
        assert [q["name"] for q in fid["compared"] if q["agrees"]] == ["the step", "fc2.bias", "fc2.weight", "fc1.bias"]
        assert "suspected device fault in fc1.weight's gradient" in d["classification"]["detail"]
        assert d["summary"].startswith("step 2: 3 replays of the step agree bit for bit and reproduce the loss and 3 of 4 gradients")
        assert d["reproduction"]["verdict"] == "not reproduced"
    assert live["classification"]["detail"] == diag["classification"]["detail"]  # one answer in process and from the bundle
    r = CliRunner().invoke(main, ["replay", str(err.bundle_path)])
    assert r.exit_code == 3, r.output  # 3: not reproduced, whatever the ladder says
    assert "suspected device fault in fc1.weight's gradient" in r.output


def test_a_weight_flipped_for_one_forward_pass_is_not_blamed_on_software_or_hardware(out_dir):
    err = _train(out_dir, fault=_flip_weight)
    for d in (err.diagnosis, replay(err.bundle_path)):
        fid, cls = d["fidelity"], d["classification"]
        assert cls["cause"] == "unknown" and fid["verdict"] == "not reproduced"
        assert "forward pass" in [x["kind"] for x in fid["differences"]]
        assert fid["first_difference"]["quantity"] == "loss" and fid["agree_bitwise"] is True
        assert cls["detail"].startswith("not reproduced: what differs between the recording and the replay: ")
        assert "ECC" not in json.dumps(d, default=str)  # never the hardware's advice for want of a finding
        assert cls["fix"]["description"].startswith("to reproduce the step: ")
        assert "recording and replay differ in: " in d["summary"] and "forward pass" in d["summary"]


def test_code_that_changes_every_gradient_after_backward_is_not_a_device_fault(out_dir):
    err = _train(out_dir, fault=_divide_grads_by_zero)
    d = err.diagnosis
    assert d["classification"]["cause"] == "unknown"
    kinds = [x["kind"] for x in d["fidelity"]["differences"]]
    assert kinds == ["spread"], kinds
    assert "whole rows or tensors" in d["fidelity"]["differences"][0]["detail"]
    assert d["classification"]["fix"]["description"] == f"to reproduce the step: {DIFFERENCES['spread']}"


# -- the ladder's rungs on their own: what each difference takes ---------------------------

def _inputs(recorded: dict, *, loss: float = 1.0, **more) -> StepInputs:
    rec = StepRecord(step=4, rng=None, batches=[(torch.zeros(2, 3),)], loss=loss)  # type: ignore[arg-type]
    return StepInputs(record=rec, state=Snapshot({}, {}), recorded_grads=recorded, loss_fn=lambda m, b: None, **more)


class _Replayed:
    """A replay result as the ladder reads it."""

    def __init__(self, grads: dict, loss: float = 1.0) -> None:
        self.grads, self.loss_values = grads, [loss]
        self.modules = type("M", (), {"events": [{"kind": "parameter gradient", "param": n} for n in grads]})()

    def products_nonfinite(self) -> bool:
        return False


def _ladder(recorded: dict, replays: list[dict], **more):
    r = StepReplays()
    for g in replays:
        r.add(_Replayed(g))  # type: ignore[arg-type]
    return assess(_inputs(recorded, **more), r)


def _grads(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(3, 2, generator=g)}


def _corrupt(grads: dict) -> dict:
    out = {n: t.clone() for n, t in grads.items()}
    out["b.weight"][1, 0] = float("nan")
    return out


@pytest.mark.parametrize("as_digest", [False, True])
def test_the_ladder_names_the_first_recorded_gradient_that_departs(as_digest):
    rep = _grads()
    recorded = {n: digest_of(t) if as_digest else t for n, t in _corrupt(rep).items()}
    fid = _ladder(recorded, [rep, rep, rep])
    assert fid["verdict"] == "device fault", fid["differences"]
    assert fid["first_difference"]["name"] == "b.weight" and "[1, 0]" in fid["first_difference"]["detail"]


def test_replays_that_differ_bit_for_bit_are_nondeterminism_with_its_rate():
    rep = _grads()
    other = {n: t.clone() for n, t in rep.items()}
    other["a.weight"][0, 0] += 1e-6
    fid = _ladder(_corrupt(rep), [rep, other, rep])
    assert fid["verdict"] == "not reproduced" and fid["agree_bitwise"] is False
    (d,) = [x for x in fid["differences"] if x["kind"] == "nondeterministic kernels"]
    assert "1 of 2 repeat replays differ bit for bit from the first (rate 0.50" in d["detail"] and "a.weight" in d["detail"]


@pytest.mark.parametrize("grads, method", [("reduced", "local loss"), ("sharded", "local loss and cotangents (origin_hook=False: ...)")])
def test_a_rank_with_origin_detection_off_gets_no_device_verdict(grads, method):
    """A clean DDP (or FSDP2) rank whose recorded gradients are the reduced ones (a user comm
    hook, or origin_hook=False): its own replay is finite and bit-equal elsewhere, but the
    recording is not this rank's computation (issue 36)."""
    rep = _grads()
    reason = {"distributed": {"rank": 1, "world_size": 2, "origin_ranks": [], "is_origin": False, "origin_method": method, "grads": grads}}
    fid = _ladder(_corrupt(rep), [rep, rep, rep], reason=reason)
    assert fid["verdict"] == "not reproduced"
    assert [x["kind"] for x in fid["differences"]] == ["origin detection off"]
    assert "origin_hook=True" in fid["differences"][0]["record"]


def test_a_rank_that_received_another_ranks_nan_gets_no_device_verdict():
    rep = _grads()
    reason = {"distributed": {"rank": 0, "world_size": 2, "origin_ranks": [1], "is_origin": False, "origin_method": "comm hook", "grads": "local"}}
    fid = _ladder(_corrupt(rep), [rep, rep, rep], reason=reason)
    assert [x["kind"] for x in fid["differences"]] == ["another rank"]


@pytest.mark.parametrize("more, kind", [
    ({"compile_state": {"compiled": True, "backend": "inductor", "modules": [""]}}, "compiled graph"),
    ({"setup": {"loss": "given"}}, "loss function"),
    ({"setup": {"model": "given", "model_source": "the given model"}}, "model code"),
    ({"setup": {"recorded_environment": {"torch": "2.1.0"}, "environment": {"torch": "2.13.0"}}}, "versions"),
    ({"setup": {"recorded_device": "cuda", "device": "cpu"}}, "device"),
])
def test_what_differs_between_recording_and_replay_blocks_the_device_verdict(more, kind):
    rep = _grads()
    fid = _ladder(_corrupt(rep), [rep, rep, rep], **more)
    assert fid["verdict"] == "not reproduced" and [x["kind"] for x in fid["differences"]] == [kind]


def test_replays_of_the_compiled_graph_as_recorded_are_evidence_for_a_compiled_recording():
    rep = _grads()
    r = StepReplays(compiled=True)
    for _ in range(3):
        r.add(_Replayed(rep))  # type: ignore[arg-type]
    fid = assess(_inputs(_corrupt(rep), compile_state={"compiled": True, "backend": "inductor", "modules": [""]}), r)
    assert fid["verdict"] == "device fault" and fid["differences"] == []


def test_without_a_logged_loss_a_departure_in_the_first_gradient_is_not_evidence():
    rep = _grads()
    recorded = {n: t.clone() for n, t in rep.items()}
    recorded["a.weight"][2, 1] = float("inf")  # a.weight is produced first by the backward pass here
    r = StepReplays()
    for _ in range(3):
        r.add(_Replayed(rep))  # type: ignore[arg-type]
    inp = _inputs(recorded)
    inp.record.loss = None
    fid = assess(inp, r)
    assert fid["verdict"] == "not reproduced" and [x["kind"] for x in fid["differences"]] == ["nothing reproduced"]


# -- reproduced from the model's recorded input; every sample named ------------------------

def _standardize_after_record(out_dir, zero_rows) -> NonFiniteGradientError:
    torch.manual_seed(0)
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    x[zero_rows] = 0.0
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        rec.record((x, y))
        xn = x / x.norm(dim=1, keepdim=True)  # the user's preprocessing after record: 0/0 in the zero rows
        loss = models.mse_loss(model, (xn, y))
        rec.log_loss(loss)
        loss.backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return info.value


def test_preprocessing_after_record_is_reproduced_from_the_models_recorded_input(out_dir):
    rows = list(range(0, 32, 2)) + [31]  # 17 rows: more than any cut at 16
    err = _standardize_after_record(out_dir, rows)
    for d in (err.diagnosis, replay(err.bundle_path)):
        assert d["phase"] == "input" and d["origin"]["recorded_forward_inputs"] is True
        assert d["reproduction"]["verdict"] == "reproduced exactly"
        assert d["reproduction"]["replayed_from"] == "the model's recorded input"
        assert d["summary"].endswith("reproduced exactly from the model's recorded input.")
        assert d["samples"]["indices"] == rows and d["samples"]["count"] == 17 and not d["samples"]["batch_level"]
        assert d["origin"]["samples"] == rows
    text = render_report(d)
    assert str(rows) in text and "reproduced exactly from the model's recorded input" in text
    pytest.importorskip("matplotlib")
    assert str(rows) in render_html(d)


def test_every_row_non_finite_in_the_models_input_is_batch_level(out_dir):
    err = _standardize_after_record(out_dir, list(range(32)))
    d = err.diagnosis
    assert d["samples"]["batch_level"] is True and d["samples"]["indices"] == [] and d["samples"]["batch_size"] == 32
    assert "every one of the 32 rows" in d["samples"]["reason"]
    assert "samples:       the whole batch of 32" in render_report(d)


# -- a module for every birth --------------------------------------------------------------

class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = self.proj(h) - y
        return torch.sqrt((d * d).sum(-1)).mean()  # sqrt'(0) is Inf for a row where the head fits exactly


class _WithLossHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.loss_head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _head_loss(model, batch):
    x, y = batch
    return model.loss_head(model(x), y)  # a module the loss function calls, outside the model's forward


def test_a_backward_birth_in_a_module_the_loss_function_calls_names_that_module(out_dir):
    torch.manual_seed(0)
    model = _WithLossHead()
    with torch.no_grad():
        model.loss_head.proj.weight.zero_()
        model.loss_head.proj.bias.zero_()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    y[3] = 0.0
    d = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), _head_loss, out_dir).diagnosis
    assert (d["phase"], d["origin"]["forward_op"], d["origin"]["module"]) == ("backward", "sqrt", "loss_head")
    assert "in module loss_head (_Head)" in d["summary"] and d["samples"]["indices"] == [3]


def test_the_root_tracker_enters_a_module_whose_output_starts_the_backward_pass():
    """torch's ModuleTracker never enters, in the backward pass, a module whose output is the
    tensor backward() starts from; RootTracker does."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.module_tracker import ModuleTracker

    from nanreplay.engine.monitors import RootTracker

    def backward_parents(tracker_type) -> list:
        head, seen = _Head(), []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if tracker.is_bw:
                    seen.append(set(tracker.parents))
                return func(*args, **(kwargs or {}))

        h = torch.randn(3, 4, requires_grad=True)
        with tracker_type() as tracker, Watch():
            loss = head(h, torch.randn(3, 4))
            if isinstance(tracker, RootTracker):
                tracker.enter_roots([loss])
            loss.backward()
        return seen

    assert not any("_Head" in s for s in backward_parents(ModuleTracker))
    seen = backward_parents(RootTracker)
    assert seen and all("_Head" in s for s in seen[:8])  # the head's own backward ops (sqrt, sum, mul...) run first


# -- cause = what to fix, trigger = what set it off ---------------------------------------

_SCHEDULE = torch.tensor([0.9, 0.7, 0.4, 0.0])  # a table of the code: its last entry is the formula's singular point


def _per_step_weight(model, batch):
    """Each sample's loss divided by its timestep's schedule entry (valid timesteps, a singular table)."""
    x, t = batch["x"], batch["t"]
    return (model(x).squeeze(-1).pow(2) / _SCHEDULE[t]).mean()


def _per_sample_count(model, batch):
    """Each sample's loss divided by its number of valid positions (an empty selection for a sample with none)."""
    x, valid = batch["x"], batch["valid"]
    return (model(x).squeeze(-1).pow(2) / valid.sum(-1)).mean()


@pytest.mark.parametrize("loss_fn, cause, lookup", [(_per_step_weight, "numerics", True), (_per_sample_count, "bad input data", False)])
def test_a_valid_value_at_a_singular_point_is_numerics_with_the_batch_as_trigger(out_dir, loss_fn, cause, lookup):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    valid = torch.ones(6, 4, dtype=torch.bool)
    valid[4] = False
    batch = {"x": torch.randn(6, 3), "t": torch.tensor([0, 1, 2, 1, 3, 0]), "valid": valid}  # sample 4: t = 3, no valid position
    d = fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss_fn, out_dir).diagnosis
    cls = d["classification"]
    assert (d["phase"], d["origin"]["op"], cls["cause"]) == ("loss", "div", cause)
    assert ("lookup" in d["origin"]["operands"]["tensors"][1]["prov"]) is lookup
    assert cls["trigger"]["samples"] == [4] and d["samples"]["indices"] == [4]  # the batch value is named either way
    assert "batch['t'] (as positions in a table of the code)" in cls["trigger"]["property"] if lookup else "batch['valid']" in cls["trigger"]["property"]


# -- the silent-data-corruption benchmark, a handful of injections ---------------------------

def _sdc():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "sdc.py"
    import sys

    spec = importlib.util.spec_from_file_location("nanreplay_bench_sdc", path)
    mod = sys.modules["nanreplay_bench_sdc"] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_injected_hardware_faults_get_a_device_verdict_only_after_the_forward_pass():
    """bench/sdc.py in small: exponent faults in a gradient buffer after backward are device faults
    naming the parameter (in process and from the bundle); in a GEMM output or a weight for one
    forward pass they are 'not reproduced', never a software cause."""
    sdc = _sdc()
    sdc.MODELS["mlp"] = 1 / 32  # a 32-wide MLP: the faults, the Recorder and the diagnosis are the benchmark's
    runs = [sdc.run_one("mlp", "grad", "exponent", 1, also_replay=True)] + [sdc.run_one("mlp", site, "exponent", 3) for site in ("gemm", "weight")]
    assert all(r.scored for r in runs), [(r.site, r.nonfinite_step) for r in runs]
    for r in runs[:1]:
        assert (r.cause, r.verdict, r.named) == ("transient", "device fault", r.target), r.summary
    assert (runs[0].replay_cause, runs[0].replay_named) == ("transient", runs[0].target)
    for r in runs[1:]:
        assert r.cause == "unknown" and r.verdict == "not reproduced" and "forward pass" in r.differences, r.summary
    s = sdc.score(runs)
    assert s["after_forward"]["share"] == 1.0 and s["forward"]["fabricated"] == 0
