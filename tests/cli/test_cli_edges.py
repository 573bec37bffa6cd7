"""CLI edges: a directory or several bundles where one is expected (exit 2, with the bundles
listed newest first), error hints in CLI terms, and no third-party warning noise from nanreplay's
own replays."""

from __future__ import annotations

import os
import shlex
import warnings

import pytest
import torch
from click.testing import CliRunner

import models
from helpers import fail_once
from nanreplay import replay
from nanreplay.cli import main


def _runner() -> CliRunner:
    """stdout and stderr apart: click < 8.2 needs ``mix_stderr=False``; 8.2+ always keeps
    ``result.stderr`` (and ``result.output`` interleaves both, as a terminal would)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def _cli(*args):
    return _runner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _one_bundle(out_dir, x_scale: float = 100.0):
    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = x_scale * torch.ones(3, 4)
    return fail_once(model, opt, (x,), models.root_mean_loss, out_dir, model_factory=models.make_root_mlp, diagnose=False).bundle_path


@pytest.fixture
def two_bundles(tmp_path):
    """Two bundles of step 0 in one directory (the second is never written over the first: it
    gets a ``-2`` suffix); the first is made the newer one by its modification time."""
    d = tmp_path / "runs"
    first, second = _one_bundle(d), _one_bundle(d)
    assert first != second
    os.utime(second, (1_000_000_000, 1_000_000_000))
    return d, first, second


@pytest.mark.parametrize("command", ["replay", "report", "bisect", "inspect"])
def test_a_directory_lists_its_bundles_newest_first_and_exits_2(two_bundles, command):
    d, newest, older = two_bundles
    r = _cli(command, d)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    err = r.stderr
    assert err.startswith(f"Error: {d} is a directory")
    assert f"  {newest}  failing step 0  written " in err and f"  {older}  failing step 0  written " in err
    assert err.index(str(newest)) < err.index(str(older))  # newest first
    assert err.rstrip().endswith(f"nanreplay {command} {shlex.quote(str(newest))}")


def test_an_empty_directory_says_where_bundles_come_from(tmp_path):
    r = _cli("replay", tmp_path)
    assert r.exit_code == 2
    assert r.stderr.startswith(f"Error: {tmp_path} is a directory; it holds no bundle (.h5, .hdf5 or .safetensors file).")


def test_a_directory_listing_finds_a_renamed_bundle_by_its_bytes(two_bundles):
    d, newest, older = two_bundles
    renamed = d / "bundle-without-suffix"
    os.replace(older, renamed)
    (d / "notes.txt").write_text("not a bundle")
    r = _cli("replay", d)
    assert r.exit_code == 2 and f"  {renamed}  failing step 0" in r.stderr and "notes.txt" not in r.stderr


def test_a_glob_matching_several_bundles_names_the_one_to_pick(two_bundles):
    """The README's `nanreplay replay runs/digits/nanreplay-step*.h5` after a second run: the shell
    passes both files; replay says so, lists them, and the command it suggests works."""
    d, newest, older = two_bundles
    r = _cli("replay", older, newest)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Error: 2 bundles were given (a shell glob such as nanreplay-step*.h5 matched several). "
                               "replay takes one bundle; the bundles, newest first:")
    suggested = r.stderr.rstrip().rsplit("Pick one, e.g. the newest: ", 1)[1]
    argv = shlex.split(suggested)
    assert argv[:2] == ["nanreplay", "replay"]
    r = _cli(*argv[1:], "--no-samples")
    assert r.exit_code == 0, r.output


def test_inspect_still_takes_several_bundles(two_bundles):
    d, newest, older = two_bundles
    r = _cli("inspect", newest, older, "--no-keys")
    assert r.exit_code == 0, r.output


def test_a_checksum_error_speaks_cli_on_the_command_line_and_python_in_python(tmp_path):
    from nanreplay import BundleFormatError, open_bundle

    path = _one_bundle(tmp_path / "b")
    with open_bundle(path) as b:
        w = b.state().params["fc2.weight"]
    data = bytearray(open(path, "rb").read())
    at = bytes(data).find(w.numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x01
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(data))
    r = _cli("replay", bad)
    assert r.exit_code == 4
    assert "checksum mismatch for tensor 'state/params/fc2.weight'" in r.stderr
    assert f"run `nanreplay inspect --no-verify {bad}` to see what it still holds" in r.stderr
    assert "verify=False" not in r.stderr
    with pytest.raises(BundleFormatError, match="pass verify=False to read the damaged data anyway"):
        replay(bad)


def test_replay_leaks_no_third_party_warnings(tmp_path):
    """Per-sample replay runs the model on one-sample batches, where ``std`` warns; the warning is
    nanreplay's doing and stays inside replay. The user's filters are unchanged afterwards, and
    the same model outside replay still warns."""
    model = models.make_batch_std()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    err = fail_once(model, opt, (torch.randn(4, 4),), models.root_mean_loss, tmp_path / "b", model_factory=models.make_batch_std,
                    diagnose=False, embed_program=False)
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        diag = replay(err.bundle_path)
        assert diag["samples"]["method"] == "per-sample replay"  # the one-sample replays did run
        assert [str(w.message) for w in seen] == []
        models.make_batch_std()(torch.randn(1, 4))
        assert any("degrees of freedom is <= 0" in str(w.message) for w in seen)
    assert warnings.filters == filters
    r = _cli("replay", err.bundle_path)
    assert r.exit_code == 0 and "Warning" not in r.stderr, r.stderr


def test_a_non_tensor_output_is_not_kept_in_the_cotangent(tmp_path, caplog):
    """An output's non-tensor leaf (a transformers DynamicCache) has no gradient: the recorded
    cotangent holds None there, so replay has nothing to warn about ("not storable")."""
    import logging

    from nanreplay import Recorder, open_bundle

    model = models.make_with_cache()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, opt, out_dir=tmp_path / "b", model_factory=models.make_with_cache, diagnose=False, embed_program=False) as rec:
        out = model(torch.randn(4, 4))
        out["y"].sum().backward()
        with pytest.raises(Exception) as info:
            opt.step()
        assert isinstance(out["cache"], models.Cache)
    path = info.value.bundle_path
    with open_bundle(path) as b:
        cot = b.step(b.failing_step).forwards[0].cotangent
    assert cot["cache"] is None and isinstance(cot["y"], torch.Tensor)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        diag = replay(path, samples=False)
    assert diag["mode"] == "cotangent" and diag["origin"]["op"] == "sqrt"
    assert [r.getMessage() for r in caplog.records if "not storable" in r.getMessage()] == []


def test_replay_quiet_is_scoped_and_steps_aside_at_debug():
    import logging

    from nanreplay.core.quiet import replay_quiet

    dynamo_log = logging.getLogger("torch._dynamo")
    level, filters = dynamo_log.level, list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with replay_quiet():
            assert dynamo_log.getEffectiveLevel() == logging.ERROR
            torch.ones(1, 3).std(dim=0)                    # silenced: the one-sample std of per-sample replay
            warnings.warn("the user's own warning")        # passes
        assert [str(w.message) for w in seen] == ["the user's own warning"]
        nr = logging.getLogger("nanreplay")
        old = nr.level
        nr.setLevel(logging.DEBUG)                          # nanreplay -vv: nothing is silenced
        try:
            with replay_quiet():
                torch.ones(1, 3).std(dim=0)
        finally:
            nr.setLevel(old)
        assert any("degrees of freedom" in str(w.message) for w in seen)
    assert dynamo_log.level == level and warnings.filters == filters


def test_bisect_table_numbers_keep_their_exponent():
    from nanreplay.cli import _g

    # a loss of 7.2e16 was printed cut to 12 characters, "7.2190256987", losing the exponent
    assert (_g(7.2190256987e16), _g(0.000123456), _g(3), _g(None), _g("nan")) == ("7.219e+16", "0.0001235", "3", "-", "nan")
