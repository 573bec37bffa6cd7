"""Host syncs on a GPU, counted by CUDA itself: ``torch.cuda.set_sync_debug_mode`` reports every
synchronizing CUDA operation (a device-to-host copy, a stream or device synchronize). The default
Recorder makes exactly one per step (the check's read); the sync-free mode (``check_every``) makes
none on the steps between its reads, which ``"error"`` mode proves by raising on any.

These tests need CUDA (``gpu`` marker) and are skipped without it; ``bench/gpu.py`` runs them and
reads the counts they record (``record_property``) into its table. The Python-level count of the
same reads runs everywhere: ``tests/capture/test_overhead_modes.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import models
from nanreplay import Recorder

pytestmark = pytest.mark.gpu

SYNC_WARNING = "called a synchronizing CUDA operation"


def _step(model, opt, x, rec=None) -> None:
    loss = model(x).pow(2).mean()
    if rec is not None:
        rec.log_loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _syncs(model, opt, x, rec=None) -> int:
    """The synchronizing CUDA operations of one training step, as CUDA's sync debug mode reports them."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(model, opt, x, rec)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in seen)


def _batches(n: int) -> list[torch.Tensor]:
    """``n`` batches made on the GPU beforehand (a copy from the host would be a sync of its own)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(16, 8, generator=g, device="cuda") for _ in range(n)]


def _pair():
    torch.manual_seed(0)
    plain = models.make_dropout_mlp().cuda()
    recorded = models.make_dropout_mlp().cuda()
    recorded.load_state_dict(plain.state_dict())
    return (plain, torch.optim.AdamW(plain.parameters(), lr=1e-3)), (recorded, torch.optim.AdamW(recorded.parameters(), lr=1e-3))


def test_the_default_recorder_syncs_once_per_step(out_dir, record_property):
    (plain, opt_p), (model, opt) = _pair()
    xs = _batches(10)
    with Recorder(model, opt, out_dir=out_dir) as rec:
        for x in xs[:2]:  # the first steps export the program and create the optimizer state: not counted
            _step(plain, opt_p, x)
            _step(model, opt, x, rec)
        torch.cuda.synchronize()
        base = [_syncs(plain, opt_p, x) for x in xs[2:]]
        counts = [_syncs(model, opt, x, rec) for x in xs[2:]]
        assert rec.nonfinite_steps == []
    record_property("plain_syncs_per_step", ",".join(map(str, base)))
    record_property("default_syncs_per_step", ",".join(map(str, counts)))
    assert [c - b for c, b in zip(counts, base)] == [1] * len(counts)


def test_the_sync_free_mode_syncs_only_when_it_reads(out_dir, record_property):
    every = 4
    (plain, opt_p), (model, opt) = _pair()
    xs = _batches(2 + 2 * every + 3 * every)
    with Recorder(model, opt, out_dir=out_dir, check_every=every) as rec:
        for x in xs[:2]:  # step 0 creates the optimizer state, step 1 sees the latch's layout once
            _step(plain, opt_p, x)
            _step(model, opt, x, rec)
        torch.cuda.synchronize()
        counted = xs[2:2 + 2 * every]
        base = [_syncs(plain, opt_p, x) for x in counted]
        counts = [c - b for c, b in zip([_syncs(model, opt, x, rec) for x in counted], base)]
        record_property("check_every_4_syncs_per_step", ",".join(map(str, counts)))
        assert sum(counts) == 2 and set(counts) <= {0, 1}, counts  # one read per `every` steps, none between
        reads = [i % every for i, c in enumerate(counts) if c]
        assert reads[0] == reads[1], counts
        # the steps between reads under "error": any synchronizing operation would raise
        raised = []
        for i, x in enumerate(xs[2 + 2 * every:]):
            if i % every == reads[0]:
                _step(model, opt, x, rec)
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                _step(model, opt, x, rec)
            except RuntimeError as e:
                raised.append(f"step {i}: {e}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        record_property("check_every_4_errors_between_reads", str(len(raised)))
        assert raised == []
        assert rec.nonfinite_steps == []
