"""Recorder.close() undoes what it did to a DDP model: module, parameter (post-accumulate-grad) and
optimizer hooks are removed, so the end-of-backward origin watch checks and keeps nothing more and
every gradient is DDP's own, on close() and when the ``with`` block raises. Two gloo processes on
the CPU."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import models
from helpers import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")]

WORLD = 2
JOIN_TIMEOUT_S = 90


def _hooks(*modules: torch.nn.Module) -> int:
    return (sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) for mod in modules for m in mod.modules())
            + sum(len(p._post_accumulate_grad_hooks or {}) for mod in modules for p in mod.parameters()))


def _train(ddp, opt, steps: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        loss = ddp(torch.randn(6, 8, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _scenario(rank: int, how: str) -> dict:
    from nanreplay import Recorder
    from nanreplay.capture.ddp import RankContext

    calls = {"n": 0}
    original = RankContext._backward_done

    def counting(self):  # counts the origin watch's work at the end of each backward
        calls["n"] += 1
        return original(self)

    RankContext._backward_done = counting
    try:
        model = models.make_mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        before = (_hooks(ddp), len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
        out: dict = {"before": before}
        if how == "close":
            rec = Recorder(ddp, opt, out_dir=f"/tmp/unused-{os.getpid()}", diagnose=False)
            _train(ddp, opt, 2, gen)
            out["hooked"], out["calls_open"] = rec.dist.hooked, calls["n"]
            # the kept local gradient tensors (they take the next step's reduced values) count against memory_budget
            counted = rec.ring._kept.get("ddp_local_grads")
            out["counted"] = [counted.nbytes() if counted else None, sum(p.numel() * 4 for p in model.parameters())]
            rec.close()
            rec.close()  # idempotent
        else:
            try:
                with Recorder(ddp, opt, out_dir=f"/tmp/unused-{os.getpid()}", diagnose=False) as rec:
                    _train(ddp, opt, 2, gen)
                    out["hooked"], out["calls_open"] = rec.dist.hooked, calls["n"]
                    raise KeyError("the loop's own error")
            except KeyError:
                out["raised"] = True
        n = calls["n"]
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _train(ddp, opt, 3, gen)
        out["calls_after"] = calls["n"] - n
        out["kept_after"] = [len(rec.dist._kept), len(rec.dist._pool), rec.dist._local_bad is not None, "ddp_local_grads" in rec.ring._kept]
        out["after"] = (_hooks(ddp), len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
        out["ring_steps"] = len(rec.ring)
        # gradients are still averaged across ranks by DDP: weights stay equal
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        out["ranks_agree"] = all(torch.equal(gathered[0], g) for g in gathered)
        out["trained"] = any(not torch.equal(ref[k], v) for k, v in model.state_dict().items())
        return out
    finally:
        RankContext._backward_done = original


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    results = {}
    try:
        for how in ("close", "exception"):
            results[how] = _scenario(rank, how)
            dist.barrier()
    except Exception as e:  # noqa: BLE001 - handed to the test
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ddp_close")
    run_ranks(_worker, (str(tmp / "store"), str(tmp)), WORLD, JOIN_TIMEOUT_S)
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r.get("error") for r in results] == [None] * WORLD
    return results


@pytest.mark.parametrize("how", ["close", "exception"])
def test_close_removes_every_hook_and_the_origin_watch(ranks, how):
    for r in ranks:
        res = r[how]
        assert res["hooked"] and res["calls_open"] > 0  # the origin watch was working while open
        assert res["after"] == res["before"]  # module, parameter and optimizer hooks: all removed
        assert res["calls_after"] == 0 and res["kept_after"] == [0, 0, False, False]  # checks, keeps and counts nothing
        assert res["ring_steps"] <= 2  # the ring stopped growing at close
        assert res["trained"] and res["ranks_agree"]  # DDP still averages gradients
    if how == "exception":
        assert all(r[how]["raised"] for r in ranks)
    else:
        assert all(r[how]["counted"][0] == r[how]["counted"][1] for r in ranks)
