"""What the Recorder costs an FSDP2 training loop, and how large each rank's bundle is.

Two gloo ranks on the CPU (spawned here; no torchrun needed). Each rank builds two identical
FSDP2 models (``fully_shard`` on every block and the root, AdamW): the plain loop and the loop under
a ``Recorder``. Each round runs one step of each, in an order that alternates per round; the
figure is the median over rounds of the per-round ratio recorded / plain (rank 0's times; the
collectives keep the ranks in step), of the wall-clock step time and of the CPU time the rank's
process spent in the step (``time.process_time``), which a machine shared with other jobs disturbs
less. Then a zero row in rank 1's batch makes a NaN, both ranks
dump, and the bundle sizes are set beside the shard bytes each rank holds (weights + AdamW state).

    python bench/fsdp.py                 # 2 ranks, width 256, depth 4, 40 rounds
    python bench/fsdp.py --width 512 --rounds 60 --json bench/results_fsdp.json
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


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """``depth`` blocks, then a row normalisation (a zero row gives 0/0 = NaN), then a head."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h / h.abs().sum(-1, keepdim=True)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _build(d: int, depth: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(d, depth)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, x) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _worker(rank: int, world: int, store: str, out: str, args: dict) -> None:
    from nanreplay import NonFiniteGradientError, Recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    d, depth, rounds, batch = args["width"], args["depth"], args["rounds"], args["batch"]
    plain, plain_opt = _build(d, depth)
    rec_model, rec_opt = _build(d, depth)
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"plain": [], "recorder": []}
    cpu: dict[str, list[float]] = {"plain": [], "recorder": []}
    bundles: list[str] = []
    with Recorder(rec_model, rec_opt, out_dir=out, action="raise", origin_hook=not args["no_origin_hook"]) as rec:
        for r in range(args["warmup"] + rounds):
            x = torch.randn(batch, d, generator=g)
            order = [("plain", plain, plain_opt), ("recorder", rec_model, rec_opt)]
            for name, m, o in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                _step(m, o, x)
                if r >= args["warmup"]:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        held = rec.held_bytes()
        x = torch.randn(batch, d, generator=g)
        if rank == 1:
            x[0] = 0.0
        try:
            _step(rec_model, rec_opt, x)
        except NonFiniteGradientError:
            bundles = [str(p) for p in rec.bundles]
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in rec_model.parameters())
    state_bytes = sum(v.to_local().numel() * v.element_size() for st in rec_opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and hasattr(v, "to_local"))
    res = {"rank": rank, "times": times, "cpu": cpu, "held_bytes": held, "shard_bytes": shard_bytes, "optimizer_shard_bytes": state_bytes,
           "bundle_bytes": [os.path.getsize(p) for p in bundles], "params": sum(p.numel() for p in rec_model.parameters())}
    Path(out, f"bench{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-origin-hook", action="store_true", help="Recorder(origin_hook=False): no wrapped reduce-scatter")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, str(Path(tmp, "store")), tmp, vars(a)), nprocs=2, start_method="spawn")
        res = [json.loads(Path(tmp, f"bench{r}.json").read_text()) for r in range(2)]
    t, c = res[0]["times"], res[0]["cpu"]
    ratios = [r / p for r, p in zip(t["recorder"], t["plain"])]
    q = statistics.quantiles(ratios, n=4)
    cpu_ratios = [r / p for r, p in zip(c["recorder"], c["plain"]) if p > 0]
    qc = statistics.quantiles(cpu_ratios, n=4)
    out = {
        "torch": torch.__version__, "machine": f"{cpu_name()}, {os.cpu_count()} cores, 1 thread per rank",
        "model": {"params": res[0]["params"], "width": a.width, "depth": a.depth, "batch": a.batch}, "rounds": a.rounds,
        "plain_step_ms": statistics.median(t["plain"]) * 1e3, "recorder_step_ms": statistics.median(t["recorder"]) * 1e3,
        "ratio_median": statistics.median(ratios), "ratio_iqr": [q[0], q[2]],
        "plain_cpu_ms": statistics.median(c["plain"]) * 1e3, "recorder_cpu_ms": statistics.median(c["recorder"]) * 1e3,
        "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_iqr": [qc[0], qc[2]],
        "ranks": [{k: r[k] for k in ("rank", "held_bytes", "shard_bytes", "optimizer_shard_bytes", "bundle_bytes")} for r in res],
    }
    print(f"torch {out['torch']}, {out['machine']}; FSDP2 on 2 gloo ranks, {out['model']['params'] / 1e6:.2f} M params, "
          f"{a.rounds} interleaved rounds")
    print(f"plain step {out['plain_step_ms']:.2f} ms, with the Recorder {out['recorder_step_ms']:.2f} ms: "
          f"{out['ratio_median']:.3f}x [{q[0]:.2f}-{q[2]:.2f}]; CPU time {out['plain_cpu_ms']:.2f} ms vs {out['recorder_cpu_ms']:.2f} ms: "
          f"{out['cpu_ratio_median']:.3f}x [{qc[0]:.2f}-{qc[2]:.2f}]")
    for r in out["ranks"]:
        print(f"rank {r['rank']}: shards {r['shard_bytes'] / 2**20:.2f} MiB weights + {r['optimizer_shard_bytes'] / 2**20:.2f} MiB AdamW "
              f"state; bundle {[round(b / 2**20, 2) for b in r['bundle_bytes']]} MiB; the Recorder held {r['held_bytes'] / 2**20:.2f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
