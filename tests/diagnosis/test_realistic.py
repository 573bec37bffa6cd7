"""The Recorder on realistic training code: CNNs with BatchNorm and in-place ReLUs, Transformer
encoders with padding masks, tied-weight RNN language models, frozen parameters, param groups,
schedulers, gradient accumulation, multi-output models, validation passes, skip/close.

Each test checks that the recorder leaves training alone, raises on the first non-finite step,
writes a bundle, and that the in-process diagnosis and the replay from the file name the right
phase, module and op and say the failure was reproduced exactly."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import realistic_models as rm
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay
from nanreplay.core.digest import digests_of


def _state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _images(step: int, n: int = 8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _recorded_loss(rec, loss_fn, model, batch):
    """``loss_fn(model, batch)``, with the batch and the loss given to ``rec`` when there is one
    (the same loop runs with and without a recorder)."""
    if rec is not None:
        rec.record(batch)
    loss = loss_fn(model, batch)
    if rec is not None:
        rec.log_loss(loss)
    return loss


# -- 1. ResNet-style CNN: BatchNorm running stats, ReLU(inplace=True), in-place residual add ----------

def _train_resnet(out_dir, *, poison=None, recorder=True, steps=5, seen=None):
    model = rm.make_resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rec = Recorder(model, opt, loss_fn=rm.ce_loss, model_factory=rm.make_resnet, out_dir=out_dir) if recorder else None
    seen = {} if seen is None else seen
    try:
        for step in range(steps):
            x, y = _images(step)
            if step == 3 and poison == "input":
                x[2, 1, 4, 4] = float("nan")  # one corrupt pixel in sample 2
            if step == 3 and poison == "dead channel":
                with torch.no_grad():  # channel 4 dies after head_bn's ReLU: its energy is 0, log(0) = -Inf
                    model.head_bn.weight[4] = 0.0
                    model.head_bn.bias[4] = -1.0
            if step == 3:
                seen["running_mean"] = model.stem[1].running_mean.clone()
            loss = _recorded_loss(rec, rm.ce_loss, model, (x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return model


def test_resnet_recorder_leaves_training_bit_identical(out_dir):
    with_rec = _train_resnet(out_dir)
    without = _train_resnet(out_dir, recorder=False)
    _assert_same_state(_state(with_rec), _state(without))  # weights and BatchNorm running stats
    assert not out_dir.exists()  # no false alarm


def test_resnet_nan_pixel_is_bad_input_and_bundle_keeps_step_start_running_stats(out_dir):
    with pytest.raises(NonFiniteGradientError) as info:
        _train_resnet(out_dir, poison="input")
    err = info.value
    assert err.step == 3 and Path(err.bundle_path).is_file()
    for diag, verdict in ((err.diagnosis, "not replayed"), (replay(err.bundle_path), "reproduced exactly")):
        assert diag["phase"] == "input"
        assert diag["origin"]["leaf"] == "batch[0]" and diag["origin"]["samples"] == [2]
        assert diag["reproduction"]["verdict"] == verdict  # in process, the batch shows the cause without a replay
    with open_bundle(err.bundle_path) as b:
        stats = b.state().buffers["stem.1.running_mean"]
    # the forward of step 3 wrote NaN into the running mean; the bundle holds its step-start value
    assert torch.isfinite(stats).all()


def test_resnet_log_of_dead_channel_is_born_in_the_custom_block(out_dir):
    seen = {}
    with pytest.raises(NonFiniteGradientError) as info:
        _train_resnet(out_dir, poison="dead channel", seen=seen)
    err = info.value
    with open_bundle(err.bundle_path) as b:  # step-start running stats, not the ones step 3's forward wrote
        assert torch.equal(b.state().buffers["stem.1.running_mean"], seen["running_mean"])
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "forward"
        o = diag["origin"]
        assert (o["module"], o["class"], o["op"], o["nonfinite"]) == ("pool", "LogEnergyPool", "log", "-Inf")
        assert o["source"]["code"] == "return torch.log(x.pow(2).mean(dim=(2, 3)))"
        assert diag["reproduction"]["verdict"] == "reproduced exactly"


# -- 2. TransformerEncoder classifier: dropout, src_key_padding_mask, attention pooling ----------------
def _token_batch(step: int, *, fully_padded: int = -1) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, 50, (6, 7), generator=g)
    lengths = torch.randint(2, 8, (6,), generator=g)
    pad = torch.arange(7)[None, :] >= lengths[:, None]  # every batch has padded positions
    if fully_padded >= 0:
        pad[fully_padded] = True  # an empty sequence: nothing to attend to
    return {"tokens": tokens.masked_fill(pad, 0), "pad_mask": pad, "label": torch.randint(0, 3, (6,), generator=g)}


def _train_transformer(out_dir, *, bad_step=-1, recorder=True, steps=6, **opts):
    model = rm.make_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)  # dropout masks
    rec = Recorder(model, opt, loss_fn=rm.transformer_loss, model_factory=rm.make_transformer, out_dir=out_dir, **opts) if recorder else None
    try:
        for step in range(steps):
            batch = _token_batch(step, fully_padded=4 if step == bad_step else -1)
            loss = _recorded_loss(rec, rm.transformer_loss, model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return model


def test_transformer_padded_batches_no_false_alarm_and_same_training(out_dir):
    with_rec = _train_transformer(out_dir)
    without = _train_transformer(out_dir, recorder=False)
    _assert_same_state(_state(with_rec), _state(without))  # dropout draws untouched by the recorder
    assert not out_dir.exists()


@pytest.mark.slow
def test_transformer_fully_padded_sequence_nan_in_attention_pooling(out_dir):
    with pytest.raises(NonFiniteGradientError) as info:
        _train_transformer(out_dir, bad_step=4)
    err = info.value
    assert err.step == 4
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "forward"
        o = diag["origin"]
        assert (o["module"], o["class"], o["op"], o["nonfinite"]) == ("pool", "MultiheadAttention", "_softmax", "NaN")
        assert o["samples"] == [4]
        assert "every position masked" in diag["classification"]["detail"]
        assert diag["allowed_births"] > 0  # the -Inf of the padding masks are legitimate, not the origin
        assert diag["reproduction"]["verdict"] == "reproduced exactly"  # dropout > 0, same masks in replay


# -- 3. tied-weight LSTM/GRU language model with clip_grad_norm_ --------------------------------------
def _lm_batch(step: int, *, empty: bool = False) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(1, 40, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[:, 7:] = False  # padded tail
    if empty:
        mask[:, 1:] = False  # every target is padding: the loss is 0 / 0
    return {"tokens": tokens, "mask": mask}


def _train_lm(out_dir, factory, *, loss_fn=rm.lm_loss, bad_step=-1, recorder=True, steps=5, zero_bias=False):
    model = factory()
    if zero_bias:
        torch.nn.init.zeros_(model.decoder.bias)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = Recorder(model, opt, loss_fn=loss_fn, model_factory=factory, out_dir=out_dir) if recorder else None
    try:
        for step in range(steps):
            batch = _lm_batch(step, empty=step == bad_step)
            loss = _recorded_loss(rec, loss_fn, model, batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("factory", [rm.make_lstm_lm, rm.make_gru_lm], ids=["lstm", "gru"])
def test_tied_lm_empty_target_batch_is_born_in_the_loss(out_dir, factory):
    _assert_same_state(_state(_train_lm(out_dir, factory, steps=3)), _state(_train_lm(out_dir, factory, steps=3, recorder=False)))
    assert not out_dir.exists()
    with pytest.raises(NonFiniteGradientError) as info:
        _train_lm(out_dir, factory, bad_step=3)
    err = info.value
    assert err.step == 3
    with open_bundle(err.bundle_path) as b:
        # the tied weight is one parameter, stored once under its first name
        assert "embed.weight" in b.state().params and "decoder.weight" not in b.state().params
        assert "decoder.weight" not in b.grads()
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "loss" and diag["origin"]["op"] == "div"
        assert diag["origin"]["source"]["code"] == "return (nll * m).sum() / m.sum()"
        assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_clip_grad_norm_spreading_one_nan_gradient_is_still_reproduced(out_dir):
    """Only decoder.bias gets a NaN gradient; clip_grad_norm_'s NaN total norm then makes every
    gradient NaN before optimizer.step(), so the recorded gradients are all NaN. The replay (which
    runs backward, not the loop's clipping) must not call that 'not reproduced'."""
    with pytest.raises(NonFiniteGradientError) as info:
        _train_lm(out_dir, rm.make_lstm_lm, loss_fn=rm.lm_loss_bias_penalty, zero_bias=True)
    err = info.value
    assert err.step == 0
    with open_bundle(err.bundle_path) as b:
        assert all(g.nan == g.numel for g in digests_of(b.grads()).values())
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "backward"
        assert diag["origin"]["node"] == "SqrtBackward0"
        assert diag["origin"]["first_nonfinite_gradient"] == "decoder.bias"
        r = diag["reproduction"]
        assert (r["verdict"], r["grad_factor"], r["nonfinite_replayed"]) == ("reproduced", "nan", 1)
        assert "clip_grad_norm_" in r["detail"]
        assert diag["summary"].endswith("reproduced (the loop then made every gradient NaN, as clip_grad_norm_ does with a non-finite total norm).")


def test_common_factor_recognises_a_global_rescale_and_nothing_else():
    from nanreplay.engine.compare import common_factor

    g = {"a": torch.tensor([1.0, -2.0, float("inf")]), "b": torch.tensor([0.5, 0.0])}
    clipped_inf = {k: v * 0.0 for k, v in g.items()}  # clip_grad_norm_ with an Inf total norm: coefficient 0
    assert common_factor(clipped_inf, g) == 0.0
    finite = {"a": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5, 0.25])}
    assert common_factor({k: v / 3 for k, v in finite.items()}, finite) == pytest.approx(1 / 3)
    other = {"a": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5, 0.26])}
    assert common_factor({k: v / 3 for k, v in other.items()}, finite) is None  # not one factor
    assert common_factor(finite, finite) is None  # no rescale at all
    assert common_factor({"a": torch.full((3,), float("nan")), "b": torch.full((2,), float("nan"))}, finite) is None  # NaN from nowhere


# -- 4. frozen backbone, two param groups, a scheduler stepping each step, gradient accumulation x3 ----
def _micro_batch(step: int, i: int, *, missing: bool = False):
    g = torch.Generator().manual_seed(300 + 3 * step + i)
    x = torch.randint(0, 20, (5, 6), generator=g).float()
    if missing:
        x[3, 2] = -9.0  # a "missing value" sentinel in sample 3: log1p(-9) is NaN
    return x, torch.randint(0, 2, (5,), generator=g)


def _train_accumulating(out_dir, *, bad_step=-1, recorder=True, loss_fn=rm.frozen_loss, lrs=None, steps=6):
    model = rm.make_frozen()
    opt = torch.optim.AdamW([{"params": model.adapter.parameters(), "lr": 1e-3}, {"params": model.head.parameters(), "lr": 1e-2}])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 1e-1], total_steps=20)
    rec = Recorder(model, opt, loss_fn=loss_fn, model_factory=rm.make_frozen, out_dir=out_dir) if recorder else None
    lrs = [] if lrs is None else lrs
    try:
        for step in range(steps):
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.zero_grad()
            for i in range(3):
                batch = _micro_batch(step, i, missing=step == bad_step and i == 1)
                if rec is not None:
                    rec.record(batch)
                rm.frozen_loss(model, batch).backward()  # the loss is already divided by 3
            opt.step()
            sched.step()
    finally:
        if rec is not None:
            rec.close()
    return model


def test_accumulation_with_frozen_params_groups_and_scheduler_trains_identically(out_dir):
    _assert_same_state(_state(_train_accumulating(out_dir)), _state(_train_accumulating(out_dir, recorder=False)))
    assert not out_dir.exists()


@pytest.mark.parametrize("loss_fn", [rm.frozen_loss, None], ids=["loss_fn", "cotangent"])
def test_accumulation_nan_in_second_micro_batch(out_dir, loss_fn):
    lrs = []
    with pytest.raises(NonFiniteGradientError) as info:
        _train_accumulating(out_dir, bad_step=4, loss_fn=loss_fn, lrs=lrs)
    err = info.value
    assert err.step == 4  # optimizer steps, not micro-batches
    with open_bundle(err.bundle_path) as b:
        rec = b.step(4)
        assert len(rec.batches if loss_fn else rec.forwards) == 3
        assert rec.lrs == lrs[4] and rec.lrs[0] != rec.lrs[1]  # both groups' scheduled lrs
        assert sorted(b.grads()) == ["adapter.bias", "adapter.weight", "head.bias", "head.weight"]  # frozen: no gradient
        assert "backbone.0.weight" in b.state().params
        assert b.meta["optimizer"]["param_groups_fqns"] == [["adapter.weight", "adapter.bias"], ["head.weight", "head.bias"]]
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["mode"] == ("loss_fn" if loss_fn else "cotangent")
        o = diag["origin"]
        assert (diag["phase"], o["module"], o["op"], o["micro_batch"], o["samples"]) == ("forward", "", "log1p", 1, [3])
        assert ", micro-batch 1, samples [3];" in diag["summary"]
        assert diag["reproduction"]["verdict"] == "reproduced exactly"


# -- 5. a model returning a dict holding a tuple; the loss combines all outputs ------------------------
def _multi_batch(step: int, *, outlier: bool = False):
    g = torch.Generator().manual_seed(400 + step)
    x = torch.randn(6, 6, generator=g)
    if outlier:
        x[1] *= 1e4  # an unnormalised sample: its score saturates the sigmoid
    return x, torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("use_loss_fn", [True, False], ids=["loss_fn", "cotangent"])
def test_multi_output_dict_and_tuple(out_dir, use_loss_fn):
    model = rm.make_multi()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=rm.multi_loss if use_loss_fn else None, model_factory=rm.make_multi, out_dir=out_dir) as rec:
            for step in range(5):
                batch = _multi_batch(step, outlier=step == 3)
                if use_loss_fn:
                    rec.record(batch)
                loss = rm.multi_loss(model, batch)
                rec.log_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert err.step == 3
    with open_bundle(err.bundle_path) as b:
        cot = b.step(3).forwards[0].cotangent  # same structure as the output: a dict holding a tuple
        assert set(cot) == {"logits", "aux"} and isinstance(cot["aux"], tuple) and len(cot["aux"]) == 2
        assert not torch.isfinite(cot["aux"][1]).all() and torch.isfinite(cot["logits"]).all()
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert diag["phase"] == "loss" and diag["origin"]["module"] is None
        assert diag["origin"]["samples"] == [1]
        assert diag["reproduction"]["verdict"] == "reproduced exactly"
        if use_loss_fn:
            assert diag["origin"]["op"] == "log" and diag["origin"]["nonfinite"] == "-Inf"
        else:  # the loss was not replayed: its gradient w.r.t. the outputs names the sample
            assert diag["samples"]["method"] == "non-finite rows of the recorded output gradient"


# -- 6. validation forwards between training steps ----------------------------------------------------
def test_fine_tuning_in_eval_mode_keeps_its_forwards(out_dir):
    """A loop that trains with the model in eval mode throughout (frozen BatchNorm statistics) is
    not mistaken for validation: its forwards are the step."""
    model = rm.make_resnet()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, model_factory=rm.make_resnet, out_dir=out_dir):  # no loss_fn: cotangent replay
            for step in range(4):
                x, y = _images(step)
                if step == 2:
                    with torch.no_grad():
                        model.head_bn.bias[4] = -1e3  # channel 4 dies under the frozen statistics
                loss = rm.ce_loss(model, (x, y))
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    with open_bundle(err.bundle_path) as b:
        assert len(b.step(2).forwards) == 1 and b.step(2).training == []
    for diag in (err.diagnosis, replay(err.bundle_path)):
        assert (diag["phase"], diag["origin"]["module"], diag["origin"]["op"]) == ("forward", "pool", "log")
        assert diag["reproduction"]["verdict"] == "reproduced exactly"


def _validate(model, how: str) -> None:
    model.eval()
    batch = _token_batch(50)
    if how == "no_grad":
        with torch.no_grad():
            rm.transformer_loss(model, batch)
    elif how == "inference_mode":
        with torch.inference_mode():
            rm.transformer_loss(model, batch)
    else:  # "forgot no_grad": a grad-enabled eval-mode forward whose output never gets a gradient
        torch.randperm(10)  # e.g. a shuffling validation sampler drawing from the global RNG
        rm.transformer_loss(model, batch).item()
    model.train()


def _train_with_validation(out_dir, how, *, use_loss_fn=True, bad_step=-1, recorder=True, steps=6):
    model = rm.make_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    rec = Recorder(model, opt, loss_fn=rm.transformer_loss if use_loss_fn else None, model_factory=rm.make_transformer, out_dir=out_dir) if recorder else None
    try:
        for step in range(steps):
            batch = _token_batch(step, fully_padded=4 if step == bad_step else -1)
            if rec is not None and use_loss_fn:
                rec.record(batch)
            loss = rm.transformer_loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            _validate(model, how)
    finally:
        if rec is not None:
            rec.close()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "forgot no_grad"])
def test_validation_between_steps_is_not_part_of_a_step(out_dir, how):
    _assert_same_state(_state(_train_with_validation(out_dir, how, steps=3)), _state(_train_with_validation(out_dir, how, steps=3, recorder=False)))
    assert not out_dir.exists()  # a fully padded validation batch would be NaN: validation uses a normal one
    for use_loss_fn in (True, False):
        with pytest.raises(NonFiniteGradientError) as info:
            _train_with_validation(out_dir / str(use_loss_fn), how, use_loss_fn=use_loss_fn, bad_step=4)
        err = info.value
        with open_bundle(err.bundle_path) as b:
            rec = b.step(4)
            assert len(rec.forwards) == 1  # the training forward only
            assert "encoder.layers.0.dropout" in rec.training  # the step ran in training mode
        for diag in (err.diagnosis, replay(err.bundle_path)):
            assert (diag["phase"], diag["origin"]["module"], diag["origin"]["op"]) == ("forward", "pool", "_softmax")
            assert diag["mode"] == ("loss_fn" if use_loss_fn else "cotangent")
            assert diag["reproduction"]["verdict"] == "reproduced exactly"  # same dropout masks as in training


# -- 7. action="skip" trains on (that close() leaves no hooks: tests/capture/test_recorder.py) -------------------------
def _train_skipping(out_dir, *, recorder: bool, bad_steps=(3, 6), steps=9):
    """With the recorder: action="skip" on NaN batches. Without: the reference loop, which never
    runs the bad steps at all (only the scheduler moves on)."""
    model = rm.make_resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rec = Recorder(model, opt, loss_fn=rm.ce_loss, model_factory=rm.make_resnet, out_dir=out_dir, action="skip") if recorder else None
    try:
        for step in range(steps):
            x, y = _images(step)
            if step in bad_steps:
                if rec is None:
                    sched.step()
                    continue
                x[2, 1, 4, 4] = float("nan")
            if rec is not None:
                rec.record((x, y))
            loss = rm.ce_loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        return model, opt, rec
    finally:
        if rec is not None:
            rec.close()


@pytest.mark.slow
def test_skip_leaves_no_trace_of_the_skipped_steps(out_dir):
    model, opt, rec = _train_skipping(out_dir, recorder=True)
    reference, _, _ = _train_skipping(out_dir, recorder=False)
    # weights, momentum-free skipped updates, and BatchNorm running stats (which the NaN forward wrote)
    _assert_same_state(_state(model), _state(reference))
    assert rec.nonfinite_steps == [3, 6] and len(rec.bundles) == 1  # max_dumps=1: the first one
    model.eval()
    assert torch.isfinite(model(_images(20)[0])).all()  # evaluation after training is not poisoned
    diag = replay(rec.bundles[0])
    assert diag["phase"] == "input" and diag["origin"]["samples"] == [2]
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


# -- 8. the command line on a real bundle, intact and damaged ---------------------------------------------
@pytest.fixture(scope="module", params=["h5", "safetensors"])
def transformer_bundle(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp(f"cli-{request.param}")
    with pytest.raises(NonFiniteGradientError) as info:
        _train_transformer(out, bad_step=4, bundle_format=request.param)
    return Path(info.value.bundle_path)


def _cli(*args):
    from nanreplay.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.slow
def test_cli_round_trip(transformer_bundle):
    r = _cli("inspect", transformer_bundle)
    assert r.exit_code == 0, r.output
    assert "failing step: 4" in r.output and "factory: realistic_models:make_transformer" in r.output
    assert "stored diagnosis: NaN born in the forward pass in op _softmax" in r.output
    r = _cli("replay", "--json", transformer_bundle)
    assert r.exit_code == 0, r.output
    diag = json.loads(r.output)
    assert (diag["phase"], diag["origin"]["module"], diag["origin"]["samples"]) == ("forward", "pool", [4])
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    r = _cli("bisect", "--over", "samples", "--json", transformer_bundle)
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["status"] == "found" and [c["sample"] for c in res["culprits"]] == [4]


def _tensor_span(bundle: Path, key: str) -> tuple[int, int]:
    """(file offset, length) of one tensor's raw bytes, read from the container's own index."""
    if bundle.suffix == ".h5":
        import h5py

        with h5py.File(bundle, "r") as f:
            ds = f["tensors/" + key.replace("/", "%2F")]
            return ds.id.get_offset(), ds.id.get_storage_size()
    data = bundle.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    lo, hi = json.loads(data[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + lo, hi - lo


@pytest.mark.parametrize("damage", ["one tensor byte", "truncated"])
@pytest.mark.parametrize("command", ["inspect", "replay"])
def test_cli_damaged_bundle_is_exit_4_without_traceback(transformer_bundle, tmp_path, damage, command):
    data = bytearray(transformer_bundle.read_bytes())
    if damage == "one tensor byte":
        off, size = _tensor_span(transformer_bundle, "state/params/head.weight")
        assert size > 0
        data[off + size // 2] ^= 0x01  # one bit of one weight: the file still parses
    else:
        data = data[: len(data) * 2 // 3]
    bad = tmp_path / ("bad" + transformer_bundle.suffix)
    bad.write_bytes(bytes(data))
    r = _cli(command, bad)
    assert r.exit_code == 4, r.output
    assert r.output.startswith("Error: ") and "Traceback" not in r.output
    if damage == "one tensor byte":
        assert "checksum mismatch for tensor 'state/params/head.weight'" in r.output


def test_a_recorded_nan_gradient_the_replay_never_produced_is_not_reproduced():
    from nanreplay.engine.compare import compare_grads

    nan = float("nan")
    r = compare_grads({"a": torch.tensor([nan, 1.0]), "b": torch.tensor([nan])}, {"a": torch.tensor([nan, 1.0])})
    assert r["verdict"] == "not reproduced" and "['b'] are finite or absent in the replay" in r["detail"]
    r = compare_grads({"a": torch.tensor([nan, 1.0]), "b": torch.tensor([2.0])}, {"a": torch.tensor([nan, 1.0])})
    assert r["verdict"] == "reproduced" and "1 recorded gradient(s) absent in the replay" in r["detail"]
