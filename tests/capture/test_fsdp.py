"""FSDP2 and tensor parallel for real: two gloo processes on the CPU, a NaN born on one rank.

Each scenario: both ranks stop in the same step, each writes its own bundle (its shards and
their layout, one run id), and one process with no process group puts the run's bundles
together and replays the origin rank's step."""

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
from nanreplay import NonFiniteGradientError, Recorder, open_bundle
from nanreplay.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")]

WORLD = 2
BAD_STEP = 2
JOIN_TIMEOUT_S = 150
#: scenario -> (model factory, rank whose batch has the zero row (-1: none), action, how the model is sharded)
SCENARIOS = {
    "forward": (models.make_ratio, 1, "raise", "fsdp"),
    "backward": (models.make_sqrt_head, 0, "raise", "fsdp"),
    "skip": (models.make_ratio, 1, "skip", "fsdp-no-reshard-bf16"),
    "tp": (models.make_ratio, None, "raise", "tp"),
    # an Inf written into rank 1's local shard of proj.weight between steps (a silent data corruption)
    "corrupt": (models.make_ratio, -1, "raise", "fsdp"),
    # AdamW eps=0 and a loss that leaves head rows 2-3 (rank 1's shard) without gradient: 0/0 written there
    "eps0": (models.make_ratio, -1, "raise", "fsdp"),
}


def _loss(name: str):
    if name == "eps0":
        return lambda model, batch: model(batch["x"])[:, :2].mean()
    return models.mean_loss


def _worker(rank: int, world: int, store: str, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        for name in names:
            _scenario(rank, world, str(Path(out, name)), name)
    finally:
        dist.destroy_process_group()


def _shard(model: torch.nn.Module, how: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if how == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"proj": ColwiseParallel(), "head": RowwiseParallel()})
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh}
    if how == "fsdp-no-reshard-bf16":
        kw.update(reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for child in (model.proj, model.head):
        fully_shard(child, **kw)
    fully_shard(model, **kw)


def _local_state(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.to_local().detach().flatten().tolist() for n, p in model.named_parameters()}


def _scenario(rank: int, world: int, out: str, name: str) -> None:
    factory, bad_rank, action, how = SCENARIOS[name]
    result: dict = {"rank": rank, "steps_done": 0}
    try:
        model = factory()
        _shard(model, how, world)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, eps=0.0) if name == "eps0" else torch.optim.Adam(model.parameters(), lr=0.01)
        loss_fn = _loss(name)
        # tensor parallel: every rank sees the same batch; data parallel: each rank its own
        g = torch.Generator().manual_seed(100 + (0 if how == "tp" else rank))
        with Recorder(model, opt, loss_fn=loss_fn if name != "eps0" else None, model_factory=factory, out_dir=out, action=action) as rec:
            try:
                for step in range(4):
                    x = torch.randn(6, 8, generator=g)
                    if step == BAD_STEP and (bad_rank is None or rank == bad_rank):
                        x[3] = 0.0
                    if step == BAD_STEP and name == "corrupt" and rank == 1:
                        with torch.no_grad():
                            model.proj.weight.to_local()[1, 2] = float("inf")
                    batch = {"x": x}
                    rec.record(batch)
                    before = _local_state(model)
                    loss = loss_fn(model, batch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if step == BAD_STEP:
                        result["unchanged_at_bad_step"] = _local_state(model) == before
                    result["steps_done"] += 1
            except NonFiniteGradientError as e:
                result.update(error_step=e.step, bundle=e.bundle_path)
            result.update(origin_ranks=rec.dist.origin_ranks, nonfinite_steps=rec.nonfinite_steps, hooked=rec.dist.hooked,
                          bundles=[str(p) for p in rec.bundles])
        result["final"] = _local_state(model)
        if how != "tp":  # close() put FSDP2's own reduce-scatter back on every module
            result["comm_after_close"] = sorted({type(grp._reduce_scatter_comm).__name__ for m in model.modules()
                                                  if hasattr(m, "_get_fsdp_state") for grp in m._get_fsdp_state()._fsdp_param_groups})
        # the full tensors, gathered here (a collective on every rank) to check the offline put-together
        result["full"] = {n: p.full_tensor().flatten().tolist() for n, p in model.named_parameters()}
        result["full_exp_avg"] = {n: opt.state[p]["exp_avg"].full_tensor().flatten().tolist() for n, p in model.named_parameters()}
        dist.barrier()  # every rank reaches here: nobody was left waiting in a collective
    finally:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"result{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "bundles"
    names = list(SCENARIOS)
    run_ranks(_worker, (WORLD, str(tmp / "store"), str(out), names), WORLD, JOIN_TIMEOUT_S, ": a rank hangs in a collective")
    return {n: ([json.loads((out / n / f"result{r}.json").read_text()) for r in range(WORLD)], out / n) for n in names}


@pytest.mark.parametrize("name", ["forward", "backward", "tp"])
def test_both_ranks_stop_in_the_same_step_with_a_bundle_each(runs, name):
    res, _ = runs[name]
    assert [r.get("error_step") for r in res] == [BAD_STEP, BAD_STEP]
    assert [r["steps_done"] for r in res] == [BAD_STEP, BAD_STEP]
    metas = []
    for r in res:
        path = Path(r["bundle"])
        assert path.name == f"nanreplay-step{BAD_STEP}-rank{r['rank']}of{WORLD}.h5"
        with open_bundle(path) as b:
            metas.append(b.meta["distributed"])
    assert metas[0]["run_id"] == metas[1]["run_id"]
    assert metas[0]["siblings"] == metas[1]["siblings"] == [f"nanreplay-step{BAD_STEP}-rank{r}of{WORLD}.h5" for r in range(WORLD)]
    assert [m["coordinate"] for m in metas] == [[0], [1]]
    assert all(m["mesh"]["shape"] == [WORLD] for m in metas)


def test_fsdp_origin_is_the_rank_whose_batch_made_the_nan(runs):
    fwd, _ = runs["forward"]
    assert [r["origin_ranks"] for r in fwd] == [[1], [1]]
    back, _ = runs["backward"]
    # the loss is finite on every rank: only the reduce-scatter hook sees rank 0's own gradients
    assert all(r["hooked"] for r in back)
    assert [r["origin_ranks"] for r in back] == [[0], [0]]


def test_close_puts_back_fsdp_own_reduce_scatter(runs):
    for name in ("forward", "backward", "skip"):
        assert [r["comm_after_close"] for r in runs[name][0]] == [["DefaultReduceScatter"]] * WORLD


def test_tensor_parallel_origin_comes_from_the_local_check(runs):
    res, _ = runs["tp"]
    assert [r["origin_ranks"] for r in res] == [[0, 1], [0, 1]]  # the same batch on both ranks: both are origins
    with open_bundle(res[0]["bundle"]) as b:
        assert b.meta["distributed"]["origin_method"].startswith("local check (tensor parallel")


def test_bundles_hold_the_local_shards_and_their_layout(runs):
    res, _ = runs["forward"]
    for r in res:
        with open_bundle(r["bundle"]) as b:
            lay = b.meta["distributed"]["sharding"]["params"]["proj.weight"]
            assert lay == {"global_shape": [8, 8], "local_shape": [4, 8], "offsets": [4 * r["rank"], 0], "placements": ["S(0)"],
                           "mesh_shape": [WORLD], "mesh_dim_names": [], "coordinate": [r["rank"]]}
            assert tuple(b.state().params["proj.weight"].shape) == (4, 8)
            assert b.meta["distributed"]["sharding"]["optimizer"]["0/exp_avg"] == "proj.weight"
    res, _ = runs["tp"]
    with open_bundle(res[1]["bundle"]) as b:
        sh = b.meta["distributed"]["sharding"]["params"]
    assert (sh["proj.weight"]["placements"], sh["head.weight"]["placements"], sh["head.bias"]["placements"]) == (["S(0)"], ["S(1)"], ["R"])
    assert sh["head.weight"]["offsets"] == [0, 4]


def test_replay_of_the_run_names_rank_module_and_op(runs):
    assert not dist.is_initialized()
    _, out = runs["forward"]
    res = CliRunner().invoke(main, ["replay", "--json", "--no-samples", str(out)])
    assert res.exit_code == 0, res.output
    diag = json.loads(res.output)
    assert diag["distributed"]["rank"] == 1 and diag["distributed"]["origin_ranks"] == [1]
    assert (diag["phase"], diag["origin"]["module"], diag["origin"]["op"]) == ("forward", "norm", "div")
    assert "born on rank 1 of 2 (mesh coordinate [1])" in diag["summary"]
    assert diag["reproduction"]["verdict"].startswith("reproduced")


def test_replay_of_one_rank_bundle_finds_its_siblings(runs):
    res, _ = runs["backward"]
    out = CliRunner().invoke(main, ["replay", "--json", "--no-samples", res[1]["bundle"]])  # the non-origin rank's file
    assert out.exit_code == 0, out.output
    diag = json.loads(out.output)
    assert diag["distributed"]["rank"] == 0
    assert diag["phase"] == "backward" and diag["origin"]["module"] == "root"


def test_replay_of_tensor_parallel_run(runs):
    _, out = runs["tp"]
    res = CliRunner().invoke(main, ["replay", "--json", "--no-samples", str(out)])
    assert res.exit_code == 0, res.output
    diag = json.loads(res.output)
    assert (diag["phase"], diag["origin"]["module"]) == ("forward", "norm")


def test_a_missing_sibling_is_exit_4_naming_it(runs, tmp_path):
    res, _ = runs["forward"]
    import shutil

    shutil.copy(res[1]["bundle"], tmp_path)
    out = CliRunner().invoke(main, ["replay", str(tmp_path / Path(res[1]["bundle"]).name)])
    assert out.exit_code == 4, out.output
    assert f"nanreplay-step{BAD_STEP}-rank0of{WORLD}.h5: missing: the sharded run" in out.output


def test_skip_keeps_every_rank_shards_as_before_the_step(runs):
    res, _ = runs["skip"]
    assert [r["nonfinite_steps"] for r in res] == [[BAD_STEP], [BAD_STEP]]
    assert [r["steps_done"] for r in res] == [4, 4]
    assert all(r["unchanged_at_bad_step"] for r in res)
    assert all(all(v == v for vals in r["final"].values() for v in vals) for r in res)  # no NaN in any shard afterwards


@pytest.mark.parametrize("name", ["forward", "tp"])
def test_merged_weights_and_optimizer_state_equal_the_gathered_full_tensors(runs, name):
    from nanreplay.engine.shards import find_run, merge_run

    res, out = runs[name]
    content = merge_run(find_run([out]))
    for n, full in res[0]["full"].items():
        assert content.state.params[n].flatten().tolist() == full, n
    fqn_index = {f: i for i, f in enumerate(content.optimizer_info["param_groups_fqns"][0])}
    for n, full in res[0]["full_exp_avg"].items():
        assert content.state.optimizer["state"][fqn_index[n]]["exp_avg"].flatten().tolist() == full, n


def _worker_2d(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank}
    try:
        from torch.distributed.tensor import Replicate

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = models.make_ratio()
        # proj is data-parallel only: its DTensor lives on the 1-D dp submesh, yet the whole mesh is recorded
        parallelize_module(model, mesh["tp"], {"head": RowwiseParallel(input_layouts=Replicate())})
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        dp = mesh["dp"].get_local_rank()
        g = torch.Generator().manual_seed(100 + dp)  # one batch per data-parallel replica, shared by its TP ranks
        with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_ratio, out_dir=out) as rec:
            try:
                for step in range(4):
                    x = torch.randn(6, 8, generator=g)
                    if dp == 1 and step == BAD_STEP:
                        x[3] = 0.0
                    batch = {"x": x}
                    rec.record(batch)
                    loss = models.mean_loss(model, batch)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            except NonFiniteGradientError as e:
                result.update(error_step=e.step, origin_ranks=rec.dist.origin_ranks)
        dist.barrier()
    finally:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"result{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def test_2x2_mesh_fsdp_over_tensor_parallel(tmp_path):
    out = tmp_path / "bundles"
    run_ranks(_worker_2d, (4, str(tmp_path / "store"), str(out)), 4, JOIN_TIMEOUT_S, ": a rank hangs in a collective")
    res = [json.loads((out / f"result{r}.json").read_text()) for r in range(4)]
    assert [r.get("error_step") for r in res] == [BAD_STEP] * 4
    assert [r["origin_ranks"] for r in res] == [[2, 3]] * 4  # data-parallel replica 1: mesh rows [1, 0] and [1, 1]
    for r in range(4):  # every rank records the whole mesh and every rank's place on it
        with open_bundle(out / f"nanreplay-step{BAD_STEP}-rank{r}of4.h5") as b:
            d = b.meta["distributed"]
        assert d["mesh"] == {"shape": [2, 2], "ranks": [[0, 1], [2, 3]], "dim_names": ["dp", "tp"]}
        assert d["coordinates"] == {"0": [0, 0], "1": [0, 1], "2": [1, 0], "3": [1, 1]}
        assert d["coordinate"] == [r // 2, r % 2] and d["origin_coordinates"] == {"2": [1, 0], "3": [1, 1]}
    assert d["sharding"]["params"]["head.weight"]["placements"] == ["S(0)", "S(1)"]
    assert d["sharding"]["params"]["proj.weight"]["placements"] == ["S(0)"]  # on the dp submesh
    res = CliRunner().invoke(main, ["replay", "--json", "--no-samples", str(out)])
    assert res.exit_code == 0, res.output
    diag = json.loads(res.output)
    assert (diag["phase"], diag["origin"]["module"], diag["distributed"]["rank"]) == ("forward", "norm", 2)
    assert "born on rank 2 of 4 (mesh coordinate [1, 0])" in diag["summary"]


def test_a_sibling_from_another_run_is_exit_4_naming_it(runs, tmp_path):
    import shutil

    fwd, _ = runs["forward"]
    back, _ = runs["backward"]
    shutil.copy(fwd[1]["bundle"], tmp_path)
    shutil.copy(back[0]["bundle"], tmp_path)  # same step and file name, another run
    out = CliRunner().invoke(main, ["replay", str(tmp_path / Path(fwd[1]["bundle"]).name)])
    assert out.exit_code == 4, out.output
    assert f"nanreplay-step{BAD_STEP}-rank0of{WORLD}.h5: inconsistent sibling: expected run" in out.output


def test_a_sibling_name_with_a_path_is_refused_when_read(runs, tmp_path):
    from nanreplay.errors import BundleFormatError
    from nanreplay.format.bundle import write_bundle

    res, _ = runs["forward"]
    with open_bundle(res[1]["bundle"]) as b:
        content = b.content()
    content.extra_meta["distributed"]["siblings"] = ["../../elsewhere/rank0.h5", "rank1.h5"]
    path = write_bundle(tmp_path / "hostile.h5", content, trusted=False)
    with pytest.raises(BundleFormatError, match=r"siblings\[0\]"):
        open_bundle(path)


@pytest.mark.parametrize("name, step, fqn, value, local, glob", [
    ("corrupt", BAD_STEP, "proj.weight", "+Inf", [1, 2], [5, 2]),  # rank 1 holds rows 4-7
    ("eps0", 1, "head.weight", "NaN", [0, 0], [2, 0]),  # rank 1 holds rows 2-3; step 0's update wrote 0/0 there
])
def test_corrupted_state_names_the_rank_whose_shard_holds_it(runs, name, step, fqn, value, local, glob):
    res, out = runs[name]
    assert [r.get("error_step") for r in res] == [step, step]
    # every rank's gradients are non-finite (the all-gather spread the shard): the state check decides
    assert [r["origin_ranks"] for r in res] == [[1], [1]]
    with open_bundle(res[1]["bundle"]) as b:
        d = b.meta["distributed"]
    assert d["state_ranks"] == [1] and d["rank_flags"] == [1, 1]
    assert {k: d["state_origin"][k] for k in ("kind", "fqn", "value", "local_index", "global_index", "placements")} == {
        "kind": "weight", "fqn": fqn, "value": value, "local_index": local, "global_index": glob, "placements": ["S(0)"]}
    with open_bundle(res[0]["bundle"]) as b:
        assert b.meta["distributed"]["state_origin"] is None  # rank 0's own shards were finite
    out_ = CliRunner().invoke(main, ["replay", "--json", "--no-samples", str(out)])
    assert out_.exit_code == 0, out_.output
    diag = json.loads(out_.output)
    assert diag["distributed"]["rank"] == 1 and diag["phase"] == "weights"
    assert (f"born on rank 1 of 2 (mesh coordinate [1]): its shard of {fqn} (S(0)) held {value} at local {local} = global {glob} "
            "at the start of the step") in diag["summary"]
