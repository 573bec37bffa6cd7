"""A real training run that dies with loss = nan, recorded and diagnosed by nanreplay.

Data: scikit-learn's digits (1797 8x8 images, 10 classes; ships with scikit-learn, no download).
Model: a small CNN. Loss: class-balanced binary cross-entropy, which divides each class's summed
BCE by that class's count in the batch -- a well-known real bug: a batch that misses a class
computes 0/0 = NaN, and the NaN reaches every gradient.

The model's forward pass is finite; the NaN is born in the loss. The Recorder catches the first
non-finite gradient, writes a bundle, diagnoses it in process and raises. Then:

    python examples/digits_nan.py --out-dir runs/digits
    nanreplay replay runs/digits/nanreplay-step*.h5
    nanreplay report runs/digits/nanreplay-step*.h5 -o runs/digits/report.html   # needs the report extra

Needs the ``examples`` extra (scikit-learn). Runs in a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NonFiniteGradientError, Recorder


class DigitsCNN(nn.Module):
    """(B, 1, 8, 8) float32 images -> (B, 10) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_model() -> nn.Module:
    """The model factory replay uses to rebuild the architecture."""
    return DigitsCNN()


def class_balanced_bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample BCE against one-hot targets, summed per class, divided by the class's count
    in the batch, averaged over classes. The bug: a class absent from the batch gives 0/0."""
    onehot = F.one_hot(y, 10).float()
    bce = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none").sum(1)
    per_class = (bce.unsqueeze(1) * onehot).sum(0)  # (10,) summed BCE of each class's samples
    counts = onehot.sum(0)                            # (10,) samples of each class in the batch
    return (per_class / counts).mean()


def step_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """loss_fn(model, batch) -> loss: what replay calls to re-run the whole step."""
    x, y = batch
    return class_balanced_bce(model(x), y)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.long)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="runs/digits", help="where the bundle goes")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["h5", "safetensors"], default="h5")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    x, y = load_digits()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    # capacity=32 keeps the whole short run (29 steps of 64 tiny images) in the ring buffer, so
    # `nanreplay report` draws the loss and grad norm of every step before the failure
    with Recorder(model, opt, loss_fn=step_loss, model_factory=make_model, out_dir=args.out_dir, bundle_format=args.format, capacity=32) as rec:
        try:
            for epoch in range(args.epochs):
                for xb, yb in loader:
                    rec.record((xb, yb))
                    loss = step_loss(model, (xb, yb))
                    rec.log_loss(loss)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                print(f"epoch {epoch}: loss {loss.item():.4f}")
        except NonFiniteGradientError as e:
            print(f"training stopped at step {e.step}: {e}")
            print(f"bundle: {e.bundle_path}")
            print(f"replay it with:  nanreplay replay {e.bundle_path}")
            return 0
    print("no non-finite step in this run")
    return 1


if __name__ == "__main__":
    sys.exit(main())
