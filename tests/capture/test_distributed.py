"""DDP for real: two gloo processes on the CPU, a NaN born on rank 1 only.

Scenarios share one process group (each a fresh model and Recorder): the plain raise and skip;
the user's ``fp16_compress_hook`` registered before and after the Recorder; ``origin_hook=False``;
an Inf written into rank 1's replica between steps (silent corruption); an origin rank whose bundle
takes seconds to write, under a simulated torchrun (``TORCHELASTIC_ERROR_FILE``); one that takes
longer than ``dump_barrier_timeout``; FSDP1 refused."""

from __future__ import annotations

import datetime
import json
import os
import time
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
JOIN_TIMEOUT_S = 150
#: scenario -> what differs from the plain run (a zero row in rank 1's batch at BAD_STEP, action="raise")
SCENARIOS = {
    "raise": {},
    "skip": {"action": "skip"},
    "fp16_before": {"hook": "before"},
    "fp16_after": {"hook": "after"},
    "no_origin": {"origin_hook": False},
    "corrupt": {"corrupt": True},
    "slow": {"slow_s": 2.0, "torchrun": True},
    "stuck": {"slow_s": 2.5, "timeout": 1.0},
    # two micro-batches a step, the first one's forward under no_sync() and its backward outside it;
    # the zero row is in rank 1's first micro-batch; a plain DDP twin trains beside it
    "accumulate": {"accumulate": True},
    "view": {"view": True},  # gradient_as_bucket_view=True: each gradient flagged as it is accumulated
}
_SCRIPT = '''import models
print("the training script runs at import")
def make():
    return models.make_ratio()
'''


def _worker(rank: int, world: int, store: str, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        for name in names:  # one process group, one fresh model and Recorder per scenario
            _scenario(rank, Path(out, name), SCENARIOS[name])
            dist.barrier()  # every rank reaches here: nobody was left waiting in a collective
        _fsdp1(rank, Path(out))
    finally:
        dist.destroy_process_group()


class _Logs(list):
    def __init__(self) -> None:
        super().__init__()
        import logging

        self.handler = logging.Handler()
        self.handler.emit = lambda r: self.append(r.getMessage())  # type: ignore[method-assign]


def _scenario(rank: int, out: Path, spec: dict) -> None:
    import logging

    import nanreplay.capture.dump as dump_mod
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"rank": rank, "steps_done": 0}
    logs = _Logs()  # nanreplay's log lines on this rank
    logging.getLogger("nanreplay").addHandler(logs.handler)
    write = dump_mod.write_bundle
    error_file = out / f"error{rank}.json"
    if spec.get("torchrun"):
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    if spec.get("slow_s") and rank == BAD_RANK:
        def slow_write(path, content, **kw):  # the origin's bundle takes seconds to write
            time.sleep(spec["slow_s"])
            return write(path, content, **kw)

        dump_mod.write_bundle = slow_write
    try:
        script = out / "train_script.py"
        script.write_text(_SCRIPT)
        model = models.make_ratio()
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bool(spec.get("view")))
        twin = torch.nn.parallel.DistributedDataParallel(models.make_ratio())
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        if spec.get("hook") == "before":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
        with Recorder(ddp, opt, loss_fn=models.mean_loss, model_factory=f"{script}:make", out_dir=out, action=spec.get("action", "raise"),
                      origin_hook=spec.get("origin_hook", True), dump_barrier_timeout=spec.get("timeout", 300.0)) as rec:
            if spec.get("hook") == "after":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            try:
                for step in range(5):
                    x = torch.randn(6, 8, generator=g)
                    if step == BAD_STEP and spec.get("corrupt"):
                        if rank == BAD_RANK:
                            with torch.no_grad():
                                model.proj.weight[1, 2] = float("inf")  # rank 1's replica only: a silent corruption
                    elif rank == BAD_RANK and step == BAD_STEP:
                        x[1 if spec.get("accumulate") else 3] = 0.0  # a padding row: 0 / 0 in norm on this rank only
                    batch = {"x": x}
                    if spec.get("accumulate"):
                        _accumulate(ddp, opt, rec, x, (twin, twin_opt) if step != BAD_STEP else None, result)
                        continue
                    rec.record(batch)
                    loss = models.mean_loss(ddp, batch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    result["steps_done"] += 1
                    result.setdefault("param_after", {})[step] = float(model.head.weight.detach().sum())
            except NonFiniteGradientError as e:
                result.update(error_step=e.step, bundle=e.bundle_path, summary=(e.diagnosis or {}).get("summary"), message=str(e),
                              raised_at=time.time(), sibling_written=[Path(out, f"nanreplay-step{BAD_STEP}-rank{r}of{WORLD}.h5").exists()
                                                                      for r in range(WORLD)])
            result.update(origin_ranks=rec.dist.origin_ranks, nonfinite_steps=rec.nonfinite_steps, bundles=[str(p) for p in rec.bundles],
                          hooked=rec.dist.hooked)
    finally:
        dump_mod.write_bundle = write
        os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
        logging.getLogger("nanreplay").removeHandler(logs.handler)
        result["logs"] = list(logs)
        result["error_file"] = json.loads(error_file.read_text()) if error_file.exists() else None
        Path(out, f"result{rank}.json").write_text(json.dumps(result))


def _accumulate(ddp, opt, rec, x, twin, result: dict) -> None:
    """One step of two micro-batches, the first one's forward under ``no_sync()`` and its backward
    outside it; the same on the plain DDP ``twin`` (model, optimizer), when given."""
    halves = [{"x": x[:3]}, {"x": x[3:]}]
    for m, o in ((twin, (ddp, opt)) if twin is not None else ((ddp, opt),)):
        o.zero_grad()
        for i, b in enumerate(halves):
            if m is ddp:
                rec.record(b)
            if i == 0:
                with m.no_sync():
                    loss = models.mean_loss(m, b)
            else:
                loss = models.mean_loss(m, b)
            loss.backward()
        o.step()
    result["steps_done"] += 1
    result.setdefault("same_as_twin", []).append(all(torch.equal(a, b) for a, b in zip(ddp.parameters(), twin[0].parameters())))


def _fsdp1(rank: int, out: Path) -> None:
    """FSDP1 is refused at construction, naming it and FSDP2's fully_shard; the loop then trains."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(models.make_ratio(), device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    res: dict = {}
    try:
        Recorder(model, opt, out_dir=out / "fsdp1")
    except TypeError as e:
        res["refused"] = str(e)
    for _ in range(2):
        loss = model(torch.randn(6, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        res.setdefault("losses", []).append(float(loss))
    Path(out, f"fsdp1-{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "bundles"
    names = list(SCENARIOS)
    run_ranks(_worker, (WORLD, str(tmp / "store"), str(out), names), WORLD, JOIN_TIMEOUT_S, ": a rank hangs in a collective")
    res = {n: [json.loads((out / n / f"result{r}.json").read_text()) for r in range(WORLD)] for n in names}
    res["fsdp1"] = [json.loads((out / f"fsdp1-{r}.json").read_text()) for r in range(WORLD)]
    res["out"] = out
    return res


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
    # each rank's console line says its part
    assert "[rank 1 of 2: the origin: non-finite values born on this rank, before the gradient all-reduce]" in raised[1]["message"]
    assert "[rank 0 of 2: clean: its own values were finite; the origin is rank(s) [1]]" in raised[0]["message"]


def test_each_rank_writes_its_own_bundle_with_rank_metadata(raised):
    for r in raised:
        path = Path(r["bundle"])
        assert path.name == f"nanreplay-step{BAD_STEP}-rank{r['rank']}of{WORLD}.h5"
        with open_bundle(path) as b:
            d = b.meta["distributed"]
            assert (b.meta["rank"], b.meta["world_size"]) == (r["rank"], WORLD)
            assert d["origin_ranks"] == [BAD_RANK] and d["rank_flags"] == [0, 1]
            assert d["clean"] is (r["rank"] != BAD_RANK)
            assert d["detection"]["on"] and d["detection"]["this_step"] and d["grads"] == "local"
            assert d["siblings"] == [f"nanreplay-step{BAD_STEP}-rank{k}of{WORLD}.h5" for k in range(WORLD)] and d["run_id"]
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


def test_replay_of_the_directory_picks_the_origin_rank_bundle_and_its_program(runs):
    out = runs["out"] / "raise"
    # the clean rank's bundle is the newest file: the directory still replays the origin's
    os.utime(out / f"nanreplay-step{BAD_STEP}-rank0of{WORLD}.h5")
    res = CliRunner().invoke(main, ["replay", "--json", "--no-samples", str(out)])
    assert res.exit_code == 0, res.output
    diag = json.loads(res.output)
    assert diag["bundle"].endswith(f"nanreplay-step{BAD_STEP}-rank1of{WORLD}.h5")
    assert (diag["phase"], diag["origin"]["module"]) == ("forward", "norm")
    # the factory is a training script that runs code at import: the embedded program replays without --import-script
    assert diag["model_source"].startswith("the program")
    assert "[born on rank 1 of 2, before the gradient all-reduce]" in diag["summary"]


def test_inspect_on_rank_bundles_names_the_first_rank(raised):
    paths = [r["bundle"] for r in raised]
    res = CliRunner().invoke(main, ["inspect", "--no-keys", *paths])
    assert res.exit_code == 0, res.output
    assert f"first non-finite step {BAD_STEP}: born on rank(s) [1] before the gradient all-reduce" in res.output
    assert "this rank: clean (its own values were finite)   every rank's flag: [0, 1]" in res.output
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


@pytest.mark.parametrize("name", ["fp16_before", "fp16_after"])
def test_the_users_comm_hook_composes_and_the_clean_rank_replays_clean(runs, name):
    res = runs[name]
    assert [r["error_step"] for r in res] == [BAD_STEP, BAD_STEP] and [r["origin_ranks"] for r in res] == [[BAD_RANK]] * 2
    with open_bundle(res[0]["bundle"]) as b:
        d = b.meta["distributed"]
    assert d["clean"] is True and d["grads"] == "local" and d["detection"]["on"]
    clean = replay(res[0]["bundle"], samples=False)
    # its own step replays finite and matches its recorded (finite, local) gradients: nothing to blame on hardware
    assert (clean["phase"], clean["reproduction"]["verdict"]) == ("none", "reproduced exactly")
    assert replay(res[1]["bundle"], samples=False)["reproduction"]["verdict"] == "reproduced exactly"


def test_origin_hook_off_is_said_and_recorded(runs):
    res = runs["no_origin"]
    assert all(any("origin detection is off (origin_hook=False)" in line for line in r["logs"]) for r in res)
    with open_bundle(res[0]["bundle"]) as b:
        d = b.meta["distributed"]
    assert d["detection"] == {"on": False, "method": "local loss", "why_off": "origin_hook=False", "this_step": False}
    assert d["clean"] is None and d["grads"] == "reduced"  # never "clean" without having looked


def test_a_corrupted_replica_names_its_rank_and_element(runs):
    res = runs["corrupt"]
    assert [r["origin_ranks"] for r in res] == [[BAD_RANK]] * 2
    with open_bundle(res[BAD_RANK]["bundle"]) as b:
        d = b.meta["distributed"]
    assert d["state_ranks"] == [BAD_RANK]
    assert {k: d["state_origin"][k] for k in ("kind", "fqn", "value", "local_index", "global_index")} == {
        "kind": "weight", "fqn": "proj.weight", "value": "+Inf", "local_index": [1, 2], "global_index": [1, 2]}
    assert "its copy of proj.weight held +Inf at [1, 2] at the start of the step" in res[BAD_RANK]["message"]


def test_a_slow_origin_write_keeps_every_bundle_and_the_origin_is_the_root_cause(runs):
    res = runs["slow"]
    # the clean rank raised only after the origin's bundle was written
    assert res[0]["sibling_written"] == [True, True] and res[0]["raised_at"] - res[1]["raised_at"] > -1.0
    err = res[BAD_RANK]["error_file"]
    assert "[rank 1 of 2: the origin" in err["message"]["message"] and err["message"]["extraInfo"]["nanreplay"] == {"origin_rank": 1, "step": BAD_STEP}
    assert res[0]["error_file"] is None  # the clean rank writes none
    # torchrun names the earliest error file's rank (whole seconds): the clean rank fails in a later second
    assert int(res[0]["raised_at"]) > int(err["message"]["extraInfo"]["timestamp"])


def test_a_peer_that_never_finishes_is_named_and_the_wait_is_bounded(runs):
    res = runs["stuck"]
    assert res[0]["error_step"] == BAD_STEP
    assert any("rank(s) [1] did not finish writing their bundles of step 2 within dump_barrier_timeout=1s" in line for line in res[0]["logs"])
    assert res[0]["sibling_written"][1] is False  # it went on without it, after the timeout


def test_fsdp1_is_refused_naming_fully_shard_and_training_goes_on(runs):
    for r in runs["fsdp1"]:
        assert "FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel)" in r["refused"] and "fully_shard" in r["refused"]
        assert len(r["losses"]) == 2


def test_accumulation_with_no_sync_keeps_every_gradient_and_names_the_origin(runs):
    res = runs["accumulate"]
    assert [r["error_step"] for r in res] == [BAD_STEP, BAD_STEP] and [r["origin_ranks"] for r in res] == [[BAD_RANK]] * 2
    # the finite steps trained exactly as the plain DDP twin: no micro-batch's gradient was lost
    assert all(r["same_as_twin"] == [True] * BAD_STEP for r in res)
    with open_bundle(res[0]["bundle"]) as b:
        assert b.meta["distributed"]["clean"] is True and not grads_nonfinite(b.grads())


def test_gradients_as_bucket_views_are_flagged_one_by_one(runs):
    res = runs["view"]
    assert [r["origin_ranks"] for r in res] == [[BAD_RANK]] * 2
    with open_bundle(res[0]["bundle"]) as b:
        d = b.meta["distributed"]
    assert d["clean"] is True and d["grads"] == "reduced" and "flagged as accumulated" in d["detection"]["method"]
