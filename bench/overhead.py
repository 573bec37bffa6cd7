"""Overhead of nanreplay's Recorder beside the common alternatives, measured side by side.

Usage::

    python bench/overhead.py                      # all models, defaults (a few minutes on 2 cores)
    python bench/overhead.py --model gpt --steps 60 --threads 2 --out bench/results.json
    python bench/overhead.py --model small --steps 400 --variants plain,recorder --bundle-mb 0 --replay-repeats 0
    python bench/overhead.py --startup small,mlp,gpt,gpt42m --model none --bundle-mb 0 --replay-repeats 0

Method. Every variant trains its own copy of the same model (same initial weights, AdamW) on
the same batches. The variants run *interleaved step by step*: each round runs one training step
of every variant, in an order that rotates every round, so machine drift (other processes, CPU
frequency, allocator state) hits all variants alike. The figure quoted per variant is the median
over rounds of ``step time(variant) / step time(plain)`` within the same round, after warm-up
rounds. A step is forward, loss, backward, ``optimizer.step()``, ``zero_grad()``; on CUDA the
timer synchronises at the end of each step (outside the counted host reads).

Host syncs are counted by wrapping the Python entry points that read a device value on the host
(``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu`` and
``numpy``); on CPU these are the calls that would synchronise on CUDA (the check's CPU shortcut,
which reads each per-tensor norm, is off while counting: the device's path is counted). The
figure is per step, net of the plain loop's own count, over the last warm-up rounds
(``COUNTED_ROUNDS``); the timed rounds run without the wrappers. On CUDA,
``torch.cuda.set_sync_debug_mode`` can confirm it.

Per-step host cost: the median over rounds of ``step time(variant) - step time(plain)`` in the
same round, in microseconds; on the ``small`` model (a step of about 1 ms) it is the Recorder's
fixed cost per step, which a large model's step hides. ``--block N`` runs N consecutive steps of
each variant per round (on N batches shared by the variants) and times their mean: a loop that
runs on, as a user's does, keeps its own code and data in the caches between its steps, while
step-by-step interleaving makes the plain step pay for what the variant before it evicted. On the
small model the Recorder reads 10-25 µs more a step in blocks of 200 than step by step
(``bench/README.md``). The Recorder variants call
``Recorder.record(batch)`` before the forward and ``Recorder.log_loss(loss)`` after it, as a loop
that wants its batch and loss checked does.

Start-up (``--startup``): what the Recorder does once, per model size. Each round builds a fresh
plain and a fresh recorded copy of the model (same weights, AdamW), times ``Recorder(...)``, then
the first ``--startup-steps`` steps of each, interleaved (the order alternates per round); the
figure is the median over rounds of ``construction + recorded steps - plain steps``, in seconds
and in plain step-times (the median of later plain steps). ``torch._dynamo`` is imported before
the rounds: any ``torch.optim`` optimizer's first step imports it, with or without a Recorder.

Memory added is the recorder's own accounting (:meth:`nanreplay.Recorder.held_bytes`: copied
batches, kept cotangents, weight snapshots, step-start buffers, preallocated snapshot slots),
reported in bytes and as a fraction of the model's parameter bytes; on CUDA the script also
reports ``torch.cuda.max_memory_allocated`` per variant run alone.

The results go to ``--out`` (JSON) and, with ``--readme``, to the table in ``bench/README.md``
between the ``<!-- results -->`` markers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402  (bench/models.py)
from machine import cpu_name  # noqa: E402  (bench/machine.py)

import nanreplay  # noqa: E402
from nanreplay import NonFiniteGradientError, Recorder  # noqa: E402
from nanreplay.capture import check as check_module  # noqa: E402

# --------------------------------------------------------------------------------- sync counting

#: warm-up rounds (the last ones) whose host reads are counted
COUNTED_ROUNDS = 3

_SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class SyncCounter:
    """Counts calls of the Tensor methods that read device data on the host (a CUDA sync).

    ``cpu``/``numpy`` are counted only for non-CPU tensors (on CPU they are free and a CPU
    tensor's ``.cpu()`` is a no-op); the other methods are counted on every device, because on
    CUDA each of them would block the host until the device catches up.
    """

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._orig: dict[str, Any] = {}
        self._cpu_reads_each = check_module.CPU_READS_EACH

    @property
    def installed(self) -> bool:
        return bool(self._orig)

    def __enter__(self) -> "SyncCounter":
        # the check's CPU shortcut reads each per-tensor norm (free on the CPU); counted here is the
        # path a device takes (one stacked read), which the CPU then runs for these rounds
        check_module.CPU_READS_EACH = False
        for name in _SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig
            setattr(torch.Tensor, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        self._orig.clear()
        check_module.CPU_READS_EACH = self._cpu_reads_each

    def _wrap(self, name: str, orig: Callable) -> Callable:
        device_only = name in ("cpu", "numpy")

        def wrapper(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if self.active and not (device_only and t.device.type == "cpu"):
                self.count += 1
            return orig(t, *a, **k)

        wrapper.__name__ = name
        return wrapper


# ------------------------------------------------------------------------------------- variants


class Variant:
    """One way of running the training loop. ``step`` runs one full training step.

    ``optimizer``: builds the optimizer from the parameters (default AdamW, lr 1e-4);
    ``autocast``: the dtype of ``torch.autocast`` around the forward pass and the loss (``None``:
    off); ``recorder_options``: keyword options every Recorder variant adds to its own
    (``bench/gpu.py`` passes ``memory_budget``)."""

    name = "plain"
    label = "plain loop"

    def __init__(self, base: torch.nn.Module, loss: Callable, out_dir: Path, *, optimizer: Optional[Callable] = None,
                 autocast: Optional[torch.dtype] = None, recorder_options: Optional[dict] = None) -> None:
        self.model = copy.deepcopy(base)
        self.opt = optimizer(self.model.parameters()) if optimizer is not None else torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loss = loss
        self.out_dir = out_dir
        self.autocast = autocast
        self.recorder_options = dict(recorder_options or {})
        self.times: list[float] = []
        self.syncs: list[int] = []
        self.setup()

    def setup(self) -> None:
        pass

    def close(self) -> None:
        pass

    def context(self) -> Any:
        return nullcontext()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.context():
            self.before_forward(x, y)
            with torch.autocast(x.device.type, dtype=self.autocast) if self.autocast is not None else nullcontext():
                out = self.model(x)
                loss = self.loss(out, y)
            self.after_forward(loss)
            loss.backward()
            self.before_step(x, y)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def before_forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    def after_forward(self, loss: torch.Tensor) -> None:
        pass

    def before_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    def held_bytes(self) -> Optional[int]:
        return None


class RecorderVariant(Variant):
    name = "recorder"
    label = "Recorder, default options"
    options: dict = {}

    def setup(self) -> None:
        self.rec = Recorder(self.model, self.opt, out_dir=self.out_dir, **{**self.options, **self.recorder_options})

    def before_forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.rec.record((x, y))

    def after_forward(self, loss: torch.Tensor) -> None:
        self.rec.log_loss(loss)

    def close(self) -> None:
        self.rec.close()

    def held_bytes(self) -> Optional[int]:
        return self.rec.held_bytes()


class SnapshotVariant(RecorderVariant):
    name = "recorder_snapshot"
    label = "Recorder, weights + optimizer state snapshotted every step"
    options = {"snapshot_every": 1}


class SnapshotRingVariant(RecorderVariant):
    name = "recorder_snapshot_ring"
    label = "Recorder, a snapshot every 4 steps in a 5-step ring buffer: always one before the failing step, for bisect"
    options = {"snapshot_every": 4, "capacity": 5}


class LaggedVariant(RecorderVariant):
    name = "recorder_lagged"
    label = "Recorder, sync-free: device flag read every 8 steps (check_every=8)"
    options = {"check_every": 8}


class AnomalyVariant(Variant):
    name = "anomaly"
    label = "torch.autograd.set_detect_anomaly(True)"

    def context(self) -> Any:
        return torch.autograd.set_detect_anomaly(True)


class HookDetectorVariant(Variant):
    name = "hook_detector"
    label = "forward hook per module, torch.isnan(out).any()"

    def setup(self) -> None:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point() and torch.isnan(out).any():
                raise RuntimeError(f"NaN in the output of {type(module).__name__}")

        self.handles = [m.register_forward_hook(hook) for m in self.model.modules()]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class CallbackVariant(Variant):
    name = "capture_callback"
    label = "capture callback: deepcopy(batch), torch.cat(grads), isnan().any()"

    def before_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.last_batch = copy.deepcopy((x, y))
        flat = torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None])
        if torch.isnan(flat).any() or torch.isinf(flat).any():
            raise RuntimeError("non-finite gradient")

    def held_bytes(self) -> Optional[int]:
        b = getattr(self, "last_batch", None)
        return sum(t.numel() * t.element_size() for t in b) if b else 0


VARIANTS: dict[str, type[Variant]] = {
    v.name: v
    for v in (Variant, RecorderVariant, SnapshotVariant, SnapshotRingVariant, LaggedVariant, AnomalyVariant, HookDetectorVariant, CallbackVariant)
}


# ---------------------------------------------------------------------------------- measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    factory, make_batch, loss = models.spec(name, args.scale)
    torch.manual_seed(0)
    base = factory().to(device)
    n_params = models.param_count(base)
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    names = [n for n in args.variants if n in VARIANTS]
    with tempfile.TemporaryDirectory() as tmp:
        variants = [VARIANTS[n](base, loss, Path(tmp) / n) for n in names]
        gen = torch.Generator().manual_seed(1)
        rounds = args.warmup + args.steps
        counted = range(max(args.warmup - COUNTED_ROUNDS, 0), args.warmup)  # the last warm-up rounds: host reads counted, not timed
        counter = SyncCounter()
        for r in range(rounds):
            batches = [make_batch(gen, device) for _ in range(args.block)]  # each variant's block of steps, on the same batches
            k = r % len(variants)
            order = variants[k:] + variants[:k]
            counting = r in counted
            if counting and not counter.installed:
                counter.__enter__()
            elif not counting and counter.installed:
                counter.__exit__()  # timed rounds run without the counting wrappers
            for v in order:
                _sync(device)
                counter.count = 0
                counter.active = counting
                t0 = time.perf_counter()
                for x, y in batches:
                    v.step(x, y)
                counter.active = False
                _sync(device)
                dt = (time.perf_counter() - t0) / args.block
                if counting:
                    v.syncs.append(counter.count / args.block)
                if r >= args.warmup:
                    v.times.append(dt)
        if counter.installed:
            counter.__exit__()
        plain = variants[names.index("plain")]
        out = {
            "params": n_params,
            "param_bytes": param_bytes,
            "plain_step_ms": 1e3 * statistics.median(plain.times),
            "variants": {},
        }
        for v in variants:
            ratios = [a / b for a, b in zip(v.times, plain.times)]
            extra_us = [1e6 * (a - b) for a, b in zip(v.times, plain.times)]
            held = v.held_bytes()
            out["variants"][v.name] = {
                "label": v.label,
                "ratio_median": statistics.median(ratios),
                "ratio_q25": statistics.quantiles(ratios, n=4)[0] if len(ratios) >= 2 else ratios[0],
                "ratio_q75": statistics.quantiles(ratios, n=4)[2] if len(ratios) >= 2 else ratios[0],
                "step_ms_median": 1e3 * statistics.median(v.times),
                "host_us_per_step": statistics.median(extra_us),
                "host_us_q25": statistics.quantiles(extra_us, n=4)[0] if len(extra_us) >= 2 else extra_us[0],
                "host_us_q75": statistics.quantiles(extra_us, n=4)[2] if len(extra_us) >= 2 else extra_us[0],
                "host_syncs_per_step": (sum(v.syncs) - sum(plain.syncs)) / len(v.syncs) if v.syncs else None,
                "held_bytes": held,
                "held_fraction_of_params": (held / param_bytes) if held is not None else None,
            }
            v.close()
    return out


# ------------------------------------------------------------------------------------ start-up


def _timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: Callable, batch: tuple, device: torch.device,
                rec: Optional[Recorder] = None) -> float:
    x, y = batch
    _sync(device)
    t0 = time.perf_counter()
    if rec is not None:
        rec.record((x, y))
    out = loss(model(x), y)
    if rec is not None:
        rec.log_loss(out)
    out.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


def bench_startup(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """What the Recorder does once, for model ``name`` (see the module docstring): per round a
    fresh plain and recorded copy, ``Recorder(...)`` timed, then their first steps interleaved."""
    import torch._dynamo  # noqa: F401  (any torch.optim optimizer's first step imports it: not the Recorder's cost)

    factory, make_batch, loss = models.spec(name, args.scale)
    torch.manual_seed(0)
    base = factory().to(device)
    extras, plains = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.startup_rounds):
            plain, recorded = copy.deepcopy(base), copy.deepcopy(base)
            opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
            opt_r = torch.optim.AdamW(recorded.parameters(), lr=1e-4)
            gen = torch.Generator().manual_seed(r)
            t0 = time.perf_counter()
            rec = Recorder(recorded, opt_r, out_dir=Path(tmp) / str(r))
            extra = time.perf_counter() - t0
            for i in range(args.startup_steps + 2):
                batch = make_batch(gen, device)
                order = [False, True] if (r + i) % 2 == 0 else [True, False]
                t = {w: _timed_step(recorded if w else plain, opt_r if w else opt_p, loss, batch, device, rec if w else None) for w in order}
                if i < args.startup_steps:
                    extra += t[True] - t[False]
                else:
                    plains.append(t[False])  # later steps: the plain step-time the start-up is measured in
            rec.close()
            extras.append(extra)
            del plain, recorded, opt_p, opt_r, rec
    step = statistics.median(plains)
    q = statistics.quantiles(extras, n=4) if len(extras) >= 2 else [extras[0]] * 3
    return {"params": models.param_count(base), "plain_step_s": step, "startup_s": statistics.median(extras),
            "startup_q": [q[0], q[2]], "startup_x_step": statistics.median(extras) / step, "rounds_s": extras}


# ------------------------------------------------------------------------------------ memory


def _rss_mib() -> float:
    """This process's resident set size, MiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_child(kind: str, args: argparse.Namespace) -> dict:
    """In a fresh process: ``--rss-steps`` steps of the ``small`` model (a new batch each step,
    drawn from torch's global generator, as a data pipeline does), plain or under a Recorder with
    ``--rss-capacity`` and ``--rss-budget``; RSS and held bytes at step 100, at the step the ring
    is full and at the end (after ``gc.collect()``)."""
    import gc

    torch.set_num_threads(args.threads)
    factory, make_batch, loss = models.spec("small")
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(model, opt, out_dir=tmp, capacity=args.rss_capacity, memory_budget=args.rss_budget) if kind == "recorder" else None
        marks, out = {100, min(100 + args.rss_capacity, args.rss_steps), args.rss_steps}, {}
        for i in range(args.rss_steps + 1):
            if i in marks:
                gc.collect()
                out[str(i)] = {"rss_mib": _rss_mib(), "held_mib": rec.held_bytes() / 2**20 if rec is not None else 0.0}
            if i == args.rss_steps:
                break
            x, y = make_batch(None, torch.device("cpu"))
            _timed_step(model, opt, loss, (x, y), torch.device("cpu"), rec)
        if rec is not None:
            rec.close()
    return out


def bench_rss(args: argparse.Namespace) -> dict:
    """RSS over ``--rss-steps`` steps, plain and recorded, each in a fresh process."""
    import subprocess

    res: dict[str, Any] = {"steps": args.rss_steps, "capacity": args.rss_capacity, "budget": args.rss_budget}
    for kind in ("plain", "recorder"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rss-child", kind, "--rss-steps", str(args.rss_steps),
               "--rss-capacity", str(args.rss_capacity), "--rss-budget", str(args.rss_budget), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


# ------------------------------------------------------------------------------------ bundles


def bench_bundle(args: argparse.Namespace) -> dict:
    """Bundle write time and size for a model of about ``--bundle-mb`` MB of float32 weights
    (SGD without momentum, so the bundle holds weights + gradients + batch), in both formats,
    against ``safetensors.torch.save_file`` of the same tensors, with and without fsync."""
    import safetensors.torch

    from nanreplay.format.bundle import write_bundle
    from nanreplay.format.atomic import _fsync, _fsync_dir

    width = int((args.bundle_mb * 2**20 / 4 / 6) ** 0.5)
    torch.manual_seed(0)
    model = models.MLP(d_in=width, width=width, depth=6, n_out=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    res: dict[str, Any] = {"model_bytes": sum(p.numel() * 4 for p in model.parameters())}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmpd = Path(tmp)
        rec = Recorder(model, opt, out_dir=tmpd, diagnose=False, action="warn")
        x = torch.randn(8, width)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        grads = rec._grads()
        rec._steps.begin()  # the step the bundle content is built for
        content = rec.bundle_content(rec._current, grads, {"benchmark": True})
        rec.close()
        timings: dict[str, list[float]] = {}
        sizes: dict[str, int] = {}
        same: dict[str, torch.Tensor] = {}
        for rep in range(args.bundle_repeats):
            for fmt in ("h5", "safetensors"):
                for fsync in (True, False):
                    p = tmpd / f"b{rep}.{fmt}"
                    t0 = time.perf_counter()
                    write_bundle(p, content, fsync=fsync)
                    timings.setdefault(f"{fmt}{'' if fsync else '_nofsync'}", []).append(time.perf_counter() - t0)
                    sizes[fmt] = p.stat().st_size
                    if not same and fmt == "safetensors":
                        with nanreplay.open_bundle(p) as b:
                            same = {k: b.tensor(k).clone() for k in b.keys()}
                    p.unlink()
            for fsync in (True, False):
                p = tmpd / f"plain{rep}.safetensors"
                t0 = time.perf_counter()
                safetensors.torch.save_file(same, p)
                if fsync:
                    _fsync(p)
                    _fsync_dir(p.parent)
                timings.setdefault(f"save_file{'' if fsync else '_nofsync'}", []).append(time.perf_counter() - t0)
                sizes["save_file"] = p.stat().st_size
                p.unlink()
    res["seconds_median"] = {k: statistics.median(v) for k, v in timings.items()}
    res["bytes"] = sizes
    s = res["seconds_median"]
    res["ratio_to_save_file"] = {
        "h5": s["h5"] / s["save_file"],
        "safetensors": s["safetensors"] / s["save_file"],
        "h5_nofsync": s["h5_nofsync"] / s["save_file_nofsync"],
        "safetensors_nofsync": s["safetensors_nofsync"] / s["save_file_nofsync"],
    }
    return res


# ------------------------------------------------------------------------------------- replay


def bench_replay(args: argparse.Namespace, device: torch.device) -> dict:
    """Time from a bundle on disk to a diagnosis (``nanreplay.replay``), as a multiple of one
    plain training step of the GPT-style model; and the in-process diagnosis the Recorder runs."""
    factory, make_batch, loss = models.spec("gpt", args.scale)
    torch.manual_seed(0)
    model = factory().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    step_times = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        with Recorder(model, opt, out_dir=tmp, diagnose=True) as rec:
            for i in range(6):
                x, y = make_batch(gen, device)
                if i == 5:  # an Inf weight: the first MLP layer of block 1 produces non-finite values
                    with torch.no_grad():
                        model.blocks[1].mlp[0].weight[0, 0] = float("inf")
                _sync(device)
                t0 = time.perf_counter()
                try:
                    loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                except NonFiniteGradientError as e:
                    detect_s = time.perf_counter() - t0
                    path, live = e.bundle_path, e.diagnosis
                    break
                _sync(device)
                step_times.append(time.perf_counter() - t0)
        step = statistics.median(step_times[2:])
        runs = {}
        for ops in (False, True):
            ts = []
            for _ in range(args.replay_repeats):
                fresh = factory()
                t0 = time.perf_counter()
                diag = nanreplay.replay(path, model=fresh, device=device, ops=ops)
                ts.append(time.perf_counter() - t0)
            runs["replay_ops" if ops else "replay_modules"] = statistics.median(ts)
        origin = (diag.get("origin") or {}) if isinstance(diag, dict) else {}
    return {
        "plain_step_s": step,
        "detect_dump_diagnose_s": detect_s,
        "replay_modules_s": runs["replay_modules"],
        "replay_ops_s": runs["replay_ops"],
        "replay_modules_x_step": runs["replay_modules"] / step,
        "replay_ops_x_step": runs["replay_ops"] / step,
        "detect_dump_diagnose_x_step": detect_s / step,
        "origin": origin.get("module") if isinstance(origin, dict) else None,
        "live_summary": (live or {}).get("summary"),
    }


# ------------------------------------------------------------------------------------- output


def machine() -> dict:
    cpu = cpu_name()
    return {
        "torch": torch.__version__,
        "nanreplay": nanreplay.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"torch {m['torch']}, {m['device']} ({m['cpu']}, {m['threads']} threads), python {m['python']}; "
        f"command: `{result['command']}`",
        "",
    ]
    models_ = result["models"]
    names = list(models_)
    if names:
        lines.append("| variant | " + " | ".join(f"{n} ({models_[n]['params'] / 1e6:.2f} M params, plain step {models_[n]['plain_step_ms']:.1f} ms)" for n in names) + " |")
        lines.append("|---|" + "---|" * len(names))
        first = models_[names[0]]["variants"]
        for v in first:
            cells = []
            for n in names:
                d = models_[n]["variants"].get(v)
                if d is None:
                    cells.append("n/a")
                    continue
                cell = f"{d['ratio_median']:.3f}x [{d['ratio_q25']:.2f}-{d['ratio_q75']:.2f}], {_us(d)}, {d['host_syncs_per_step']:.2f} syncs/step"
                if d["held_bytes"] is not None:
                    cell += f", holds {d['held_bytes'] / 2**20:.1f} MiB ({d['held_fraction_of_params']:.2f}x params)"
                cells.append(cell)
            lines.append(f"| {first[v]['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    if names:
        block = result["settings"].get("block", 1)
        lines.append("Ratios: median over interleaved rounds of step time / plain step time in the same round, "
                     + (f"a round's step time the mean over {block} consecutive steps of the variant, " if block > 1 else "")
                     + "[interquartile range]; then the median of the per-round difference, in microseconds per step (the "
                     "variant's host cost). Syncs: host reads of device values per step beyond the plain loop's.")
    st = result.get("startup")
    if st:
        lines += ["", "Start-up: everything the Recorder does once (construction and its extra work in the first "
                  f"{st['steps']} steps), median of {st['rounds']} rounds, against a plain step of the same model.", "",
                  "| model | params | plain step | Recorder start-up | in plain steps |", "|---|---|---|---|---|"]
        for n, d in st["models"].items():
            lines.append(f"| {n} | {d['params'] / 1e6:.2f} M | {d['plain_step_s'] * 1e3:.1f} ms | {d['startup_s'] * 1e3:.1f} ms "
                         f"[{d['startup_q'][0] * 1e3:.1f}-{d['startup_q'][1] * 1e3:.1f}] | **{d['startup_x_step']:.2f}** |")
    m_ = result.get("rss")
    if m_:
        full = str(min(100 + m_["capacity"], m_["steps"]))
        last = str(m_["steps"])
        lines += ["", f"Memory over {m_['steps']} steps of the small model (a new batch every step), each run in a fresh process; the "
                  f"Recorder with capacity={m_['capacity']}, memory_budget={m_['budget'] / 2**20:.0f} MiB: RSS growth from step 100 and "
                  f"once the ring is full, and at step {last} the RSS above the plain run's and the part of it the Recorder does not "
                  "count as held (`held_bytes()`).", "",
                  f"| run | RSS growth, steps 100-{last} | RSS growth once the ring is full (steps {full}-{last}) | "
                  f"RSS above plain at step {last} | held at step {last} | above plain beyond held |",
                  "|---|---|---|---|---|---|"]
        base = m_["plain"][last]["rss_mib"]
        for kind in ("plain", "recorder"):
            d = m_[kind]
            a, f, e = d["100"], d[full], d[last]
            above = e["rss_mib"] - base
            lines.append(f"| {kind} | {e['rss_mib'] - a['rss_mib']:.1f} MiB | {e['rss_mib'] - f['rss_mib']:.1f} MiB | {above:.1f} MiB | "
                         f"{e['held_mib']:.1f} MiB | {above - e['held_mib']:.1f} MiB |")
    b = result.get("bundle")
    if b:
        s = b["seconds_median"]
        lines += [
            "",
            f"Bundle write, model of {b['model_bytes'] / 2**20:.0f} MiB (float32, SGD): "
            f"bundle {b['bytes']['h5'] / 2**20:.0f} MiB (h5) / {b['bytes']['safetensors'] / 2**20:.0f} MiB (safetensors), "
            f"`save_file` of the same tensors {b['bytes']['save_file'] / 2**20:.0f} MiB.",
            "",
            "| writer | with fsync (s) | ratio to save_file + fsync | without fsync (s) | ratio to save_file |",
            "|---|---|---|---|---|",
        ]
        for k in ("h5", "safetensors"):
            lines.append(f"| write_bundle .{k} | {s[k]:.3f} | {b['ratio_to_save_file'][k]:.2f}x | {s[k + '_nofsync']:.3f} | {b['ratio_to_save_file'][k + '_nofsync']:.2f}x |")
        lines.append(f"| safetensors.torch.save_file | {s['save_file']:.3f} | 1.00x | {s['save_file_nofsync']:.3f} | 1.00x |")
    r = result.get("replay")
    if r:
        lines += [
            "",
            f"Replay to diagnosis (GPT-style model, plain step {r['plain_step_s'] * 1e3:.0f} ms): "
            f"module-level {r['replay_modules_s']:.2f} s = {r['replay_modules_x_step']:.1f} steps; "
            f"with the op-level monitor {r['replay_ops_s']:.2f} s = {r['replay_ops_x_step']:.1f} steps; "
            f"in-process detect + dump + diagnose {r['detect_dump_diagnose_s']:.2f} s = {r['detect_dump_diagnose_x_step']:.1f} steps. "
            f"Origin found: `{r['origin']}`.",
        ]
    return "\n".join(lines)


def _us(d: dict) -> str:
    """A variant's per-step host cost: the median difference to the plain step, in µs."""
    if "host_us_per_step" not in d:
        return "-"
    return f"{d['host_us_per_step']:+.0f} µs/step"


def write_readme(text: str, readme: Path) -> None:
    start, end = "<!-- results -->", "<!-- /results -->"
    body = readme.read_text() if readme.exists() else f"# Benchmarks\n\n{start}\n{end}\n"
    if start not in body:
        body += f"\n{start}\n{end}\n"
    head, rest = body.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all", choices=[*models.MODELS, "all", "none"],
                   help="all: small, mlp, cnn, gpt (gpt42m only when named); none: only --startup and the bundle / replay parts")
    p.add_argument("--steps", type=int, default=40, help="timed rounds per model (each round: --block steps of every variant)")
    p.add_argument("--block", type=int, default=1, help="consecutive steps of each variant per round (1: step by step; 200: as a training loop runs)")
    p.add_argument("--warmup", type=int, default=4, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="width multiplier of the models")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--startup", default="", help="comma-separated models whose Recorder start-up cost to measure (e.g. small,gpt,gpt42m)")
    p.add_argument("--startup-rounds", type=int, default=3, help="fresh plain + recorded pairs per model for --startup")
    p.add_argument("--startup-steps", type=int, default=3, help="first steps counted in the start-up")
    p.add_argument("--rss", action="store_true", help="also measure RSS over --rss-steps steps of the small model, plain and recorded")
    p.add_argument("--rss-steps", type=int, default=3000)
    p.add_argument("--rss-capacity", type=int, default=1000, help="the recorded run's capacity")
    p.add_argument("--rss-budget", type=int, default=256 << 20, help="the recorded run's memory_budget, bytes")
    p.add_argument("--rss-child", choices=["plain", "recorder"], help=argparse.SUPPRESS)
    p.add_argument("--bundle-mb", type=float, default=100.0, help="model size for the bundle write test (0 = skip)")
    p.add_argument("--bundle-repeats", type=int, default=3)
    p.add_argument("--replay-repeats", type=int, default=3, help="0 = skip the replay test")
    p.add_argument("--tmp", default=None, help="directory for bundle files (default: the system temp dir)")
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--readme", action="store_true", help="also rewrite the table in bench/README.md")
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args)))
        return {}
    if args.block < 1:
        p.error(f"--block must be at least 1 (consecutive steps per round); got {args.block}")
    args.variants = [v for v in args.variants.split(",") if v]
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "command": "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items()},
        "models": {},
    }
    names = ["small", "mlp", "cnn", "gpt"] if args.model == "all" else [] if args.model == "none" else [args.model]
    for n in names:
        t0 = time.perf_counter()
        result["models"][n] = bench_model(n, args, device)
        print(f"[{n}] {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    startup = [n for n in args.startup.split(",") if n]
    if startup:
        result["startup"] = {"rounds": args.startup_rounds, "steps": args.startup_steps, "models": {}}
        for n in startup:
            t0 = time.perf_counter()
            result["startup"]["models"][n] = bench_startup(n, args, device)
            print(f"[start-up {n}] {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.rss:
        result["rss"] = bench_rss(args)
    if args.bundle_mb > 0:
        result["bundle"] = bench_bundle(args)
    if args.replay_repeats > 0:
        result["replay"] = bench_replay(args, device)
    text = table(result)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(text)
    if args.readme:
        write_readme(text, HERE / "README.md")
    return result


if __name__ == "__main__":
    main()
