"""The Hugging Face Trainer callback with a real Trainer on the CPU: a tiny randomly initialised
GPT-2 (from a config, no download), gradient accumulation over two micro-batches, and one
optimizer step whose micro-batches hold no label to predict (every label -100), so the loss is
the token sum divided by a token count of zero: 0/0."""

from __future__ import annotations

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
