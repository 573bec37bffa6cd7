"""What nanreplay costs as the model grows: GPT models of 3.7M, 42M and 124M parameters, on CPU.

For each size, in one process:

* **per-step overhead**: two copies of the model (same initial weights, AdamW each), one plain and
  one under a default ``Recorder(model, opt, loss_fn=...)``, trained side by side; each round runs
  one step of each, in an order that alternates per round; the figure is the median over rounds
  of recorded step / plain step (in the same round), with the interquartile range;
* **start-up**: what the Recorder does once: its construction (the weights' attach scan) and its
  first step against the plain model's first step (``torch._dynamo`` is imported before either:
  any ``torch.optim`` optimizer's first step imports it, with or without a Recorder); by default
  nothing is exported before a step fails (``export_early=False``);
* **bytes held** by the Recorder after those steps (:meth:`Recorder.held_bytes`);
* then the recorded model fails (``--failure``: by default ``overflow``, a finite weight of 3e38
  makes the first MLP layer of block 1 overflow, a NaN born inside the model, which the diagnosis
  has to find at the op level; or ``padding``, a batch whose every target is padding, so the loss
  is the mean over no targets, 0/0: a NaN born in the loss, whose fix the diagnosis verifies by a
  replay that rewrites the loss op), and the failing step is timed from its start to the ``NonFiniteGradientError``: **in process**
  (detect + write the bundle + export the program and verify it + diagnose + write again), with the parts read
  from nanreplay's own log lines (bundle write, program export, diagnosis);
* **bundle size** against the **training state**: parameters + optimizer state + the batch (the
  bytes a checkpoint of the step would hold);
* **out of process**: ``nanreplay replay BUNDLE --json`` in a fresh interpreter (imports included),
  wall-clock, the model's code not on the path (the embedded program replays), ``--replays`` times
  (default 3), each run between two plain steps of the plain model: its figure in step-times is
  the median over runs of the run against the mean of the two plain steps around it (this
  machine's speed drifts by 20% within minutes, so a run is compared with steps taken beside it).

Every other time is also given in plain step-times (the median plain step of the rounds). Usage::

    python bench/scale.py --readme                          # the three sizes; writes the table in bench/README.md
    python bench/scale.py --sizes 42M --rounds 8            # one size
    python bench/scale.py --help

``--readme`` rewrites the section between ``<!-- scale -->`` markers in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402
from machine import cpu_name  # noqa: E402

from nanreplay import NonFiniteGradientError, Recorder  # noqa: E402


@dataclass(frozen=True)
class Size:
    """One GPT shape (``bench/models.py``'s GPT: pre-LN blocks, tied embedding) and its batch."""

    name: str
    vocab: int
    d: int
    layers: int
    heads: int
    ctx: int
    batch: int
    rounds: int  # default interleaved rounds
    tied: bool = True  # the output head shares the token embedding (GPT-2); False: its own weight

    def make(self) -> torch.nn.Module:
        m = models.GPT(vocab=self.vocab, d=self.d, layers=self.layers, heads=self.heads, ctx=self.ctx)
        if not self.tied:
            m.head.weight = torch.nn.Parameter(m.tok.weight.detach().clone())
        return m


SIZES = {
    # the bench GPT of overhead.py / diagnosis.py (bench/models.py spec("gpt"))
    "3.7M": Size("3.7M", vocab=2048, d=256, layers=4, heads=4, ctx=64, batch=8, rounds=9),
    # issue 23's model: 8 layers, width 512, vocabulary 16,384 (head not tied), 4 x 128 tokens
    "42M": Size("42M", vocab=16384, d=512, layers=8, heads=8, ctx=128, batch=4, rounds=5, tied=False),
    # GPT-2 small's shape (12 x 768, 50,257 tokens), a short context to keep it modest on 2 cores
    "124M": Size("124M", vocab=50257, d=768, layers=12, heads=12, ctx=128, batch=4, rounds=2),
}


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_batch(size: Size, g: torch.Generator) -> tuple:
    t = torch.randint(0, size.vocab, (size.batch, size.ctx + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def poison(model: torch.nn.Module) -> None:
    """A finite weight so large that the first MLP layer of block 1 overflows float32."""
    with torch.no_grad():
        model.blocks[1].mlp[0].weight[0, :] = 3e38


def all_padding(batch: tuple) -> tuple:
    """The batch with every target set to padding (-100, ``F.cross_entropy``'s ``ignore_index``)."""
    x, y = batch
    return x, torch.full_like(y, -100)


#: ``--failure``: how the failing step fails (the model, the batch) -> the batch it runs
FAILURES = {
    "overflow": lambda model, batch: (poison(model), batch)[1],
    "padding": lambda model, batch: all_padding(batch),
}


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def training_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> int:
    """Parameters (tied ones once) + optimizer state tensors + batch tensors, in bytes."""
    opt_tensors = [v for s in opt.state.values() for v in s.values()]
    return nbytes(dict((id(p), p) for p in model.parameters()).values()) + nbytes(opt_tensors) + nbytes(batch)


class _Log(logging.Handler):
    """Keeps nanreplay's log records of the failing step, for the times it logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def seconds(self, pattern: str, index: int) -> list[float]:
        return [float(r.args[index]) for r in self.records if isinstance(r.args, tuple) and re.search(pattern, str(r.msg))]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple, rec: Optional[Recorder] = None) -> float:
    t0 = time.perf_counter()
    if rec is not None:
        rec.record(batch)
    loss = loss_fn(model, batch)
    if rec is not None:
        rec.log_loss(loss)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def _q(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _profiled(top: int, what: str, fn: Any) -> Any:
    """``fn()``, under cProfile when ``top``: the ``top`` entries by cumulative time go to stderr."""
    if not top:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        print(f"--- cProfile: {what} ---\n{out.getvalue()}", file=sys.stderr)


def bench_size(size: Size, rounds: int, out_dir: Path, verbose: bool, profile: int = 0, replays: int = 3,
               failure: str = "overflow") -> dict:
    torch.manual_seed(0)
    plain = size.make()
    recorded = size.make()
    recorded.load_state_dict(plain.state_dict())
    params = models.param_count(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_r = torch.optim.AdamW(recorded.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    log = _Log()
    lg = logging.getLogger("nanreplay")
    lg.addHandler(log)
    prev_level = lg.level
    lg.setLevel(logging.INFO)
    importlib.import_module("torch._dynamo")  # imported by any optimizer's first step: the plain loop's cost as much as the Recorder's
    try:
        t0 = time.perf_counter()
        rec = Recorder(recorded, opt_r, loss_fn=loss_fn, out_dir=str(out_dir))
        construct = time.perf_counter() - t0
        with rec:
            batch = make_batch(size, g)
            first_plain = _step(plain, opt_p, batch)       # warm-up step (allocations, AdamW state)
            first_rec = _step(recorded, opt_r, batch, rec)
            plains, ratios, recs = [], [], []
            for i in range(rounds):
                batch = make_batch(size, g)
                if i % 2 == 0:
                    p = _step(plain, opt_p, batch)
                    r = _step(recorded, opt_r, batch, rec)
                else:
                    r = _step(recorded, opt_r, batch, rec)
                    p = _step(plain, opt_p, batch)
                plains.append(p)
                recs.append(r)
                ratios.append(r / p)
                if verbose:
                    print(f"  [{size.name}] round {i + 1}/{rounds}: plain {p * 1e3:.0f} ms, recorded {r * 1e3:.0f} ms", file=sys.stderr)
            held = rec.held_bytes()
            step = statistics.median(plains)
            batch = make_batch(size, g)
            state_bytes = training_state_bytes(recorded, opt_r, batch)
            early = log.seconds(r"exported the %s program at step %d in", 2)  # export_early, at the first step
            batch = FAILURES[failure](recorded, batch)
            log.records.clear()
            t0 = time.perf_counter()
            try:
                _profiled(profile, f"{size.name}: the failing step in process", lambda: _step(recorded, opt_r, batch, rec))
                raise RuntimeError(f"the failing step ({failure}) did not fail")
            except NonFiniteGradientError as e:
                in_process = time.perf_counter() - t0
                bundle = Path(e.bundle_path)
            diag = rec.last_diagnosis or {}
    finally:
        lg.removeHandler(log)
        lg.setLevel(prev_level)
    writes = log.seconds(r"^nanreplay: wrote ", 3)
    export = log.seconds(r"embedded step %d's %s program in", 2)
    diag_s = log.seconds(r"^nanreplay: diagnosis of step %d \(", 1)
    bundle_bytes = bundle.stat().st_size
    del recorded, opt_r
    if profile:  # the out-of-process replay's work, in this process (the fresh interpreter's imports aside)
        import nanreplay

        _profiled(profile, f"{size.name}: nanreplay.replay of the bundle", lambda: nanreplay.replay(bundle))
    # out of process: a fresh interpreter, the bench's model code not importable (cwd: the bundle's folder);
    # each run between two plain steps, its ratio against their mean (the machine's speed drifts)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS=str(torch.get_num_threads()))
    replay_runs, replay_ratios, proc = [], [], None
    for i in range(replays):
        before = _step(plain, opt_p, batch)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "nanreplay.cli", "replay", str(bundle), "--json"],
                              cwd=str(out_dir), env=env, capture_output=True, text=True)
        replay_runs.append(time.perf_counter() - t0)
        after = _step(plain, opt_p, batch)
        replay_ratios.append(replay_runs[-1] / ((before + after) / 2))
        if verbose:
            print(f"  [{size.name}] replay {i + 1}/{replays}: {replay_runs[-1]:.1f} s, plain steps around it {before * 1e3:.0f} / "
                  f"{after * 1e3:.0f} ms: {replay_ratios[-1]:.1f} steps", file=sys.stderr)
        if proc.returncode not in (0,):
            print(proc.stderr[-2000:], file=sys.stderr)
    del plain, opt_p
    replay_s = statistics.median(replay_runs)
    try:
        replay_summary = json.loads(proc.stdout).get("summary")
    except (ValueError, AttributeError):
        replay_summary = None
    res = {
        "params": params, "tokens_per_step": size.batch * size.ctx, "rounds": rounds,
        "plain_step_s": step, "recorded_step_s": statistics.median(recs),
        "overhead_x": statistics.median(ratios), "overhead_iqr": list(_q(ratios)),
        "held_bytes": held, "training_state_bytes": state_bytes, "bundle_bytes": bundle_bytes,
        "bundle_x_state": bundle_bytes / state_bytes,
        "in_process_s": in_process, "write_s": sum(writes), "writes": len(writes), "export_s": export[0] if export else None,
        "early_export_s": early[0] if early else None,
        "startup_s": construct + first_rec - first_plain, "construct_s": construct,
        "diagnose_s": diag_s[0] if diag_s else None,
        "replay_cli_s": replay_s, "replay_cli_rc": proc.returncode if proc is not None else None,
        "replay_cli_runs_s": replay_runs, "replay_cli_ratios": replay_ratios,
        "summary": diag.get("summary"), "replay_summary": replay_summary,
    }
    for k in ("in_process_s", "write_s", "export_s", "early_export_s", "startup_s", "diagnose_s", "replay_cli_s"):
        if res[k] is not None:
            res[k.replace("_s", "_x_step")] = res[k] / step
    res["replay_cli_x_step"] = statistics.median(replay_ratios)  # each run against the plain steps around it
    return res


def run(sizes: list[str], rounds: Optional[int], verbose: bool, profile: int = 0, replays: int = 3, failure: str = "overflow") -> dict:
    out: dict[str, Any] = {"machine": {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
                                       "threads": torch.get_num_threads()}, "failure": failure, "sizes": {}}
    for name in sizes:
        size = SIZES[name]
        with tempfile.TemporaryDirectory(prefix="nanreplay-scale-") as tmp:
            r = bench_size(size, rounds or size.rounds, Path(tmp), verbose, profile, replays, failure)
        out["sizes"][name] = r
        print(f"{name}: {r['params'] / 1e6:.1f} M params, plain step {r['plain_step_s'] * 1e3:.0f} ms, recorded {r['overhead_x']:.3f}x, "
              f"held {r['held_bytes'] / 2**20:.1f} MiB, bundle {r['bundle_bytes'] / 2**20:.0f} MiB = {r['bundle_x_state']:.2f}x state "
              f"({r['training_state_bytes'] / 2**20:.0f} MiB); in process {r['in_process_s']:.1f} s = {r['in_process_x_step']:.1f} steps "
              f"(writes {r['write_s']:.1f} s, embed {r['export_s'] or 0:.1f} s [early export {r['early_export_s'] or 0:.1f} s], diagnosis {r['diagnose_s'] or 0:.1f} s); "
              f"start-up {r['startup_s']:.2f} s = {r['startup_x_step']:.2f} steps; "
              f"`nanreplay replay` {r['replay_cli_s']:.1f} s = {r['replay_cli_x_step']:.1f} steps (rc {r['replay_cli_rc']}); "
              f"{(r['summary'] or '')[:100]}", flush=True)
    return out


def _fmt_x(s: Optional[float], step: float) -> str:
    return "-" if s is None else f"{s:.1f} s = {s / step:.1f}"


def table(res: dict, command: str) -> str:
    m = res["machine"]
    sizes = res["sizes"]
    cols = list(sizes)
    head = [f"{n}: {sizes[n]['params'] / 1e6:.1f} M params, {sizes[n]['tokens_per_step']} tokens/step" for n in cols]
    rows = [
        ("plain step (median)", [f"{sizes[n]['plain_step_s'] * 1e3:.0f} ms" for n in cols]),
        ("default Recorder / plain step (median of rounds, [IQR])",
         [f"{sizes[n]['overhead_x']:.3f}x [{sizes[n]['overhead_iqr'][0]:.2f}-{sizes[n]['overhead_iqr'][1]:.2f}] ({sizes[n]['rounds']} rounds)" for n in cols]),
        ("bytes held by the Recorder", [f"{sizes[n]['held_bytes'] / 2**20:.1f} MiB" for n in cols]),
        ("training state (params + AdamW state + batch)", [f"{sizes[n]['training_state_bytes'] / 2**20:.0f} MiB" for n in cols]),
        ("bundle (target <= 1.15x the training state)", [f"{sizes[n]['bundle_bytes'] / 2**20:.0f} MiB = **{sizes[n]['bundle_x_state']:.2f}x**" for n in cols]),
        ("first bundle write (before the diagnosis; written again with it)", [_fmt_x(sizes[n]['write_s'], sizes[n]['plain_step_s']) for n in cols]),
        ("**start-up**: Recorder construction + its first step - the plain first step (target <= 1 step at 42M)",
         [f"**{_fmt_x(sizes[n].get('startup_s'), sizes[n]['plain_step_s'])}**" for n in cols]),
        ("program export + verifying replay at the first step (`export_early=True` only)",
         [_fmt_x(sizes[n].get('early_export_s'), sizes[n]['plain_step_s']) for n in cols]),
        ("program export + verifying replay at the dump (the default)", [_fmt_x(sizes[n]['export_s'], sizes[n]['plain_step_s']) for n in cols]),
        ("in-process diagnosis", [_fmt_x(sizes[n]['diagnose_s'], sizes[n]['plain_step_s']) for n in cols]),
        ("**in process: detect + dump + diagnosis** (target <= 10 steps at 42M)",
         [f"**{_fmt_x(sizes[n]['in_process_s'], sizes[n]['plain_step_s'])}**" for n in cols]),
        ("**`nanreplay replay --json`**, a fresh process (target <= 8 steps; median of runs, each against the plain steps around it)",
         [f"**{sizes[n]['replay_cli_s']:.1f} s = {sizes[n]['replay_cli_x_step']:.1f}** ({len(sizes[n]['replay_cli_ratios'])} runs: "
          + ", ".join(f"{x:.1f}" for x in sizes[n]['replay_cli_ratios']) + ")" for n in cols]),
        ("diagnosis (`nanreplay replay`)", [(sizes[n]["replay_summary"] or sizes[n]["summary"] or "").split(", step")[0][:140] for n in cols]),
    ]
    lines = [f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, python {m['python']}; command: `{command}`", "",
             "| | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(vals) + " |" for label, vals in rows]
    lines.append("")
    lines.append("Times in seconds = plain step-times of the same model (the median plain step of the rounds; "
                 "`nanreplay replay`: each run against the plain steps around it).")
    return "\n".join(lines)


def write_readme(text: str, readme: Path) -> None:
    body = readme.read_text()
    block = f"<!-- scale -->\n{text}\n<!-- /scale -->"
    if "<!-- scale -->" in body:
        body = re.sub(r"<!-- scale -->.*?<!-- /scale -->", lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip("\n") + "\n\n## Cost at scale\n\n`bench/scale.py` measures, on GPT models of 3.7M, 42M and 124M parameters, " \
            "the default Recorder's per-step overhead and memory, the bundle against the training state, and the time from a failing " \
            "step to a diagnosis in process and with `nanreplay replay`, in plain step-times (see the script's docstring for the method). " \
            "The table is written by the script (`--readme`).\n\n" + block + "\n"
    readme.write_text(body)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="model sizes (default: all three)")
    p.add_argument("--rounds", type=int, help="interleaved rounds per size (default: 9 / 5 / 2)")
    p.add_argument("--replays", type=int, default=3, help="`nanreplay replay` runs per size, each between two plain steps (default 3)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--readme", action="store_true", help="rewrite the table between <!-- scale --> markers in bench/README.md")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2; 1 on a machine shared with other jobs)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the failing step and an in-process replay; print the top N entries to stderr")
    p.add_argument("--failure", choices=list(FAILURES), default="overflow",
                   help="how the failing step fails: overflow (a 3e38 weight, a NaN born in the forward pass; default) or padding "
                        "(every target is padding, a NaN born in the loss, with a fix verified by replay)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each round")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args.sizes, args.rounds, args.verbose, args.profile, args.replays, args.failure)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if args.readme:
        given = list(argv if argv is not None else sys.argv[1:])
        shown = " ".join(a for i, a in enumerate(given) if not a.startswith("--json") and not (i and given[i - 1] == "--json"))
        write_readme(table(res, f"python bench/scale.py {shown}".strip()), HERE / "README.md")
    return res


if __name__ == "__main__":
    main()
