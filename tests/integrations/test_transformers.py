"""The Hugging Face Trainer callback with a real Trainer on the CPU: a tiny randomly initialised
GPT-2 (from a config, no download), gradient accumulation over two micro-batches, and one
optimizer step whose micro-batches hold no label to predict (every label -100), so the loss is
the token sum divided by a token count of zero: 0/0."""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanreplay import open_bundle, replay, untrust_bundle  # noqa: E402
from nanreplay.integrations.transformers import NanReplayCallback, hf_loss, model_from_config  # noqa: E402

BAD_STEP = 2
MICRO, ACCUM, SEQ, VOCAB = 2, 2, 12, 64


def _config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0)


class Tokens(torch.utils.data.IterableDataset):
    """In order (an iterable dataset is not shuffled): optimizer step k sees examples 4k..4k+3."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(MICRO * ACCUM * 6):
            ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
            labels = torch.full_like(ids, -100) if i // (MICRO * ACCUM) == BAD_STEP else ids.clone()
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    yield


def _trainer(tmp_path, cb):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=6, learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    return model, transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])


@pytest.mark.slow
def test_trainer_stops_at_the_nan_and_the_bundle_replays_without_user_code(tmp_path, caplog):
    cb = NanReplayCallback(out_dir=tmp_path / "bundles", diagnose=False)
    model, trainer = _trainer(tmp_path, cb)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        trainer.train()
    # the Trainer stopped right after the failing step, whose update was skipped
    assert cb.recorder.nonfinite_steps == [BAD_STEP]
    assert trainer.state.global_step == BAD_STEP + 1
    assert "training stops" in caplog.text
    assert cb.loss_fn_reason is None
    with open_bundle(cb.bundle_path) as b:
        assert b.failing_step == BAD_STEP
        assert b.loss_fn == "nanreplay.integrations.transformers:hf_loss" and b.model_factory is None
        assert b.meta["model_init"]["kwargs"]["model_class"] == "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"
        assert b.meta["transformers"]["gradient_accumulation_steps"] == ACCUM and b.meta["transformers"]["trainer_found"]
        rec = b.step(BAD_STEP)
        state = b.state()
        assert len(rec.forwards) == ACCUM and len(rec.batches) == ACCUM  # both micro-batches
        first = rec.batches[0]
        assert set(first["inputs"]) >= {"input_ids", "attention_mask", "labels"}
        assert (first["inputs"]["labels"] == -100).all()
        # the model normalised by the step's token count (num_items_in_batch = 0): no extra division
        assert "divide_by" not in first and int(first["inputs"]["num_items_in_batch"]) == 0
    # the failing update was skipped: the model still holds the pre-step weights
    for n, p in model.named_parameters():
        if n in state.params:
            assert torch.equal(p.detach(), state.params[n]), n
    # replay in this process, without a factory: the recorded class + config rebuild GPT-2
    diag = replay(cb.bundle_path, samples=False)
    assert diag["mode"] == "loss_fn"
    assert diag["reproduction"]["verdict"].startswith("reproduced"), diag["reproduction"]
    assert diag["phase"] in ("forward", "loss")
    # as a stranger's bundle: GPT-2's embedded program is proven in bounds and runs under the index guard
    untrust_bundle(cb.bundle_path)
    stranger = replay(cb.bundle_path, samples=False)
    assert stranger["model_source"].startswith("the program embedded in the bundle"), stranger["model_source"]
    assert stranger["reproduction"]["verdict"] == diag["reproduction"]["verdict"] and stranger["phase"] == diag["phase"]


def test_hf_loss_divides_like_the_trainer_and_model_from_config_builds_offline():
    model = model_from_config("transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel", _config().to_dict(), dtype="float32")
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.transformer.wte.weight.dtype == torch.float32
    model.eval()  # no dropout: the three losses below come from the same forward values
    ids = torch.randint(1, VOCAB, (2, SEQ))
    batch = {"inputs": {"input_ids": ids, "labels": ids}}
    full = hf_loss(model, batch)
    assert torch.equal(hf_loss(model, {**batch, "divide_by": 2}), full / 2)
    assert torch.equal(hf_loss(model, {**batch, "multiply_by": 3}), full * 3)
    with pytest.raises(Exception, match="without a loss"):
        hf_loss(model, {"inputs": {"input_ids": ids}})


def test_the_recorded_model_init_rebuilds_the_model_without_a_program():
    """The fallback when a bundle holds no program: the callback's model_init names nanreplay's
    own builder (a function, allowed beside nn.Module classes), only for a trusted bundle."""
    from nanreplay.engine.state import build_from_init
    from nanreplay.errors import UntrustedBundleError

    init = {"class": "nanreplay.integrations.transformers:model_from_config",
            "kwargs": {"model_class": "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel", "config": _config().to_dict()}}
    assert isinstance(build_from_init(init, trusted=True), transformers.GPT2LMHeadModel)
    with pytest.raises(UntrustedBundleError) as e:
        build_from_init(init, trusted=False)
    # the refusal lists the class model_from_config would import, not only model_from_config (issue 18)
    assert e.value.names == {"model class (model_init)": [init["class"]],
                             "imported by the model class (model_init.kwargs.model_class)": [init["kwargs"]["model_class"]]}
    with pytest.raises(Exception, match="not a torch.nn.Module subclass"):
        build_from_init({"class": "nanreplay.integrations.transformers:hf_loss", "kwargs": {}}, trusted=True)


def test_callback_refuses_to_manage_the_action():
    with pytest.raises(ValueError, match="action"):
        NanReplayCallback(action="raise")
    with pytest.raises(ValueError, match="on_nonfinite"):
        NanReplayCallback(on_nonfinite="ignore")


def test_import_nanreplay_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, nanreplay; nanreplay.Recorder; nanreplay.replay; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_a_resumed_run_numbers_its_steps_by_the_trainers_global_step(tmp_path):
    """Resumed from a checkpoint saved at global step 2, the Trainer skips the data already seen
    and the next step is the failing one: the Recorder calls it step 2, as the Trainer does (its
    first step, counted from the Recorder's creation, would be 0)."""
    from pathlib import Path

    torch.manual_seed(0)
    args = dict(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, learning_rate=1e-3,
                report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    first = transformers.Trainer(model=transformers.GPT2LMHeadModel(_config()), train_dataset=Tokens(),
                                 args=transformers.TrainingArguments(max_steps=BAD_STEP, save_strategy="steps", save_steps=BAD_STEP, **args))
    first.train()
    ckpt = tmp_path / "hf" / f"checkpoint-{BAD_STEP}"
    assert ckpt.is_dir()
    cb = NanReplayCallback(out_dir=tmp_path / "bundles", diagnose=False)
    torch.manual_seed(0)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(_config()), train_dataset=Tokens(), callbacks=[cb],
                                   args=transformers.TrainingArguments(max_steps=6, save_strategy="no", **args))
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert cb.recorder.nonfinite_steps == [BAD_STEP]
    assert Path(cb.bundle_path).name == f"nanreplay-step{BAD_STEP}.h5"
    with open_bundle(cb.bundle_path) as b:
        assert b.failing_step == BAD_STEP and b.meta["attach_scan"]["step"] == BAD_STEP
        assert b.meta["transformers"]["global_step"] == BAD_STEP


# -- the loss the Trainer backpropagates, per micro-batch (issue 33, item 3) -------------------------

GA4 = 4          # gradient accumulation steps
BAD_MICRO = 2    # the micro-batch of the failing step whose labels are all -100


class EmptyMicroBatch(torch.utils.data.IterableDataset):
    """Optimizer step k sees examples 4k..4k+3 (one per micro-batch); in step ``bad`` the third
    micro-batch (``BAD_MICRO``) holds no label to predict."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(GA4 * 6):
            ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
            empty = i == self.bad * GA4 + BAD_MICRO
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100) if empty else ids.clone()}


def _token_ce(model, inputs):
    labels = inputs.pop("labels")
    out = model(**inputs)
    logits, targets = out.logits[:, :-1], labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="none")
    return ce.reshape(targets.shape), targets != -100, out


def token_sum_loss(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func: the summed token cross-entropy over the step's token count."""
    logits, targets = outputs.logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100,
                                             reduction="sum") / num_items_in_batch


class SumOverValid(transformers.Trainer):
    """A token mean written as the ignored tokens' sum over the count of valid tokens: for a
    micro-batch with no valid token, 0/0 = NaN, with finite (zero) gradients."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ce, valid, out = _token_ce(model, inputs)
        loss = ce.sum() / valid.sum()
        return (loss, out) if return_outputs else loss


class MaskedMean(transformers.Trainer):
    """The same mean written by hand over the tokens' log-probabilities: the 0/0's derivative,
    NaN, reaches every logit of the micro-batch, so its gradients are NaN too."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        logp, targets = out.logits[:, :-1].log_softmax(-1), labels[:, 1:]
        valid = targets != -100
        token = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        loss = -(token * valid).sum() / valid.sum()
        return (loss, out) if return_outputs else loss


class OwnTrainingStep(MaskedMean):
    """Overrides training_step: the callback cannot vouch that compute_loss is the loss, and
    records the model's forward inputs only (no labels)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


def _custom_trainer(tmp_path, cls, cb, bad, **extra):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=1, gradient_accumulation_steps=GA4, max_steps=5,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **extra,
    )
    return model, cls(model=model, args=args, train_dataset=EmptyMicroBatch(bad), callbacks=[cb])


@pytest.mark.slow
def test_a_nan_loss_with_finite_gradients_in_a_custom_compute_loss_is_caught(tmp_path, caplog):
    """The Trainer's NaN filter hides this loss from its logs and the gradients are finite: the
    callback checks the loss each micro-batch backpropagates (accelerator.backward), stops, and
    the bundle holds what compute_loss received (labels included), so the replay runs the
    user's compute_loss and names the micro-batch, in process and from the bundle alone."""
    from nanreplay.diagnosis.api import load_diagnosis

    cb = NanReplayCallback(out_dir=tmp_path / "bundles")
    model, trainer = _custom_trainer(tmp_path, SumOverValid, cb, bad=1, max_grad_norm=1.0)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        trainer.train()
    assert cb.recorder.nonfinite_steps == [1] and trainer.state.global_step == 2
    assert f"non-finite loss (first in micro-batch {BAD_MICRO} of {GA4})" in caplog.text
    assert cb.loss_fn_reason is None
    with open_bundle(cb.bundle_path) as b:
        reason = b.meta["reason"]
        assert reason["nonfinite_loss"] and not reason["nonfinite_grad"] and reason["nonfinite_loss_micro_batch"] == BAD_MICRO
        assert b.loss_fn == "nanreplay.integrations.transformers:trainer_loss"
        assert b.loss_fn_kwargs["trainer_class"] == "test_transformers:SumOverValid"
        assert b.meta["program"]["kind"] == "loss", b.meta["program"].get("error")
        batches = b.step(1).batches
        assert len(batches) == GA4 and (batches[BAD_MICRO]["inputs"]["labels"] == -100).all()
        # the early warning reads the norm before clipping (max_grad_norm=1.0 clips every step here)
        norms = [r.grad_norm_pre_clip for r in (b.step(k) for k in b.steps) if r.finite]
        assert norms and all(n is not None and n > 1.0 for n in norms)
    live = load_diagnosis(cb.bundle_path)
    fresh = replay(cb.bundle_path)  # `nanreplay replay`: from the embedded program, no user code
    for d in (live, fresh):
        assert d["mode"] == "loss_fn" and d["reproduction"]["verdict"].startswith("reproduced"), d["reproduction"]
        assert (d["phase"], d["origin"]["op"], d["origin"]["module"], d["origin"]["micro_batch"]) == ("loss", "div", None, BAD_MICRO)
        assert f"micro-batch {BAD_MICRO}" in d["summary"]


def test_trainer_loss_replays_a_compute_loss_override_without_the_trainer(tmp_path):
    """What a bundle records of a compute_loss override (TrainerLoss.nanreplay_callable) replays
    it on a stand-in of the Trainer class, to the value the live Trainer computes, divided as the
    Trainer's training_step divides it; what the stand-in lacks is named."""
    from nanreplay.core.callables import callable_record
    from nanreplay.integrations.transformers import TrainerLoss, _trainer_spec, trainer_loss

    cb = NanReplayCallback(out_dir=tmp_path)
    model, trainer = _custom_trainer(tmp_path, SumOverValid, cb, bad=1, label_smoothing_factor=0.0)
    model.eval()
    live = TrainerLoss(trainer, _trainer_spec(trainer, trainer.args))
    path, kwargs = callable_record(live)
    assert path == "nanreplay.integrations.transformers:trainer_loss" and kwargs["trainer_class"] == "test_transformers:SumOverValid"
    assert kwargs["args"]["gradient_accumulation_steps"] == GA4 and "output_dir" in kwargs["args"]
    ids = torch.randint(1, VOCAB, (2, SEQ))
    batch = {"inputs": {"input_ids": ids, "labels": ids}, "num_items_in_batch": torch.tensor(2 * (SEQ - 1)), "divide_by": 4}
    expected = SumOverValid.compute_loss(trainer, model, dict(batch["inputs"])) / 4
    assert torch.equal(live(model, batch), expected)
    assert torch.equal(trainer_loss(model, batch, **kwargs), expected)
    assert set(batch["inputs"]) == {"input_ids", "labels"}  # compute_loss popped the labels of a copy

    # compute_loss_func and label smoothing: the Trainer's default compute_loss, outside the model
    for extra, kw in (({}, {"compute_loss_func": token_sum_loss}), ({"label_smoothing_factor": 0.1}, {})):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf2"), report_to=[], use_cpu=True, **extra)
        base = transformers.Trainer(model=model, args=args, **kw)
        spec = _trainer_spec(base, args)
        assert spec["trainer_class"] == "transformers.trainer:Trainer"
        assert spec.get("compute_loss_func") == ("test_transformers:token_sum_loss" if kw else None)
        expected = transformers.Trainer.compute_loss(base, model, dict(batch["inputs"]), num_items_in_batch=batch["num_items_in_batch"]) / 4
        assert torch.equal(TrainerLoss(base, spec)(model, batch), expected)
        assert torch.equal(trainer_loss(model, batch, **spec), expected)

    class ReadsItsOwnState(SumOverValid):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs) * self.class_weight

    ReadsItsOwnState.__module__, ReadsItsOwnState.__qualname__ = __name__, "ReadsItsOwnState"
    globals()["ReadsItsOwnState"] = ReadsItsOwnState
    with pytest.raises(Exception, match=r"ReadsItsOwnState.compute_loss reads self.class_weight, which the Trainer sets up"):
        trainer_loss(model, batch, **{**kwargs, "trainer_class": "test_transformers:ReadsItsOwnState"})


@pytest.mark.slow
def test_nan_gradients_from_a_custom_compute_loss_name_the_micro_batch(tmp_path):
    """Without an embedded program, replay rebuilds GPT-2 from its recorded config and runs the
    recorded compute_loss on a stand-in of the Trainer class (trainer_loss)."""
    cb = NanReplayCallback(out_dir=tmp_path / "bundles", diagnose=False, embed_program=False)
    model, trainer = _custom_trainer(tmp_path, MaskedMean, cb, bad=1)
    trainer.train()
    assert cb.recorder.nonfinite_steps == [1]
    with open_bundle(cb.bundle_path) as b:
        assert b.meta["reason"]["nonfinite_grad"] and b.meta["reason"]["nonfinite_loss_micro_batch"] == BAD_MICRO
    diag = replay(cb.bundle_path)
    assert diag["model_source"] == "the recorded class and hyperparameters" and diag["mode"] == "loss_fn"
    assert diag["reproduction"]["verdict"].startswith("reproduced"), diag["reproduction"]
    assert diag["phase"] == "loss" and diag["origin"]["micro_batch"] == BAD_MICRO
    assert diag["samples"].get("micro_batch", BAD_MICRO) == BAD_MICRO


@pytest.mark.slow
def test_loss_fn_on_a_bundle_without_labels_is_refused_with_the_reason(tmp_path):
    from click.testing import CliRunner

    from nanreplay.cli import main

    cb = NanReplayCallback(out_dir=tmp_path / "bundles", diagnose=False, embed_program=False)
    model, trainer = _custom_trainer(tmp_path, OwnTrainingStep, cb, bad=1)
    trainer.train()
    assert cb.loss_fn_reason == "OwnTrainingStep overrides training_step"
    with open_bundle(cb.bundle_path) as b:
        assert b.loss_fn is None and not b.step(1).batches
    res = CliRunner().invoke(main, ["replay", cb.bundle_path, "--loss-fn", "nanreplay.integrations.transformers:hf_loss"])
    assert res.exit_code == 5, res.output
    assert "the bundle holds no labels: step 1 has no recorded batch" in res.output
    assert "(OwnTrainingStep overrides training_step)" in res.output and "or replay without --loss-fn" in res.output
    # without it, the recorded output gradient drives the backward pass, and it names the micro-batch
    res = CliRunner().invoke(main, ["replay", cb.bundle_path, "--json", "--no-ops"])
    assert res.exit_code == 0, res.output
    diag = json.loads(res.output)
    assert diag["mode"] == "cotangent" and diag["phase"] == "loss" and diag["origin"]["micro_batch"] == BAD_MICRO
