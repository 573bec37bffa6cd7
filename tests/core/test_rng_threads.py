"""The Recorder never changes the user's random streams: per-step capture only reads them, and its
own random work (the in-process diagnosis's replay, the check of an exported program) neither
consumes nor rewinds a generator that a user's thread draws from, in one thread or several."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

import models
from nanreplay import NonFiniteGradientError, Recorder


def _user_draws() -> list:
    """One round of the draws a training loop makes from the process-wide generators."""
    return [torch.randn(3), random.random(), float(np.random.rand())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _single_thread_run(out_dir, *, recorder: bool) -> tuple[list, list]:
    """Six steps of a dropout MLP whose loop also draws from torch, random and numpy; step 3's
    batch holds a NaN (action='warn': dump, diagnose in process, go on)."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = models.make_dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    draws, losses = [], []
    rec = Recorder(model, opt, out_dir=out_dir, action="warn", snapshot_every=2, embed_program=True) if recorder else None
    try:
        for i in range(6):
            draws.append(_user_draws())
            x = torch.randn(4, 8)
            if i == 3:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            losses.append(float(loss))
            loss.backward()
            opt.step()
            opt.zero_grad()
            draws.append(_user_draws())  # right after a dump + diagnosis at i == 3
    finally:
        if rec is not None:
            rec.close()
    return draws, losses + ([str(rec.bundles), rec.last_diagnosis is not None] if rec is not None else [])


def test_recorder_leaves_a_single_threads_random_streams_alone(out_dir):
    plain_draws, plain_losses = _single_thread_run(out_dir, recorder=False)
    draws, losses = _single_thread_run(out_dir, recorder=True)
    assert "nanreplay-step3" in losses[-2] and losses[-1] is True  # a dump and an in-process diagnosis happened
    assert [_same(a, b) for a, b in zip(draws, plain_draws)] == [True] * len(plain_draws)
    assert losses[:3] == plain_losses[:3] and np.isnan(losses[3]) and np.isnan(plain_losses[3])


class _Trainer(threading.Thread):
    """Trains a tiny model with its own Recorder, drawing its batches from generators it owns.
    ``fail_at``: that step's batch overflows the model (the Recorder dumps, diagnoses in process,
    raises; the thread stops there, with or without a Recorder)."""

    def __init__(self, name: str, model, out_dir, *, recorder: bool, steps: int, fail_at: int = -1,
                 forwards_done: threading.Event = None, seed: int = 0) -> None:
        super().__init__(name=name)
        self.model, self.out_dir, self.recorder, self.steps, self.fail_at = model, out_dir, recorder, steps, fail_at
        self.forwards_done = forwards_done
        self.gen = torch.Generator().manual_seed(seed)
        self.py = random.Random(seed)
        self.np = np.random.RandomState(seed)
        self.draws: list = []
        self.losses: list = []
        self.error: BaseException = None
        self.diagnosed = False
        self.in_step = False

    def run(self) -> None:
        try:
            opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
            rec = Recorder(self.model, opt, out_dir=self.out_dir, snapshot_every=2, diagnose_timeout=None) if self.recorder else None
            try:
                for i in range(self.steps):
                    self.draws.append([torch.randn(4, 8, generator=self.gen), self.py.random(), float(self.np.rand())])
                    x = self.draws[-1][0].clone()
                    if i == self.fail_at:
                        x[0] = 1e30  # finite, overflows inside the model: the diagnosis replays the step
                    loss = self.model(x).pow(2).mean()
                    if i == self.fail_at and self.forwards_done is not None:
                        self.forwards_done.set()  # the last draw this thread makes from the shared generator
                    self.losses.append(float(loss))
                    loss.backward()
                    self.in_step = True
                    try:
                        opt.step()
                    except NonFiniteGradientError as e:
                        self.diagnosed = e.diagnosis is not None and bool(e.bundle_path)
                        break
                    finally:
                        self.in_step = False
                    if i == self.fail_at:  # without a Recorder nothing raises: stop where it would have
                        break
                    opt.zero_grad()
                    time.sleep(0.001)
            finally:
                if rec is not None:
                    rec.close()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e


def _threaded_run(tmp_path, *, recorder: bool) -> dict:
    """Thread A trains an MLP with no random ops for 40 steps; thread B trains a dropout MLP (the
    shared torch generator) whose step 3 fails; thread C, once B's last forward is done, draws from
    torch / random / numpy in a loop until B is finished (dump, program export, in-process
    diagnosis). Returns what each thread drew and computed."""
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    model_a, model_b = models.make_mlp(), models.make_dropout_mlp()
    forwards_done, b_done = threading.Event(), threading.Event()
    a = _Trainer("A", model_a, tmp_path / "a", recorder=recorder, steps=40, seed=10)
    b = _Trainer("B", model_b, tmp_path / "b", recorder=recorder, steps=6, fail_at=3, forwards_done=forwards_done, seed=20)
    c: dict = {"draws": [], "during_b_step": 0}

    def draw_loop() -> None:
        forwards_done.wait(60)
        c["start"] = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        while not b_done.is_set() or len(c["draws"]) < 50:
            in_step = b.in_step
            c["draws"].append(_user_draws())
            c["during_b_step"] += in_step
            time.sleep(0.0005)

    threads = [a, b, threading.Thread(target=draw_loop, name="C")]
    for t in threads:
        t.start()
    b.join(120)
    b_done.set()
    for t in threads:
        t.join(120)
    assert a.error is None and b.error is None, (a.error, b.error)
    return {"a": a, "b": b, "c": c}


def _replayed(start: tuple, n: int) -> list:
    """``n`` rounds of :func:`_user_draws` from the given states, in private generators."""
    g = torch.Generator()
    g.set_state(start[0])
    py = random.Random()
    py.setstate(start[1])
    rs = np.random.RandomState()
    rs.set_state(start[2])
    return [[torch.randn(3, generator=g), py.random(), float(rs.rand())] for _ in range(n)]


def test_two_recorders_in_two_threads_leave_every_threads_draws_alone(tmp_path):
    plain = _threaded_run(tmp_path / "plain", recorder=False)
    run = _threaded_run(tmp_path / "rec", recorder=True)
    # Recorders on two training threads: neither exports early (only B, when it dumps), and
    # torch.export's process-wide "inside an export" flag is off again (else torch.compile is a
    # no-op for the rest of the process)
    assert not torch.compiler.is_exporting()
    b = run["b"]
    assert b.diagnosed  # B dumped and diagnosed in process, while C was drawing
    assert run["c"]["during_b_step"] > 0
    # A and B: their own draws and their losses are those of the run without nanreplay
    for name in ("a", "b"):
        assert [_same(x, y) for x, y in zip(run[name].draws, plain[name].draws)] == [True] * len(plain[name].draws)
        assert len(run[name].draws) == len(plain[name].draws)
    assert run["a"].losses == plain["a"].losses
    assert run["b"].losses[:3] == plain["b"].losses[:3]
    # C: starts from the same states (nanreplay consumed nothing before), and every draw is the
    # next one of each shared stream (nothing consumed or rewound while B dumped and diagnosed)
    (t0, py0, np0), (t1, py1, np1) = run["c"]["start"], plain["c"]["start"]
    assert torch.equal(t0, t1) and py0 == py1 and np.array_equal(np0[1], np1[1]) and np0[2] == np1[2]
    draws = run["c"]["draws"]
    expected = _replayed(run["c"]["start"], len(draws))
    mismatches = [i for i, (x, y) in enumerate(zip(draws, expected)) if not _same(x, y)]
    assert mismatches == [], f"{len(mismatches)} of {len(draws)} draws of thread C differ, first at {mismatches[:1]}"


def _alive_thread(name: str) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name=name, daemon=True)
    t.start()
    return t, stop


def test_threads_that_draw_nothing_leave_the_replay_on_the_process_wide_generators():
    """tqdm's monitor (started by the first progress bar, even a disabled one: torch.fx's Interpreter
    makes one at every run) and nanreplay's status line draw no random numbers: a replay beside them
    still sets and restores the process-wide generators, exactly; any other thread makes it private."""
    from nanreplay.core.rng import STATUS_THREAD_NAME, ReplayRNG, sole_thread

    tqdm = pytest.importorskip("tqdm")
    bar = tqdm.tqdm(total=1, disable=True)
    status, stop_status = _alive_thread(STATUS_THREAD_NAME)
    try:
        assert any(type(t).__name__ == "TMonitor" for t in threading.enumerate()) or tqdm.tqdm.monitor_interval == 0
        assert sole_thread()
        with ReplayRNG() as rng:
            assert not rng.shared
        other, stop_other = _alive_thread("user-data-loader")
        try:
            assert not sole_thread()
            with ReplayRNG() as rng:
                assert rng.shared
        finally:
            stop_other.set()
            other.join()
    finally:
        bar.close()
        stop_status.set()
        status.join()


def test_an_fx_interpreter_run_does_not_make_later_replays_private():
    from nanreplay.core.rng import sole_thread

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    torch.fx.Interpreter(gm).run(torch.ones(1, 2))
    assert sole_thread()


def test_inductor_compile_pool_workers_draw_nothing(monkeypatch, tmp_path):
    """On a machine with several cores, inductor keeps a pool of compile threads alive after the
    first compile; a replay beside them still uses the process-wide generators. A thread pool of
    the user's own is not taken for it."""
    from concurrent.futures import ThreadPoolExecutor

    from nanreplay.core.rng import _draws_nothing

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache: the kernels are compiled
    from torch._inductor import config

    before = set(threading.enumerate())
    torch._dynamo.reset()
    with config.patch(compile_threads=2):
        torch.compile(lambda x: (x.sin() + 1).cos())(torch.randn(8))
    torch._dynamo.reset()
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("ThreadPoolExecutor")]
    if not started:
        pytest.skip("inductor's compile pool was not started here (made earlier in this process, or not used by this torch)")
    assert all(_draws_nothing(t) for t in started)
    with ThreadPoolExecutor(1) as own:
        own.submit(lambda: None).result()
        mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("ThreadPoolExecutor") and t not in started]
        assert mine and not any(_draws_nothing(t) for t in mine)
