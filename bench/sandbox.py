"""What the sandbox costs: ``nanreplay replay`` of a stranger's bundle (its embedded program runs in
a forked child under seccomp and rlimits, :mod:`nanreplay.engine.sandbox`) against the same
command with ``--trust`` (the program runs in the command's own process), on the README's digits
example.

Each round runs both commands as fresh processes (``python -m nanreplay.cli replay --json B``,
what a user types), in alternating order, with a trust store that does not hold the bundle (a
fresh ``NANREPLAY_HOME``); the figure is the median wall time of each over the rounds and their
ratio. Both commands must print the same diagnosis (``--json``), or the run fails.

    python bench/sandbox.py --rounds 7                 # records the digits bundle first
    python bench/sandbox.py --rounds 7 --bundle B      # any bundle with an embedded program
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import cpu_name  # noqa: E402


def digits_bundle(out: Path, env: dict) -> Path:
    """Record the README's example (``examples/digits_nan.py``) into ``out``; its bundle."""
    subprocess.run([sys.executable, str(ROOT / "examples" / "digits_nan.py"), "--out-dir", str(out)], env=env, check=True,
                   capture_output=True)
    (bundle,) = out.glob("nanreplay-step*.h5")
    return bundle


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return seconds, r.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bundle", help="a bundle with an embedded program (default: record the digits example)")
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    work = Path(tempfile.mkdtemp(prefix="nanreplay-bench-sandbox-"))
    bundle = Path(args.bundle) if args.bundle else digits_bundle(work / "digits", {**env, "NANREPLAY_HOME": str(work / "writer")})
    env["NANREPLAY_HOME"] = str(work / "stranger")  # the reader's own store: the bundle is not in it
    base = [sys.executable, "-m", "nanreplay.cli", "replay", "--json", str(bundle)]
    variants = {"sandboxed (untrusted)": base, "in process (--trust)": base[:4] + ["--trust"] + base[4:]}
    times: dict[str, list[float]] = {k: [] for k in variants}
    outputs: dict[str, str] = {}
    for i in range(args.rounds):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds, out = timed(variants[name], env)
            times[name].append(seconds)
            outputs[name] = out
    a, b = (json.loads(outputs[k]) for k in variants)
    same = a == b
    import torch

    print(f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} threads, python {sys.version.split()[0]}; "
          f"bundle {bundle.name} ({bundle.stat().st_size // 1024} KiB); {args.rounds} rounds, alternating order")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:<24} median {med[k]:.2f} s   (runs: {', '.join(f'{x:.2f}' for x in v)})")
    sandboxed, trusted = med["sandboxed (untrusted)"], med["in process (--trust)"]
    print(f"  ratio sandboxed / in process: {sandboxed / trusted:.2f}x; same diagnosis (--json): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
