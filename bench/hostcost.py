"""The Recorder's fixed host cost per step, this checkout against another revision, side by side.

Usage::

    python bench/hostcost.py --against 819aa0f                 # 3 runs of 3,000 rounds each
    python bench/hostcost.py --against HEAD~3 --steps 5000 --runs 5
    python bench/hostcost.py --against HEAD --copies 3        # 3 model copies per loop

Method. The other revision's ``nanreplay`` package is taken from git (``git archive``) into a
temporary directory under another name, so both versions load in one process. Three copies of the
``small`` model (``bench/models.py``: a step of about 1 ms on 2 CPU threads, where the fixed cost
shows) train on the same batches: plain, under the other revision's Recorder and under this
checkout's, default options, ``record(batch)`` and ``log_loss(loss)`` called. Each round runs one
step of each, in an order that cycles through the six permutations (shuffled with ``--copies``); the figure per Recorder is the
median over rounds of its step time minus the plain step time of the same round (microseconds),
and the ratio of the two medians. The machine's speed drifts between runs (the plain step here
ranges about 0.8-1.1 ms): the ratio, measured within one run, is the steadier figure.

Identical Recorders on separate copies of the model differ by up to about 5 µs within one run (where
their tensors and objects landed in memory): ``--copies K`` gives each loop K copies of the model,
all interleaved, and a loop's figure is the mean over its copies of their medians, which averages
that out (a run then takes K times as long).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
from functools import partial
from io import BytesIO
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402  (bench/models.py)
import overhead  # noqa: E402  (bench/overhead.py: the training step it times)

OTHER = "nanreplay_other"


def load_other(rev: str, into: Path) -> type:
    """The ``Recorder`` class of revision ``rev``, imported as package :data:`OTHER` from ``into``."""
    data = subprocess.run(["git", "archive", rev, "nanreplay"], cwd=HERE.parent, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "nanreplay").rename(into / OTHER)
    sys.path.insert(0, str(into))
    mod = __import__(OTHER, fromlist=["Recorder"])
    return mod.Recorder


def at_least_one(text: str) -> int:
    """``argparse`` type of ``--block``: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps of at least 1, got {text!r}")
    return n


def interleave(makers: dict[str, Callable], steps: int, warmup: int, copies: int = 1, block: int = 1) -> tuple[dict[str, list[float]], float]:
    """One interleaved run of the ``small`` model's step: a plain loop and one loop per entry of
    ``makers`` (``name -> make(model, optimizer, out_dir)``, returning what the step is given: an
    object with ``record`` and ``log_loss``, closed at the end if it has ``close``), each on
    ``copies`` copies of the model. ``block``: consecutive steps each loop runs in a round (1: one
    step, the loops alternating step by step; more: each loop runs on for that many steps, as a
    training loop does, its code and data staying in the caches between its own steps, and a
    round's time is the mean over its block, the early warning's batched digest included once in
    64 steps); ``steps`` and ``warmup`` count rounds. Returns, per name, each copy's median over
    rounds of its step time minus the plain step time of the same round and copy index
    (microseconds), and the plain step's median (microseconds)."""
    factory, make_batch, loss_fn = models.spec("small")
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch(gen, cpu) for _ in range(64)]
    loops = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in range(copies):
            for name, make in {"plain": None, **makers}.items():
                torch.manual_seed(0)
                model = factory()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                loops[(name, c)] = (model, opt, make(model, opt, tmp) if make is not None else None)

        times: dict[tuple[str, int], list[float]] = {n: [] for n in loops}
        orders = list(itertools.permutations(loops)) if len(loops) <= 6 else None
        shuffle = random.Random(0).shuffle
        for i in range(warmup + steps):
            if orders is None:
                order = list(loops)
                shuffle(order)
            else:
                order = orders[i % len(orders)]
            for name in order:
                model, opt, rec = loops[name]
                dt = sum(overhead._timed_step(model, opt, loss_fn, batches[j % len(batches)], cpu, rec)  # bench/overhead.py's step
                         for j in range(i * block, (i + 1) * block)) / block
                if i >= warmup:
                    times[name].append(dt)
        for _, _, rec in loops.values():
            if hasattr(rec, "close"):
                rec.close()
    extra = {name: [statistics.median(a - b for a, b in zip(times[(name, c)], times[("plain", c)])) * 1e6 for c in range(copies)]
             for name in makers}
    return extra, statistics.median(t for c in range(copies) for t in times[("plain", c)]) * 1e6


def run(recorders: dict, steps: int, warmup: int, copies: int = 1, block: int = 1) -> dict[str, float]:
    """One interleaved run (:func:`interleave`) of Recorder classes, default options; returns each
    one's extra microseconds per step (the mean over its copies) and the plain step's median
    (``"plain_us"``)."""
    extra, plain = interleave({name: partial(_recorder, cls) for name, cls in recorders.items()}, steps, warmup, copies, block)
    return {**{name: statistics.fmean(per) for name, per in extra.items()}, "plain_us": plain}


def _recorder(cls: type, model: torch.nn.Module, opt: torch.optim.Optimizer, out_dir: str) -> object:
    return cls(model, opt, out_dir=out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the git revision to compare with (e.g. a commit or HEAD~3)")
    p.add_argument("--steps", type=int, default=3000, help="timed rounds per run (each: one step of each loop)")
    p.add_argument("--warmup", type=int, default=300, help="untimed rounds first")
    p.add_argument("--runs", type=int, default=3, help="runs, each in this process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=1, help="model copies per loop, all interleaved (averages out where each landed in memory)")
    p.add_argument("--block", type=at_least_one, default=1, help="consecutive steps of each loop per round (1: step by step; 200: as a training loop runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from nanreplay import Recorder

    with tempfile.TemporaryDirectory() as tmp:
        other = load_other(args.against, Path(tmp))
        rows = []
        for r in range(args.runs):
            res = run({"other": other, "this": Recorder}, args.steps, args.warmup, args.copies, args.block)
            rows.append(res)
            print(f"run {r + 1}: plain step {res['plain_us']:.0f} µs; {args.against} +{res['other']:.0f} µs/step; "
                  f"this checkout +{res['this']:.0f} µs/step; ratio {res['this'] / res['other']:.2f}", flush=True)
    this = statistics.median(r["this"] for r in rows)
    ratio = statistics.median(r["this"] / r["other"] for r in rows)
    print(f"median of {args.runs} runs: this checkout +{this:.0f} µs/step, {ratio:.2f}x the host cost of {args.against} "
          f"(command: python bench/hostcost.py --against {args.against} --steps {args.steps} --runs {args.runs}"
          + (f" --copies {args.copies}" if args.copies > 1 else "") + (f" --block {args.block}" if args.block > 1 else "") + ")")


if __name__ == "__main__":
    main()
