"""What the check's fused norm costs in a training step, by how it is called, side by side.

Usage::

    python bench/normcall.py                      # 4 copies per variant, 2,000 rounds
    python bench/normcall.py --copies 6 --steps 3000

Each variant is an optimizer step pre-hook on its own copy of the ``small`` model
(``bench/models.py``: a step of about 1 ms on 2 CPU threads) that does what the Recorder's check
does with the gradients: one ``torch._foreach_norm`` over them and a host read of each norm and of
the loss. The variants differ only in how the norm is called:

* ``keyword``: ``_foreach_norm(grads, 2.0, dtype=torch.float32)`` (the Recorder before 638116b);
* ``position``: ``_foreach_norm(grads, 2.0, torch.float32)`` (the Recorder now; same kernels, same
  float32 results);
* ``none``: ``_foreach_norm(grads, 2.0)`` (no dtype: a float16 gradient would be normed in float16).

The loop is ``bench/hostcost.py``'s (:func:`hostcost.interleave`): every round runs one step of
each copy, plain ones included, in a shuffled order; a copy's figure is the median over rounds of
its step time minus the plain step time of that round and copy index, and a variant's is the mean
over its copies (identical copies differ by a few µs where their tensors landed in memory).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hostcost  # noqa: E402  (bench/hostcost.py: the interleaved loop of plain and hooked model copies)

CALLS = {
    "keyword": lambda gs: torch._foreach_norm(gs, 2.0, dtype=torch.float32),
    "position": lambda gs: torch._foreach_norm(gs, 2.0, torch.float32),
    "none": lambda gs: torch._foreach_norm(gs, 2.0),
}


class NormCheck:
    """An optimizer step pre-hook that norms the gradients with ``call`` and reads the norms and the loss."""

    def __init__(self, optimizer: torch.optim.Optimizer, call) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.call = call
        self.loss = None
        optimizer.register_step_pre_hook(self.check)

    def record(self, batch) -> None:  # the step bench/overhead.py times calls these two
        pass

    def log_loss(self, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def check(self, *hook_args) -> None:
        norms = self.call([p.grad for p in self.params if p.grad is not None])
        total = math.sqrt(math.fsum(float(n) ** 2 for n in norms))
        if not (math.isfinite(total) and math.isfinite(float(self.loss))):
            raise RuntimeError("non-finite step in the benchmark")


def _norm_check(call, model: torch.nn.Module, opt: torch.optim.Optimizer, out_dir: str) -> NormCheck:
    return NormCheck(opt, call)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="timed rounds (each: one step of every copy)")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--copies", type=int, default=4, help="model copies per variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(CALLS), help="comma-separated, of: " + ", ".join(CALLS))
    args = p.parse_args()
    variants = args.variants.split(",")
    torch.set_num_threads(args.threads)
    makers = {name: partial(_norm_check, CALLS[name]) for name in variants}
    extra, plain = hostcost.interleave(makers, args.steps, args.warmup, args.copies)
    print(f"plain step {plain:.0f} µs; the norm and its reads, per step (mean over {args.copies} copies "
          f"of each copy's median extra µs):")
    for name, per in extra.items():
        print(f"  {name:9s} +{statistics.fmean(per):5.1f} µs   (copies: {', '.join(f'{v:.1f}' for v in per)})")
    print(f"(command: python bench/normcall.py --steps {args.steps} --copies {args.copies} --variants {args.variants})")


if __name__ == "__main__":
    main()
