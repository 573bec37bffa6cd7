"""What each default feature of the Recorder costs a step on the small model, each turned off in turn.

Usage::

    python bench/features.py                       # blocks of 200 steps, 16 rounds, 2 copies, 2 runs
    python bench/features.py --block 1 --steps 3000 --warmup 300

Method: ``bench/hostcost.py``'s loop (:func:`hostcost.interleave`): a plain loop and one Recorder
loop per variant below on the ``small`` model (a step of about 1 ms on 2 CPU threads), ``record``
and ``log_loss`` called, each loop running ``--block`` steps in a row per round (200 by default:
as a training loop runs, its code and data kept in the caches between its own steps), rounds in
a shuffled order, each loop on ``--copies`` copies of the model; a figure is the median over rounds
of the loop's mean step time minus the plain loop's of the same round and copy (microseconds),
the mean over copies. A variant's saving is its figure against the default's in the same run. On
this machine two identical loops differ by up to about 10 µs in a run of this length (where
their tensors and objects landed, the machine's drift over the run): a saving smaller than that
needs several runs. The variants are the options a user can set today:

* ``default``: default options.
* ``no-cotangent``: ``capture_cotangent=False`` (no ``retain_grad()`` on the output; a replay then
  needs the loss function to run the backward pass).
* ``no-early-warning``: ``on_spike=None`` (the scalar history is still kept; no bands judged).
* ``no-storage-watch``: ``copy_batch=False`` (batches kept by reference with no watch of their
  storages and versions: a loop that refills one buffer replays the wrong batch).
* ``none-of-them``: the three together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import hostcost  # noqa: E402  (bench/hostcost.py: the interleaved loop)
from nanreplay import Recorder  # noqa: E402

VARIANTS = {
    "default": {},
    "no-cotangent": {"capture_cotangent": False},
    "no-early-warning": {"on_spike": None},
    "no-storage-watch": {"copy_batch": False},
    "none-of-them": {"capture_cotangent": False, "on_spike": None, "copy_batch": False},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="timed rounds per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--block", type=hostcost.at_least_one, default=200, help="consecutive steps of each loop per round")
    p.add_argument("--runs", type=int, default=2, help="runs, each in this process")
    p.add_argument("--copies", type=int, default=2, help="model copies per loop, all interleaved (averages out where each landed in memory)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = p.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    makers = {name: (lambda m, o, out_dir, opts=VARIANTS[name]: Recorder(m, o, out_dir=out_dir, **opts)) for name in names}
    print(f"torch {torch.__version__}, {args.threads} threads, python {sys.version.split()[0]}; command: "
          f"`python bench/features.py --steps {args.steps} --warmup {args.warmup} --block {args.block} --runs {args.runs} --copies {args.copies}`")
    for r in range(args.runs):
        extra, plain = hostcost.interleave(makers, args.steps, args.warmup, args.copies, args.block)
        cost = {name: statistics.fmean(v) for name, v in extra.items()}
        base = cost.get("default")
        print(f"run {r + 1}: plain step {plain / 1e3:.2f} ms; " + ", ".join(
            f"{name} +{c:.1f} µs" + (f" ({c - base:+.1f})" if base is not None and name != "default" else "") for name, c in cost.items()),
            flush=True)


if __name__ == "__main__":
    main()
