"""Test helpers shared by several test modules."""

from __future__ import annotations

import pytest

from nanreplay import NonFiniteGradientError, Recorder


def fail_once(model, opt, batch, loss_fn, out_dir, **opts) -> NonFiniteGradientError:
    """Run one recorded step of ``loss_fn(model, batch)`` that must fail, and return the error
    (it carries the bundle path and the in-process diagnosis)."""
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, **opts) as rec:
        rec.record(batch)
        loss = loss_fn(model, batch)
        rec.log_loss(loss)
        loss.backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return info.value
