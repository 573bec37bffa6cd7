"""DDP for real: two gloo processes on the CPU, a NaN born on rank 1 only."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import models
from helpers import run_ranks
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay
from nanreplay.cli import main
from nanreplay.core.digest import grads_nonfinite

pytestmark = pytest.mark.slow

WORLD = 2
BAD_RANK, BAD_STEP = 1, 2
JOIN_TIMEOUT_S = 90


def _worker(rank: int, world: int, store: str, out: str, actions: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        for action in actions:  # one process group, one fresh model and Recorder per scenario
            _scenario(rank, str(Path(out, action)), action)
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, out: str, action: str) -> None:
    result: dict = {"rank": rank, "steps_done": 0}
    try:
        model = models.make_ratio()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
        with Recorder(ddp, opt, loss_fn=models.mean_loss, model_factory=models.make_ratio, out_dir=out, action=action) as rec:
            try:
                for step in range(5):
                    x = torch.randn(6, 8, generator=g)
                    if rank == BAD_RANK and step == BAD_STEP:
                        x[3] = 0.0  # a padding row: 0 / 0 in norm on this rank only
                    batch = {"x": x}
                    rec.record(batch)
                    loss = models.mean_loss(ddp, batch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    result["steps_done"] += 1
                    result.setdefault("param_after", {})[step] = float(model.head.weight.detach().sum())
            except NonFiniteGradientError as e:
                result.update(error_step=e.step, bundle=e.bundle_path, summary=(e.diagnosis or {}).get("summary"))
            result["origin_ranks"] = rec.dist.origin_ranks
            result["nonfinite_steps"] = rec.nonfinite_steps
            result["bundles"] = [str(p) for p in rec.bundles]
            result["hooked"] = rec.dist.hooked
        dist.barrier()  # every rank reaches here: nobody was left waiting in a collective
    finally:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"result{rank}.json").write_text(json.dumps(result))


def _run(tmp: Path, actions: list[str]) -> dict[str, list[dict]]:
    out = tmp / "bundles"
    run_ranks(_worker, (WORLD, str(tmp / "store"), str(out), actions), WORLD, JOIN_TIMEOUT_S, ": a rank hangs in a collective")
    return {a: [json.loads((out / a / f"result{r}.json").read_text()) for r in range(WORLD)] for a in actions}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ddp"), ["raise", "skip"])


@pytest.fixture(scope="module")
def raised(runs):
    return runs["raise"]


def test_both_ranks_stop_in_the_same_step(raised):
    assert [r["error_step"] for r in raised] == [BAD_STEP, BAD_STEP]
    assert [r["steps_done"] for r in raised] == [BAD_STEP, BAD_STEP]
    assert all(r["hooked"] for r in raised)


def test_rank1_is_named_origin_on_every_rank(raised):
    assert [r["origin_ranks"] for r in raised] == [[BAD_RANK], [BAD_RANK]]
    assert "[born on rank 1 of 2, before the gradient all-reduce]" in raised[1]["summary"]
    assert "came from rank(s) [1]" in raised[0]["summary"]


def test_each_rank_writes_its_own_bundle_with_rank_metadata(raised):
    for r in raised:
        path = Path(r["bundle"])
        assert path.name == f"nanreplay-step{BAD_STEP}-rank{r['rank']}of{WORLD}.h5"
        with open_bundle(path) as b:
            assert (b.meta["rank"], b.meta["world_size"]) == (r["rank"], WORLD)
            assert b.meta["distributed"]["origin_ranks"] == [BAD_RANK]
            assert b.meta["distributed"]["grads"] == "local"
            grads = b.grads()
        finite = not grads_nonfinite(grads)
        # the bundle holds the rank-local gradients, from before the all-reduce averaged the NaN in
        assert finite == (r["rank"] != BAD_RANK)


def test_origin_bundle_replays_on_one_process_and_reproduces(raised):
    assert not dist.is_initialized()
    diag = replay(raised[BAD_RANK]["bundle"])
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert diag["phase"] == "forward"
    assert diag["origin"]["module"] == "norm"
    other = replay(raised[0]["bundle"])
    assert other["phase"] == "none"  # rank 0's own step is finite
    assert other["reproduction"]["verdict"] == "reproduced exactly"


def test_inspect_on_rank_bundles_names_the_first_rank(raised):
    paths = [r["bundle"] for r in raised]
    res = CliRunner().invoke(main, ["inspect", "--no-keys", *paths])
    assert res.exit_code == 0, res.output
    assert f"first non-finite step {BAD_STEP}: born on rank(s) [1] before the gradient all-reduce" in res.output
    res = CliRunner().invoke(main, ["inspect", "--json", "--no-keys", *paths])
    info = json.loads(res.output)
    assert info["ranks"]["origin_ranks"] == [BAD_RANK]
    assert [b["rank"] for b in info["bundles"]] == [0, 1]


def test_skip_is_agreed_and_keeps_ranks_in_step(runs):
    res = runs["skip"]
    # both ranks skipped the same step and went on; their weights stay identical
    assert [r["nonfinite_steps"] for r in res] == [[BAD_STEP], [BAD_STEP]]
    assert [r["steps_done"] for r in res] == [5, 5]
    assert res[0]["param_after"] == res[1]["param_after"]
    assert res[0]["param_after"][str(BAD_STEP)] == res[0]["param_after"][str(BAD_STEP - 1)]
