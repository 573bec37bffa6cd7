"""The trust rule: no code named by a bundle runs unless the user named it or trusts the bundle."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import models
from nanreplay import (NonFiniteGradientError, Recorder, UntrustedBundleError, open_bundle, replay, trust_bundle, untrust_bundle,
                       write_bundle)
from nanreplay.cli import main
from nanreplay.core import trust
from nanreplay.search.api import bisect


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh, empty trust store for this test."""
    h = tmp_path / "home"
    monkeypatch.setenv("NANREPLAY_HOME", str(h))
    return h


def _record(out_dir, opt_cls=torch.optim.SGD, *, embed_program=False, **opts):
    """A Recorder bundle; without the embedded program (by default here), so replay needs the
    code it names."""
    model = models.make_nested()
    with torch.no_grad():
        model.encoder["block"].proj.bias.fill_(-1.0)
    opt = opt_cls(model.parameters(), lr=0.1)
    x = torch.randn(6, 8) * 3
    x[2] = 0.0
    with Recorder(model, opt, loss_fn=models.mean_loss, model_factory=models.make_nested, out_dir=out_dir, diagnose=False,
                  embed_program=embed_program, **opts) as rec:
        rec.record({"x": x})
        models.mean_loss(model, {"x": x}).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    from pathlib import Path

    return Path(info.value.bundle_path)


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.output


def _stranger(path, tmp_path):
    """The same bundle as someone else would hand it over: not in this user's trust store."""
    copy = tmp_path / f"stranger-{path.name}"
    shutil.copyfile(path, copy)
    untrust_bundle(copy)
    return copy


def test_the_recorder_marks_what_it_writes_as_trusted_with_a_private_key(home, out_dir):
    path = _record(out_dir)
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "secret").st_mode) == 0o600
    assert len(list((home / "trusted").iterdir())) == 1
    with open_bundle(path) as b:
        assert b.trusted
    diag = replay(path)  # the recorded factory and loss function run without asking
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


def test_a_copy_or_rename_keeps_trust_an_edit_loses_it(home, out_dir, tmp_path):
    path = _record(out_dir)
    renamed = tmp_path / "renamed.txt"
    shutil.copyfile(path, renamed)
    with open_bundle(renamed) as b:
        assert b.trusted
    import h5py
    import numpy as np

    with h5py.File(renamed, "r+") as f:  # change one name of code in the metadata
        m = json.loads(f["__manifest__"][()].tobytes())
        m["meta"]["loss_fn"] = "models:mse_loss"
        del f["__manifest__"]
        f.create_dataset("__manifest__", data=np.frombuffer(json.dumps(m).encode(), dtype=np.uint8))
    with open_bundle(renamed) as b:
        assert not b.trusted


def test_an_untrusted_bundle_is_refused_with_what_it_names_and_nothing_runs(home, out_dir, tmp_path, monkeypatch):
    path = _stranger(_record(out_dir), tmp_path)
    imported = []
    monkeypatch.setattr("nanreplay.core.callables.importlib.import_module", lambda name: imported.append(name) or pytest.fail(f"imported {name}"))
    with pytest.raises(UntrustedBundleError) as e:
        replay(path)
    here = str(Path(models.__file__).resolve().parent)  # where models was imported from when recording: replay may add it to sys.path
    assert e.value.names == {"model factory": ["models:make_nested"], "model factory imported from": [here],
                             "loss function": ["models:mean_loss"], "loss function imported from": [here]}
    assert "trust=True" in str(e.value) and "nanreplay.trust_bundle" in str(e.value)
    assert imported == []
    code, output = _cli("replay", path)
    assert code == 7
    assert f"model factory 'models:make_nested'; model factory imported from {here!r}; loss function 'models:mean_loss'" in output
    assert f"nanreplay trust {path}" in output and "--trust" in output
    assert "Traceback" not in output


def test_an_untrusted_bundle_with_an_embedded_program_replays_without_its_code(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir, embed_program=True), tmp_path)
    with open_bundle(path) as b:
        assert not b.trusted and (b.meta.get("program") or {}).get("kind") == "loss"
    code, output = _cli("replay", path, "--json")
    assert code == 0, output
    diag = json.loads(output)
    assert diag["model_source"].startswith("the program embedded in the bundle")
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    # replaying with the model's own forward (the recorded cotangent) needs the recorded factory
    code, output = _cli("replay", path, "--no-loss-fn")
    assert code == 7 and "model factory 'models:make_nested'" in output


def test_the_users_own_code_replays_an_untrusted_bundle(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir), tmp_path)
    diag = replay(path, model_factory=models.make_nested, loss_fn=models.mean_loss)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    code, _ = _cli("replay", path, "--model-factory", "models:make_nested", "--no-loss-fn")
    assert code == 0
    code, output = _cli("replay", path, "--model-factory", "models:make_nested")  # the recorded loss function would run
    assert code == 7 and "loss function 'models:mean_loss'" in output and "model factory" not in output


def test_trust_for_one_run_and_trust_for_good(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir), tmp_path)
    assert _cli("replay", path, "--trust")[0] == 0
    with open_bundle(path) as b:
        assert not b.trusted  # --trust was for that run only
    code, output = _cli("trust", path)
    assert code == 0 and "trusted; replay may now run model factory models:make_nested" in output
    assert _cli("replay", path)[0] == 0
    code, output = _cli("trust", "--revoke", path)
    assert code == 0 and "no longer trusted" in output
    assert _cli("replay", path)[0] == 7


def test_inspect_says_what_a_bundle_names_and_whether_it_is_trusted(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir), tmp_path)
    code, output = _cli("inspect", "--no-keys", path)
    assert code == 0
    here = str(Path(models.__file__).resolve().parent)
    assert (f"code it names: model factory models:make_nested; model factory imported from {here}; loss function models:mean_loss; "
            f"loss function imported from {here}   NOT trusted") in output
    info = json.loads(_cli("inspect", "--json", path)[1])
    assert info["trusted"] is False and info["code"]["loss function"] == ["models:mean_loss"]


def test_rewriting_an_untrusted_bundle_does_not_launder_it(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir), tmp_path)
    with open_bundle(path) as b:
        content = b.content()
    assert content.trusted is False
    copy = write_bundle(tmp_path / "copy.safetensors", content)
    with open_bundle(copy) as b:
        assert not b.trusted


def test_torch_optim_needs_no_trust_a_custom_optimizer_does(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir / "sgd", snapshot_every=1), tmp_path)
    res = bisect(path, over="steps", model_factory=models.make_nested, loss_fn=models.mean_loss)  # torch.optim.SGD: looked up, not imported
    assert res["status"] in ("found", "not reproduced", "not in search space", "incomplete")
    custom = _stranger(_record(out_dir / "custom", opt_cls=CustomSGD, snapshot_every=1), tmp_path)
    with pytest.raises(UntrustedBundleError) as e:
        bisect(custom, over="steps", model_factory=models.make_nested, loss_fn=models.mean_loss)
    assert list(e.value.names) == ["optimizer class"]
    diag = replay(custom, model_factory=models.make_nested, loss_fn=models.mean_loss)  # replay itself does not need the optimizer
    assert diag["reproduction"]["verdict"] == "reproduced exactly"


class CustomSGD(torch.optim.SGD):
    """An optimizer class outside torch.optim."""


def test_a_planted_store_entry_trusts_nothing(home, out_dir, tmp_path):
    path = _stranger(_record(out_dir), tmp_path)
    with open_bundle(path) as b:
        digest = b._flat.manifest_digest
    (home / "trusted" / trust.manifest_digest(digest).hex()).write_text("{}")  # a guess without the key
    (home / "trusted" / digest.hex()).write_text("{}")
    with open_bundle(path) as b:
        assert not b.trusted


def test_a_key_others_can_read_is_not_used(home, out_dir, caplog):
    path = _record(out_dir)
    os.chmod(home / "secret", 0o644)
    with caplog.at_level(logging.WARNING, logger="nanreplay.core.trust"):
        with open_bundle(path) as b:
            assert not b.trusted
    assert "chmod 0600" in caplog.text
    with pytest.raises(PermissionError, match="chmod 0600"):
        trust_bundle(path)


def test_a_store_that_cannot_be_written_never_stops_a_dump(tmp_path, monkeypatch, out_dir, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NANREPLAY_HOME", str(blocker / "home"))
    with caplog.at_level(logging.WARNING):
        path = _record(out_dir)
    assert path.exists()
    assert "could not record it as trusted" in caplog.text


def weighted_loss(model, batch, *, weight, reference=None):
    """A loss function taking keyword arguments, recorded as a functools.partial."""
    return models.mean_loss(model, batch) * weight


def test_a_partial_loss_function_is_recorded_with_its_arguments_and_they_are_reviewed(home, out_dir, tmp_path):
    """A functools.partial of an importable loss function is recorded as the function and its JSON
    keyword arguments (meta.loss_fn_kwargs), bound again at replay; an import path among them is
    listed for review and needs trust like the loss function itself."""
    import functools

    model = models.make_nested()
    with torch.no_grad():
        model.encoder["block"].proj.bias.fill_(-1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = functools.partial(weighted_loss, weight=2.0, reference="models:make_nested")
    x = torch.randn(6, 8) * 3
    x[2] = 0.0
    with Recorder(model, opt, loss_fn=loss_fn, model_factory=models.make_nested, out_dir=out_dir, diagnose=False, embed_program=False) as rec:
        rec.record({"x": x})
        loss_fn(model, {"x": x}).backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    path = Path(info.value.bundle_path)
    with open_bundle(path) as b:
        assert b.loss_fn == "test_trust:weighted_loss"
        assert b.loss_fn_kwargs == {"weight": 2.0, "reference": "models:make_nested"}
    diag = replay(path)
    assert diag["mode"] == "loss_fn" and diag["reproduction"]["verdict"] == "reproduced exactly"  # weight=2.0 bound again
    with pytest.raises(UntrustedBundleError) as e:
        replay(_stranger(path, tmp_path))
    assert e.value.names["imported by the loss function (loss_fn_kwargs.reference)"] == ["models:make_nested"]
    assert e.value.names["loss function"] == ["test_trust:weighted_loss"]
