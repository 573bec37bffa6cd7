"""The Recorder's fixed host cost per step against the least a replayable step needs, side by side.

Usage::

    python bench/floor.py                          # 3 runs of 3,000 rounds, 2 copies per loop
    python bench/floor.py --copies 1 --compact     # one copy each, and the compact yardstick

The ``floor`` is a minimal recorder written here, keeping only what a replay of the step cannot do
without, each the cheapest way this project knows: the RNG states at the start of the step
(:class:`nanreplay.core.rng.RNGReader`, the Recorder's own reader: exact, copies only what moved),
references to the batch and to the model's arguments, the model output's cotangent by
``retain_grad()``, one fused ``_foreach_norm`` over the gradients with a host read of each norm and
of the loss, and a ``deque`` of the last 4 steps. It has none of the rest of the Recorder's default
options: no watch of the inputs' storages and versions (a loop that refills one buffer would replay
the wrong batch), no byte budget, no module modes or step-start buffers, no scalar history or
early warning, no autocast, compile, DataParallel or GradScaler handling, no non-finite action.

``--compact`` adds a third loop, ``compact``: the floor plus most of what the Recorder does by
default, written as one flat object (a yardstick, not a recorder to use): the storage watch and
version checks of the captured tensors, the step's record (:class:`~nanreplay.format.records.StepRecord`
and :class:`~nanreplay.format.records.ForwardRecord`), the module modes, the learning rates, the
ring's byte count and eviction, and the finite steps' scalar history and early warning taken in
64 at a time (nanreplay's :class:`~nanreplay.capture.early.EarlyWarning` and
:class:`~nanreplay.capture.early.ScalarHistory`). Against the Recorder it shows what the Recorder's
generality costs apart from the features themselves: the tests and torch calls its rarer cases
need (a compiled model, autocast, a long ring, copies, a scaler, a step begun in eval mode), its
work spread over some forty Python calls into eight objects.

The loop is ``bench/hostcost.py``'s (:func:`hostcost.interleave`): every round runs one step of each
copy, plain ones included, in a shuffled order, with ``record(batch)`` and ``log_loss(loss)``
called; a figure is the median over rounds of the step time minus the plain step time of the same
round and copy index (microseconds), the mean over copies. The difference between the Recorder's
figure and the floor's is the Recorder's work beyond the floor.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from operator import attrgetter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import hostcost  # noqa: E402  (bench/hostcost.py: the interleaved loop of plain and hooked model copies)
from nanreplay import Recorder  # noqa: E402
from nanreplay.core.rng import RNGReader  # noqa: E402
from nanreplay.format.records import ForwardRecord, StepRecord  # noqa: E402


def read_step(grads: list[torch.Tensor], loss: torch.Tensor, step: int) -> tuple[float, float]:
    """The check both loops make: one fused ``_foreach_norm`` over ``grads`` and a host read of each
    norm and of ``loss``; (grad norm, loss), or ``FloatingPointError`` when either is not finite."""
    norm = math.sqrt(math.fsum(float(n) ** 2 for n in torch._foreach_norm(grads, 2.0, torch.float32)))
    value = float(loss)
    if not (math.isfinite(norm) and math.isfinite(value)):
        raise FloatingPointError(f"step {step}: grad norm {norm}, loss {value}")
    return norm, value


class Floor:
    """The minimal recorder (see the module docstring), hooked into ``model`` and ``optimizer``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, capacity: int = 4) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.rng = RNGReader()
        self.ring: collections.deque = collections.deque(maxlen=capacity)
        self.current: list | None = None
        self.out: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.step = 0
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True), model.register_forward_hook(self._post),
                        optimizer.register_step_pre_hook(self._check), optimizer.register_step_post_hook(self._end)]

    def record(self, batch: object) -> None:
        if self.current is None:
            self.current = [self.step, self.rng.capture(), [], [], None]
        self.current[2].append(batch)

    def log_loss(self, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.current is None:
            self.record(())
        self.current[3].append((args, kwargs))

    def _post(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        self.out = out

    def _check(self, *hook_args: object) -> None:
        norm, loss = read_step([p.grad for p in self.params if p.grad is not None], self.loss, self.step)
        self.current[4] = (norm, loss, self.out.grad)

    def _end(self, *hook_args: object) -> None:
        self.ring.append(self.current)
        self.current, self.out = None, None
        self.step += 1


class Compact:
    """The floor plus most of the Recorder's default per-step work, in one flat object (``--compact``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, capacity: int = 4) -> None:
        from nanreplay.capture.early import EarlyWarning, ScalarHistory

        self.groups = optimizer.param_groups
        self.rng = RNGReader()
        self.names, self.modules = zip(*model.named_modules())
        self.flags: tuple | None = None
        self.training: list[str] = []
        self.ring: collections.deque = collections.deque()
        self.capacity = capacity
        self.current: StepRecord | None = None
        self.out: tuple | None = None
        self.loss: torch.Tensor | None = None
        self.step = 0
        self.refs: dict[int, list[tuple]] = {}    # step -> (tensor, version, storage address, storage bytes)
        self.storages: dict[int, int] = {}        # storage address -> last step it was an input of
        self.same: dict[int, torch.Tensor] = {}   # id -> tensor, within the step
        self.copying = False
        self.held, self.counted = 0, {}
        self.live = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
        self.waiting: list[tuple] = []
        self.early, self.history = EarlyWarning(), ScalarHistory(1000)
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True), model.register_forward_hook(self._post),
                        optimizer.register_step_pre_hook(self._check), optimizer.register_step_post_hook(self._end)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _begin(self) -> StepRecord:
        rec = StepRecord(step=self.step, rng=self.rng.capture())
        flags = tuple(map(_TRAINING, self.modules))
        if flags != self.flags:
            self.flags, self.training = flags, [n for n, on in zip(self.names, flags) if on]
        rec.training = self.training
        if len(self.ring) >= self.capacity:
            old = self.ring.popleft()
            self.held -= self.counted.pop(old.step, 0)
            for _, _, ptr, _ in self.refs.pop(old.step, ()):
                if self.storages.get(ptr) == old.step:
                    del self.storages[ptr]
        self.ring.append(rec)
        self.current, self.refs[rec.step], self.same = rec, [], {}
        return rec

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        if id(x) in self.same:
            return x
        st = x.untyped_storage()
        ptr = st.data_ptr()
        if self.storages.setdefault(ptr, self.step) != self.step:
            self.copying = True  # the Recorder would copy from now on
        self.refs[self.step].append((x, x._version, ptr, st.nbytes()))
        self.same[id(x)] = x
        return x

    def record(self, batch: tuple) -> None:
        rec = self.current or self._begin()
        rec.batches.append(tuple(map(self._keep, batch)))

    def log_loss(self, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        rec = self.current or self._begin()
        fw = ForwardRecord(inputs=(tuple(map(self._keep, args)), kwargs))
        rec.forwards.append(fw)
        self.fw = fw

    def _post(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        self.out = (self.fw, out)

    def _check(self, *hook_args: object) -> None:
        rec = self.current
        if self.out is not None:
            fw, out = self.out
            fw.cotangent, self.out = out.grad.detach(), None
        rec.lrs = [float(g["lr"]) for g in self.groups]
        norm, loss = read_step([p.grad for g in self.groups for p in g["params"] if p.grad is not None], self.loss, self.step)
        rec.grad_norm, rec.loss, rec.finite = norm, loss, True
        for t, v, _, _ in self.refs[rec.step]:
            if t._version != v:
                self.copying = True
        self.waiting.append((rec.step, loss, norm, rec.lrs))
        if len(self.waiting) >= 64:
            waiting, self.waiting = self.waiting, []
            for step, lo, n, lrs in waiting:
                self.history.add(step, lo, n, lrs, True)
                self.early.observe(step, loss=lo, grad_norm=n, lrs=lrs)

    def _end(self, *hook_args: object) -> None:
        rec, seen, n = self.current, set(), 0
        for _, _, ptr, size in self.refs[rec.step]:
            if ptr not in seen and ptr not in self.live:
                seen.add(ptr)
                n += size
        n += sum(fw.cotangent.untyped_storage().nbytes() for fw in rec.forwards if fw.cotangent is not None)
        self.counted[rec.step] = n
        self.held += n
        self.current = None
        self.step += 1


_TRAINING = attrgetter("training")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="timed rounds per run (each: one step of each loop)")
    p.add_argument("--warmup", type=int, default=300, help="untimed rounds first")
    p.add_argument("--runs", type=int, default=3, help="runs, each in this process")
    p.add_argument("--copies", type=int, default=2, help="model copies per loop, all interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compact", action="store_true", help="add the compact loop (the floor plus most default work, one flat object)")
    p.add_argument("--block", type=hostcost.at_least_one, default=1, help="consecutive steps of each loop per round (1: step by step; 200: as a training loop runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    makers = {"floor": lambda m, o, out_dir: Floor(m, o), "recorder": lambda m, o, out_dir: Recorder(m, o, out_dir=out_dir)}
    if args.compact:
        makers["compact"] = lambda m, o, out_dir: Compact(m, o)
    print(f"torch {torch.__version__}, {args.threads} threads, python {sys.version.split()[0]}; command: "
          f"`python bench/floor.py --steps {args.steps} --runs {args.runs} --copies {args.copies}{' --compact' if args.compact else ''}"
          f"{f' --warmup {args.warmup} --block {args.block}' if args.block > 1 else ''}`")
    for r in range(args.runs):
        extra, plain = hostcost.interleave(makers, args.steps, args.warmup, args.copies, args.block)
        floor, rec = statistics.fmean(extra["floor"]), statistics.fmean(extra["recorder"])
        compact = f"; compact +{statistics.fmean(extra['compact']):.1f} µs" if args.compact else ""
        print(f"run {r + 1}: plain step {plain / 1e3:.2f} ms; floor +{floor:.1f} µs, Recorder +{rec:.1f} µs "
              f"(beyond the floor: +{rec - floor:.1f} µs, {rec / floor:.2f}x the floor){compact}", flush=True)


if __name__ == "__main__":
    main()
