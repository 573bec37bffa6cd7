"""What :class:`~nanreplay.integrations.lightning.NanReplayCallback` costs a Lightning fit, per batch and per fit.

Usage::

    python bench/lightning_cost.py                      # 6 fits of each kind, 600 steps each
    python bench/lightning_cost.py --fits 10 --steps 300

Method. The ``small`` model of ``bench/models.py`` (an MLP whose plain step takes about 1 ms on
2 CPU threads, where a fixed host cost shows) is trained by ``lightning.Trainer`` (CPU, one
device, no logger, no checkpointing, no progress bar, AdamW) on 64 fixed batches, in fits that
alternate between a plain one and one with ``NanReplayCallback`` (default options: the callback
records each batch, logs the loss and checks the gradients before the optimizer step), the order
flipped every round. Per batch: a timing callback placed first in the list starts a clock in
``on_train_batch_start`` and one placed last stops it in ``on_train_batch_end``, so the span holds
the callback's own hooks, the training step, the backward pass and the optimizer step; a fit's
figure is the median over its batches after the first 50, and the figure quoted is the median
over fits of the difference with the plain fit of the same round (microseconds). Per fit: the
wall time of ``trainer.fit`` (start-up included), the median over rounds of the ratio.

Needs ``lightning`` (``pip install lightning``; not a dependency of nanreplay).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402  (bench/models.py)

SKIP = 50  # batches of each fit left out of its median (the first steps warm up)


def fit_once(pl, callback, steps: int, batches: list) -> tuple[float, float]:
    """One fit of ``steps`` steps: (median batch time in µs past the first :data:`SKIP`, wall time of ``trainer.fit`` in s)."""
    factory, _, loss_fn = models.spec("small")
    times: list[int] = []

    class Start(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):  # noqa: ANN001  (Lightning's hook)
            self.t0 = time.perf_counter_ns()

    start = Start()

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):  # noqa: ANN001
            times.append(time.perf_counter_ns() - start.t0)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = factory()

        def training_step(self, batch, i):  # noqa: ANN001
            x, y = batch
            return loss_fn(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=tempfile.mkdtemp(),
                         callbacks=[start, *([callback] if callback is not None else []), Stop()])
    t0 = time.perf_counter()
    trainer.fit(Module(), loader)
    return statistics.median(times[SKIP:]) / 1e3, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fits", type=int, default=6, help="rounds, each one plain fit and one with the callback")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per fit (more than %d)" % SKIP)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.steps <= SKIP:
        p.error(f"--steps must be more than {SKIP} (the first {SKIP} batches of a fit are left out); got {args.steps}")
    try:
        import lightning
        import lightning.pytorch as pl
    except ImportError:
        sys.exit("bench/lightning_cost.py needs Lightning: pip install lightning")
    from nanreplay.integrations.lightning import NanReplayCallback

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    _, make_batch, _ = models.spec("small")
    batches = [make_batch(torch.Generator().manual_seed(i), torch.device("cpu")) for i in range(64)]
    plain, hooked = [], []
    for r in range(args.fits):
        for kind in (("plain", "callback") if r % 2 == 0 else ("callback", "plain")):
            cb = NanReplayCallback(out_dir=tempfile.mkdtemp()) if kind == "callback" else None
            (hooked if cb is not None else plain).append(fit_once(pl, cb, args.steps, batches))
        print(f"round {r + 1}/{args.fits}: plain batch {plain[-1][0]:.0f} µs, with the callback {hooked[-1][0]:.0f} µs", file=sys.stderr, flush=True)
    diff = statistics.median(h[0] - q[0] for q, h in zip(plain, hooked))
    ratio = statistics.median(h[0] / q[0] for q, h in zip(plain, hooked))
    fit_ratio = statistics.median(h[1] / q[1] for q, h in zip(plain, hooked))
    print(f"torch {torch.__version__}, lightning {lightning.__version__}, {args.threads} threads, python {sys.version.split()[0]}; "
          f"command: `python bench/lightning_cost.py --fits {args.fits} --steps {args.steps}`")
    print(f"per batch: plain {statistics.median(q[0] for q in plain):.0f} µs, with NanReplayCallback "
          f"{statistics.median(h[0] for h in hooked):.0f} µs: +{diff:.0f} µs ({ratio:.3f}x)")
    print(f"per fit of {args.steps} steps: plain {statistics.median(q[1] for q in plain):.2f} s, with NanReplayCallback "
          f"{statistics.median(h[1] for h in hooked):.2f} s ({fit_ratio:.3f}x, start-up included)")


if __name__ == "__main__":
    main()
