"""Under torchrun for real: two gloo workers on the CPU, a NaN born on rank 1, whose bundle takes
seconds to write. Every rank's bundle is kept, and torchrun's "Root Cause" names rank 1 with the
origin's message (its error file, written first), not the clean rank that would have raised first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")]

TESTS = Path(__file__).resolve().parents[1]
_SCRIPT = '''import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["MODELS_DIR"])
import models
import nanreplay.capture.dump as dump_mod
from nanreplay import Recorder

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:  # the origin's bundle takes seconds to write
    write = dump_mod.write_bundle
    def slow(path, content, **kw):
        time.sleep(2.0)
        return write(path, content, **kw)
    dump_mod.write_bundle = slow
torch.set_num_threads(1)
model = models.make_ratio()
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)
with Recorder(ddp, opt, loss_fn=models.mean_loss, out_dir=os.environ["OUT"], embed_program=False) as rec:
    for step in range(4):
        x = torch.randn(6, 8, generator=g)
        if rank == 1 and step == 2:
            x[3] = 0.0
        batch = {"x": x}
        rec.record(batch)
        loss = models.mean_loss(ddp, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_torchrun_keeps_every_bundle_and_names_the_origin_rank_as_root_cause(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "bundles"
    env = {**os.environ, "MODELS_DIR": str(TESTS), "OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["nanreplay-step2-rank0of2.h5", "nanreplay-step2-rank1of2.h5"]
    root = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root), root
    assert "[rank 1 of 2: the origin: non-finite values born on this rank, before the gradient all-reduce]" in root
