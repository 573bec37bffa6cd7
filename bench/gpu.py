"""Every GPU measurement of nanreplay in one run, at most 8 minutes on one H100 (issue 39).

Usage::

    python bench/gpu.py                                   # on a CUDA machine: bench/results_gpu.json and the table in bench/README.md
    python bench/gpu.py --out $OUT/results_gpu.json --readme $OUT/README.md --budget-s 330
    python bench/gpu.py --dry-run --out /tmp/gpu.json --readme /tmp/README.md   # the CPU, tiny sizes, the same code paths
    bash bench/gpu.sh                                     # the device machine's command (bench/README.md, "On a GPU")

Sections, in this order, each guarded (an error is recorded in its place and the next section
runs), each skipped when ``--budget-s`` has too little left for it; the JSON (``--out``) and the
README table (``--readme``, between ``<!-- gpu -->`` markers) are rewritten after every section,
so a run cut short keeps what it measured:

1. ``gpu_tests``: ``pytest -m gpu`` on the test files that hold GPU tests (the sync-debug checks of
   ``tests/capture/test_cuda_syncs.py``, the CUDA replays of ``tests/engine/test_cuda_replay.py``,
   ...), read back from its JUnit XML with the values the tests record (verdicts, sync counts).
2. ``overhead:124M`` and ``overhead:3.7M``: the bench GPT family (``bench/models.py``'s ``GPT``,
   the shapes of ``bench/scale.py``'s ``SIZES``): GPT-2 small's shape (12 x 768, 50,257 tokens, tied
   head) at 8 x 1024 tokens per step, and the bench GPT of ``bench/overhead.py`` (3.7M, 8 x 64);
   bf16 autocast around forward and loss, AdamW (fused where torch has it). Variants of
   ``bench/overhead.py``, each its own copy of the model: plain loop, default Recorder,
   ``check_every=8``, ``snapshot_every=4`` (5-step ring), anomaly mode, per-module
   ``isnan().any()`` forward hooks. Rounds run one step of every variant in an order that rotates
   per round; each step is timed on the device by a pair of CUDA events, and the host
   synchronises only at the end of a round; the figure is the median over rounds of the ratio to
   the plain step of the same round, with the interquartile range, beside the median host time
   of a step call (the host's own work, or its wait at a sync). Then, per variant, host syncs
   counted by CUDA itself (``torch.cuda.set_sync_debug_mode("warn")``: one warning per
   synchronizing operation) beside the Python-level count of ``bench/overhead.py``'s
   ``SyncCounter``; the sync-free mode's steps that made no synchronizing call run under ``"error"`` mode, where
   any sync raises. Targets on the 124M model: default Recorder <= 1.01x, ``check_every=8`` <=
   1.005x; a missed target adds a ``torch.profiler`` summary of the recorded step against the
   plain one (the host ops that make the floor).
3. ``dump_replay:124M``: the 124M model recorded with its loss function (bf16 autocast, fused
   AdamW), a weight of 3e38 in block 1's first MLP layer (bench/scale.py's ``overflow``): the
   failing step from its start to the ``NonFiniteGradientError`` (detect + bundle from GPU memory
   + in-process diagnosis), the bundle write against ``safetensors.torch.save_file`` of the same
   tensors from GPU memory, and ``nanreplay replay`` in a fresh process, each in step-times.

``--dry-run`` runs all of it on the CPU at tiny sizes (a CPU test runs it: tests/house/test_bench_gpu.py);
only the clock (CUDA events or the host clock) and the sync debug mode (CUDA only) differ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import models  # noqa: E402  (bench/models.py: the GPT family)
import overhead  # noqa: E402  (bench/overhead.py: the variants, SyncCounter)
import scale  # noqa: E402  (bench/scale.py: the GPT sizes, the failure, the log reader)
from machine import cpu_name  # noqa: E402

import nanreplay  # noqa: E402
from nanreplay import NonFiniteGradientError, Recorder  # noqa: E402

#: the variants of bench/overhead.py this script runs, in table order
VARIANTS = ("plain", "recorder", "recorder_lagged", "recorder_snapshot_ring", "anomaly", "hook_detector")
#: (variant, largest ratio to the plain step) on the 124M model
TARGETS = {"recorder": 1.01, "recorder_lagged": 1.005}
SYNC_WARNING = "called a synchronizing CUDA operation"
START, END = "<!-- gpu -->", "<!-- /gpu -->"


# ------------------------------------------------------------------------------------------- plan

@dataclasses.dataclass
class Plan:
    """Sizes and counts of one run: the GPU's, or the dry run's tiny ones (same code paths)."""

    device: torch.device
    dry_run: bool
    sizes: dict                  # "124M" / "3.7M" -> scale.Size
    warmup: int                  # untimed rounds first (the first one exports the program)
    rounds: int                  # timed rounds at most (fewer when the section's time is up)
    min_rounds: int              # timed rounds at least
    sync_steps: int              # steps per variant counted under the sync debug mode, and then under error mode (a multiple of check_every)
    memory_budget: int           # Recorder(memory_budget=...) of every Recorder variant, bytes
    profile_steps: int           # steps per profiled variant
    failing_warmup: int          # finite steps before the failing one (dump_replay)
    section_s: dict              # section -> (seconds it needs at least, seconds it may take at most)
    profile: str                 # "missed" (a missed target), "always", "never"
    autocast: torch.dtype = torch.bfloat16
    block: int = 4               # steady_blocks: consecutive steps of one variant per round (the first untimed)
    block_rounds: int = 24       # steady_blocks: rounds at most
    export_early: bool = True    # the overhead variants' Recorder(export_early=...): the dry run skips the one-time export there

    def recorder_options(self) -> dict:
        """What every Recorder variant of the overhead sections adds to its own options."""
        return {"memory_budget": self.memory_budget} if self.export_early else {"memory_budget": self.memory_budget, "export_early": False}


def make_plan(args: argparse.Namespace) -> Plan:
    if args.dry_run:
        return Plan(
            device=torch.device("cpu"), dry_run=True,
            sizes={"124M": scale.Size("dry-run 124M-family", vocab=512, d=64, layers=2, heads=2, ctx=32, batch=2, rounds=0),
                   "3.7M": scale.Size("dry-run 3.7M-family", vocab=256, d=32, layers=1, heads=2, ctx=16, batch=2, rounds=0)},
            warmup=1, rounds=2, min_rounds=2, sync_steps=8, memory_budget=1 << 30, profile_steps=1, failing_warmup=2,
            section_s={"gpu_tests": (5, 120), "overhead:124M": (5, 60), "dump_replay:124M": (5, 120), "overhead:3.7M": (5, 60)},
            profile="always" if args.profile == "missed" else args.profile, export_early=False, block=2, block_rounds=2)
    big = dataclasses.replace(scale.SIZES["124M"], ctx=1024, batch=8)  # GPT-2 small at its own context, 8k tokens a step
    return Plan(
        device=torch.device(args.device), dry_run=False, sizes={"124M": big, "3.7M": scale.SIZES["3.7M"]},
        warmup=args.warmup, rounds=args.rounds, min_rounds=8, sync_steps=16, memory_budget=int(args.memory_budget_gib * 2**30),
        profile_steps=3, failing_warmup=3,
        section_s={"gpu_tests": (40, 150), "overhead:124M": (50, 150), "dump_replay:124M": (60, 180), "overhead:3.7M": (20, 60)},
        profile=args.profile)


# ------------------------------------------------------------------------------------- helpers

class _HostEvent:
    """``torch.cuda.Event``'s interface on the host clock (the dry run's CPU has no device queue)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _event(device: torch.device) -> Any:
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else _HostEvent()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def sync_debug(device: torch.device, mode: str) -> Iterator[list]:
    """CUDA's sync debug mode around the block (``"warn"``: every synchronizing CUDA operation
    warns; ``"error"``: raises). Yields the list the block's warnings are recorded in. Off CUDA
    nothing synchronizes a device, and the block runs as it is."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(mode)
        try:
            yield seen
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")


def _cuda_syncs(seen: list) -> int:
    return sum(SYNC_WARNING in str(w.message) for w in seen)


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW, lr 1e-4, fused where torch has a fused kernel for the device, else torch's default."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-4)


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_batches(size: Any, device: torch.device, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` token batches made on ``device`` beforehand (a copy from the host in a step would be a sync)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, size.vocab, (size.batch, size.ctx + 1), generator=g, device=device)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _guarded(res: dict, key: str, fn: Callable[[], Any]) -> Any:
    """``res[key] = fn()``; an exception is recorded as ``{"error", "traceback"}`` instead."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001 - one failed measurement must not lose the others
        res[key] = {"error": _short(e), "traceback": traceback.format_exc()[-3000:]}
    return res[key]


def _env_without_cublas() -> dict:
    """This process's environment for a child, ``CUBLAS_WORKSPACE_CONFIG`` unset (as in a user's
    shell: what the replay does about it is the product's business), the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# --------------------------------------------------------------------------------- the context

class Run:
    """One run: the plan, the results, the budget, and the writers of the JSON and the table."""

    def __init__(self, args: argparse.Namespace, plan: Plan, command: str) -> None:
        self.args, self.plan = args, plan
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.readme = Path(args.readme) if args.readme else None
        self.result: dict[str, Any] = {"command": command, "dry_run": plan.dry_run, "budget_s": args.budget_s,
                                       "machine": {}, "plan": {}, "sections": {}, "finished": False}

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, self.out)
        if self.readme is not None:
            write_readme(table(self.result), self.readme)


# --------------------------------------------------------------------------------- section 1

def gpu_test_files() -> list[str]:
    """The test files that hold ``gpu``-marked tests, relative to the checkout."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text(errors="replace"))


def run_gpu_tests(run: Run, deadline: float) -> dict:
    """``pytest -m gpu`` on :func:`gpu_test_files` in a child process (``CUBLAS_WORKSPACE_CONFIG``
    unset), read back from its JUnit XML: each test's outcome, message and recorded properties."""
    xml = run.out.with_name("gpu_tests.xml")
    xml.unlink(missing_ok=True)
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}", *files]
    res: dict[str, Any] = {"command": "python -m pytest -q -m gpu " + " ".join(files), "files": files}
    try:
        p = subprocess.run(cmd, cwd=str(ROOT), env=_env_without_cublas(), capture_output=True, text=True,
                           timeout=max(10.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {**res, "error": f"pytest ran past {e.timeout:.0f} s", "output_tail": tail[-3000:]}
    res.update(rc=p.returncode, output_tail=(p.stdout + p.stderr)[-3000:],
               summary=next((ln for ln in reversed(p.stdout.splitlines()) if ln.strip()), ""))
    if not xml.exists():
        return {**res, "error": f"pytest wrote no JUnit XML (exit {p.returncode})"}
    tests, counts = [], {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (el.get("message") or el.text or "")[:600]
                break
        counts[outcome] += 1
        props = {pr.get("name"): pr.get("value") for pr in case.iter("property")}
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message, "properties": props})
    res.update(tests=tests, counts=counts)
    return res


# ------------------------------------------------------------------------------- section 2

def timed_rounds(variants: list, batches: list, plan: Plan, deadline: float) -> int:
    """Interleaved rounds (bench/overhead.py's method): one step of every variant per round, the
    order rotating; each step timed by two events on the device's queue, the host synchronising
    once per round. Fills ``v.times`` (seconds) and ``v.host`` (seconds of the step call on the
    host). Returns the timed rounds run."""
    dev = plan.device
    timed = 0
    for r in range(plan.warmup + plan.rounds):
        if r >= plan.warmup + plan.min_rounds and time.monotonic() > deadline:
            break
        x, y = batches[r % len(batches)]
        k = r % len(variants)
        marks = []
        for v in variants[k:] + variants[:k]:
            start, end = _event(dev), _event(dev)
            h0 = time.perf_counter()
            start.record()
            v.step(x, y)
            end.record()
            marks.append((v, start, end, time.perf_counter() - h0))
        _synchronize(dev)
        if r >= plan.warmup:
            timed += 1
            for v, start, end, host in marks:
                v.times.append(start.elapsed_time(end) / 1e3)
                v.host.append(host)
    return timed


def steady_blocks(variants: list, batches: list, plan: Plan, deadline: float, offset: int) -> dict:
    """The steady state of a training loop: rounds in which each variant runs ``plan.block``
    consecutive steps (the order rotating per round) and the last ``block - 1`` are timed by two
    events, so each variant's steps queue behind its own earlier ones, as in a loop that runs
    only it. :func:`timed_rounds` puts one step of every variant after another's, so a sync-free
    step often starts on a queue that a syncing variant (anomaly mode, the hooks' reads) has just
    drained, and its host time shows up on the device; this measures what a loop of that variant
    alone pays. The host synchronises once per round. Returns ``{variant: {ratio_median,
    ratio_q25, ratio_q75, step_ms_median}}`` and the rounds run."""
    dev, k = plan.device, plan.block
    per: dict[str, list[float]] = {v.name: [] for v in variants}
    rounds = 0
    for r in range(plan.block_rounds):
        if r >= 2 and time.monotonic() > deadline:
            break
        marks = []
        j = r % len(variants)
        for v in variants[j:] + variants[:j]:
            first = batches[(offset + r * k) % len(batches)]
            v.step(*first)
            start, end = _event(dev), _event(dev)
            start.record()
            for i in range(1, k):
                v.step(*batches[(offset + r * k + i) % len(batches)])
            end.record()
            marks.append((v, start, end))
        _synchronize(dev)
        rounds += 1
        for v, start, end in marks:
            per[v.name].append(start.elapsed_time(end) / 1e3 / (k - 1))
    plain = per["plain"]
    out: dict[str, Any] = {"block": k, "rounds": rounds, "variants": {}}
    for name, times in per.items():
        ratios = [a / b for a, b in zip(times, plain)]
        q25, q75 = _quartiles(ratios)
        out["variants"][name] = {"ratio_median": statistics.median(ratios), "ratio_q25": q25, "ratio_q75": q75,
                                 "step_ms_median": 1e3 * statistics.median(times)}
    return out


def count_syncs(variants: list, batches: list, plan: Plan, offset: int) -> dict:
    """Per variant and step, the synchronizing CUDA operations of ``plan.sync_steps`` steps as
    CUDA's sync debug mode reports them (``None`` off CUDA), and the Python-level host reads
    (``overhead.SyncCounter``). Each variant runs alone here; the host synchronises between steps."""
    dev = plan.device
    out: dict[str, Any] = {}
    with overhead.SyncCounter() as counter:
        for v in variants:
            cuda, python = [], []
            for i in range(plan.sync_steps):
                x, y = batches[(offset + i) % len(batches)]
                _synchronize(dev)
                counter.count, counter.active = 0, True
                try:
                    with sync_debug(dev, "warn") as seen:
                        v.step(x, y)
                finally:
                    counter.active = False
                cuda.append(_cuda_syncs(seen) if dev.type == "cuda" else None)
                python.append(counter.count)
            out[v.name] = {"cuda": cuda, "python": python}
    base = out.get("plain")
    for name, d in out.items():
        if dev.type == "cuda":
            d["cuda_per_step"] = statistics.fmean(d["cuda"])
            d["cuda_net"] = [a - b for a, b in zip(d["cuda"], base["cuda"])] if base else None
            d["cuda_net_per_step"] = statistics.fmean(d["cuda_net"]) if base else None
        else:
            d["cuda_per_step"] = d["cuda_net_per_step"] = d["cuda_net"] = None
        d["python_net_per_step"] = statistics.fmean(a - b for a, b in zip(d["python"], base["python"])) if base else None
    return out


def sync_free_error_mode(v: Any, syncs: dict, batches: list, plan: Plan, offset: int) -> dict:
    """The sync-free variant's steps between its reads under ``set_sync_debug_mode("error")``:
    any synchronizing CUDA operation in them raises. Which steps read is taken from the counts of
    :func:`count_syncs` just before (its step count is a multiple of ``check_every``, so the
    phase carries on)."""
    every = v.rec.config.check_every
    counts = syncs[v.name]["cuda_net"] if plan.device.type == "cuda" else syncs[v.name]["python"]
    base = syncs.get("plain", {}).get("python") if plan.device.type != "cuda" else None
    if base is not None:
        counts = [a - b for a, b in zip(counts, base)]
    pattern = [c > 0 for c in counts[-every:]]
    checked, raised = 0, []
    for j in range(plan.sync_steps):
        x, y = batches[(offset + j) % len(batches)]
        if pattern[j % every]:
            v.step(x, y)
            continue
        checked += 1
        _synchronize(plan.device)
        try:
            with sync_debug(plan.device, "error"):
                v.step(x, y)
        except RuntimeError as e:
            raised.append(f"step {j} after the count: {_short(e)} (at {_where(e)})")
            break  # the step stopped half way: this variant's later steps would say nothing
    return {"check_every": every, "read_phase": [i for i, p in enumerate(pattern) if p], "steps_under_error_mode": checked, "steps": plan.sync_steps,
            "raised": raised, "cuda": plan.device.type == "cuda"}


def _where(e: BaseException) -> str:
    """The innermost frame of ``e``'s traceback in nanreplay's code, else the innermost one: who synchronized."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f"{os.sep}nanreplay{os.sep}" in f.filename]
    f = (ours or frames or [None])[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}" if f is not None else "?"


def _device_us(e: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, attr, None)
        if v:
            return float(v)
    return 0.0


def profile_steps(by_name: dict, names: list, batches: list, plan: Plan) -> dict:
    """``torch.profiler`` over ``steps`` steps of each variant in ``names`` (CPU and, on a GPU,
    CUDA activity): the top host ops by self CPU time per step, the table torch prints, and for
    each variant but ``plain`` the ops whose host time per step grew most over the plain loop's."""
    from torch.profiler import ProfilerActivity, profile

    steps = plan.profile_steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device.type == "cuda" else [])
    per: dict[str, dict] = {}
    out: dict[str, Any] = {"steps": steps}
    for n in names:
        v = by_name[n]
        _synchronize(plan.device)
        with profile(activities=acts) as prof:
            for i in range(steps):
                x, y = batches[i % len(batches)]
                v.step(x, y)
            _synchronize(plan.device)
        avgs = prof.key_averages()
        rows = {e.key: (int(e.count), float(e.self_cpu_time_total), _device_us(e)) for e in avgs}
        per[n] = rows
        top = sorted(rows.items(), key=lambda kv: -kv[1][1])[:15]
        out[n] = {"top_self_cpu": [{"op": k, "calls_per_step": c / steps, "self_cpu_us_per_step": s / steps, "self_device_us_per_step": d / steps}
                                   for k, (c, s, d) in top],
                  "host_us_per_step": sum(s for _, s, _ in rows.values()) / steps,
                  "table": avgs.table(sort_by="self_cpu_time_total", row_limit=15)}
    plain = per.get("plain", {})
    for n in names:
        if n == "plain":
            continue
        grown = [(k, (s - plain.get(k, (0, 0.0, 0.0))[1]) / steps, c / steps - plain.get(k, (0, 0.0, 0.0))[0] / steps)
                 for k, (c, s, _) in per[n].items()]
        out[n]["over_plain"] = [{"op": k, "self_cpu_us_per_step": round(d, 1), "calls_per_step": round(dc, 2)}
                                for k, d, dc in sorted(grown, key=lambda t: -t[1])[:12] if d > 0]
    return out


def bench_overhead(run: Run, key: str, deadline: float) -> dict:
    """The variants' overhead on one model of the GPT family (see the module docstring)."""
    plan, dev = run.plan, run.plan.device
    size = plan.sizes[key]
    torch.manual_seed(0)
    with torch.device(dev):
        base = size.make()
    res: dict[str, Any] = {"model": size.name, "params": models.param_count(base), "tokens_per_step": size.batch * size.ctx,
                           "shape": {f.name: getattr(size, f.name) for f in dataclasses.fields(size) if f.name != "rounds"},
                           "autocast": str(plan.autocast).replace("torch.", ""), "recorder_options": plan.recorder_options()}
    n_batches = max(plan.warmup + plan.rounds, 3 * plan.sync_steps)
    batches = make_batches(size, dev, n_batches)
    with tempfile.TemporaryDirectory(prefix="nanreplay-gpu-") as tmp:
        variants = [overhead.VARIANTS[n](base, lm_loss, Path(tmp) / n, optimizer=adamw, autocast=plan.autocast,
                                         recorder_options=plan.recorder_options()) for n in VARIANTS]
        del base
        res["optimizer"] = type(variants[0].opt).__name__ + (" (fused)" if variants[0].opt.defaults.get("fused") else "")
        for v in variants:
            v.host = []
        by_name = {v.name: v for v in variants}
        try:
            res["rounds"] = timed_rounds(variants, batches, plan, deadline)
            plain = by_name["plain"]
            res["plain_step_ms"] = 1e3 * statistics.median(plain.times)
            res["variants"] = {}
            for v in variants:
                ratios = [a / b for a, b in zip(v.times, plain.times)]
                q25, q75 = _quartiles(ratios)
                res["variants"][v.name] = {
                    "label": v.label, "ratio_median": statistics.median(ratios), "ratio_q25": q25, "ratio_q75": q75,
                    "step_ms_median": 1e3 * statistics.median(v.times), "host_us_median": 1e6 * statistics.median(v.host),
                    "host_us_over_plain": 1e6 * (statistics.median(v.host) - statistics.median(plain.host)),
                    "held_bytes": v.held_bytes(),
                }
            offset = plan.warmup + plan.rounds
            steady_names = [n for n in VARIANTS if n not in ("anomaly", "hook_detector")]  # the syncing baselines drain the queue anyway
            steady = _guarded(res, "steady", lambda: steady_blocks([by_name[n] for n in steady_names], batches, plan,
                                                                   time.monotonic() + (deadline - time.monotonic()) / 4, offset))
            if plan.device.type == "cuda":
                res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            res["targets"] = {n: {"target": t, "ratio": res["variants"][n]["ratio_median"], "met": res["variants"][n]["ratio_median"] <= t,
                                  **({"steady": steady["variants"][n]["ratio_median"], "steady_met": steady["variants"][n]["ratio_median"] <= t}
                                     if isinstance(steady, dict) and n in steady.get("variants", {}) else {})}
                              for n, t in TARGETS.items()} if key == "124M" else {}
            syncs = _guarded(res, "syncs", lambda: count_syncs(variants, batches, plan, offset))
            if isinstance(syncs, dict) and "error" not in syncs:  # right after the count: the read phase carries on
                _guarded(res, "sync_free_error_mode",
                         lambda: sync_free_error_mode(by_name["recorder_lagged"], syncs, batches, plan, offset + plan.sync_steps))
            missed = [n for n, t in res["targets"].items() if not (t["met"] and t.get("steady_met", True))]
            if plan.profile == "always" or (plan.profile == "missed" and missed):
                names = ["plain"] + (list(TARGETS) if plan.profile == "always" else missed)
                _guarded(res, "profile", lambda: profile_steps(by_name, names, batches, plan))
        finally:
            for v in variants:
                v.close()
            del variants, by_name
            _free(dev)
    return res


# ------------------------------------------------------------------------------- section 3

def _recorded_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple, rec: Recorder, autocast: torch.dtype) -> None:
    rec.record(batch)
    with torch.autocast(batch[0].device.type, dtype=autocast):
        loss = scale.loss_fn(model, batch)
    rec.log_loss(loss)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _save_file_from_device(bundle: Path, device: torch.device, tmp: Path) -> dict:
    """``safetensors.torch.save_file`` of the bundle's own tensors, put on ``device`` first, then
    fsync'd as the bundle is (file and directory): the same bytes from the same memory."""
    import safetensors.torch

    from nanreplay.format.atomic import _fsync, _fsync_dir

    with nanreplay.open_bundle(bundle) as b:
        tensors = {k: b.tensor(k).to(device) for k in b.keys()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    p = tmp / "same_tensors.safetensors"
    _synchronize(device)
    t0 = time.perf_counter()
    safetensors.torch.save_file(tensors, str(p))
    _fsync(p)
    _fsync_dir(p.parent)
    s = time.perf_counter() - t0
    size = p.stat().st_size
    p.unlink()
    del tensors
    return {"seconds": s, "tensor_bytes": nbytes, "file_bytes": size}


def bench_dump_replay(run: Run, key: str, deadline: float) -> dict:
    """The failing step of the recorded model, from GPU memory: in process, against save_file, and
    `nanreplay replay` in a fresh process (see the module docstring)."""
    plan, dev = run.plan, run.plan.device
    size = plan.sizes[key]
    torch.manual_seed(0)
    with torch.device(dev):
        model = size.make()
    opt = adamw(model.parameters())
    batches = make_batches(size, dev, plan.failing_warmup + 6, seed=2)
    res: dict[str, Any] = {"model": size.name, "params": models.param_count(model), "tokens_per_step": size.batch * size.ctx,
                           "optimizer": type(opt).__name__ + (" (fused)" if opt.defaults.get("fused") else ""),
                           "failure": "overflow: a weight of 3e38 in blocks.1.mlp.0 (bench/scale.py)"}
    log = scale._Log()
    lg = logging.getLogger("nanreplay")
    lg.addHandler(log)
    prev = lg.level
    lg.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="nanreplay-gpu-dump-") as tmp:
        tmpd = Path(tmp)
        try:
            with Recorder(model, opt, loss_fn=scale.loss_fn, out_dir=str(tmpd / "bundles"), memory_budget=plan.memory_budget) as rec:
                t0 = time.perf_counter()
                for i in range(plan.failing_warmup):  # the first exports the program (export_early)
                    _recorded_step(model, opt, batches[i], rec, plan.autocast)
                _synchronize(dev)
                res["warmup_s"] = time.perf_counter() - t0
                res["early_export_s"] = (log.seconds(r"exported the %s program at step %d in", 2) or [None])[0]
                steps = []
                for i in range(5):
                    start, end = _event(dev), _event(dev)
                    start.record()
                    _recorded_step(model, opt, batches[plan.failing_warmup + i], rec, plan.autocast)
                    end.record()
                    _synchronize(dev)
                    steps.append(start.elapsed_time(end) / 1e3)
                step = statistics.median(steps)
                res["step_s"] = step
                batch = batches[-1]
                res["training_state_bytes"] = scale.training_state_bytes(model, opt, batch)
                scale.poison(model)
                log.records.clear()
                _synchronize(dev)
                t0 = time.perf_counter()
                try:
                    _recorded_step(model, opt, batch, rec, plan.autocast)
                    raise RuntimeError("the failing step (a 3e38 weight) did not fail")
                except NonFiniteGradientError as e:
                    res["in_process_s"] = time.perf_counter() - t0
                    bundle = Path(e.bundle_path)
                diag = rec.last_diagnosis or {}
            writes = log.seconds(r"^nanreplay: wrote ", 3)
            res.update(
                bundle_bytes=bundle.stat().st_size, write_s=writes[0] if writes else None, writes=len(writes),
                embed_s=(log.seconds(r"embedded step %d's %s program in", 2) or [None])[0],
                diagnose_s=(log.seconds(r"^nanreplay: diagnosis of step %d \(", 1) or [None])[0],
                summary=diag.get("summary"), verdict=(diag.get("reproduction") or {}).get("verdict"),
                origin=(diag.get("origin") or {}).get("module"),
                log=[r.getMessage()[:600] for r in log.records if r.levelno >= logging.WARNING][-12:],  # what the dump said
            )
            res["in_process_x_step"] = res["in_process_s"] / step
            res["bundle_x_state"] = res["bundle_bytes"] / res["training_state_bytes"]
            del model, opt, rec, batches
            _free(dev)
            sf = _guarded(res, "save_file", lambda: _save_file_from_device(bundle, dev, tmpd))
            if isinstance(sf, dict) and res.get("write_s") and "seconds" in sf:
                res["write_x_save_file"] = res["write_s"] / sf["seconds"]
            _guarded(res, "replay_cli", lambda: _replay_cli(bundle, tmpd, step, deadline))
        finally:
            lg.removeHandler(log)
            lg.setLevel(prev)
            _free(dev)
    return res


def _replay_cli(bundle: Path, cwd: Path, step: float, deadline: float) -> dict:
    """``nanreplay replay BUNDLE --json`` in a fresh interpreter (imports included, the model's code
    not on the path: the embedded program replays; CUBLAS_WORKSPACE_CONFIG unset), wall clock."""
    cmd = [sys.executable, "-m", "nanreplay.cli", "replay", str(bundle), "--json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=str(cwd), env=_env_without_cublas(), capture_output=True, text=True,
                       timeout=max(30.0, deadline - time.monotonic()))
    s = time.perf_counter() - t0
    out: dict[str, Any] = {"seconds": s, "x_step": s / step, "rc": p.returncode, "stderr_tail": p.stderr[-1500:],
                           "cublas_alert_on_stderr": "CuBLAS" in p.stderr}
    try:
        d = json.loads(p.stdout)
        out.update(verdict=(d.get("reproduction") or {}).get("verdict"), summary=d.get("summary"), device=d.get("device"),
                   origin=(d.get("origin") or {}).get("module"), max_abs_diff=(d.get("reproduction") or {}).get("max_abs_diff"))
    except ValueError:
        out["error"] = f"no JSON on stdout (exit {p.returncode})"
    return out


# --------------------------------------------------------------------------------- machine

def machine_info(device: torch.device) -> dict:
    info: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "nanreplay": nanreplay.__version__, "device": "cpu", "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    try:  # NANREPLAY_COMMIT: the device tool copies the working tree, whose .git may be older than the files
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT), capture_output=True, text=True, timeout=10)
        info["git"] = os.environ.get("NANREPLAY_COMMIT") or git.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = os.environ.get("NANREPLAY_COMMIT")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                            text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    return info


# ----------------------------------------------------------------------------------- table

def _x(d: Any, *keys: str, fmt: str = "{}", default: str = "n/a") -> str:
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return default
        d = d[k]
    try:
        return fmt.format(d)
    except (ValueError, TypeError):
        return str(d)


def _err(d: Any) -> Optional[str]:
    if isinstance(d, dict) and d.get("error"):
        return f"error: {d['error']}"
    if isinstance(d, dict) and d.get("skipped"):
        return f"skipped: {d['skipped']}"
    if isinstance(d, dict) and d.get("running"):
        return "cut short while running"
    return None


def _overhead_cell(sec: dict, name: str) -> str:
    v = (sec.get("variants") or {}).get(name)
    if v is None:
        return "n/a"
    cell = f"{v['ratio_median']:.3f}x [{v['ratio_q25']:.3f}-{v['ratio_q75']:.3f}], host {v['host_us_median']:.0f} µs"
    s = (sec.get("syncs") or {}).get(name) if isinstance(sec.get("syncs"), dict) else None
    if isinstance(s, dict):
        if s.get("cuda_per_step") is not None:
            cell += f", {s['cuda_per_step']:.2f} syncs/step (CUDA; {s['python_net_per_step']:.2f} host reads)"
        else:
            cell += f", {s['python_net_per_step']:.2f} host reads/step (no CUDA)"
    if v.get("held_bytes") is not None:
        cell += f", holds {v['held_bytes'] / 2**20:.0f} MiB"
    st = ((sec.get("steady") or {}).get("variants") or {}).get(name) if isinstance(sec.get("steady"), dict) else None
    if st is not None and name != "plain":
        cell += f"; **steady {st['ratio_median']:.3f}x** [{st['ratio_q25']:.3f}-{st['ratio_q75']:.3f}]"
    return cell


def table(result: dict) -> str:
    """The README table of a result (partial results too: a section's error or skip is said in its place)."""
    m = result.get("machine") or {}
    secs = result.get("sections") or {}
    gpu = (f" (compute capability {m['capability']}, {m.get('multiprocessors')} SMs, {m.get('memory_gib')} GiB, driver {m.get('driver')})"
           if m.get("capability") else "")
    lines = [("**DRY RUN on the CPU at tiny sizes: these are not figures** (tests/house/test_bench_gpu.py). " if result.get("dry_run") else "")
             + f"{m.get('device', '?')}{gpu}, torch {m.get('torch')}, CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, python {m.get('python')}, "
             + f"nanreplay {m.get('nanreplay')}" + (f" at {m['git']}" if m.get("git") else "")
             + f"; command: `{result.get('command')}` ({result.get('elapsed_s', '?')} s" + ("" if result.get("finished") else ", cut short") + ")", ""]
    lines += _overhead_lines(secs)
    lines += _test_lines(secs.get("gpu_tests"))
    lines += _dump_lines(secs.get("dump_replay:124M"))
    lines += [f"{name}: {_err(s)}" for name, s in secs.items()
              if _err(s) and name not in ("gpu_tests", "dump_replay:124M") and not name.startswith("overhead:")]
    return "\n".join(lines)


def _overhead_lines(secs: dict) -> list[str]:
    keys = [k for k in ("overhead:124M", "overhead:3.7M") if k in secs]
    if not keys:
        return []
    heads = [_err(secs[k]) or f"{secs[k].get('model')}: {secs[k].get('params', 0) / 1e6:.1f} M params, {secs[k].get('tokens_per_step')} "
             f"tokens/step, {secs[k].get('autocast')} autocast, {secs[k].get('optimizer')}, plain step "
             f"{_x(secs[k], 'plain_step_ms', fmt='{:.2f}')} ms, {secs[k].get('rounds')} rounds" for k in keys]
    lines = ["| variant | " + " | ".join(heads) + " |", "|---|" + "---|" * len(keys)]
    for name in VARIANTS:
        cells = ["" if _err(secs[k]) else _overhead_cell(secs[k], name) for k in keys]
        lines.append(f"| {overhead.VARIANTS[name].label} | " + " | ".join(cells) + " |")
    block = next((secs[k]["steady"].get("block") for k in keys if isinstance(secs[k].get("steady"), dict) and secs[k]["steady"].get("block")), 4)
    lines += ["", "Ratios: median over interleaved rounds of the step's time on the device (CUDA events) / the plain step's in the same "
                  "round, [interquartile range]; host: median time of the step call on the host; syncs: synchronizing CUDA operations per "
                  "step as `torch.cuda.set_sync_debug_mode(\"warn\")` reports them, beside the host reads counted in Python beyond the "
                  f"plain loop's. Steady: the same ratio in a loop of that variant alone (rounds of {block} consecutive steps of each "
                  f"variant, the last {block - 1} timed by two events: its steps queue behind its own), where a sync-free step's host work hides "
                  "behind the device's queue as it does in training; the per-step interleaving puts a step right after another "
                  "variant's, often on a queue that a syncing variant has just drained."]
    tg = (secs.get("overhead:124M") or {}).get("targets") or {}
    if tg:
        lines += ["", "Targets on the 124M model: " + "; ".join(
            f"{overhead.VARIANTS[n].label} <= {t['target']}x: **{'met' if t['met'] else 'missed'}** ({t['ratio']:.4f}x interleaved per step"
            + (f"; steady **{'met' if t['steady_met'] else 'missed'}**, {t['steady']:.4f}x" if "steady" in t else "") + ")"
            for n, t in tg.items()) + "."]
    for k in keys:
        lines += _sync_free_and_profile_lines(k.split(":")[1], secs[k])
    return lines


def _sync_free_and_profile_lines(model: str, sec: dict) -> list[str]:
    lines = []
    e = sec.get("sync_free_error_mode")
    if isinstance(e, dict) and "error" not in e:
        lines.append(f"{model}: sync-free mode (check_every={e['check_every']}) under `set_sync_debug_mode(\"error\")`: "
                     f"{e['steps_under_error_mode']} steps of {e.get('steps', e['steps_under_error_mode'])} (those that made no "
                     f"synchronizing call when counted), {len(e['raised'])} raised"
                     + (f" ({e['raised'][0]})" if e["raised"] else "") + ("" if e["cuda"] else " (no CUDA: nothing to raise)") + ".")
    elif _err(e):
        lines.append(f"{model}: sync-free mode under error mode: {_err(e)}")
    prof = sec.get("profile")
    if isinstance(prof, dict) and "error" not in prof:
        for n, p in prof.items():
            if isinstance(p, dict) and p.get("over_plain"):
                ops = ", ".join(f"`{o['op']}` {o['self_cpu_us_per_step']:.0f} µs" for o in p["over_plain"][:6])
                lines.append(f"{model} profile, {overhead.VARIANTS[n].label}: host time per step over the plain loop's, by op: {ops}.")
    elif _err(prof):
        lines.append(f"{model} profile: {_err(prof)}")
    return lines


def _test_lines(t: Optional[dict]) -> list[str]:
    if t is None:
        return []
    if _err(t) and not t.get("tests"):
        return ["", f"GPU tests: {_err(t)}"]
    c = t.get("counts") or {}
    lines = ["", f"GPU tests (`{t.get('command')}`): {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
                 f"{c.get('error', 0)} errors, {c.get('skipped', 0)} skipped."]
    for case in t.get("tests") or []:
        props = "; ".join(f"{k} = {v}" for k, v in (case.get("properties") or {}).items())
        if case["outcome"] == "skipped" and not props:
            continue
        why = " ".join(case["message"].split())[:200] if case["outcome"] in ("failed", "error") else ""
        lines.append(f"* `{case['name'].split('.')[-1]}`: {case['outcome']}" + (f" ({why})" if why else "") + (f"; {props}" if props else ""))
    return lines


def _dump_lines(d: Optional[dict]) -> list[str]:
    if d is None:
        return []
    if _err(d) and "in_process_s" not in d:
        return ["", f"Failing step: {_err(d)}"]
    step = d.get("step_s") or float("nan")
    sf = d.get("save_file") if isinstance(d.get("save_file"), dict) else {}
    cli = d.get("replay_cli") if isinstance(d.get("replay_cli"), dict) else {}
    return ["", (
        f"Failing step of the {d.get('model')} model ({d.get('params', 0) / 1e6:.1f} M params, {d.get('tokens_per_step')} tokens/step, "
        f"bf16 autocast, {d.get('optimizer')}; {d.get('failure')}), recorded step {step * 1e3:.1f} ms: **in process, detect + dump + "
        f"diagnosis {_x(d, 'in_process_s', fmt='{:.1f}')} s = {_x(d, 'in_process_x_step', fmt='{:.0f}')} steps** (first bundle write "
        f"{_x(d, 'write_s', fmt='{:.2f}')} s, diagnosis {_x(d, 'diagnose_s', fmt='{:.1f}')} s, program re-embedded in "
        f"{_x(d, 'embed_s', fmt='{:.2f}')} s; the early export at the first step {_x(d, 'early_export_s', fmt='{:.1f}')} s, once); "
        f"bundle {_x(d, 'bundle_bytes', fmt='{:,}')} bytes = {_x(d, 'bundle_x_state', fmt='{:.2f}')}x the training state; "
        f"`safetensors.torch.save_file` of the same tensors from the device's memory + fsync {_x(sf, 'seconds', fmt='{:.2f}')} s "
        f"(the bundle write {_x(d, 'write_x_save_file', fmt='{:.2f}')}x that){'' if not _err(sf) else ' (' + _err(sf) + ')'}; "
        f"**`nanreplay replay --json` in a fresh process {_x(cli, 'seconds', fmt='{:.1f}')} s = {_x(cli, 'x_step', fmt='{:.0f}')} steps** "
        f"(exit {_x(cli, 'rc')}, on {_x(cli, 'device')}){'' if not _err(cli) else ' (' + _err(cli) + ')'}. "
        f"In process: {d.get('summary') or 'n/a'} Fresh process: verdict {_x(cli, 'verdict')}, origin `{_x(cli, 'origin')}`"
        + (", torch's cuBLAS alert on its stderr." if cli.get("cublas_alert_on_stderr") else "."))]


def write_readme(text: str, readme: Path) -> None:
    """Put ``text`` between the ``<!-- gpu -->`` markers of ``readme`` (a section is appended when it has none)."""
    body = readme.read_text() if readme.exists() else "# Benchmarks\n"
    if START not in body:
        body = body.rstrip("\n") + f"\n\n## On a GPU\n\n{START}\n{END}\n"
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1) if END in rest else ("", "\n")
    tmp = readme.with_name(readme.name + ".tmp")
    tmp.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    os.replace(tmp, readme)


# ------------------------------------------------------------------------------------ main

class _Stopped(BaseException):
    """SIGTERM (``timeout``) while a section ran: recorded, then the outputs are written."""


def _on_term(signum: int, frame: Any) -> None:
    raise _Stopped(f"signal {signum}")


SECTIONS: tuple[tuple[str, Callable[[Run, float], dict]], ...] = (
    ("gpu_tests", run_gpu_tests),
    ("overhead:124M", lambda run, dl: bench_overhead(run, "124M", dl)),
    ("dump_replay:124M", lambda run, dl: bench_dump_replay(run, "124M", dl)),
    ("overhead:3.7M", lambda run, dl: bench_overhead(run, "3.7M", dl)),
)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes, the same code paths (for CI)")
    p.add_argument("--out", help="results JSON (default bench/results_gpu.json; dry run: a temporary file)")
    p.add_argument("--readme", help="the README whose <!-- gpu --> section gets the table (default bench/README.md; dry run: none)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all sections; one is skipped when too little is left (default 420)")
    p.add_argument("--sections", default=",".join(n for n, _ in SECTIONS), help="comma-separated subset of " + ",".join(n for n, _ in SECTIONS))
    p.add_argument("--device", default="cuda", help="the CUDA device (default cuda)")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds per model at most (default 60; fewer when a section's time is up)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    p.add_argument("--memory-budget-gib", type=float, default=16.0,
                   help="Recorder(memory_budget=...) of every Recorder variant, GiB (default 16: the sync-free mode holds 8 unchecked steps' "
                        "cotangents, 0.8 GiB each at 124M, without an early read)")
    p.add_argument("--profile", choices=["missed", "always", "never"], default="missed",
                   help="torch.profiler summary of the recorded step: when a target is missed (default), always, never")
    args = p.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(wanted) - {n for n, _ in SECTIONS})
    if unknown:
        p.error(f"--sections: unknown {', '.join(unknown)}; expected a comma-separated subset of {', '.join(n for n, _ in SECTIONS)}")
    given = list(argv if argv is not None else sys.argv[1:])
    if args.out is None:
        args.out = str(Path(tempfile.mkdtemp(prefix="nanreplay-gpu-dry-")) / "results_gpu.json") if args.dry_run else str(HERE / "results_gpu.json")
    if args.readme is None and not args.dry_run:
        args.readme = str(HERE / "README.md")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU, or with --dry-run on the CPU")
    plan = make_plan(args)
    run = Run(args, plan, "python bench/gpu.py " + " ".join(given))
    run.result["plan"] = {"device": str(plan.device), "sizes": {k: dataclasses.asdict(v) for k, v in plan.sizes.items()}, "warmup": plan.warmup,
                          "rounds": plan.rounds, "min_rounds": plan.min_rounds, "sync_steps": plan.sync_steps,
                          "recorder_options": plan.recorder_options(), "profile": plan.profile, "profile_steps": plan.profile_steps}
    _guarded(run.result, "machine", lambda: machine_info(plan.device))
    run.write()
    prev = signal.signal(signal.SIGTERM, _on_term)
    try:
        for name, fn in SECTIONS:
            if name not in wanted:
                continue
            need, most = plan.section_s[name]
            left = run.left()
            if left < need:
                run.result["sections"][name] = {"skipped": f"{left:.0f} s of the budget left, the section needs about {need} s"}
                run.write()
                continue
            print(f"[gpu.py] {name} ({left:.0f} s left)", file=sys.stderr, flush=True)
            run.result["sections"][name] = {"running": True}
            run.write()
            t0 = time.monotonic()
            try:
                run.result["sections"][name] = fn(run, t0 + min(most, left))
            except _Stopped as e:
                run.result["sections"][name] = {"error": f"stopped by {e} while running"}
                raise
            except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
                run.result["sections"][name] = {"error": _short(e), "traceback": traceback.format_exc()[-4000:]}
            finally:
                if isinstance(run.result["sections"].get(name), dict):
                    run.result["sections"][name]["seconds"] = round(time.monotonic() - t0, 1)
                run.write()
                _free(plan.device)  # the exception and its frames are gone: what the section held is freed
        run.result["finished"] = True
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, prev)
        run.write()
    print(table(run.result))
    return run.result


if __name__ == "__main__":
    main()
