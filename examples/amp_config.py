"""Two runs of one training loop that differ in one setting, the autocast dtype: float16 turns a
step non-finite, bfloat16 does not. ``nanreplay diff`` and ``nanreplay bisect --over config``
name that setting (docs/bisect.md, "Which setting?").

A small regression MLP on seeded random features, AdamW, the loss under
``torch.autocast("cpu", dtype)``. At step 22 a batch arrives unnormalised (its features 3000
times larger: a data pipeline that skipped its scaler once): the last layer's outputs reach about
1.5e5, past float16's largest finite value 65504 but well inside bfloat16's range. Under float16
the step's gradients are Inf/NaN and the Recorder writes ``nanreplay-step22.h5`` (``action="warn"``:
the run goes on); under bfloat16 the step is finite, a spike of the loss, and ``on_spike="dump"``
writes ``nanreplay-spike-step22.h5``: the healthy run's record of the same step. Then:

    python examples/amp_config.py --dtype float16 --out-dir runs/fp16
    python examples/amp_config.py --dtype bfloat16 --out-dir runs/bf16
    nanreplay diff runs/fp16/nanreplay-step22.h5 runs/bf16/nanreplay-spike-step22.h5
    nanreplay bisect runs/fp16/nanreplay-step22.h5 --over config
    nanreplay bisect runs/fp16/nanreplay-step22.h5 --over config --against runs/bf16/nanreplay-spike-step22.h5

Needs only torch. Runs in a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import Recorder

#: the step whose batch arrives unnormalised, and how much larger its features are
BAD_STEP, SCALE = 22, 3e3


class Regressor(nn.Module):
    """(B, 8) float32 features -> (B, 1) predictions."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_model() -> nn.Module:
    return Regressor()


def step_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="the autocast dtype")
    p.add_argument("--out-dir", default="runs/amp", help="where the bundles go")
    p.add_argument("--steps", type=int, default=BAD_STEP + 1)
    p.add_argument("--scale", type=float, default=SCALE, help="how much larger step 22's features are")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = getattr(torch, args.dtype)
    with Recorder(model, opt, loss_fn=step_loss, model_factory=make_model, out_dir=args.out_dir, action="warn", on_spike="dump",
                  diagnose=False) as rec:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if step == BAD_STEP:
                x = x * args.scale
            rec.record((x, y))
            with torch.autocast("cpu", dtype=dtype):
                loss = step_loss(model, (x, y))
            rec.log_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    written = sorted(Path(args.out_dir).glob("nanreplay-*.h5"))
    print(f"{args.dtype}: non-finite steps {rec.nonfinite_steps or 'none'}; bundles: {', '.join(map(str, written)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
