"""The logical bundle layer: write_bundle and open_bundle are a symmetric pair."""

from __future__ import annotations

import torch

from nanreplay import BundleContent, open_bundle, write_bundle
import scenarios


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)


def test_content_round_trips_through_write_bundle(tmp_path, out_dir):
    err = scenarios.sqrt_at_zero(out_dir, optimizer=torch.optim.Adam, diagnose=False)  # Adam: optimizer state to round-trip
    with open_bundle(err.bundle_path) as b:
        content = b.content()
        assert isinstance(content, BundleContent)
        copy = write_bundle(tmp_path / "copy.safetensors", content)
    with open_bundle(err.bundle_path) as a, open_bundle(copy) as c:
        # the same tensors, bit for bit, under the same keys
        assert a.keys() == c.keys()
        assert all(_same(a.tensor(k), c.tensor(k)) for k in a.keys())
        # the same metadata, but for what describes the write itself
        differs = {"created_unix", "environment"}
        assert {k: v for k, v in a.meta.items() if k not in differs} == {k: v for k, v in c.meta.items() if k not in differs}
        assert torch.equal(c.step(c.failing_step).batches[0]["x"], a.step(a.failing_step).batches[0]["x"])
