"""What the Recorder costs a DDP training loop: the plain loop and the recorded loops, interleaved.

Two gloo ranks on the CPU (spawned here; no torchrun needed). Each rank builds one
``DistributedDataParallel`` model per variant, all with the same weights (AdamW), on the same
process group:

* ``plain``: DDP as torch builds it (its C++ all-reduce);
* ``python_hook``: DDP with torch's own Python ``allreduce_hook`` registered (what any Python comm
  hook costs, for reference);
* ``recorder``: the same model under a ``Recorder`` with default options;
* ``recorder_no_origin``: ``Recorder(origin_hook=False)`` (no origin detection: logged and recorded);
* ``recorder_fp16``: the user's ``fp16_compress_hook`` registered after the Recorder, which wraps it
  (its ``plain_fp16`` twin is the reference for that ratio).

Each round runs one step of every variant, in an order that rotates per round; the figure is the
median over rounds of the per-round ratio variant / plain (rank 0's times; the collectives keep the
ranks in step), with the interquartile range: of the wall-clock step time, and of the CPU time the
rank's process spent in the step (``time.process_time``, all its threads), which a machine shared
with other jobs disturbs less.

    python bench/ddp.py                              # width 512, depth 4, 40 rounds
    python bench/ddp.py --width 1024 --rounds 60 --json bench/results_ddp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

VARIANTS = ("plain", "python_hook", "recorder", "recorder_no_origin", "plain_fp16", "recorder_fp16")


class Net(nn.Module):
    """``depth`` blocks of Linear + ReLU between a projection and a head."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.proj(x)))


def _build(name: str, d: int, depth: int, out: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from nanreplay import Recorder

    torch.manual_seed(0)
    model = Net(d, depth)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    rec = None
    if name == "python_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if name == "plain_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if name.startswith("recorder"):
        rec = Recorder(ddp, opt, out_dir=out, origin_hook=name != "recorder_no_origin")
    if name == "recorder_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # after the Recorder: it wraps it
    return ddp, opt, rec


def _step(model, opt, x, rec) -> None:
    loss = model(x).pow(2).mean()
    if rec is not None:
        rec.log_loss(loss)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    d, depth, rounds, batch = args["width"], args["depth"], args["rounds"], args["batch"]
    names = args["variants"]
    runs = {n: _build(n, d, depth, str(Path(out, n))) for n in names}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args["warmup"] + rounds):
        x = torch.randn(batch, d, generator=g)
        k = r % len(names)
        for n in names[k:] + names[:k]:
            model, opt, rec = runs[n]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(model, opt, x, rec)
            if r >= args["warmup"]:
                times[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
    held = {n: rec.held_bytes() for n, (_, _, rec) in runs.items() if rec is not None}
    for _, _, rec in runs.values():
        if rec is not None:
            rec.close()
    params = sum(p.numel() for p in runs[names[0]][0].parameters())
    Path(out, f"bench{rank}.json").write_text(json.dumps({"rank": rank, "times": times, "cpu": cpu, "held_bytes": held, "params": params}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, among {', '.join(VARIANTS)}")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose among {', '.join(VARIANTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, str(Path(tmp, "store")), tmp, {**vars(a), "variants": names}), nprocs=2, start_method="spawn")
        res = [json.loads(Path(tmp, f"bench{r}.json").read_text()) for r in range(2)]
    t, c = res[0]["times"], res[0]["cpu"]
    base = {n: ("plain_fp16" if n == "recorder_fp16" and "plain_fp16" in t else "plain") for n in names}
    rows = {}
    for n in names:
        ratios = [v / p for v, p in zip(t[n], t[base[n]])]
        cpu_ratios = [v / p for v, p in zip(c[n], c[base[n]]) if p > 0]
        q, qc = statistics.quantiles(ratios, n=4), statistics.quantiles(cpu_ratios, n=4)
        rows[n] = {"step_ms": statistics.median(t[n]) * 1e3, "baseline": base[n], "ratio_median": statistics.median(ratios), "ratio_iqr": [q[0], q[2]],
                   "cpu_ms": statistics.median(c[n]) * 1e3, "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_iqr": [qc[0], qc[2]]}
    out = {"torch": torch.__version__, "machine": f"{cpu_name()}, {os.cpu_count()} cores, 1 thread per rank",
           "model": {"params": res[0]["params"], "width": a.width, "depth": a.depth, "batch": a.batch}, "rounds": a.rounds,
           "variants": rows, "held_bytes": res[0]["held_bytes"]}
    print(f"torch {out['torch']}, {out['machine']}; DDP on 2 gloo ranks, {out['model']['params'] / 1e6:.2f} M params, "
          f"{a.rounds} interleaved rounds")
    for n, row in rows.items():
        print(f"{n:>20}: wall {row['step_ms']:7.2f} ms  {row['ratio_median']:.3f}x of {row['baseline']} "
              f"[{row['ratio_iqr'][0]:.2f}-{row['ratio_iqr'][1]:.2f}]   CPU {row['cpu_ms']:7.2f} ms  {row['cpu_ratio_median']:.3f}x "
              f"[{row['cpu_ratio_iqr'][0]:.2f}-{row['cpu_ratio_iqr'][1]:.2f}]")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
