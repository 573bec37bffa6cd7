"""The third wall (nanreplay/engine/sandbox.py): an untrusted bundle's embedded program replays in
a child process under seccomp and rlimits. Inside the child, writing a file, running a program,
opening a socket, forking and signalling another process fail; a crash, a hang and a memory bomb
end as one sentence (exit 5), never a traceback; a genuine replay gives the same diagnosis as
in-process."""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanreplay.cli import main
from nanreplay.core.rng import sole_thread
from nanreplay.diagnosis.api import SANDBOXED
from nanreplay.engine import sandbox
from nanreplay.engine.sandbox import SandboxLimits, contained_call
from nanreplay.errors import ReplayError, SandboxError

pytestmark = pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")


def _errno_of(fn) -> object:
    try:
        fn()
    except OSError as e:
        return e.errno
    except ValueError:
        return "refused"
    return "allowed"


# ------------------------------------------------------------------------------ the walls

def test_inside_the_sandbox_no_file_is_written_created_or_truncated(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"original")
    marker = tmp_path / "PWNED-created"

    def probe():
        return {
            "create": _errno_of(lambda: open(marker, "w")),
            "append": _errno_of(lambda: open(victim, "a")),
            "rw": _errno_of(lambda: os.open(victim, os.O_RDWR)),
            "truncate": _errno_of(lambda: os.truncate(victim, 0)),
            "unlink": _errno_of(lambda: os.unlink(victim)),
            "rename": _errno_of(lambda: os.rename(victim, marker)),
            "mkdir": _errno_of(lambda: os.mkdir(tmp_path / "PWNED-dir")),
            "read": open(victim).read(),
        }

    got = contained_call(probe)
    assert got == {"create": errno.EPERM, "append": errno.EPERM, "rw": errno.EPERM, "truncate": errno.EPERM, "unlink": errno.EPERM,
                   "rename": errno.EPERM, "mkdir": errno.EPERM, "read": "original"}
    assert victim.read_bytes() == b"original" and not marker.exists() and not (tmp_path / "PWNED-dir").exists()


def test_inside_the_sandbox_no_program_runs_and_no_process_is_made(tmp_path):
    marker = tmp_path / "PWNED-exec"

    def probe():
        return {
            "execv": _errno_of(lambda: os.execv("/bin/sh", ["sh", "-c", f"touch {marker}"])),
            "system": os.system(f"touch {marker}"),  # fork/exec inside: a non-zero status, nothing run
            "fork": _errno_of(os.fork),
        }

    got = contained_call(probe)
    assert got["execv"] == errno.EPERM and got["fork"] == errno.EPERM and got["system"] != 0
    assert not marker.exists()


def test_inside_the_sandbox_no_socket_opens_and_no_other_process_is_signalled():
    parent = os.getpid()

    def probe():
        return {
            "socket": _errno_of(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
            "unix": _errno_of(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
            "kill parent": _errno_of(lambda: os.kill(parent, signal.SIGTERM)),
            "kill group": _errno_of(lambda: os.kill(0, signal.SIGTERM)),
            # Python reports the filter's EPERM on setrlimit as "not allowed to raise maximum limit"
            "setrlimit": _errno_of(lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_CORE, (0, 0))),
        }

    assert contained_call(probe) == {"socket": errno.EPERM, "unix": errno.EPERM, "kill parent": errno.EPERM, "kill group": errno.EPERM,
                                     "setrlimit": "refused"}


def test_inside_the_sandbox_threads_and_torch_work():
    import threading

    import torch

    def probe():
        seen = []
        t = threading.Thread(target=lambda: seen.append(threading.get_ident()))
        t.start()
        t.join()
        x = torch.arange(12.0).reshape(3, 4)
        return {"thread ran": len(seen) == 1, "sum": float((x @ x.T).sum())}

    assert contained_call(probe) == {"thread ran": True, "sum": float((torch.arange(12.0).reshape(3, 4) @ torch.arange(12.0).reshape(3, 4).T).sum())}


# ------------------------------------------------------------------------------ what is contained

def test_a_segfault_is_contained_as_one_sentence():
    t0 = time.monotonic()
    with pytest.raises(SandboxError) as e:
        contained_call(lambda: ctypes.string_at(0))  # a read of address 0: SIGSEGV in the child
    assert "signal SIGSEGV" in str(e.value) and "nothing outside the sandbox was touched" in str(e.value)
    assert time.monotonic() - t0 < 30


def test_a_hang_is_stopped_at_the_wall_clock_limit():
    t0 = time.monotonic()
    with pytest.raises(SandboxError) as e:
        contained_call(lambda: time.sleep(600), limits=SandboxLimits(timeout=2))
    elapsed = time.monotonic() - t0
    assert "time limit of 2 s" in str(e.value) and "--timeout" in str(e.value)
    assert elapsed < 15, elapsed


def test_a_memory_bomb_stops_at_the_address_space_limit():
    import resource

    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with pytest.raises(SandboxError) as e:
        contained_call(lambda: len(bytearray(8 << 30)), memory=256 << 20)  # 8 GiB asked, 256 MiB allowed
    assert "out of memory" in str(e.value) and "--memory-limit" in str(e.value)
    assert time.monotonic() - t0 < 30
    # the child never got near the 8 GiB (ru_maxrss of the largest child, KiB; other tests' children count too)
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < max(before, 2 << 20)


def test_an_error_in_the_child_is_relayed_as_itself():
    def probe():
        raise ReplayError("the embedded program failed while running: shape mismatch")

    with pytest.raises(ReplayError) as e:
        contained_call(probe)
    assert str(e.value) == "the embedded program failed while running: shape mismatch"


# ------------------------------------------------------------------------------ replays

@pytest.fixture(scope="module")
def program_bundle(tmp_path_factory) -> Path:
    """A small bundle with an embedded loss program, untrusted (tests/attacks/program_attacks.py)."""
    from attacks.program_attacks import record_base
    from nanreplay import untrust_bundle

    path = record_base(tmp_path_factory.mktemp("sandbox") / "base")
    untrust_bundle(path)
    return path


def test_a_replay_in_the_sandbox_gives_the_in_process_diagnosis(program_bundle, monkeypatch):
    forks = []
    real_fork = os.fork

    def counting_fork():
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", counting_fork)
    sandboxed = CliRunner().invoke(main, ["replay", "--json", str(program_bundle)], catch_exceptions=False)
    assert sandboxed.exit_code == 0, sandboxed.output
    assert len(forks) == 1  # the untrusted program ran in a child
    trusted = CliRunner().invoke(main, ["replay", "--json", "--trust", str(program_bundle)], catch_exceptions=False)
    assert trusted.exit_code == 0 and len(forks) == 1  # --trust: in this process, no child
    a, b = json.loads(sandboxed.output), json.loads(trusted.output)
    assert a["reproduction"]["verdict"] == "reproduced exactly" and a["model_source"].startswith("the program embedded")
    # the one difference: the sandboxed replay says where it ran
    assert a.pop("model_source") == f"{b.pop('model_source')}, {SANDBOXED}"
    if not sole_thread():  # a thread another test left alive: the in-process replay says so (the sandbox's child has one thread)
        b["warnings"] = [w for w in b["warnings"] if not w.startswith("other threads were running")]
    assert a == b


def test_a_crash_during_the_replay_ends_with_exit_5_and_one_sentence(program_bundle, monkeypatch):
    """A kernel that corrupts memory, simulated: a test seam (monkeypatch, copied into the forked
    child) kills the child with SIGSEGV in the middle of the replay. No bundle can reach it."""
    import nanreplay.diagnosis.api as api

    def crash(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSEGV)

    monkeypatch.setattr(api, "replay_step", crash)
    r = CliRunner().invoke(main, ["replay", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 5, r.output
    assert r.output.startswith("Error: the bundle's program crashed the sandboxed replay") and "signal SIGSEGV" in r.output
    assert "Traceback" not in r.output and r.output.count("\n") == 1


def test_a_hanging_replay_is_killed_at_timeout(program_bundle, monkeypatch):
    import nanreplay.diagnosis.api as api

    monkeypatch.setattr(api, "replay_step", lambda *a, **k: time.sleep(600))
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["replay", "--timeout", "3", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 5 and "time limit of 3 s" in r.output, r.output
    assert time.monotonic() - t0 < 30


def test_export_in_the_sandbox_writes_the_files_from_validated_data(program_bundle, tmp_path):
    sandboxed = CliRunner().invoke(main, ["export", str(program_bundle), "--repro", str(tmp_path / "a")], catch_exceptions=False)
    assert sandboxed.exit_code == 0, sandboxed.output
    trusted = CliRunner().invoke(main, ["export", "--trust", str(program_bundle), "--repro", str(tmp_path / "b")], catch_exceptions=False)
    assert trusted.exit_code == 0, trusted.output
    from safetensors.torch import load_file

    assert (tmp_path / "a" / "repro.py").read_text() == (tmp_path / "b" / "repro.py").read_text()
    a, b = load_file(tmp_path / "a" / "op_inputs.safetensors"), load_file(tmp_path / "b" / "op_inputs.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) or (a[k].isnan() == b[k].isnan()).all() for k in a)


def test_check_and_bisect_run_in_the_sandbox(program_bundle):
    r = CliRunner().invoke(main, ["check", "--json", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 3, r.output
    out = json.loads(r.output)
    assert out["finite"] is False and out["loss"] in ("nan", "inf", "-inf")  # the check's non-finite loss, as JSON writes it
    from nanreplay.testing import check_finite

    py = check_finite(program_bundle)  # the Python API: sandboxed too, the loss a float again
    assert isinstance(py["loss"], float) and not math.isfinite(py["loss"]) and py["nonfinite"] == out["nonfinite"]
    r = CliRunner().invoke(main, ["bisect", "--over", "samples", "--json", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code in (0, 6), r.output
    assert json.loads(r.output)["over"] == "samples"


def test_a_forged_result_is_refused(program_bundle, monkeypatch):
    """A child that a hostile program took over sends what it likes: the parent checks it against
    the diagnosis schema before anything reads it."""
    import nanreplay.diagnosis.api as api

    monkeypatch.setattr(api, "_replay", lambda *a, **k: {"summary": "\x1b]8;;http://evil/\x07click\x1b]8;;\x07", "phase": "pwned"})
    r = CliRunner().invoke(main, ["replay", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 5 and "does not follow its schema" in r.output, r.output
    assert "\x1b" not in r.output


def test_without_seccomp_an_untrusted_program_needs_trust(program_bundle, monkeypatch):
    monkeypatch.setattr(sandbox, "_UNAVAILABLE", ["the seccomp binding cannot be loaded (ImportError: no pyseccomp)"])
    r = CliRunner().invoke(main, ["replay", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 7, r.output
    assert "cannot run (the seccomp binding cannot be loaded" in r.output and "--trust" in r.output
    r = CliRunner().invoke(main, ["replay", "--trust", "--json", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def test_an_untrusted_program_is_not_replayed_on_another_device(program_bundle):
    r = CliRunner().invoke(main, ["replay", "--device", "cuda:0", str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 5 and "replays only inside nanreplay's sandbox, on the CPU" in r.output, r.output


def test_sandbox_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="timeout"):
        SandboxLimits(timeout=0)
    with pytest.raises(ValueError, match="memory"):
        SandboxLimits(memory=-1)
    assert SandboxLimits().memory_for(1 << 20) == sandbox.MEMORY_ALLOWANCE + 8 * (1 << 20)


@pytest.mark.parametrize("trusted", [False, True])
def test_an_exception_in_torchs_deserializer_is_one_sentence_without_torchs_traceback(program_bundle, monkeypatch, caplog, trusted):
    """A record torch's deserializer trips over (simulated: it logs a traceback through torch's own
    logger and raises a KeyError) ends in exit 5 with one sentence, in the sandbox or in-process
    (--trust), and stderr carries none of torch's output."""
    import logging

    from torch._export.serde import serialize

    def broken(self, *args, **kwargs):
        try:
            raise KeyError("node 'evil'")
        except KeyError:
            logging.getLogger("torch._export.serde.serialize").exception("TORCH-LOG-MARKER while deserializing")
            raise

    monkeypatch.setattr(serialize.ExportedProgramDeserializer, "deserialize", broken)
    caplog.set_level(logging.DEBUG, logger="torch._export")
    r = CliRunner().invoke(main, ["replay", *(["--trust"] if trusted else []), str(program_bundle)], catch_exceptions=False)
    assert r.exit_code == 5, r.output
    assert r.output.startswith("Error: the embedded program (torch ") and "KeyError: \"node 'evil'\"; replay with --model-factory" in r.output
    assert r.output.count("\n") == 1 and "Traceback" not in r.output and "TORCH-LOG-MARKER" not in r.output
    assert not [rec for rec in caplog.records if "TORCH-LOG-MARKER" in rec.getMessage()]  # torch's logger said nothing
