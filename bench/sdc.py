"""Silent data corruption: faults of the hardware the replay cannot see, injected into training
runs recorded as users record them, and the verdicts the diagnosis gives (issue 34).

Usage::

    python bench/sdc.py                          # 120 injections over mlp, cnn, gpt (CPU, a few minutes)
    python bench/sdc.py --per-model 6 --models mlp
    python bench/sdc.py --replay                 # also nanreplay.replay(bundle) each scored injection
    python bench/sdc.py --json out.json          # every injection, its fault and its verdict
    python bench/sdc.py --readme                 # rewrite the table in bench/README.md

Each injection is one fresh run of a model of ``bench/models.py`` (an MLP, a small CNN with
BatchNorm, a small GPT with dropout and tied embeddings) under a ``Recorder`` with its defaults
(``record(batch)``, ``log_loss``, AdamW), for ``STEPS`` steps; at step ``FAULT_STEP`` one fault:

* ``grad``: after backward, one element of one parameter's gradient buffer (a fault after the
  forward pass: the replay computes that gradient again);
* ``gemm``: in the forward pass, one element of the output of one ``Linear`` / ``Conv2d`` call
  (a forward hook on that one call);
* ``weight``: one weight element for one forward pass, put back after it (the bundle holds the
  clean weights, as the device's memory would after a transient fault).

Bits of the float32 element: ``exponent``: every 0 bit of its exponent set (a burst in the
exponent field: the value becomes +-Inf, or NaN when its mantissa is not 0); ``exponent-msb``: bit
30 alone (a value in [1, 2) becomes Inf or NaN, any other a finite value 2**128 larger or smaller);
``mantissa``: one mantissa bit (the value stays finite: silent).

Scored: the injections that made that step non-finite (the Recorder raised at ``FAULT_STEP``),
diagnosed in process by the Recorder (with ``--replay`` also from the bundle). Targets: faults
after the forward pass get a device verdict (cause ``transient``, ``fidelity.verdict`` ``device
fault``) naming the corrupted parameter (``fidelity.first_difference``) in at least 95%; faults in
the forward pass get 0 fabricated causes (a software cause: bad input data, numerics, overflow,
underflow, explosion, optimizer update, compiler); "not reproduced" with what differs is right.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import re
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nanreplay import NonFiniteGradientError, Recorder, replay  # noqa: E402


def _bench_module(name: str) -> Any:
    """``bench/<name>.py`` loaded by path (tests/ has its own ``models`` module, which a test that
    runs this benchmark has imported already)."""
    spec_ = importlib.util.spec_from_file_location(f"nanreplay_bench_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec_)  # type: ignore[arg-type]
    spec_.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


spec = _bench_module("models").spec
cpu_name = _bench_module("machine").cpu_name

STEPS, FAULT_STEP = 3, 1
MODELS = {"mlp": 0.125, "cnn": 0.25, "gpt": 0.25}  # width scales of bench/models.py: steps of a few ms on CPU
#: per model: (site, bits) -> injections, for a run of --per-model 40
PLAN = {("grad", "exponent"): 10, ("grad", "exponent-msb"): 3, ("grad", "mantissa"): 3,
        ("gemm", "exponent"): 6, ("gemm", "exponent-msb"): 3, ("gemm", "mantissa"): 3,
        ("weight", "exponent"): 6, ("weight", "exponent-msb"): 3, ("weight", "mantissa"): 3}
SOFTWARE_CAUSES = frozenset({"bad input data", "numerics", "overflow", "underflow", "explosion", "optimizer update", "compiler"})
EXPONENT = 0x7F800000


@dataclass
class Injection:
    """One fault and what the diagnosis said of it."""

    model: str
    site: str
    bits: str
    target: str = ""          # the parameter (grad, weight) or module (gemm)
    index: int = 0            # flat element index
    before: float = 0.0
    after: float = 0.0
    nonfinite_step: Optional[int] = None  # the step the Recorder stopped at (None: the run stayed finite)
    cause: Optional[str] = None
    verdict: Optional[str] = None         # fidelity.verdict
    named: Optional[str] = None           # fidelity.first_difference.name
    differences: list[str] = field(default_factory=list)
    summary: str = ""
    replay_cause: Optional[str] = None
    replay_named: Optional[str] = None
    seconds: float = 0.0

    @property
    def scored(self) -> bool:
        return self.nonfinite_step == FAULT_STEP

    @property
    def after_forward(self) -> bool:
        return self.site == "grad"


def flip(t: torch.Tensor, index: int, bits: str, rng: random.Random) -> tuple[float, float]:
    """Flip ``bits`` of element ``index`` (flat) of the float32 tensor ``t`` in place, through an
    int32 view of its storage (no autograd version bump). Returns (value before, value after)."""
    word = t.detach().view(-1).view(torch.int32)
    before = float(t.detach().view(-1)[index])
    w = int(word[index])
    if bits == "exponent":
        w |= EXPONENT
    elif bits == "exponent-msb":
        w ^= 1 << 30
    else:
        w ^= 1 << rng.randrange(23)
    word[index] = w if w < 2**31 else w - 2**32
    return before, float(t.detach().view(-1)[index])


def _fault(model: nn.Module, site: str, bits: str, rng: random.Random, inj: Injection) -> Callable[[str], Optional[Callable]]:
    """The fault as the loop applies it: ``at("forward")`` before the forward pass (returns what
    undoes it after), ``at("backward")`` after backward."""
    params = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.float32]
    if site in ("grad", "weight"):
        name, p = params[rng.randrange(len(params))]
        inj.target, inj.index = name, rng.randrange(p.numel())

        def at(when: str) -> Optional[Callable]:
            if site == "grad" and when == "backward" and p.grad is not None:
                inj.before, inj.after = flip(p.grad, inj.index, bits, rng)
            if site == "weight" and when == "forward":
                saved = p.data.view(-1)[inj.index].clone()
                inj.before, inj.after = flip(p.data, inj.index, bits, rng)
                return lambda: p.data.view(-1).__setitem__(inj.index, saved)
            return None

        return at
    gemms = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    name, mod = gemms[rng.randrange(len(gemms))]
    inj.target = name

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        handle.remove()  # one call
        inj.index = rng.randrange(out.numel())
        bad = out.detach().clone()
        inj.before, inj.after = flip(bad, inj.index, bits, rng)
        return out + (bad - out.detach())  # the corrupted value, the gradient of the clean call

    handle: Any = None

    def at(when: str) -> Optional[Callable]:
        nonlocal handle
        if when == "forward":
            handle = mod.register_forward_hook(hook)
            return lambda: handle.remove()
        return None

    return at


def run_one(model_name: str, site: str, bits: str, seed: int, *, also_replay: bool = False) -> Injection:
    """One fresh run with one fault at ``FAULT_STEP``, under a Recorder with its defaults."""
    make, batch_of, criterion = spec(model_name, MODELS[model_name])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    inj = Injection(model_name, site, bits)
    at = _fault(model, site, bits, rng, inj)

    def loss_fn(m: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        return criterion(m(x), y)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with Recorder(model, opt, loss_fn=loss_fn, out_dir=tmp) as rec:
                for step in range(STEPS):
                    batch = batch_of(gen, torch.device("cpu"))
                    rec.record(batch)
                    undo = at("forward") if step == FAULT_STEP else None
                    loss = loss_fn(model, batch)
                    if undo is not None:
                        undo()
                    rec.log_loss(loss)
                    opt.zero_grad()
                    loss.backward()
                    if step == FAULT_STEP:
                        at("backward")
                    opt.step()
        except NonFiniteGradientError as e:
            inj.nonfinite_step = e.step
            _verdict(inj, e.diagnosis or {})
            if also_replay and e.bundle_path is not None and inj.scored:
                d = replay(e.bundle_path)  # the program embedded in the bundle (the loss function is a closure here)
                inj.replay_cause = d["classification"]["cause"]
                inj.replay_named = ((d.get("fidelity") or {}).get("first_difference") or {}).get("name")
    inj.seconds = time.perf_counter() - t0
    return inj


def _verdict(inj: Injection, d: dict) -> None:
    fid = d.get("fidelity") or {}
    inj.cause = (d.get("classification") or {}).get("cause")
    inj.verdict = fid.get("verdict")
    inj.named = (fid.get("first_difference") or {}).get("name")
    inj.differences = [x["kind"] for x in fid.get("differences") or []]
    inj.summary = d.get("summary", "")


def plan(models: list[str], per_model: int, seed: int) -> list[tuple[str, str, str, int]]:
    """The injections: for each model, the PLAN's share of ``per_model``, each with its seed."""
    total = sum(PLAN.values())
    out = []
    for m in models:
        k = 0
        for (site, bits), n in PLAN.items():
            for _ in range(max(1, round(n * per_model / total))):
                out.append((m, site, bits, seed + 1000 * len(out) + k))
                k += 1
    return out


def score(injections: list[Injection]) -> dict:
    """The figures: per (site, bits), and the two targets."""
    rows = {}
    for inj in injections:
        r = rows.setdefault(f"{inj.site} / {inj.bits}", {"injected": 0, "nonfinite": 0, "device_right": 0, "device_wrong": 0,
                                                         "not_reproduced": 0, "fabricated": 0, "other": 0})
        r["injected"] += 1
        if not inj.scored:
            continue
        r["nonfinite"] += 1
        if inj.cause == "transient":
            r["device_right" if inj.named == inj.target else "device_wrong"] += 1
        elif inj.cause in SOFTWARE_CAUSES:
            r["fabricated"] += 1
        elif inj.verdict == "not reproduced":
            r["not_reproduced"] += 1
        else:
            r["other"] += 1
    after = [i for i in injections if i.scored and i.after_forward]
    forward = [i for i in injections if i.scored and not i.after_forward]
    device = sum(i.cause == "transient" and i.named == i.target for i in after)
    replayed = [i for i in after if i.replay_cause is not None]
    return {
        "rows": rows,
        "after_forward": {"scored": len(after), "device_verdict_right_parameter": device, "share": device / len(after) if after else None},
        "forward": {"scored": len(forward), "fabricated": sum(i.cause in SOFTWARE_CAUSES for i in forward),
                    "device_verdicts": sum(i.cause == "transient" for i in forward)},
        "replay_agrees": (sum(i.replay_cause == i.cause and i.replay_named == i.named for i in replayed), len(replayed)),
    }


def table(s: dict, injections: list[Injection], seconds: float, command: str) -> str:
    a, f = s["after_forward"], s["forward"]
    lines = [
        f"`{command}`: {len(injections)} injections over {', '.join(sorted({i.model for i in injections}))}; torch {torch.__version__}, "
        f"{cpu_name()} ({platform.machine()}), {torch.get_num_threads()} threads, {seconds:.0f} s in all (median "
        f"{sorted(i.seconds for i in injections)[len(injections) // 2]:.1f} s a run, the machine shared).",
        "",
        "| fault | injected | non-finite at that step | device verdict, right parameter | device verdict, other | not reproduced | fabricated cause |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, r in s["rows"].items():
        lines.append(f"| {k} | {r['injected']} | {r['nonfinite']} | {r['device_right']} | {r['device_wrong']} | {r['not_reproduced']} | {r['fabricated']} |")
    share = f"{100 * a['share']:.0f}%" if a["share"] is not None else "-"
    lines += ["", f"* after the forward pass (gradient buffers): {a['device_verdict_right_parameter']} of {a['scored']} non-finite steps "
                  f"got a device verdict naming the corrupted parameter ({share}; target at least 95%);",
              f"* in the forward pass (GEMM outputs, weights for one forward pass): {f['fabricated']} fabricated causes in {f['scored']} "
              f"non-finite steps (target 0), {f['device_verdicts']} device verdicts."]
    done, n = s["replay_agrees"]
    if n:
        lines.append(f"* `nanreplay.replay(bundle)` gave the same cause and parameter as the in-process diagnosis in {done} of {n}.")
    return "\n".join(lines)


#: the paragraph above the table in bench/README.md
INTRO = (
    'Faults of the hardware the replay cannot see (`bench/sdc.py`: bit flips in a gradient buffer after '
    'backward, in one GEMM output through a forward hook on one call, in a weight element for one forward '
    'pass; exponent and mantissa bits), injected at step 1 of fresh runs of the MLP, CNN and GPT of '
    '`bench/models.py` recorded with a default `Recorder`, and diagnosed in process (and, with '
    '`--replay`, from the bundle). A gradient-buffer fault is the only one the recording can show against '
    'a faithful replay: the loss and the gradients before it reproduced bit for bit, the recording '
    'departing at one element. A forward fault leaves nothing recorded inside the forward pass: the '
    'honest verdict is `not reproduced` (difference `forward pass`), never a software cause. Mantissa '
    'flips and most single exponent-bit flips of small values stay finite (the step is not non-finite, '
    'nothing is scored).'
)


def write_readme(text: str, readme: Path) -> None:
    """Put :data:`INTRO` and ``text`` under the '## Silent data corruption' heading of ``readme``
    (replacing what was there)."""
    head = "## Silent data corruption: device verdicts only with evidence"
    body = readme.read_text()
    section = f"{head}\n\n{textwrap.fill(INTRO, 100)}\n\n{text}\n"
    if head in body:
        body = re.sub(rf"{re.escape(head)}\n.*?(?=\n## |\Z)", section.rstrip("\n") + "\n", body, flags=re.S)
    else:
        body = body.rstrip("\n") + "\n\n" + section
    readme.write_text(body)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp, cnn, gpt")
    p.add_argument("--per-model", type=int, default=40, help="injections per model (default 40: 120 in all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", action="store_true", help="also replay each scored injection's bundle")
    p.add_argument("--json", type=Path, help="write every injection and the scores here")
    p.add_argument("--readme", action="store_true", help="rewrite the table in bench/README.md")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per injection on stderr")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    t0 = time.perf_counter()
    runs = []
    for model_name, site, bits, seed in plan(models, args.per_model, args.seed):
        inj = run_one(model_name, site, bits, seed, also_replay=args.replay)
        runs.append(inj)
        if args.verbose:
            print(f"{model_name:4} {site:6} {bits:12} {inj.target:24} {inj.before:.3g} -> {inj.after:.3g}: step {inj.nonfinite_step}, "
                  f"{inj.cause} ({inj.named})", file=sys.stderr)
    s = score(runs)
    command = "python bench/sdc.py" + (f" --models {args.models}" if args.models != ",".join(MODELS) else "") + (
        f" --per-model {args.per_model}" if args.per_model != 40 else "") + (" --replay" if args.replay else "")
    text = table(s, runs, time.perf_counter() - t0, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"scores": s, "injections": [asdict(i) for i in runs]}, indent=1, default=str))
    if args.readme:
        write_readme(text, HERE / "README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
