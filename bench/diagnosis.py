"""How long a diagnosis takes, in plain training steps of the same model, measured side by side.

For each failure scenario on the bench GPT-style model (``bench/models.py``), a recorded run fails
at step 5 and writes a bundle; then, in rounds, one plain training step and one replay of the
bundle to a diagnosis (``nanreplay.replay``, the embedded program, the op monitor on) are timed
back to back, and the figure is the median over rounds of replay time / step time. The
in-process diagnosis the Recorder runs (detect, dump, export the program, diagnose, dump again)
is timed once per scenario from the failing step's start to the exception.

Scenarios (each needs a different part of the diagnosis):

* ``weights``: an Inf weight at step start (answered from the bundle, no monitored replay);
* ``forward overflow``: a finite weight of 3e38 makes the first MLP layer of block 1 overflow
  (op monitor, wider-dtype recompute);
* ``loss 0/0``: the loss divides by a count of the batch that is 0 (op monitor, provenance);
* ``backward sqrt``: a hand-written norm of an all-zero row: finite forward, Inf in backward
  (op monitor with anomaly-mode source lines, per-sample rows).

Usage: ``python bench/diagnosis.py [--rounds 5] [--readme]``; ``--readme`` rewrites the table
between ``<!-- diagnosis -->`` markers in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402
from machine import cpu_name  # noqa: E402

import nanreplay  # noqa: E402
from nanreplay import NonFiniteGradientError, Recorder  # noqa: E402

FAIL_AT = 5


def _poison(name: str) -> tuple[Callable, Callable]:
    """(poison(model, batch) applied before the failing step, loss(model, batch))."""

    def base_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y, w = batch
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / w.sum()

    def sqrt_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y, w = batch
        h = model.blocks[0].ln1(model.tok(x))                      # (B, T, d)
        h = h * (w[:, None, None] > 0)                             # a sample with weight 0 is an all-zero row
        norm = torch.sqrt((h * h).sum(-1))                         # sqrt(0) = 0: finite forward, Inf derivative
        return base_loss(model, batch) + norm.mean()

    def weights(model: torch.nn.Module, batch: tuple) -> tuple:
        with torch.no_grad():
            model.blocks[1].mlp[0].weight[0, 0] = float("inf")
        return batch

    def overflow(model: torch.nn.Module, batch: tuple) -> tuple:
        with torch.no_grad():
            model.blocks[1].mlp[0].weight[0, :] = 3e38
        return batch

    def zero_count(model: torch.nn.Module, batch: tuple) -> tuple:
        x, y, w = batch
        return x, y, torch.zeros_like(w)

    def zero_row(model: torch.nn.Module, batch: tuple) -> tuple:
        x, y, w = batch
        w = w.clone()
        w[2] = 0.0
        return x, y, w

    return {
        "weights": (weights, base_loss),
        "forward overflow": (overflow, base_loss),
        "loss 0/0": (zero_count, base_loss),
        "backward sqrt": (zero_row, sqrt_loss),
    }[name]


def _record(name: str, tmp: str) -> tuple[str, float, Callable, Callable]:
    factory, make_batch, _ = models.spec("gpt")
    poison, loss_fn = _poison(name)
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=tmp) as rec:
        for i in range(FAIL_AT + 1):
            x, y = make_batch(g, torch.device("cpu"))
            batch = (x, y, torch.ones(x.shape[0]))
            if i == FAIL_AT:
                batch = poison(model, batch)
            t0 = time.perf_counter()
            try:
                rec.record(batch)
                loss = loss_fn(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
            except NonFiniteGradientError as e:
                return e.bundle_path, time.perf_counter() - t0, factory, loss_fn
    raise RuntimeError(f"scenario {name!r} did not fail")


def _plain_step(factory: Callable, loss_fn: Callable, g: torch.Generator) -> float:
    _, make_batch, _ = models.spec("gpt")
    model = _plain_step.model = getattr(_plain_step, "model", None) or factory()  # type: ignore[attr-defined]
    opt = _plain_step.opt = getattr(_plain_step, "opt", None) or torch.optim.AdamW(model.parameters(), lr=1e-4)  # type: ignore[attr-defined]
    x, y = make_batch(g, torch.device("cpu"))
    t0 = time.perf_counter()
    loss = loss_fn(model, (x, y, torch.ones(x.shape[0])))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def bench(rounds: int) -> dict:
    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    out: dict[str, Any] = {"machine": {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
                                       "threads": torch.get_num_threads(), "params": models.param_count(models.spec("gpt")[0]())},
                           "scenarios": {}}
    g = torch.Generator().manual_seed(7)
    for name in ("weights", "forward overflow", "loss 0/0", "backward sqrt"):
        with tempfile.TemporaryDirectory() as tmp:
            path, in_process, factory, loss_fn = _record(name, tmp)
            for _ in range(2):  # warm up the plain step
                _plain_step(factory, loss_fn, g)
            ratios, steps, replays, f_ratios, f_replays = [], [], [], [], []
            diag: dict = {}
            for _ in range(rounds):
                s = _plain_step(factory, loss_fn, g)
                t0 = time.perf_counter()
                diag = nanreplay.replay(path)  # the embedded program (no user code)
                r = time.perf_counter() - t0
                t0 = time.perf_counter()
                nanreplay.replay(path, model_factory=factory, loss_fn=loss_fn)  # the user's own model code
                f = time.perf_counter() - t0
                steps.append(s)
                replays.append(r)
                ratios.append(r / s)
                f_replays.append(f)
                f_ratios.append(f / s)
            step = statistics.median(steps)
            out["scenarios"][name] = {
                "plain_step_s": step, "replay_s": statistics.median(replays), "replay_x_step": statistics.median(ratios),
                "replay_x_step_range": [min(ratios), max(ratios)], "factory_replay_s": statistics.median(f_replays),
                "factory_replay_x_step": statistics.median(f_ratios), "factory_replay_x_step_range": [min(f_ratios), max(f_ratios)],
                "in_process_s": in_process, "in_process_x_step": in_process / step,
                "summary": diag.get("summary"), "model_source": diag.get("model_source"),
            }
            print(f"{name:<18} replay {statistics.median(replays):6.2f} s = {statistics.median(ratios):5.1f} steps "
                  f"[{min(ratios):.1f}-{max(ratios):.1f}]; with the factory {statistics.median(f_ratios):5.1f} steps; "
                  f"in process {in_process:6.2f} s = {in_process / step:5.1f} steps; {diag.get('summary', '')[:90]}")
    return out


def _shown_args(args: list[str]) -> str:
    """The command line as shown in the README: without ``--json FILE`` (a local path)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return " ".join(out)


def _table(res: dict, command: str) -> str:
    m = res["machine"]
    lines = [
        f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, python {m['python']}; GPT-style model, {m['params'] / 1e6:.2f} M parameters; "
        f"command: `{command}`",
        "",
        "| failure | plain step | replay to diagnosis: embedded program (median of rounds) | same, with the model factory | "
        "in-process detect + dump + export + diagnose | diagnosis |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["scenarios"].items():
        lo, hi = r["replay_x_step_range"]
        flo, fhi = r["factory_replay_x_step_range"]
        lines.append(f"| {name} | {r['plain_step_s'] * 1e3:.0f} ms | {r['replay_s']:.2f} s = **{r['replay_x_step']:.1f} steps** [{lo:.1f}-{hi:.1f}] | "
                     f"{r['factory_replay_s']:.2f} s = **{r['factory_replay_x_step']:.1f} steps** [{flo:.1f}-{fhi:.1f}] | "
                     f"{r['in_process_s']:.2f} s = {r['in_process_x_step']:.1f} steps | {(r['summary'] or '')[:140]} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="replays per scenario (each beside one plain step)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--readme", action="store_true", help="rewrite the table between <!-- diagnosis --> markers in bench/README.md")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    res = bench(args.rounds)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if args.readme:
        readme = Path(__file__).resolve().parent / "README.md"
        text = readme.read_text()
        block = "<!-- diagnosis -->\n" + _table(res, "python bench/diagnosis.py " + _shown_args(argv if argv is not None else sys.argv[1:])) + "\n<!-- /diagnosis -->"
        if "<!-- diagnosis -->" in text:
            text = re.sub(r"<!-- diagnosis -->.*?<!-- /diagnosis -->", lambda _: block, text, flags=re.S)
        else:
            text += "\n## Diagnosis time\n\n`bench/diagnosis.py` times a replay to the diagnosis beside a plain training step of the same model, " \
                    "in one process, and the in-process diagnosis from the failing step's start to the exception.\n\n" + block + "\n"
        readme.write_text(text)
    return res


if __name__ == "__main__":
    main()
