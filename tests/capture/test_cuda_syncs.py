"""Host syncs on a GPU, counted by CUDA itself: ``torch.cuda.set_sync_debug_mode`` reports every
synchronizing CUDA operation (a device-to-host copy, a stream or device synchronize). The default
Recorder makes exactly one per step (the check's read); the sync-free mode (``check_every``) makes
none on any step (its reads wait on an event, not the stream), which ``"error"`` mode proves by
raising on any.

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


def test_the_sync_free_mode_never_synchronizes_the_stream(out_dir, record_property):
    """Every ``every`` steps the host reads the verdicts, but from pinned host memory filled by
    copies started when each step was checked: it waits (if at all) on the event after the last
    copy, never for the stream, so CUDA reports no synchronizing operation on any step, and
    under ``"error"`` mode no step raises, the reading ones included."""
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
        waiting = []
        counts = []
        for x, b in zip(counted, base):
            counts.append(_syncs(model, opt, x, rec) - b)
            waiting.append(len(rec._lagged.pending))
        record_property("check_every_4_syncs_per_step", ",".join(map(str, counts)))
        assert counts == [0] * len(counts), counts
        assert min(waiting) == 1 and max(waiting) == every, waiting  # the reads happened: 4 waited, then 1
        raised = []
        for i, x in enumerate(xs[2 + 2 * every:]):
            torch.cuda.set_sync_debug_mode("error")
            try:
                _step(model, opt, x, rec)
            except RuntimeError as e:
                raised.append(f"step {i}: {e}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        record_property("check_every_4_errors", str(len(raised)))
        assert raised == []
        assert rec.nonfinite_steps == []


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_sync_free_bundle_holds_the_failing_steps_state_on_cuda(out_dir, fused, record_property):
    """The sync-free mode on CUDA bundles the failing step's own pre-step state: with a foreach
    AdamW its ``step`` counters stay on the CPU (kept per step on the host, not selected by the
    device flag, which would sync); with a fused one the update is skipped on the device from
    the failing step on and nothing but the gradients is copied."""
    from nanreplay import NonFiniteGradientError, open_bundle

    torch.manual_seed(0)
    model = models.make_dropout_mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
    xs = _batches(10)  # steps 4..7 are read at step 8's check
    xs[5][1, 3] = float("inf")
    seen, err = {}, None
    with Recorder(model, opt, out_dir=out_dir, check_every=4, action="raise") as rec:
        for i, x in enumerate(xs):
            if i == 5:
                seen = {"params": {n: p.detach().cpu() for n, p in model.named_parameters()},
                        "opt": {pid: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                                for pid, st in opt.state_dict()["state"].items()}}
            try:
                _step(model, opt, x, rec)
            except NonFiniteGradientError as e:
                err = e
                break
        freeze = rec._lagged.freeze if rec._lagged is not None else None
    record_property(f"sync_free_{'fused' if fused else 'foreach'}_freeze", str(freeze))
    assert err is not None and err.step == 5
    assert freeze == fused
    with open_bundle(err.bundle_path) as b:
        state = b.state()
        for n, w in seen["params"].items():
            assert torch.equal(state.params[n].cpu(), w), n
        for pid, entries in seen["opt"].items():
            for k, v in entries.items():
                got = state.optimizer["state"][pid][k]
                assert torch.equal(torch.as_tensor(got).cpu(), torch.as_tensor(v)), (pid, k)
    for n, p in model.named_parameters():  # "raise" leaves the live model at step 5's pre-step weights
        assert torch.equal(p.detach().cpu(), seen["params"][n]), n
