"""Test helpers shared by several test modules."""

from __future__ import annotations

import os
import time
from typing import Callable

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


def run_ranks(worker: Callable, args: tuple, nprocs: int, timeout_s: float, why: str = "") -> None:
    """Start ``worker(rank, *args)`` in ``nprocs`` spawned processes (one per rank) and wait for
    them; fails the test after ``timeout_s`` seconds (``why`` says what a hang means) and kills
    any rank still alive."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish within {timeout_s} s{why}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
