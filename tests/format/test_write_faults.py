"""A dump never hurts training: a full disk is an OSError the Recorder logs (never a crash later),
and temporary files of killed dumps are removed by the next write into their directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from nanreplay.format import atomic
from nanreplay.format.container import STALE_PARTIAL_SECONDS, read_flat, write_flat

ROOT = Path(__file__).resolve().parents[2]

# Runs in a child process: a segfault there fails the test instead of killing pytest. It fills
# the disk twice with a direct write_flat, then once through a Recorder's dump (logged, training
# goes on), collects garbage (where the HDF5 library used to crash, after the error was logged)
# and keeps computing.
_FULL_DISK_SCRIPT = textwrap.dedent("""
    import gc, logging, os, resource, signal, sys
    import torch
    from nanreplay import Recorder
    from nanreplay.format.container import write_flat

    directory, ext, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    if limit:  # fault injection without a small filesystem: writes past `limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    for i in range(2):  # many small datasets: the HDF5 library fails while flushing its metadata
        try:
            write_flat(os.path.join(directory, f"direct{i}.{ext}"), {f"w{j}": torch.randn(1000) for j in range(300)}, {"i": i})
            print("written")
        except OSError as e:
            print("OSError", e.errno)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(100)])  # 1.7 MB of weights, as much in gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fmt = "h5" if ext == "h5" else "safetensors"
    with Recorder(model, opt, out_dir=directory, bundle_format=fmt, action="skip", max_consecutive=10, diagnose=False) as rec:
        for step in range(3):
            x = torch.randn(4, 64) * (float("nan") if step == 1 else 1.0)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    print("bundles", len(rec.bundles))
    gc.collect()
    print("still training", float(model(torch.randn(2, 64)).sum()) is not None)
""")


def _run_full_disk(directory: Path, ext: str, limit: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _FULL_DISK_SCRIPT, str(directory), ext, str(limit)],
                          capture_output=True, text=True, timeout=300, env=env)


def _check_survived(r: subprocess.CompletedProcess, errno_: int, directory: Path) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.count(f"OSError {errno_}") == 2, r.stdout
    assert "could not write the bundle for step 1" in r.stderr  # the Recorder logged its failed dump
    assert "bundles 0" in r.stdout and "still training True" in r.stdout
    assert "Can't decrement id ref count" not in r.stderr
    assert [p.name for p in directory.iterdir() if p.name.endswith(".partial")] == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE variant below covers the same failure")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the RLIMIT_FSIZE variant covers the same failure")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("ext", ["h5", "safetensors"])
def test_a_full_disk_is_an_oserror_and_training_goes_on(tiny_tmpfs, ext):
    _check_survived(_run_full_disk(tiny_tmpfs, ext), 28, tiny_tmpfs)  # ENOSPC


@pytest.mark.slow
@pytest.mark.parametrize("ext", ["h5", "safetensors"])
def test_a_failing_write_is_an_oserror_and_training_goes_on(tmp_path, ext):
    """The same failure by fault injection (file size limit: the OS fails the write with EFBIG),
    which reproduced the HDF5 crash of the old writer (exit -11 after 'Can't decrement id ref count')."""
    _check_survived(_run_full_disk(tmp_path, ext, limit=300_000), 27, tmp_path)  # EFBIG


# ------------------------------------------------------------------------------------ stale temporary files


def _partial(directory: Path, age: float, name: str = "nanreplay-step3.h5") -> Path:
    p = directory / f".{name}.{uuid.uuid4().hex[:12]}.partial"
    p.write_bytes(b"\0" * 4096)
    past = time.time() - age
    os.utime(p, (past, past))
    return p


def test_a_killed_dump_leaves_a_partial_that_the_next_write_removes(tmp_path):
    script = textwrap.dedent("""
        import sys, time, torch
        from nanreplay.format import atomic, container
        atomic._fsync = lambda path: (print("writing", flush=True), time.sleep(60))  # killed here
        container.write_flat(sys.argv[1], {"w": torch.zeros(1000)}, {})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "a.h5")], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "writing"
    (left,) = tmp_path.glob(".a.h5.*.partial")
    os.utime(left, (0, 0))  # old, but its writer is alive and holds its lock: left alone
    write_flat(tmp_path / "b.h5", {"w": torch.zeros(1)}, {})
    assert left.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert left.exists()  # what a killed dump leaves behind
    os.utime(left, (time.time() - 120, time.time() - 120))
    write_flat(tmp_path / "c.h5", {"w": torch.zeros(1)}, {})
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.h5", "c.h5"]


def test_only_our_own_dead_and_not_too_young_partials_are_removed(tmp_path):
    dead = _partial(tmp_path, age=120)
    young = _partial(tmp_path, age=5)  # its writer may be between creating and locking it
    locked = _partial(tmp_path, age=10 * STALE_PARTIAL_SECONDS)
    holder = os.open(locked, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live writer (another process in real life)
    foreign = [tmp_path / ".notes.partial", tmp_path / ".x.h5.partial", tmp_path / ".x.h5.0123456789ab.partial.bak", tmp_path / "data.partial"]
    for p in foreign:
        p.write_bytes(b"x")
        os.utime(p, (0, 0))
    try:
        write_flat(tmp_path / "new.safetensors", {"w": torch.zeros(2)}, {})
    finally:
        os.close(holder)
    assert not dead.exists()
    assert young.exists() and locked.exists() and all(p.exists() for p in foreign)


def test_without_locks_only_age_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_writer_gone", lambda path, st: None)  # a filesystem without locks
    recent = _partial(tmp_path, age=600)
    old = _partial(tmp_path, age=STALE_PARTIAL_SECONDS + 60)
    write_flat(tmp_path / "new.h5", {"w": torch.zeros(2)}, {})
    assert recent.exists() and not old.exists()


@pytest.mark.slow
def test_two_writers_in_one_directory_do_not_remove_each_others_files(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = textwrap.dedent("""
        import sys, torch
        from nanreplay.format.container import write_flat
        for i in range(20):
            write_flat(f"{sys.argv[1]}/{sys.argv[2]}{i}.h5", {f"w{j}": torch.randn(2000) for j in range(20)}, {"i": i})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), name], env=env) for name in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}{i}.h5" for n in "ab" for i in range(20))
    for p in tmp_path.iterdir():
        with read_flat(p) as b:
            assert len(b.keys()) == 20
