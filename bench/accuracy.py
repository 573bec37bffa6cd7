"""Diagnosis accuracy on the corpus of real NaN/Inf bugs (tests/corpus/cases), for nanreplay and two
common alternatives, scored field by field against each case's EXPECTED.

Usage::

    python bench/accuracy.py                          # every case (a few minutes on 2 cores)
    python bench/accuracy.py --cases '*attention*'    # a glob (or substring) on case names
    python bench/accuracy.py --json out.json          # everything, per case and method
    python bench/accuracy.py --readme                 # rewrite the tables in bench/README.md

Three methods, run on every case in a subprocess per case with a time limit (a case that hangs or
crashes is reported as an error, scored as a miss on every field; ``--jobs`` cases run at once):

1. **nanreplay**: the case's loop under a ``Recorder`` (``diagnose=False``), then the bundle through
   ``python -m nanreplay.cli replay BUNDLE --json`` in another process (exit code 3, "not
   reproduced", still prints the diagnosis).
2. **anomaly mode**: the same loop, no Recorder, each step under
   ``torch.autograd.detect_anomaly(check_nan=True)``. It stops at the first ``RuntimeError`` anomaly
   mode raises ("Function 'XBackward0' returned nan values ..."), else at the first step whose
   logged loss or gradient 2-norm (as ``clip_grad_norm_`` computes it) is non-finite. It reports
   what anomaly mode can tell: the step; phase ``backward`` (it only checks backward), or ``loss``
   when the step's loss was already non-finite (it cannot tell forward from loss); op = the
   node's forward op (``SqrtBackward0`` -> ``sqrt``); no module, samples or cause.
3. **forward hooks**: the per-module detector people paste: a forward hook on every module checks
   ``torch.isfinite(...).all()`` on its inputs and outputs, a full backward hook on every module
   checks its ``grad_input``. The first module seen with a non-finite input -> phase ``input``; the
   first with a non-finite output from finite inputs -> phase ``forward``, that module, samples =
   the non-finite rows of its output; a non-finite loss with nothing in the forward -> ``loss``;
   the first module whose ``grad_input`` is non-finite -> ``backward``, that module; a non-finite
   gradient caught only at ``optimizer.step()`` -> ``backward``, no module. No op, no cause.

Fields are compared with ``tests/corpus/runner.py:field_matches`` (the same rule as
tests/diagnosis/test_corpus.py). The table shows per-field accuracy, percentage and count, and "all six"
(cases with every field right); then how often nanreplay proposed a fix and a replay that rewrites
only the origin op verified it (``classification.fix``), case by case; then, per method, the misses
(case, field, expected, got).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from corpus import runner  # noqa: E402  (tests/corpus/runner.py)
from machine import cpu_name  # noqa: E402  (bench/machine.py)

METHODS = ("nanreplay", "anomaly", "hooks")
TITLES = {"nanreplay": "nanreplay", "anomaly": "anomaly mode", "hooks": "forward hooks"}
ROWS = runner.FIELDS + ("all six",)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ============================================================================= workers (subprocess)

class Detected(Exception):
    """A baseline detector fired: what it reports."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(str(fields))
        self.fields = fields


def _nonfinite(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and not bool(torch.isfinite(t).all())


def _leaves(tree: Any) -> list:
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tree)


def _rows(t: Any) -> Optional[list]:
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(1) if t.dim() > 1 else ~torch.isfinite(t)
    return bad.nonzero().flatten().tolist() or None


def _grad_norm(model: Any) -> Optional[float]:
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])))


def _finite_number(x: Optional[float]) -> bool:
    import math

    return x is None or math.isfinite(x)


def _loss_bad(rec: runner.NullRecorder) -> bool:
    import math

    return rec.last_loss is not None and not all(math.isfinite(float(v)) for v in rec.last_loss.reshape(-1).float())


def _node_to_op(node: str) -> str:
    """'SqrtBackward0' -> 'sqrt', 'LogSoftmaxBackward0' -> 'log_softmax', 'VecNormBackward' -> 'vec_norm'."""
    base = re.sub(r"Backward\d*$", "", node)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


def work_nanreplay(case: Any, timeout: float) -> dict:
    import shutil

    out_dir = tempfile.mkdtemp(prefix="nanreplay-acc-")
    try:
        t0 = time.perf_counter()
        rec = runner.record_case(case, out_dir, diagnose=False)
        t1 = time.perf_counter()
        # case files only define names; a case whose program cannot be embedded replays from its factory
        cmd = [sys.executable, "-m", "nanreplay.cli", "replay", rec["bundle"], "--json", "--import-script"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(ROOT))
        t2 = time.perf_counter()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if proc.returncode not in (0, 3):
        lines = [ln.strip() for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise RuntimeError(f"`nanreplay replay` exited {proc.returncode}: {' / '.join(lines[-2:])[-500:]}")
    diag = json.loads(proc.stdout)
    return {"diagnosis": diag, "fields": runner.got_fields(diag), "exit_code": proc.returncode,
            "record_s": round(t1 - t0, 2), "replay_s": round(t2 - t1, 2)}


def _check_before_step(model: Any, opt: Any, rec: Any) -> None:
    """What a user's loop checks before ``optimizer.step()``: a non-finite loss, then a
    non-finite grad norm, each raised as :class:`Detected` (an optimizer step pre-hook)."""

    def pre_step(optimizer, args, kwargs):
        if _loss_bad(rec):
            raise Detected(phase="loss")
        if not _finite_number(_grad_norm(model)):
            raise Detected(phase="backward")
        return None

    opt.register_step_pre_hook(pre_step)


def _baseline_loop(case: Any, rec: Any, model_setup=None) -> dict:
    """Run the case's loop without a Recorder until a detector raises Detected; return its fields
    with the step added."""
    model, opt, _scaler = runner.build(case)
    if model_setup is not None:
        model_setup(model)
    _check_before_step(model, opt, rec)
    step_fn = runner.train_step_of(case)
    for i, batch in enumerate(case.batches()):
        rec.last_loss = None
        try:
            step_fn(model, opt, batch, rec, i)
        except Detected as d:
            return dict(step=i, **d.fields)
    return {}


def work_anomaly(case: Any, timeout: float) -> dict:
    import torch

    rec = runner.NullRecorder()

    def ctx():
        return torch.autograd.detect_anomaly(check_nan=True)

    def step_end():  # a GradScaler loop never calls optimizer.step() on a skipped step: look at the loss
        if _loss_bad(rec):
            raise Detected(phase="loss")

    found = _anomaly_run(case, rec, ctx, step_end)
    fields = {"step": found.get("step"), "phase": found.get("phase"), "module": None, "op": found.get("op"),
              "samples": None, "cause": None}
    return {"fields": fields, "message": found.get("message")}


def _anomaly_run(case: Any, rec: Any, ctx, step_end) -> dict:
    model, opt, _scaler = runner.build(case)
    _check_before_step(model, opt, rec)
    step_fn = runner.train_step_of(case)
    for i, batch in enumerate(case.batches()):
        rec.last_loss = None
        try:
            with ctx():
                step_fn(model, opt, batch, rec, i)
            step_end()
        except Detected as d:
            return dict(step=i, **d.fields)
        except RuntimeError as e:
            m = re.search(r"Function '(\w+)' returned nan values", str(e))
            if not m:
                raise
            phase = "loss" if _loss_bad(rec) else "backward"
            return {"step": i, "phase": phase, "op": _node_to_op(m.group(1)), "message": str(e).splitlines()[0][:200]}
    return {}


def work_hooks(case: Any, timeout: float) -> dict:
    import torch

    class DetectingRecorder(runner.NullRecorder):
        def log_loss(self, loss):
            super().log_loss(loss)
            if _nonfinite(self.last_loss):
                raise Detected(phase="loss", module=None, samples=None)

    rec = DetectingRecorder()

    def setup(model):
        names = {m: n for n, m in model.named_modules()}

        def fwd(m, args, output):
            if not torch.is_grad_enabled():
                return None
            if any(_nonfinite(t) for t in _leaves(args)):
                raise Detected(phase="input", module=None, samples=None)
            bad = [t for t in _leaves(output) if _nonfinite(t)]
            if bad:
                raise Detected(phase="forward", module=names[m], samples=_rows(bad[0]))
            return None

        def bwd(m, grad_input, grad_output):
            if any(_nonfinite(t) for t in _leaves(grad_input)):
                raise Detected(phase="backward", module=names[m], samples=None)
            return None

        for m in model.modules():
            m.register_forward_hook(fwd)
            try:
                m.register_full_backward_hook(bwd)
            except Exception:  # some modules cannot take one; the pasted detector skips them too
                pass

    found = _baseline_loop(case, rec, model_setup=setup)
    fields = {"step": found.get("step"), "phase": found.get("phase"), "module": found.get("module"), "op": None,
              "samples": found.get("samples"), "cause": None}
    return {"fields": fields}


WORKERS = {"nanreplay": work_nanreplay, "anomaly": work_anomaly, "hooks": work_hooks}


def worker_main(case_path: str, out: str, timeout: float, methods: tuple = METHODS) -> int:
    """Run every method on one case (each on a freshly imported copy of the case) and write the
    results; a method that fails is reported as an error."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    results = {}
    for method in methods:
        t0 = time.perf_counter()
        try:
            res = WORKERS[method](runner.load_case(case_path), timeout)
            res["error"] = None
        except Exception as e:  # reported, scored as a miss
            res = {"fields": None, "error": f"{type(e).__name__}: {str(e).strip()[:600]}"}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results[method] = res
        Path(out).write_text(json.dumps(results, default=str))  # what is done survives a later hang
    return 0


# ================================================================================ driver (main)

def run_case(path: Path, timeout: float) -> dict:
    """The three methods on one case, in one subprocess (the nanreplay method starts a second one for
    the out-of-process replay); a method the subprocess did not finish is an error."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", str(path), "--out", str(out),
               "--timeout", str(timeout)]
        t0 = time.perf_counter()
        why = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(ROOT))
            if proc.returncode != 0:
                why = f"worker exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}"
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:.0f} s"
        done = json.loads(out.read_text()) if out.exists() else {}
        for m in METHODS:
            if m not in done:
                done[m] = {"fields": None, "error": why or "no result", "seconds": round(time.perf_counter() - t0, 2)}
        return done


def score(expected: dict, res: dict) -> dict:
    if res.get("fields") is None:
        return {f: False for f in runner.FIELDS}
    if res.get("diagnosis") is not None:
        return runner.field_matches(expected, res["diagnosis"])
    f = res["fields"]
    diag = {"step": f["step"], "phase": f["phase"], "origin": {"module": f["module"], "op": f["op"]},
            "samples": {"indices": f["samples"] or []}, "classification": {"cause": f["cause"]}}
    return runner.field_matches(expected, diag)


def run_all(paths: list[Path], timeout: float, jobs: int, progress: bool = True) -> dict:
    cases = {p.stem: runner.load_case(p) for p in paths}
    results: dict = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futs = {ex.submit(run_case, p, timeout): p.stem for p in paths}
        for fut in cf.as_completed(futs):
            name = futs[fut]
            results[name] = fut.result()
            for m in METHODS:
                res = results[name][m]
                res["matches"] = score(cases[name].EXPECTED, res)
                res["all_six"] = all(res["matches"].values())
            if progress:
                states = []
                for m in METHODS:
                    res = results[name][m]
                    states.append(f"{TITLES[m]} " + ("error" if res.get("error") else ("ok" if res["all_six"] else f"{sum(res['matches'].values())}/6")))
                print(f"  {name:45s} " + ", ".join(states), file=sys.stderr, flush=True)
    expected = {name: cases[name].EXPECTED for name in sorted(cases)}
    return {"cases": {n: results[n] for n in sorted(results)}, "expected": expected,
            "sources": {n: cases[n].SOURCE for n in sorted(cases)}}


def summary(data: dict) -> dict:
    n = len(data["cases"])
    out = {}
    for m in METHODS:
        counts = {f: sum(1 for r in data["cases"].values() if r[m]["matches"][f]) for f in runner.FIELDS}
        counts["all six"] = sum(1 for r in data["cases"].values() if r[m]["all_six"])
        counts["errors"] = sum(1 for r in data["cases"].values() if r[m].get("error"))
        out[m] = counts
    out["n"] = n
    out["fix"] = fix_counts(data)
    return out


def fix_counts(data: dict) -> dict:
    """How often nanreplay's diagnosis proposed a fix (``classification.fix``), and how often a
    replay with only the origin op rewritten verified it (finite), refuted it, or could not run."""
    fixes = [((r["nanreplay"].get("diagnosis") or {}).get("classification") or {}).get("fix") for r in data["cases"].values()]
    return {"proposed": sum(1 for f in fixes if f), "verified": sum(1 for f in fixes if f and f.get("verified") is True),
            "refuted": sum(1 for f in fixes if f and f.get("verified") is False),
            "unverified": sum(1 for f in fixes if f and f.get("verified") is None)}


def fix_table(data: dict) -> list[str]:
    """The fix figures, and each case's fix in a table."""
    c, n = fix_counts(data), len(data["cases"])
    lines = ["", f"Fixes (`classification.fix`): proposed for {c['proposed']}/{n} cases; verified by a replay that rewrites only the "
             f"origin op: {c['verified']}/{n} ({c['refuted']} still non-finite with it, {c['unverified']} advice or not verifiable).",
             "", "| case | cause | fix: op rewritten (or advice) | verified |", "|---|---|---|---|"]
    for name in sorted(data["cases"]):
        diag = data["cases"][name]["nanreplay"].get("diagnosis") or {}
        cls = diag.get("classification") or {}
        fix = cls.get("fix") or {}
        what = fix.get("op") or ("advice" if fix else "-")
        lines.append(f"| {name} | {cls.get('cause', '-')} | {what} | {_fmt(fix.get('verified')) if fix else '-'} |")
    return lines


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        v = list(v)
    return json.dumps(v) if not isinstance(v, str) else repr(v)


def tables(data: dict) -> str:
    s = summary(data)
    n = s["n"]
    lines = [f"Per-field accuracy on {n} corpus cases (tests/corpus/cases):", "",
             "| field | " + " | ".join(TITLES[m] for m in METHODS) + " |", "|---|" + "---|" * len(METHODS)]
    for row in ROWS:
        cells = [f"{100 * s[m][row] / n:.1f}% ({s[m][row]}/{n})" if n else "-" for m in METHODS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("| errors (scored as misses) | " + " | ".join(str(s[m]["errors"]) for m in METHODS) + " |")
    lines += fix_table(data)
    for m in METHODS:
        lines += ["", f"Misses of {TITLES[m]}:", "", "| case | field | expected | got |", "|---|---|---|---|"]
        any_miss = False
        for name in sorted(data["cases"]):
            res = data["cases"][name][m]
            exp = data["expected"][name]
            if res.get("error"):
                err = " ".join(str(res["error"]).split()).replace("|", "/")
                lines.append(f"| {name} | (all) | | error: {err[:300]} |")
                any_miss = True
                continue
            for f in runner.FIELDS:
                if not res["matches"][f]:
                    lines.append(f"| {name} | {f} | {_fmt(exp[f])} | {_fmt(res['fields'][f])} |".replace("\n", " "))
                    any_miss = True
        if not any_miss:
            lines.append("| (none) | | | |")
    return "\n".join(lines)


def machine() -> dict:
    import torch

    import nanreplay

    cpu = cpu_name()
    return {"torch": torch.__version__, "nanreplay": nanreplay.__version__, "python": platform.python_version(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def write_readme(text: str, readme: Path) -> None:
    start, end = "<!-- accuracy -->", "<!-- /accuracy -->"
    body = readme.read_text() if readme.exists() else "# Benchmarks\n"
    if start in body and end in body:
        head, rest = body.split(start, 1)
        _, tail = rest.split(end, 1)
        readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")
        return
    section = (
        "\n## Diagnosis accuracy on the corpus\n\n"
        "`bench/accuracy.py` runs every case of the corpus of real NaN/Inf bugs (`tests/corpus/cases/`, each\n"
        "citing its public source) three ways: nanreplay (record, then `nanreplay replay --json` in another\n"
        "process), `torch.autograd.detect_anomaly()`, and per-module forward/backward hooks, and scores the six\n"
        "fields of each diagnosis against the case's `EXPECTED` (see `tests/corpus/README.md` for the rule).\n"
        "The tables below are written by the script (`--readme`), not by hand.\n\n"
        f"{start}\n{text}\n{end}\n"
    )
    readme.write_text(body.rstrip("\n") + "\n" + section)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None, help="glob or substring on case names (default: all)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--readme", action="store_true", help="rewrite the tables in bench/README.md")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case, all three methods (default 600)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="cases run at once (default 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.case, args.out, args.timeout)

    paths = runner.case_paths(args.cases)
    if not paths:
        print(f"no corpus case matches {args.cases!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    data = run_all(paths, args.timeout, args.jobs)
    env = machine()
    cmd = "python bench/accuracy.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    data["env"] = env
    data["command"] = cmd
    data["summary"] = summary(data)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    text = tables(data)
    header = (f"torch {env['torch']}, {env['cpu']} ({env['cpu_count']} cores), python {env['python']}; "
              f"command: `{cmd}` ({data['seconds']:.0f} s)")
    print(header + "\n\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    if args.readme:
        write_readme(header + "\n\n" + text, HERE / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
