"""`nanreplay check` and `nanreplay.testing.assert_replays_finite`: a regression test from a bundle."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

from nanreplay import NonFiniteGradientError, Recorder
from nanreplay.cli import main
from nanreplay.testing import assert_replays_finite, check_finite


class Norm(nn.Module):
    """x / ||x||: NaN for an all-zero row (the bug); ``eps`` is the fix."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.eps = eps

    def forward(self, x):
        return self.fc(x / (x.norm(dim=1, keepdim=True) + self.eps))


def buggy():
    torch.manual_seed(0)
    return Norm()


def fixed():
    torch.manual_seed(0)
    return Norm(eps=1e-6)


def loss_fn(model, batch):
    return model(batch[0]).pow(2).mean()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    model, x = buggy(), torch.randn(4, 4)
    x[2] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteGradientError) as ei:
        with Recorder(model, opt, loss_fn=loss_fn, model_factory=buggy, out_dir=tmp_path_factory.mktemp("b"), diagnose=False) as rec:
            rec.record((x,))
            loss_fn(model, (x,)).backward()
            opt.step()
    return str(ei.value.bundle_path)


def test_the_recorded_model_still_fails_and_the_fixed_one_replays_finite(bundle):
    assert check_finite(bundle)["finite"] is False
    with pytest.raises(AssertionError, match=r"step 0 of .* still replays non-finite \(loss, outputs, gradients\): the fix does not hold"):
        assert_replays_finite(bundle)
    out = assert_replays_finite(bundle, model_factory=fixed)
    assert out["finite"] and out["nonfinite"] == [] and isinstance(out["loss"], float)


def test_check_command_exit_codes(bundle):
    r = CliRunner().invoke(main, ["check", bundle])
    assert r.exit_code == 3 and "step 0 still replays non-finite" in r.output, r.output
    r = CliRunner().invoke(main, ["check", bundle, "--model-factory", f"{__file__}:fixed", "--import-script"])
    assert r.exit_code == 0 and "step 0 replays finite (loss " in r.output and "the fix holds" in r.output, r.output
