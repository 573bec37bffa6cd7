"""What the benchmarks say about the machine they ran on (shared by bench/*.py; imports no torch)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
