"""The ``nanreplay`` console entry (``cli.entry``) ends its process without the interpreter's
teardown: the exit status is the command's, its output is complete and flushed, ``atexit``
handlers run, and a non-daemon thread still running keeps the ordinary exit that waits for it."""

from __future__ import annotations

import subprocess
import sys

_RUN = r"""
import atexit, sys, threading, time
marker, thread, *argv = sys.argv[1:]
atexit.register(lambda: open(marker, "a").write("atexit\n"))
if thread == "thread":  # a non-daemon thread that finishes after the command
    threading.Thread(target=lambda: (time.sleep(0.5), open(marker, "a").write("thread\n"))).start()
sys.argv = ["nanreplay", *argv]
from nanreplay.cli import entry
entry()
print("not reached", file=sys.stderr)
"""


def _entry(tmp_path, *argv: str, thread: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    marker = tmp_path / "marker"
    marker.touch()
    proc = subprocess.run([sys.executable, "-c", _RUN, str(marker), "thread" if thread else "-", *argv], capture_output=True, text=True,
                          timeout=120)
    return proc, marker.read_text()


def test_the_entry_exits_with_the_commands_status_after_its_atexit_handlers(tmp_path):
    proc, marker = _entry(tmp_path, "inspect", str(tmp_path / "nope.h5"))
    assert proc.returncode == 4 and "nope.h5" in proc.stderr and "not reached" not in proc.stderr
    assert marker == "atexit\n"


def test_the_entrys_piped_output_is_complete(tmp_path):
    proc, marker = _entry(tmp_path, "--help")
    assert proc.returncode == 0 and marker == "atexit\n"
    for command in ("replay", "bisect", "inspect", "report"):
        assert command in proc.stdout
    ordinary = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['nanreplay', '--help']; from nanreplay.cli import main; main()"],
                              capture_output=True, text=True, timeout=120)
    assert proc.stdout == ordinary.stdout  # all of it, to the last line, as the ordinary exit writes it


def test_a_running_non_daemon_thread_keeps_the_ordinary_exit(tmp_path):
    proc, marker = _entry(tmp_path, "--help", thread=True)
    assert proc.returncode == 0
    assert marker.splitlines() == ["thread", "atexit"]  # the exit waited for the thread, then ran the handlers
