"""The Recorder's per-step path, checked for its structure rather than timed (timing lives in
bench/overhead.py): no walk of the module tree per step, host work that does not grow with the
model, RNG states read without copying what did not change (and still restored exactly), and a
running total of held bytes that equals a full recount."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import Recorder
from nanreplay.capture import recorder as recorder_module
from nanreplay.capture.forward import _FAST_CALL_CODE as FAST_CALL_CODE

PACKAGE = os.path.dirname(os.path.abspath(sys.modules["nanreplay"].__file__)) + os.sep


def mlp(depth: int, *, dropout: float = 0.0, norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.BatchNorm1d(16) if norm else nn.Identity(), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)  # a private generator: the loop itself draws from no global stream
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def step(rec: Recorder, model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    rec.record(batch)
    loss = loss_fn(model, batch)
    rec.log_loss(loss)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_a_step_walks_no_module_tree(out_dir, monkeypatch):
    model = mlp(4, norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(6)
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir) as rec:
        for b in data[:2]:  # the first step learns which buffers change, and reads the module tree again
            step(rec, model, opt, b)
        walks = []
        for name in ("named_modules", "named_parameters", "named_buffers", "modules", "parameters", "buffers", "named_children"):
            orig = getattr(nn.Module, name)
            monkeypatch.setattr(nn.Module, name, lambda self, *a, _n=name, _o=orig, **k: (walks.append(_n), _o(self, *a, **k))[1])
        for b in data[2:]:
            step(rec, model, opt, b)
        monkeypatch.undo()
        assert walks == []
        assert rec.nonfinite_steps == [] and len(rec.ring) == 4


def _nanreplay_calls(depth: int, out_dir) -> list[int]:
    """Python function calls made while nanreplay's code runs (its own and the library calls it
    makes), in each of 3 steps after 2 warm-up steps."""
    torch.manual_seed(0)
    model = mlp(depth, dropout=0.1, norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir) as rec:
        for i, b in enumerate(batches(5)):
            n, inside = [0], set()

            def prof(frame, event, arg, n=n, inside=inside):
                # every call made while a nanreplay frame is on the stack: its own, and torch's on its behalf
                if event == "call":
                    if inside:
                        n[0] += 1
                    # the tap's fast call is nanreplay's frame around the model's own forward: the forward's calls are the model's
                    if frame.f_code.co_filename.startswith(PACKAGE) and frame.f_code is not FAST_CALL_CODE:
                        inside.add(id(frame))
                elif event == "return":
                    inside.discard(id(frame))

            if i >= 2:
                gc.collect()
                gc.disable()  # a collection inside a step would count the finalizers it runs (weakref callbacks)
                sys.setprofile(prof)
            try:
                step(rec, model, opt, b)
            finally:
                sys.setprofile(None)
                gc.enable()
            if i >= 2:
                counts.append(n[0])
    return counts


def test_host_work_per_step_does_not_grow_with_the_model(out_dir, monkeypatch):
    """The same Python calls per step for a model of 2 and of 40 hidden blocks (12x the modules,
    parameters and buffers): per-module and per-parameter work stays inside C (the fused norm,
    one flag read per module), never a Python call per module."""
    monkeypatch.setattr(recorder_module, "WAIT_SECONDS", float("inf"))  # the waiting steps are taken in by count, not by the clock
    small, large = _nanreplay_calls(2, out_dir / "a"), _nanreplay_calls(40, out_dir / "b")
    assert small == large, (small, large)
    assert small[0] > 0


def test_unchanged_rng_states_are_shared_not_copied(out_dir, monkeypatch):
    model = mlp(2)  # no dropout, batches from a private generator: no global stream moves
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, capacity=8) as rec:
        copies = []
        monkeypatch.setattr(random, "getstate", lambda: copies.append("python") or random.Random.getstate(random._inst))
        monkeypatch.setattr(np.random, "get_state", lambda *a, **k: copies.append("numpy") or np.random.mtrand._rand.get_state(*a, **k))
        for b in batches(6):
            step(rec, model, opt, b)
        monkeypatch.undo()
        first = rec.ring[0].rng
        # NumPy's state is read once, at the first step; Python's is never built as a tuple of ints
        # (its raw bytes are kept); an unchanged state is not read again
        assert copies == ["numpy"]
        for r in rec.ring:
            assert r.rng.python is first.python and r.rng.numpy is first.numpy and r.rng.torch_cpu is first.torch_cpu


class Noisy(nn.Module):
    """Draws from every generator in forward: torch (dropout), Python and NumPy (a Gaussian,
    which NumPy's legacy generator makes in pairs and caches)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.drop = nn.Dropout(0.5)
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, g = random.random(), float(np.random.randn())
        self.seen.append((u, g))
        return self.drop(self.fc(x)) * (1 + 1e-3 * (u + g))


@pytest.mark.parametrize("between", ["nothing", "python", "numpy gauss", "torch"])
def test_recorded_rng_state_restores_each_steps_draws(out_dir, between):
    """Whatever moved between two steps (or nothing did), each held step's RNG state, restored,
    gives the draws that step made, including NumPy's cached Gaussian consumed without moving
    its Mersenne Twister."""
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    model = Noisy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masks = []
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, capacity=6) as rec:
        for b in batches(6):
            if between == "python":
                random.random()
            elif between == "numpy gauss":
                np.random.randn()
            elif between == "torch":
                torch.rand(1)
            step(rec, model, opt, b)
            masks.append(torch.get_rng_state())
        held = list(rec.ring)
    assert [r.step for r in held] == list(range(6))
    for r in held:
        x, _ = r.batches[0]
        r.rng.restore()
        u, g = random.random(), float(np.random.randn())
        assert (u, g) == model.seen[r.step], r.step
        drop = nn.Dropout(0.5)
        r.rng.restore()
        random.random(), np.random.randn()
        a = drop(torch.ones(16))
        r.rng.restore()
        random.random(), np.random.randn()
        assert torch.equal(a, drop(torch.ones(16)))


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize("options", [
    {},
    {"capacity": 40, "memory_budget": 6000},
    {"snapshot_every": 2, "capacity": 5},
    {"snapshot_every": 1, "capacity": 6, "memory_budget": 40_000},
    {"copy_batch": True, "capacity": 10},
    {"check_every": 4, "capacity": 3},
    {"capture_cotangent": True, "capacity": 7},
])
def test_held_bytes_running_total_matches_a_full_recount(out_dir, options):
    torch.manual_seed(0)
    model = mlp(2, norm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with Recorder(model, opt, loss_fn=None, out_dir=out_dir, **options) as rec:
        for i in range(14):
            opt.zero_grad()
            for micro in range(2):  # two micro-batches, the second a dataclass
                x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
                batch = (x, y) if micro == 0 else Batch(x, y)
                rec.record(batch)
                F.cross_entropy(model(x), y).backward()
            opt.step()
            assert rec.ring.held_bytes() == rec.ring.recount(), (i, rec.ring.held_bytes(), rec.ring.recount())
            if "memory_budget" in options:
                assert rec.held_bytes() <= options["memory_budget"]
    assert rec.held_bytes() > 0


def test_a_waiting_step_holds_nothing_of_its_record(out_dir, monkeypatch):
    """A finite step waiting for the early warning keeps only host values: once it leaves the ring
    buffer its batch is freed, although its scalars have not been taken in yet."""
    import weakref

    monkeypatch.setattr(recorder_module, "WAIT_SECONDS", float("inf"))
    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capacity = 4
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, capacity=capacity) as rec:
        first = None
        for i, b in enumerate(batches(capacity + 3)):
            step(rec, model, opt, b)
            if i == 0:
                first = weakref.ref(b[0])
            del b
        assert len(rec._waiting) == capacity + 3  # none taken in yet
        gc.collect()
        assert first() is None  # the first step left the ring: its batch went with it
        assert [w[0] for w in rec._waiting] == list(range(capacity + 3))
    assert [r[0] for r in rec._history.rows] == list(range(capacity + 3))


def test_finite_steps_wait_and_are_taken_in_before_anything_reads_them(out_dir, monkeypatch, caplog):
    """The default mode takes a finite step's scalar history and early warning in with the next
    few steps' (WAIT_STEPS); a reader (the scalar history, close) never sees them late."""
    monkeypatch.setattr(recorder_module, "WAIT_SECONDS", float("inf"))
    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(recorder_module.WAIT_STEPS + 3)
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir) as rec:
        for b in data[:3]:
            step(rec, model, opt, b)
        assert len(rec._waiting) == 3 and not rec._scalars.rows  # waiting: nothing done yet
        assert [r[0] for r in rec._history.rows] == [0, 1, 2] and rec._waiting == []  # a reader takes them in
        for b in data[3:]:
            step(rec, model, opt, b)
        assert len(rec._waiting) < recorder_module.WAIT_STEPS  # taken in by count without a reader
    assert [r[0] for r in rec._history.rows] == list(range(len(data)))
    with Recorder(mlp(2), opt, out_dir=out_dir, on_spike="dump") as other:
        assert other._waiting is None  # a spike action that needs the step's own state: judged at once


def test_an_eager_forward_runs_the_hooks_without_dynamos_disable_wrapper(out_dir, monkeypatch):
    """On a plain eager model the forward hooks call the step's callbacks directly: no
    torch.compiler.disable wrapper setting Dynamo's eval frame around them (C calls and a Python
    frame each, every step), so a recorded step sets it as often as a plain one (the optimizer's
    own step does); under a compiled call they still go through it (tests/engine/test_compile.py)."""
    import torch._dynamo.eval_frame as eval_frame

    def eval_frame_sets(rec):
        torch.manual_seed(0)
        model = mlp(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = batches(4)
        with rec(model, opt) if rec else contextlib.nullcontext() as r:
            (step if r else plain_step)(r, model, opt, data[0])
            calls = []
            original = eval_frame.set_eval_frame
            monkeypatch.setattr(eval_frame, "set_eval_frame", lambda cb: calls.append(cb) or original(cb))
            for b in data[1:]:
                (step if r else plain_step)(r, model, opt, b)
            monkeypatch.undo()
            if r:
                assert [len(s.forwards) for s in r.ring] == [1, 1, 1, 1]  # the hooks ran, every step
        return len(calls)

    def plain_step(_, model, opt, batch):
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()

    plain = eval_frame_sets(None)
    recorded = eval_frame_sets(lambda model, opt: Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir))
    assert recorded == plain


def test_the_check_norms_low_precision_gradients_in_float32_in_one_call():
    """The check's fused norm takes its dtype by position (a keyword costs a few µs a step in the
    binding) and still accumulates and returns float32 for float16 and bfloat16 gradients, mixed
    with float32 ones in one list: a float16 gradient whose 2-norm is above float16's largest
    value (65504) is finite, not Inf."""
    from nanreplay.core.numerics import tensor_norms, total_norm

    big = torch.full((4096,), 2.0, dtype=torch.float16)  # 2-norm 128; squared sum 16384 fits float16...
    huge = torch.full((64,), 10000.0, dtype=torch.float16)  # ...but this one's 2-norm is 80000 > 65504
    grads = [torch.ones(3), big, torch.ones(5, dtype=torch.bfloat16), huge]
    norms = tensor_norms(grads)
    assert [n.dtype for n in norms] == [torch.float32] * 4
    assert [round(float(n), 3) for n in norms] == [round(3 ** 0.5, 3), 128.0, round(5 ** 0.5, 3), 80000.0]
    assert total_norm([float(n) for n in norms]) == pytest.approx((3 + 4 * 4096 + 5 + 64 * 1e8) ** 0.5, rel=1e-6)


@pytest.mark.parametrize("pre_clip", [False, True])
def test_the_usual_step_is_taken_in_by_the_pre_hook_as_the_general_check_would(out_dir, monkeypatch, pre_clip):
    """The default mode's finite step is read and taken in by the optimizer's pre-hook itself
    (Recorder._check), without read_check; its records, scalar history and verdicts are those of the
    general check (forced by turning the usual path off), and a NaN step still goes the general way
    (a bundle, its history)."""
    calls = []
    original = recorder_module.read_check
    monkeypatch.setattr(recorder_module, "read_check", lambda *a, **k: calls.append(1) or original(*a, **k))

    def run(usual: bool):
        torch.manual_seed(0)
        model = mlp(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = batches(6)
        rec = Recorder(model, opt, out_dir=out_dir / f"usual{usual}", capacity=8, action="warn", diagnose=False)
        rec._usual = rec._usual and usual
        verdicts = []
        for i, (x, y) in enumerate(data):
            rec.record((x, y))
            loss = F.cross_entropy(model(x), y) * (float("nan") if i == 4 else 1.0)
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            if pre_clip:
                rec.log_grad_norm(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            opt.step()
            verdicts.append(rec._verdict)
        rec.close()
        rows = [(r.step, r.loss, r.grad_norm, r.grad_norm_pre_clip, r.finite, r.lrs) for r in rec.ring]
        return verdicts, rows, list(rec._history.rows), rec.nonfinite_steps, len(rec.bundles)

    calls.clear()
    usual = run(True)
    assert len(calls) == 2  # the non-finite steps only: the NaN loss's, and the next, on the weights its update made NaN
    general = run(False)
    assert len(calls) == 2 + 6
    assert usual[0] == general[0] == [True] * 4 + [False, False]
    assert repr(usual[1:]) == repr(general[1:])  # NaN rows alike too
    assert usual[3] == [4, 5] and usual[4] >= 1


def test_an_eager_model_is_called_through_the_taps_fast_call_which_copies_and_other_hooks_go_around(out_dir):
    """On an eager model the tap's fast call (the model's _compiled_call_impl) runs the capture and
    the forward without the hook machinery; a deep copy (an EMA model) leaves it behind and computes
    with its own weights; a hook the loop adds later runs (the fast call steps aside for
    _call_impl, where the tap's hooks still capture); close() takes it off; under DataParallel
    (replicas share the module's __dict__) none is installed."""
    import copy

    from nanreplay.capture.forward import is_tap_call

    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    with Recorder(model, opt, out_dir=out_dir) as rec:
        assert is_tap_call(model.__dict__.get("_compiled_call_impl"))
        step(rec, model, opt, data[0])
        assert len(rec.ring[-1].forwards) == 1 and rec.ring[-1].forwards[0].cotangent is not None
        ema = copy.deepcopy(model)
        assert ema.__dict__.get("_compiled_call_impl") is None
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.5)
            ref = mlp(2)
            ref.load_state_dict(ema.state_dict())
            x = data[1][0]
            assert torch.equal(ema(x), ref(x)) and not torch.equal(ema(x), model(x))
        seen = []
        handle = model.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        step(rec, model, opt, data[1])
        assert seen == [(6, 3)] and len(rec.ring[-1].forwards) == 1 and rec.ring[-1].forwards[0].cotangent is not None
        handle.remove()
        step(rec, model, opt, data[2])
        assert len(rec.ring[-1].forwards) == 1 and rec.nonfinite_steps == []
    assert model.__dict__.get("_compiled_call_impl") is None
    with Recorder(torch.nn.DataParallel(model), opt, out_dir=out_dir) as rec:
        assert model.__dict__.get("_compiled_call_impl") is None
        step(rec, model, opt, data[3])
        assert len(rec.ring[-1].forwards) == 1


def test_a_replica_made_after_attach_and_called_from_another_thread_computes_with_its_own_modules(out_dir):
    """DataParallel wrapped around the model after the Recorder was built replicates the module as
    a shallow copy of its __dict__ (the fast call included) and calls each replica from a worker
    thread: there the fast call sends a call made for the replica to the replica's own _call_impl,
    so it computes with the replica's modules, not the original's."""
    import copy
    import threading

    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = batches(1)[0][0]
    with Recorder(model, opt, out_dir=out_dir):
        replica = model._replicate_for_data_parallel()  # what torch.nn.parallel.replicate starts from
        replica._modules = {k: copy.deepcopy(m) for k, m in model._modules.items()}
        with torch.no_grad():
            for p in replica.parameters():
                p.mul_(0.5)
        ref = mlp(2)
        ref.load_state_dict(replica.state_dict())
        out = {}
        with torch.no_grad():
            worker = threading.Thread(target=lambda: out.setdefault("y", replica(x)))
            worker.start()
            worker.join()
            assert torch.equal(out["y"], ref(x)) and not torch.equal(out["y"], model(x))
