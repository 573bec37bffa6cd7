"""The failure scenarios several test files share, each defined once.

Each builder runs the scenario with a fixed seed (the same bundle whatever ran before it) and
returns the :class:`~nanreplay.NonFiniteGradientError` the Recorder raised: it carries the bundle
path and the in-process diagnosis. ``tests/conftest.py`` turns the common ones into fixtures
(``nested_div_bundle``, ``sqrt_bundle``, ``unreproducible_bundle``).
"""

from __future__ import annotations

import pytest
import torch

import models
from helpers import fail_once
from nanreplay import NonFiniteGradientError, Recorder


def division_by_zero_in_a_submodule(out_dir, **opts) -> NonFiniteGradientError:
    """0/0 born in the forward pass, in ``encoder.block.norm`` (``SafeDiv``) of ``models.Nested``,
    for sample 2 of 6 only: ``proj`` is the identity minus 1, every other row is ``2 + rand``, so
    ``relu(proj(x))`` is all zero for row 2 alone and its row sum divides 0 by 0. SGD, lr 0.1,
    ``models.mean_loss`` with ``model_factory=models.make_nested``."""
    torch.manual_seed(0)
    model = models.make_nested()
    with torch.no_grad():
        model.encoder["block"].proj.weight.copy_(torch.eye(8))
        model.encoder["block"].proj.bias.fill_(-1.0)
    x = 2.0 + torch.rand(6, 8)
    x[2] = 0.0
    opts.setdefault("model_factory", models.make_nested)
    return fail_once(model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x}, models.mean_loss, out_dir, **opts)


def sqrt_at_zero(out_dir, *, optimizer=torch.optim.SGD, **opts) -> NonFiniteGradientError:
    """+Inf born in the backward pass: ``models.SqrtNet`` with a zero ``fc`` bias on a batch of 5
    whose row 1 is all zero, so ``root`` computes sqrt(0) = 0 (finite) and its derivative
    1/(2*0) = +Inf. ``models.mean_loss`` with ``model_factory=models.make_sqrt``."""
    torch.manual_seed(0)
    model = models.make_sqrt()
    with torch.no_grad():
        model.fc.bias.zero_()
    x = torch.randn(5, 4)
    x[1] = 0.0
    opts.setdefault("model_factory", models.make_sqrt)
    return fail_once(model, optimizer(model.parameters(), lr=0.1), {"x": x}, models.mean_loss, out_dir, **opts)


def poisoned_step(opt, param: torch.Tensor) -> NonFiniteGradientError:
    """After backward, set the first entry of ``param.grad`` to NaN (a corruption no replay of the
    step can produce) and take the optimizer step, which must raise."""
    param.grad.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    return info.value


def unreproducible(out_dir) -> NonFiniteGradientError:
    """A step whose NaN gradient (``fc1.bias``) was written after backward: the bundle is whole,
    but its replay is finite and says ``not reproduced``. ``models.MLP``, no loss function."""
    torch.manual_seed(0)
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, model_factory=models.make_mlp, out_dir=out_dir):
        model(torch.randn(4, 8)).sum().backward()
        return poisoned_step(opt, model.fc1.bias)


def masked_root_under_dropout(out_dir, device: str = "cpu", **opts) -> NonFiniteGradientError:
    """A NaN gradient born in the backward pass under dropout, on ``device``: ``models.DropoutRoot``
    trains 3 finite steps (SGD, lr 0.01, ``models.mse_loss``, a new batch of 16 each step, made on
    the device), then its ``floor`` is pushed below 0 and step 3's backward pass gives ``floor`` a
    NaN gradient; every other gradient is finite and depends on the step's dropout masks. The
    bundle keeps whole gradients (``store_grads="full"``), so a replay's verdict gives the max abs
    difference of the finite values. ``model_factory=models.make_dropout_root``."""
    torch.manual_seed(0)
    model = models.make_dropout_root().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator(device=device).manual_seed(1)
    opts.setdefault("model_factory", models.make_dropout_root)
    opts.setdefault("store_grads", "full")
    with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=out_dir, **opts) as rec:
        for step in range(4):
            batch = (torch.randn(16, 8, generator=gen, device=device), torch.randn(16, 4, generator=gen, device=device))
            if step == 3:
                with torch.no_grad():
                    model.floor.fill_(-1.0)
            rec.record(batch)
            loss = models.mse_loss(model, batch)
            rec.log_loss(loss)
            loss.backward()
            if step < 3:
                opt.step()
                opt.zero_grad()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return info.value


def hook_count(model: torch.nn.Module, opt=None) -> int:
    """Every hook registered on ``model``'s modules and parameters and on ``opt``'s step."""
    n = 0
    for m in model.modules():
        n += sum(len(h) for h in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks))
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) + len(p._backward_hooks or {})
    if opt is not None:
        n += len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return n


#: the step whose batch is unnormalised in examples/amp_config.py
AUTOCAST_BAD_STEP = 22


def autocast_run(out_dir, dtype: str, *, scale: float = 3e3) -> list:
    """``examples/amp_config.py``: two runs of one loop that differ in one setting, the autocast
    dtype (``"float16"`` or ``"bfloat16"``). The batch of step 22 is ``scale`` times larger, so
    the last layer's outputs reach about 1.5e5 (at 3e3): under float16 (largest finite value
    65504) step 22's gradients are non-finite and ``nanreplay-step22.h5`` is written; under
    bfloat16 the step is a finite spike of the loss and ``on_spike="dump"`` writes
    ``nanreplay-spike-step22.h5``, the healthy run's record. Returns the bundles written, sorted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "amp_config.py"
    spec = importlib.util.spec_from_file_location("amp_config_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dtype", dtype, "--out-dir", str(out_dir), "--scale", str(scale)]) == 0
    return sorted(Path(out_dir).glob("nanreplay-*.h5"))
