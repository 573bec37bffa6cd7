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


#: the step whose batch is unnormalised in :func:`autocast_run`, and the steps it runs
AUTOCAST_BAD_STEP, AUTOCAST_STEPS = 22, 23


def autocast_run(out_dir, dtype: torch.dtype, *, scale: float = 3e3, **opts) -> Recorder:
    """Two runs of one loop that differ in one setting, the autocast dtype: ``models.WideNet``,
    AdamW, ``models.mse_loss`` under ``torch.autocast("cpu", dtype)``, 23 steps of seeded batches;
    the batch of step 22 is ``scale`` times larger, so ``fc2``'s outputs reach about 1e5. Under
    float16 (largest finite value 65504) step 22's gradients are non-finite and a bundle is
    written (``action="warn"``: the run goes on); under bfloat16 the step is finite, a spike of
    the loss, and ``on_spike="dump"`` writes a spike bundle of it: the healthy run's record.
    Returns the closed Recorder (``bundles``, ``_dump.spike_bundles``)."""
    torch.manual_seed(0)
    model = models.make_wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opts = {"loss_fn": models.mse_loss, "model_factory": models.make_wide, "out_dir": out_dir, "diagnose": False, "embed_program": False,
            "action": "warn", "on_spike": "dump", **opts}
    with Recorder(model, opt, **opts) as rec:
        for step in range(AUTOCAST_STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == AUTOCAST_BAD_STEP:
                x = x * scale
            rec.record((x, y))
            with torch.autocast("cpu", dtype=dtype):
                loss = models.mse_loss(model, (x, y))
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rec
