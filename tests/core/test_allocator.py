"""The CLI process's heap keeps freed memory (nanreplay.core.allocator): tensors allocated again
after others of their sizes were freed mostly reuse those pages instead of faulting in new ones."""

import subprocess
import sys

import pytest

from nanreplay.core import allocator

_PROBE = r"""
import resource, sys, torch
if sys.argv[1] == "keep":
    from nanreplay.core.allocator import keep_freed_memory
    assert keep_freed_memory()
def one_round():  # a replay's pattern: tensors of a few sizes (4-64 MiB, written whole) allocated, then freed
    ts = [torch.ones(n) for n in (2**20, 3 * 2**20, 2**23, 5 * 2**21, 2**22, 2**24)]
    del ts
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _repeat_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    default, kept = _repeat_faults("default"), _repeat_faults("keep")
    assert default > 100_000  # 4 rounds of 155 MiB: glibc maps fresh pages for each large tensor (38,000 pages a round)
    assert kept < default / 2  # measured: 1,000-43,000 against 155,000


def test_not_linux_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False


def test_the_command_runs_main_with_the_heap_kept(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nanreplay.cli", "inspect", str(tmp_path / "missing.h5")], capture_output=True, text=True)
    assert out.returncode == 4 and "missing.h5" in out.stderr and "Traceback" not in out.stderr
