"""The recorded configuration: no secret value ever reaches a bundle, the recording's environment
survives a rewrite, and the schema refuses a hostile configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

import scenarios
from nanreplay import open_bundle
from nanreplay.errors import BundleFormatError
from nanreplay.format.bundle import write_bundle
from nanreplay.format.environment import environment, looks_secret, recorded_variables

SECRETS = {
    "HF_TOKEN": "hf_secret123",
    "MY_API_KEY": "sk-myapikey-0451",
    "WANDB_API_KEY": "wandb0123456789secret",
    "TORCH_HUB_TOKEN": "ghp_torchhubtoken777",          # a prefix nanreplay records, a secret's name
    "NCCL_IB_AUTH_SECRET": "nccl-auth-s3cr3t",
    "CUDA_PASSWORD": "cuda-pass-w0rd",
}
URL = ("TORCHINDUCTOR_REMOTE_CACHE_URL", "redis://admin:pw-in-url-991@cache.local:6379/0")
MARKER = ("TORCH_NANREPLAY_TEST_MARKER", "visible-marker-5b1e")


@pytest.mark.parametrize("suffix", [".h5", ".safetensors"])
def test_no_secret_value_reaches_a_bundle(tmp_path, monkeypatch, suffix):
    """A run with tokens and keys in its environment: the bundle file holds none of their bytes.
    A variable nanreplay records (the marker) is found in the same file, so the search for the
    secrets' bytes would have found them."""
    for k, v in {**SECRETS, URL[0]: URL[1], MARKER[0]: MARKER[1]}.items():
        monkeypatch.setenv(k, v)
    err = scenarios.sqrt_at_zero(tmp_path, bundle_format=suffix.lstrip("."), diagnose=False)
    path = Path(err.bundle_path)
    data = path.read_bytes()
    assert MARKER[1].encode() in data
    for name, value in SECRETS.items():
        assert value.encode() not in data, name
    assert b"pw-in-url-991" not in data and b"admin:" not in data
    with open_bundle(path) as b:
        rec = b.meta["environment"]["variables"]
    assert rec[MARKER[0]] == MARKER[1]
    assert rec["TORCH_HUB_TOKEN"] is None and rec["NCCL_IB_AUTH_SECRET"] is None and rec["CUDA_PASSWORD"] is None
    assert "HF_TOKEN" not in rec and "MY_API_KEY" not in rec and "WANDB_API_KEY" not in rec  # unrelated: not recorded at all
    assert rec[URL[0]] == "redis://***@cache.local:6379/0"


def test_which_variables_are_recorded():
    env = {"NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "4", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HOME": "/root", "PATH": "/bin",
           "HF_TOKEN": "x", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_SECRET_SAUCE": "y", "TORCH_X": "z" * 5000}
    rec = recorded_variables(env)
    assert rec == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "4",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_SECRET_SAUCE": None, "TORCH_X": "z" * 1024}
    assert all(looks_secret(n) for n in ("hf_token", "WANDB_API_KEY", "NCCL_AUTH", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"))
    assert not any(looks_secret(n) for n in ("NCCL_ALGO", "OMP_NUM_THREADS", "TORCH_LOGS"))


def test_environment_imports_nothing_new_and_reads_the_flags():
    import sys

    before = set(sys.modules)
    env = environment()
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("transformers", "lightning", "accelerate", "deepspeed", "triton")}
    assert env["numerics"]["float32_matmul_precision"] in ("highest", "high", "medium")
    assert isinstance(env["numerics"]["sdpa_flash"], bool) and env["determinism"]["deterministic_algorithms"] is False


def test_a_rewrite_keeps_the_recordings_environment_and_config(sqrt_bundle, tmp_path, monkeypatch):
    """A bundle rewritten in another process environment (Dump.amend, the merge of a sharded run)
    still says how the recording ran, not how the rewrite did."""
    with open_bundle(sqrt_bundle) as b:
        env, config, created = b.meta["environment"], b.meta["config"], b.meta["created_unix"]
        content = b.content()
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # the rewriting process differs
    out = write_bundle(tmp_path / "again.h5", content)
    with open_bundle(out) as b:
        assert b.meta["environment"] == env and "NCCL_ALGO" not in b.meta["environment"]["variables"]
        assert b.meta["config"] == config and b.meta["created_unix"] >= created


@pytest.mark.parametrize("edit, where", [
    (lambda m: m["environment"]["variables"].update({"TORCH_X": 3}), "meta.environment.variables"),
    (lambda m: m["environment"]["variables"].update({"TORCH_X": "x" * 5000}), "meta.environment.variables"),
    (lambda m: m["environment"].update({"libraries": {f"lib{i}": "1" for i in range(100)}}), "meta.environment.libraries"),
    (lambda m: m["environment"]["numerics"].update({"sdpa_flash": {"nested": True}}), "meta.environment.numerics"),
    (lambda m: m["config"]["data"][0].update({"sha256": "not hex"}), "meta.config.data[0].sha256"),
    (lambda m: m["config"]["data"][0].update({"of": "elsewhere"}), "meta.config.data[0].of"),
    (lambda m: m["config"]["optimizer"]["param_groups"][0].update({"lr": list(range(40))}), "meta.config.optimizer.param_groups[0]"),
    (lambda m: m["config"].update({"distributed": {"reduce_dtype": ["bf16"]}}), "meta.config.distributed"),
])
def test_the_schema_refuses_a_hostile_configuration(sqrt_bundle, tmp_path, edit, where):
    with open_bundle(sqrt_bundle) as b:
        content = b.content()
    edit(content.extra_meta)
    out = write_bundle(tmp_path / "hostile.h5", content, trusted=False)
    with pytest.raises(BundleFormatError, match=f"at {where.replace('[', '.').replace(']', '.')}"):
        open_bundle(out)
