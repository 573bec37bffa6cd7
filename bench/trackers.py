"""What telling a tracker costs the training process, once per bundle (``log_to``): the time of
``Trackers.emit`` for one diagnosed bundle, per tracker, and the HTML report's share of it.

Nothing runs per step: the Recorder calls the trackers only when it writes a bundle or a spike
episode starts. The variants run interleaved, round by round, in one process; the figure is the
median over rounds (the first round, which imports matplotlib and the trackers, is reported apart).

    python bench/trackers.py --rounds 5

Needs the ``trackers`` and ``report`` extras; W&B runs offline, MLflow on a local file store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402


def ratio_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum() / (y > 0).sum()


def make_bundle(out: Path) -> Path:
    """One diagnosed bundle of a small MLP whose step 3 divides 0/0 in the loss."""
    from nanreplay import Recorder

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with Recorder(net, opt, loss_fn=ratio_loss, action="warn", embed_program=False, out_dir=out) as rec:
        for step in range(5):
            x, y = torch.randn(32, 64), torch.rand(32, 1) + 0.1
            if step == 3:
                y = -y
            rec.record((x, y))
            loss = ratio_loss(net, (x, y))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return rec.bundles[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nanreplay-bench-trk-"))
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"})
    import logging

    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    from nanreplay.capture.trackers import MlflowTracker, Trackers, event_from_meta
    from nanreplay.format.bundle import open_bundle

    bundle = make_bundle(tmp / "bundles")
    with open_bundle(bundle) as b:
        meta = dict(b.meta)
    writer = SummaryWriter(str(tmp / "tb"))
    run = wandb.init(project="bench", dir=str(tmp))
    client = mlflow.MlflowClient(tracking_uri=(tmp / "mlruns").as_uri())
    run_id = client.create_run(client.create_experiment("bench")).info.run_id
    variants = {
        "TensorBoard (text + scalar)": lambda: Trackers(writer),
        "W&B offline (bundle + HTML artifact)": lambda: Trackers(run),
        "MLflow file store (bundle + HTML artifacts)": lambda: Trackers(MlflowTracker(client, run_id)),
        "MLflow file store, bundle only (html=False)": lambda: Trackers(MlflowTracker(client, run_id), html=False),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):
        names = list(variants)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the order per round
        for name in names:
            trk = variants[name]()
            t0 = time.perf_counter()
            trk.emit(event_from_meta(bundle, meta))
            times[name].append(time.perf_counter() - t0)
            assert not trk.failures, trk.failures
    run.finish()
    writer.close()
    print(f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} threads; bundle {bundle.stat().st_size / 2**20:.2f} MiB; "
          f"command: python bench/trackers.py --rounds {args.rounds}")
    print("| tracker | median of rounds 2.. (s) | first round (s) |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts[1:]):.3f} | {ts[0]:.3f} |")


if __name__ == "__main__":
    main()
