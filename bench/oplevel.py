"""The diagnosis's op-level replay of a bundle's failing step against a bare replay, in one process.

Loads the bundle's subject (the embedded program, or the recorded factory for a trusted bundle;
with ``--size``, the failing step of ``bench/scale.py``'s GPT of that size, recorded first into a
temporary folder with ``diagnose=False``), then alternates, ``--rounds`` times, a bare replay (``run_step(ops=False, monitors=False)``) and
the op-level replay the diagnosis runs (``run_step(ops=True, settle=True)``: module and op
monitors; ``settle`` where this version has it), and prints the medians in seconds. Usage::

    python bench/oplevel.py --size 3.7M --rounds 3     # scale.py's failure (a 3e38 weight in block 1)
    python bench/oplevel.py BUNDLE --rounds 3          # any bundle
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanreplay.diagnosis.api import bundle_step_inputs
from nanreplay.engine.compiled import eager_modules
from nanreplay.engine.run import run_step
from nanreplay.engine.state import ReplayRequest, load_state, opened_subject


def record_failure(size_name: str, out_dir: str) -> str:
    """The bundle of ``bench/scale.py``'s failing step for one size (two finite steps, then the
    poisoned one), written to ``out_dir`` without the in-process diagnosis."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scale

    from nanreplay import NonFiniteGradientError, Recorder

    size = scale.SIZES[size_name]
    torch.manual_seed(0)
    model = size.make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    with Recorder(model, opt, loss_fn=scale.loss_fn, out_dir=out_dir, diagnose=False) as rec:
        for _ in range(2):
            scale._step(model, opt, scale.make_batch(size, g), rec)
        scale.poison(model)
        try:
            scale._step(model, opt, scale.make_batch(size, g), rec)
        except NonFiniteGradientError as e:
            return str(e.bundle_path)
    raise RuntimeError("the poisoned step did not fail")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", help="a bundle (else --size)")
    p.add_argument("--size", choices=["3.7M", "42M", "124M"], help="record bench/scale.py's failure of this size first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args()
    if (args.bundle is None) == (args.size is None):
        p.error("give a BUNDLE or --size")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle or record_failure(args.size, tmp)
        measure(bundle, args.rounds, args.threads)


def measure(bundle: str, rounds: int, threads: int) -> None:
    settle = {"settle": True} if "settle" in inspect.signature(run_step).parameters else {}
    with opened_subject(bundle, ReplayRequest()) as (b, subject, dev), eager_modules(subject.model):
        model, state = subject.model, b.state()
        load_state(model, state)
        inp = bundle_step_inputs(b, state, subject.loss_fn)
        times: dict[str, list[float]] = {"bare": [], "op-level": []}
        for _ in range(rounds):
            for kind, ts in times.items():
                load_state(model, state)
                t0 = time.perf_counter()
                if kind == "bare":
                    run_step(model, inp, ops=False, monitors=False)
                else:
                    run_step(model, inp, ops=True, **settle)
                ts.append(time.perf_counter() - t0)
    bare, op = statistics.median(times["bare"]), statistics.median(times["op-level"])
    print(f"{Path(bundle).name}: bare replay {bare:.3f} s, op-level replay {op:.3f} s = {op / bare:.1f}x (medians of {rounds}; "
          f"torch {torch.__version__}, {threads} thread(s))")


if __name__ == "__main__":
    main()
