"""The run's configuration the Recorder writes at the dump (meta["config"]): read once per bundle,
never per step; the optimizer's param groups, activation checkpointing, DDP's comm hook, one data
digest per step held."""

from __future__ import annotations

import collections

import pytest
import torch

import models
from nanreplay import Recorder, open_bundle
from nanreplay.capture import settings as capture_settings
from nanreplay.capture.settings import checkpointing, data_digest, optimizer_groups, reduce_settings


def test_nothing_is_read_per_step(tmp_path, monkeypatch):
    """Thirty finite steps read the configuration zero times; the one failing step reads it once."""
    calls = collections.Counter()
    real = capture_settings.run_config

    def counted(*args, **kw):
        calls["run_config"] += 1
        return real(*args, **kw)

    monkeypatch.setattr("nanreplay.capture.recorder.run_config", counted)
    model = models.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, loss_fn=models.mse_loss, out_dir=tmp_path, diagnose=False, embed_program=False, action="warn") as rec:
        for step in range(31):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            if step == 30:
                x[0, 0] = float("nan")
            rec.record((x, y))
            loss = models.mse_loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            if step == 29:
                assert calls["run_config"] == 0
            opt.step()
    assert calls["run_config"] == 1 and len(rec.bundles) == 1
    with open_bundle(rec.bundles[0]) as b:
        cfg = b.meta["config"]
    assert cfg["optimizer"]["param_groups"][0]["lr"] == 0.1 and cfg["training"] == {"checkpointing": {}}
    assert [r["step"] for r in cfg["data"]] == [s["step"] for s in b.meta["steps"]]


def test_the_data_digest_is_the_bytes_and_the_structure():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    same = data_digest([(x.clone(), {"y": torch.ones(3), "n": 3})])
    assert same == data_digest([(x, {"y": torch.ones(3), "n": 3})])
    changed = x.clone()
    changed[2, 3] = 11.5
    others = [data_digest([(changed, {"y": torch.ones(3), "n": 3})]), data_digest([(x, {"y": torch.ones(3), "n": 4})]),
              data_digest([(x.double(), {"y": torch.ones(3), "n": 3})]), data_digest([(x.reshape(4, 3), {"y": torch.ones(3), "n": 3})]),
              data_digest([[x, {"y": torch.ones(3), "n": 3}]])]
    assert len({same, *others}) == 6
    assert data_digest([torch.ones(2, dtype=torch.bfloat16)]) != data_digest([torch.ones(2, dtype=torch.float16)])


def test_optimizer_groups_without_params_and_bounded():
    model = models.make_mlp()
    opt = torch.optim.Adam([{"params": model.fc1.parameters(), "lr": 1e-3, "name": "body", "long": list(range(100))},
                            {"params": model.fc2.parameters(), "lr": 1e-4}], foreach=True)
    g0, g1 = optimizer_groups(opt)
    assert "params" not in g0 and g0["lr"] == 1e-3 and g1["lr"] == 1e-4 and g0["betas"] == [0.9, 0.999]
    assert g0["foreach"] is True and g0["fused"] is None and g0["name"] == "body"
    assert isinstance(g0["long"], str) and len(g0["long"]) <= 512  # past the schema's 16 entries: its text, cut


def test_checkpointing_seen_on_the_model():
    model = models.make_nested()
    assert checkpointing(model) == {}
    model.encoder.gradient_checkpointing = True  # what a Hugging Face model sets on its blocks
    assert checkpointing(model) == {"gradient_checkpointing": ["encoder"]}


def _compress(state, bucket):  # a user's comm hook (fp16 compression is the classic one)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook(state, bucket)


def test_ddp_comm_hook_and_backend(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = models.make_mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert reduce_settings(ddp, model) == {"comm_hook": None, "backend": "gloo"}
        ddp.register_comm_hook(None, _compress)
        assert reduce_settings(ddp, model) == {"comm_hook": f"{__name__}:_compress", "backend": "gloo"}
        assert reduce_settings(model, model) == {}  # not wrapped: nothing distributed to say
    finally:
        dist.destroy_process_group()


def test_fsdp2_mixed_precision_policy():
    """FSDP2 (``fully_shard``) on one CPU rank: the outermost module's MixedPrecisionPolicy gives
    the param and reduce dtypes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = models.make_mlp()
        fully_shard(model.fc1, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        assert reduce_settings(model, model) == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "backend": "gloo"}
    finally:
        dist.destroy_process_group()
