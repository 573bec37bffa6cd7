"""The Lightning callback with a real Trainer on the CPU: a NaN stops training, the bundle
rebuilds the LightningModule from its hyperparameters and replays training_step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import models  # noqa: E402
from nanreplay import NonFiniteGradientError, open_bundle, replay  # noqa: E402
from nanreplay.integrations.lightning import NanReplayCallback  # noqa: E402

BAD_STEP = 2


class LitRatio(pl.LightningModule):
    def __init__(self, lr: float = 0.05, seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = models.RatioNet()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def _loader():
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(36, 8, generator=g), torch.randn(36, 4, generator=g)
    xs[6 * BAD_STEP + 1] = 0.0  # a padding row in the third batch: 0 / 0 in net.norm
    ds = torch.utils.data.TensorDataset(xs, ys)
    return torch.utils.data.DataLoader(ds, batch_size=6, shuffle=False)


def _trainer(cb):
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
    )


def test_trainer_stops_at_the_nan_and_the_bundle_replays(tmp_path):
    model = LitRatio(lr=0.05)
    cb = NanReplayCallback(out_dir=tmp_path)
    trainer = _trainer(cb)
    trainer.fit(model, _loader())
    assert trainer.should_stop
    assert cb.recorder.nonfinite_steps == [BAD_STEP]
    assert cb.recorder.step == BAD_STEP + 1  # stopped right after the failing batch
    with open_bundle(cb.bundle_path) as b:
        assert b.failing_step == BAD_STEP
        assert b.meta["model_init"] == {"class": "test_lightning:LitRatio", "kwargs": {"lr": 0.05, "seed": 1234}}
        assert b.loss_fn == "nanreplay.integrations.lightning:training_step_loss"
        state = b.state()
        batch = b.step(BAD_STEP).batches[0]
    assert batch["batch_idx"] == BAD_STEP
    # the failing step was skipped: the weights after fit are the failing step's pre-step weights
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), state.params[n]), n
    diag = replay(cb.bundle_path)  # rebuilds LitRatio(lr=0.05, seed=1234), loss = training_step
    assert diag["mode"] == "loss_fn"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward" and diag["origin"]["module"] == "net.norm"


def test_raise_mode_raises_from_fit(tmp_path):
    cb = NanReplayCallback(out_dir=tmp_path, on_nonfinite="raise", diagnose=False)
    with pytest.raises(NonFiniteGradientError) as info:
        _trainer(cb).fit(LitRatio(), _loader())
    assert info.value.step == BAD_STEP
    assert info.value.bundle_path == cb.bundle_path and cb.bundle_path.endswith(f"nanreplay-step{BAD_STEP}.h5")


def test_callback_refuses_action():
    with pytest.raises(ValueError, match="action is set by NanReplayCallback"):
        NanReplayCallback(action="warn")


def test_import_nanreplay_does_not_import_lightning():
    code = "import sys, nanreplay, nanreplay.cli; print(json.dumps(sorted(m for m in sys.modules if 'lightning' in m)))"
    out = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_a_resumed_run_numbers_its_steps_by_the_trainers_global_step(tmp_path):
    """Resumed from a checkpoint at global step 2, the Recorder numbers its steps from there:
    the bundle's name, its failing step and the message use the trainer's global step."""
    from pathlib import Path

    first = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False)
    first.fit(LitRatio(lr=0.05), _loader())
    ckpt = tmp_path / "resume.ckpt"
    first.save_checkpoint(ckpt)
    assert first.global_step == 2
    cb = NanReplayCallback(out_dir=tmp_path / "bundles")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    trainer.fit(LitRatio(lr=0.05), _loader(), ckpt_path=str(ckpt))
    rec = cb.recorder
    failing = rec.extra_meta["lightning"]["global_step"]  # the trainer's global step during the failing step
    assert failing >= 2 and rec.nonfinite_steps == [failing]
    assert Path(cb.bundle_path).name == f"nanreplay-step{failing}.h5"
    with open_bundle(cb.bundle_path) as b:
        assert b.failing_step == failing and b.meta["attach_scan"]["step"] == 2
        assert b.meta["diagnosis"]["summary"].count(f"step {failing}") >= 1


# -- the loss of each micro-batch, and one answer per bundle (issue 33, items 3 and 6) --------------

class LitLabelledMean(pl.LightningModule):
    """A classifier whose loss is the summed cross-entropy over the count of labelled rows: a
    micro-batch with no label (every target -100) gives 0/0 = NaN, with zero gradients."""

    def __init__(self, lr: float = 0.05, seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = models.MLP()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, ignore_index=-100, reduction="sum") / (y != -100).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nan_loss_with_finite_gradients_in_any_micro_batch_is_caught_and_answered_once(tmp_path, accumulate):
    """Batch 2 has no label: its loss is NaN, its gradients zero, the step's gradients finite.
    The callback checks every micro-batch's loss (with accumulate_grad_batches=2 it is the first
    of step 1's two, not the last), and the in-process diagnosis stored in the bundle and
    `nanreplay replay BUNDLE --json` give one answer: the loss, in training_step (a method of the
    root module), in that micro-batch. Without accumulation the replay runs the embedded program
    (training_step's frames are gone there: the export noted which ops ran in a method of the
    module); with it, the program's constant batch_idx fits one micro-batch only, so the recorded
    class rebuilds the module."""
    from click.testing import CliRunner

    from corpus.runner import answer
    from nanreplay.cli import main
    from nanreplay.diagnosis.api import load_diagnosis

    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(36, 8, generator=g), torch.randint(0, 4, (36,), generator=g)
    ys[12:18] = -100  # batch 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=6, shuffle=False)
    cb = NanReplayCallback(out_dir=tmp_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb], accumulate_grad_batches=accumulate, gradient_clip_val=0.5)
    trainer.fit(LitLabelledMean(), loader)
    step, micro = (2, None) if accumulate == 1 else (1, 0)
    assert cb.recorder.nonfinite_steps == [step]
    with open_bundle(cb.bundle_path) as b:
        reason = b.meta["reason"]
        assert reason["nonfinite_loss"] and not reason["nonfinite_grad"]
        assert reason.get("nonfinite_loss_micro_batch") == micro
        program = b.meta["program"]
        assert program["kind"] == ("loss" if accumulate == 1 else None), program.get("error")
    live = load_diagnosis(cb.bundle_path)
    res = CliRunner().invoke(main, ["replay", cb.bundle_path, "--json"])
    assert res.exit_code == 0, res.output
    fresh = json.loads(res.output)
    assert fresh["model_source"].startswith("the program embedded" if accumulate == 1 else "the recorded class")
    assert answer(live) == answer(fresh), f"in process: {live['summary']}\nreplayed:   {fresh['summary']}"
    assert (fresh["phase"], fresh["origin"]["op"], fresh["origin"]["module"], fresh["origin"].get("micro_batch")) == ("loss", "div", "", micro)
