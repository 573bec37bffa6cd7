"""What proving an untrusted program costs a replay: ``nanreplay replay`` of the digits example's
bundle as a stranger's (its program proven in bounds on fake tensors, ``nanreplay/engine/bounds.py``,
and run under the index guard, ``nanreplay/engine/guards.py``) against the same replay with
``--trust`` (neither), interleaved, each a fresh process; medians and their ratio. Then the same
two replays in one process (``nanreplay.replay``, interleaved: no process start in the figure),
and the verifier's own seconds (``Proof.seconds``, one proof per shape of call).

Run: ``python bench/bounds.py [--runs 5] [BUNDLE]`` (without BUNDLE it records one with
``examples/digits_nan.py`` in a temporary directory, and a temporary trust store; a minute or two
on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _replay(bundle: Path, env: dict, trust: bool) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "nanreplay.cli", "replay", *(["--trust"] if trust else []), str(bundle)],
                       capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"replay exited {r.returncode}: {r.stdout[-500:]} {r.stderr[-1000:]}")
    return seconds


_IN_PROCESS = """
import statistics, sys, time, logging
import nanreplay
from nanreplay.engine import program
proofs = []
orig = program._prove
def counting(bounds, pm, leaves):
    n = len(bounds.proven)
    proof = orig(bounds, pm, leaves)
    if len(bounds.proven) != n:
        proofs.append(proof.seconds)
    return proof
program._prove = counting
bundle, runs = sys.argv[1], int(sys.argv[2])
nanreplay.replay(bundle, trust=True)  # warm: imports, caches
times = {False: [], True: []}
for _ in range(runs):
    for trust in (False, True):
        t0 = time.perf_counter()
        nanreplay.replay(bundle, trust=trust)
        times[trust].append(time.perf_counter() - t0)
u, t = statistics.median(times[False]), statistics.median(times[True])
print(f"in one process: untrusted median {u:.3f} s, --trust median {t:.3f} s, ratio {u / t:.3f}; "
      f"the verifier: {len(proofs) / runs:.0f} proofs a replay, {statistics.median(proofs) * 1000:.0f} ms each (median)")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", nargs="?", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NANREPLAY_HOME": str(Path(tmp) / "home"), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        bundle = args.bundle
        if bundle is None:
            subprocess.run([sys.executable, str(ROOT / "examples" / "digits_nan.py"), "--out-dir", tmp], check=True, capture_output=True, env=env)
            bundle = next(Path(tmp).glob("nanreplay-step*"))
        subprocess.run([sys.executable, "-m", "nanreplay.cli", "trust", "--revoke", str(bundle)], capture_output=True, env=env)
        times: dict[bool, list[float]] = {False: [], True: []}
        _replay(bundle, env, True)  # warm the file cache
        for _ in range(args.runs):
            for trust in (False, True):
                times[trust].append(_replay(bundle, env, trust))
        in_process = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(bundle), str(args.runs)], capture_output=True, text=True, env=env)
    untrusted, trusted = statistics.median(times[False]), statistics.median(times[True])
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} CPUs, {args.runs} runs each, interleaved")
    print(f"nanreplay replay (untrusted: proven + guarded): median {untrusted:.2f} s  {[round(t, 2) for t in times[False]]}")
    print(f"nanreplay replay --trust (neither):            median {trusted:.2f} s  {[round(t, 2) for t in times[True]]}")
    print(f"ratio: {untrusted / trusted:.3f}")
    print(in_process.stdout.strip() or in_process.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
