"""Replay: reproduction and origin attribution, from the live recorder and from a bundle."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import models
from helpers import fail_once
from scenarios import poisoned_step
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay
from nanreplay.errors import ModelMismatchError, ReplayError
from nanreplay.core.digest import digest_of, digests_of


def test_dropout_model_replays_exact_gradients(out_dir):
    model = models.make_dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with Recorder(model, opt, loss_fn=models.mse_loss, model_factory=models.make_dropout_mlp, out_dir=out_dir) as rec:
        for step in range(3):
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            loss.backward()
            if step == 2:
                err = poisoned_step(opt, model.fc2.bias)  # poison after the fact: the replay's grads differ only there
            else:
                opt.step()
                opt.zero_grad()
    # replay from the bundle in a fresh model: dropout masks must be the same
    with open_bundle(err.bundle_path) as b:
        recorded = b.grads()
        model2 = models.make_dropout_mlp()
        diag = replay(b, model=model2)
    replayed = {n: p.grad for n, p in model2.named_parameters()}
    for n in recorded:
        if n != "fc2.bias":
            assert digests_of(recorded)[n].same_values(digest_of(replayed[n])), n  # bit-equal (the bundle keeps digests)
    # the poisoned gradient was not produced by the step: replay says so honestly
    assert diag["reproduction"]["verdict"] == "not reproduced"


def test_dropout_nan_step_reproduced_exactly(out_dir):
    """A step made non-finite by its data replays to bit-identical gradients under dropout."""
    model = models.make_dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    y = torch.randn(16, 4)
    y[3, 1] = float("inf")
    err = fail_once(model, opt, (x, y), models.mse_loss, out_dir, model_factory=models.make_dropout_mlp)
    # in process, the recorded batch shows the cause: answered without a replay
    assert (err.diagnosis["phase"], err.diagnosis["reproduction"]["verdict"]) == ("input", "not replayed")
    diag = replay(err.bundle_path)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "input"
    assert diag["origin"]["leaf"] == "batch[1]"
    assert diag["origin"]["samples"] == [3]


def test_model_only_replay_uses_the_recorded_cotangent(out_dir):
    import scenarios

    bundle = scenarios.division_by_zero_in_a_submodule(out_dir, capture_cotangent=True).bundle_path
    diag = replay(bundle, use_loss_fn=False)
    assert diag["mode"] == "cotangent"
    assert diag["origin"]["module"] == "encoder.block.norm"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_nonfinite_cotangent_is_born_in_the_loss(out_dir):
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, model_factory=models.make_mlp, out_dir=out_dir) as rec:
        out = model(torch.randn(4, 8))
        (out / torch.zeros(())).sum().backward()  # the loss divides by zero; the model is fine
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    diag = replay(info.value.bundle_path)
    assert diag["mode"] == "cotangent"
    assert diag["phase"] == "loss"
    assert "born in the loss, outside the model" in diag["summary"]
    assert "give the loss function (Recorder(loss_fn=...), or `nanreplay replay --loss-fn`) to name it" in diag["classification"]["detail"]
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_model_mismatch_is_a_clear_error(nested_div_bundle):
    with pytest.raises(ModelMismatchError, match="the model does not match the bundle"):
        replay(nested_div_bundle, model=models.make_mlp())
    with pytest.raises(ReplayError, match="could not import 'no_such_module:f'"):
        replay(nested_div_bundle, model_factory="no_such_module:f")


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    meta: dict


Pair = collections.namedtuple("Pair", "a b")


def nested_loss(model, batch) -> torch.Tensor:
    b: Batch = batch["main"]
    assert isinstance(b, Batch) and isinstance(batch["pair"], Pair)
    scale = batch["pair"].b * b.meta["scale"]
    return (model(b.image) * scale).mean() + 0 * batch["extra"][1][0].sum()


@pytest.mark.parametrize("fmt", ["h5", "safetensors"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_bundle_round_trips_nested_batch_and_optimizer_state(out_dir, fmt, opt_name):
    model = models.make_mlp()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if opt_name == "sgd_momentum"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    batch = {
        "main": Batch(image=torch.randn(3, 8), meta={"scale": 2.0, "name": "x", "none": None}),
        "pair": Pair(a=[1, 2], b=torch.tensor(0.5)),
        "extra": (torch.arange(4), [torch.ones(2, dtype=torch.bfloat16)]),
    }
    with Recorder(model, opt, loss_fn=nested_loss, out_dir=out_dir, bundle_format=fmt, diagnose=False) as rec:
        for _ in range(2):
            rec.record(batch)
            nested_loss(model, batch).backward()
            opt.step()
        state = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
        rec.record(batch)
        nested_loss(model, batch).backward()
        path = poisoned_step(opt, model.fc1.weight).bundle_path
    assert path.endswith(".h5" if fmt == "h5" else ".safetensors")
    with open_bundle(path) as b:  # reading imports nothing the file names: typed nodes are dicts of their fields
        plain = b.step(2).batches[0]
        assert plain["main"]["meta"] == batch["main"].meta and plain["pair"]["a"] == [1, 2]
    with open_bundle(path, types=[Batch, Pair]) as b:  # the caller names the types it accepts
        got = b.step(2).batches[0]
        assert isinstance(got["main"], Batch) and torch.equal(got["main"].image, batch["main"].image)
        assert got["main"].meta == batch["main"].meta
        assert isinstance(got["pair"], Pair) and got["pair"].a == [1, 2] and torch.equal(got["pair"].b, batch["pair"].b)
        assert isinstance(got["extra"], tuple) and torch.equal(got["extra"][0], batch["extra"][0])
        assert got["extra"][1][0].dtype == torch.bfloat16
        saved = b.state().optimizer
        assert saved["param_groups"] == opt.state_dict()["param_groups"]
        for k, v in state.items():
            for kk, vv in v.items():
                assert torch.equal(saved["state"][k][kk], vv) if isinstance(vv, torch.Tensor) else saved["state"][k][kk] == vv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["h5", "safetensors"])
def test_weights_and_grads_of_every_float_dtype_round_trip_bit_exactly(out_dir, dtype, fmt):
    model = models.make_mlp().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=out_dir, bundle_format=fmt, diagnose=False, store_grads="full") as rec:
        model(torch.randn(2, 8, dtype=dtype)).float().sum().backward()
        g = model.fc1.weight.grad
        g.view(torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.int64)[0, 0] = -1  # NaN with a full payload
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    with open_bundle(info.value.bundle_path) as b:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        for n, p in model.named_parameters():
            assert b.state().params[n].dtype == dtype
            assert torch.equal(b.state().params[n].view(ints), p.detach().view(ints))
            assert torch.equal(b.grads()[n].view(ints), p.grad.view(ints))


def test_dataclass_model_output_keeps_its_cotangent(out_dir):
    """Model outputs that are dataclasses (Hugging Face's ModelOutput) are opaque to pytree;
    their tensors must still get a cotangent, so a model-only replay drives the backward pass."""
    model = models.make_dataclass_out()
    with torch.no_grad():
        model.enc.bias.fill_(-1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4) * 3
    x[1] = 0.0  # relu(enc(0)) = 0 on row 1, then 0 / 0 in `scale`
    with Recorder(model, opt, model_factory=models.make_dataclass_out, out_dir=out_dir) as rec:
        out = model(x)
        (out.logits.sum() + out.hidden.mean()).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    with open_bundle(info.value.bundle_path, types=[models.Output]) as b:
        cot = b.step(0).forwards[0].cotangent
    assert isinstance(cot, models.Output) and cot.logits.shape == (5, 3) and cot.hidden.shape == (5, 6)
    assert cot.aux is None
    diag = replay(info.value.bundle_path)  # the Recorder's own bundle is trusted: the recorded factory and types are used
    assert diag["mode"] == "cotangent"
    assert diag["origin"]["module"] == "scale"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def accumulate_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return models.mse_loss(model, (x, y)) / 3


@pytest.mark.parametrize("with_loss_fn", [True, False])
def test_random_draws_between_micro_batches_replay_exactly(out_dir, with_loss_fn):
    """The loop augments each micro-batch with fresh noise (a global-RNG draw between forwards)
    and the model uses dropout: the RNG state before every forward is recorded and restored."""
    model = models.make_dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, loss_fn=accumulate_loss if with_loss_fn else None, model_factory=models.make_dropout_mlp, out_dir=out_dir) as rec:
        for i in range(3):
            x = torch.randn(8, 8)
            x = x + 0.1 * torch.randn_like(x)  # augmentation after the data: drawn between micro-batches
            y = torch.randn(8, 4)
            if i == 2:
                y[5, 0] = float("inf")
            if with_loss_fn:
                rec.record((x, y))
            accumulate_loss(model, (x, y)).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    with open_bundle(info.value.bundle_path) as b:
        fws = b.step(0).forwards
        assert fws[0].rng is None and fws[1].rng is not None and fws[2].rng is not None
    # with the loss function the recorded batch shows the Inf: the in-process diagnosis needs no replay
    assert info.value.diagnosis["reproduction"]["verdict"] == ("not replayed" if with_loss_fn else "reproduced exactly")
    assert replay(info.value.bundle_path)["reproduction"]["verdict"] == "reproduced exactly"


def dataclass_batch_loss(model, batch: Batch) -> torch.Tensor:
    return model(batch.image).pow(2).mean()


def test_bad_input_inside_a_dataclass_batch_is_named(out_dir):
    """A dataclass is one opaque leaf to torch's pytree: the input check must look inside it."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8)
    x[3, 1] = float("nan")
    err = fail_once(model, opt, Batch(image=x, meta={"scale": 1.0}), dataclass_batch_loss, out_dir)
    for diag in (err.diagnosis, replay(err.bundle_path, model=models.make_mlp(), loss_fn=dataclass_batch_loss)):
        assert diag["phase"] == "input"
        assert diag["origin"]["leaf"] == "batch.image"
        assert diag["origin"]["samples"] == [3]


def test_with_a_loss_function_only_the_failing_step_keeps_its_cotangent(out_dir):
    """The replay runs the loss function: a finite step's cotangent (as large as the model's
    outputs) is dropped once the step is checked; the failing step keeps its own, as a fallback
    for a replay whose loss function cannot run."""
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=out_dir, capacity=4, diagnose=False) as rec:
            for step in range(3):
                x, y = torch.randn(4, 8), torch.randn(4, 4)
                if step == 2:
                    y[1, 0] = float("inf")
                rec.record((x, y))
                loss = models.mse_loss(model, (x, y))
                rec.log_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step < 2:
                    assert all(fw.cotangent is None for s in rec.ring.upto(step) for fw in s.forwards)
    with open_bundle(info.value.bundle_path) as b:
        assert b.step(2).forwards[0].cotangent is not None
        assert all(fw.cotangent is None for k in b.steps if k != 2 for fw in b.step(k).forwards)
