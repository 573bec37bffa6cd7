"""Loads the corpus cases, records each one under a nanreplay Recorder, and compares a diagnosis
with a case's EXPECTED fields.

Uses nanreplay's public API only (``Recorder``, ``NonFiniteGradientError``), so it survives
changes inside the package.

A case is one file in ``tests/corpus/cases/``; its module-level names are the protocol (see
``tests/corpus/README.md``): ``SOURCE``, ``EXPECTED``, ``TAGS``, optional ``RECORDER``,
``make_model()``, ``make_optimizer(model)``, ``loss_fn(model, batch)``, ``batches()``, optional
``train_step(model, optimizer, batch, recorder, step)`` and optional ``make_scaler()`` (a
``torch.amp.GradScaler`` handed to the Recorder; the case's ``train_step`` uses the one it made).
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import numpy
import torch

CASES_DIR = Path(__file__).resolve().parent / "cases"

#: the six fields every case's EXPECTED names
FIELDS = ("step", "phase", "module", "op", "samples", "cause")
PHASES = ("input", "weights", "forward", "loss", "backward", "optimizer", "none")
CAUSES = ("bad input data", "numerics", "overflow", "underflow", "explosion", "optimizer update", "nondeterminism", "compiler", "transient", "unknown")

# name given to case modules; they are not put in sys.modules, so no other process (nor this one)
# can import them by name: the Recorder stores their functions as "/path/to/case.py:fn" and
# `nanreplay replay` in another process finds them by path
_MODULE_PREFIX = "nanreplay_corpus_case_"


def case_name(case: ModuleType) -> str:
    return Path(case.__file__).stem


def load_case(path: "str | Path") -> ModuleType:
    """Import one case file by path."""
    path = Path(path).resolve()
    name = _MODULE_PREFIX + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import corpus case {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_paths(pattern: Optional[str] = None) -> list[Path]:
    """The case files, sorted by name; ``pattern`` is a glob on the name (``"*attention*"``) or a
    substring of it."""
    paths = sorted(p for p in CASES_DIR.glob("*.py") if not p.name.startswith("_"))
    if pattern:
        import fnmatch

        paths = [p for p in paths if fnmatch.fnmatch(p.stem, pattern) or pattern in p.stem]
    return paths


def load_cases(pattern: Optional[str] = None) -> list[ModuleType]:
    """Import every case file by path, sorted by name."""
    return [load_case(p) for p in case_paths(pattern)]


def seed_all(seed: int = 0) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


class NullRecorder:
    """Stands in for the Recorder when a loop runs without one (the baselines of
    bench/accuracy.py): ``record`` does nothing, ``log_loss`` keeps the last loss."""

    def __init__(self) -> None:
        self.last_loss: Optional[torch.Tensor] = None

    def record(self, batch: Any) -> None:
        return None

    def log_loss(self, loss: torch.Tensor) -> None:
        self.last_loss = loss.detach() if isinstance(loss, torch.Tensor) else None


def default_step(case: ModuleType) -> Callable:
    """The plain loop body: record, loss, backward, step."""

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, recorder: Any, i: int) -> None:
        recorder.record(batch)
        loss = case.loss_fn(model, batch)
        recorder.log_loss(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def train_step_of(case: ModuleType) -> Callable:
    return getattr(case, "train_step", None) or default_step(case)


def build(case: ModuleType) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Seed, then the case's model, optimizer and (optional) GradScaler."""
    seed_all(0)
    model = case.make_model()
    opt = case.make_optimizer(model)
    scaler = case.make_scaler() if hasattr(case, "make_scaler") else None
    return model, opt, scaler


class NoFailure(AssertionError):
    """The case ran all its batches without the Recorder stopping it."""


def record_case(case: ModuleType, out_dir: "str | Path", **recorder_opts: Any) -> dict:
    """Run the case's training loop under a Recorder and return ``{"step", "bundle",
    "diagnosis", "seconds"}`` from the ``NonFiniteGradientError`` it raises (``diagnosis`` is
    None with ``diagnose=False``). Raises :class:`NoFailure` when no step failed."""
    from nanreplay import NonFiniteGradientError, Recorder

    model, opt, scaler = build(case)
    opts = dict(getattr(case, "RECORDER", None) or {})
    opts.update(recorder_opts)
    if scaler is not None:
        opts["scaler"] = scaler
    step_fn = train_step_of(case)
    batches = case.batches()
    t0 = time.perf_counter()
    try:
        with Recorder(model, opt, loss_fn=case.loss_fn, model_factory=case.make_model, out_dir=str(out_dir), **opts) as rec:
            for i, batch in enumerate(batches):
                step_fn(model, opt, batch, rec, i)
    except NonFiniteGradientError as e:
        return {
            "step": e.step,
            "bundle": str(e.bundle_path) if e.bundle_path is not None else None,
            "diagnosis": e.diagnosis,
            "seconds": time.perf_counter() - t0,
        }
    raise NoFailure(
        f"corpus case {case_name(case)}: the Recorder did not stop the run in {len(batches)} steps "
        f"(EXPECTED step {case.EXPECTED.get('step')}); the case no longer reproduces its bug"
    )


# -- comparing a diagnosis with EXPECTED -----------------------------------------------------------

def norm_op(name: Any) -> Optional[str]:
    """An op name as compared: overload packet without leading/trailing underscores, lower case
    (``aten._softmax.default`` -> ``softmax``, ``SqrtBackward0`` stays a node name)."""
    if name is None:
        return None
    s = str(name)
    if s.startswith("aten."):
        s = s.split(".")[1]
    return s.strip("_").lower()


def _expected_ops(op: Any) -> Optional[set]:
    if op is None:
        return None
    ops = op if isinstance(op, (tuple, list)) else (op,)
    return {norm_op(o) for o in ops}


def field_matches(expected: dict, diagnosis: Optional[dict]) -> dict[str, bool]:
    """Per field, whether ``diagnosis`` (a nanreplay diagnosis dict) says what ``expected`` (a
    case's EXPECTED) says. ``op``: the expected name or any of a tuple; for a backward birth the
    origin's ``forward_op`` counts too. ``samples``: same set of indices; None expected means no
    indices reported."""
    d = diagnosis or {}
    origin = d.get("origin") or {}
    got_ops = {norm_op(origin.get("op"))} - {None}
    if expected.get("phase") == "backward" or d.get("phase") == "backward":
        fo = norm_op(origin.get("forward_op"))
        if fo:
            got_ops.add(fo)
    exp_ops = _expected_ops(expected.get("op"))
    indices = (d.get("samples") or {}).get("indices") or []
    exp_samples = expected.get("samples")
    return {
        "step": d.get("step") == expected.get("step"),
        "phase": d.get("phase") == expected.get("phase"),
        "module": origin.get("module") == expected.get("module"),
        "op": (not got_ops) if exp_ops is None else bool(got_ops & exp_ops),
        "samples": (not indices) if exp_samples is None else set(indices) == set(exp_samples),
        "cause": (d.get("classification") or {}).get("cause") == expected.get("cause"),
    }


def got_fields(diagnosis: Optional[dict]) -> dict:
    """The six fields as a diagnosis states them (for tables of misses)."""
    d = diagnosis or {}
    origin = d.get("origin") or {}
    op = origin.get("op")
    if d.get("phase") == "backward" and origin.get("forward_op"):
        op = f"{op} ({origin.get('forward_op')})" if op else origin.get("forward_op")
    return {
        "step": d.get("step"),
        "phase": d.get("phase"),
        "module": origin.get("module"),
        "op": op,
        "samples": (d.get("samples") or {}).get("indices") or None,
        "cause": (d.get("classification") or {}).get("cause"),
    }


def answer(diagnosis: dict) -> dict:
    """What two diagnoses of one bundle must agree on (the in-process one and a replay's): the
    cause, the origin (phase, module FQN, op, micro-batch) and the samples (indices, micro-batch)."""
    origin = diagnosis.get("origin") or {}
    samples = diagnosis.get("samples") or {}
    return {
        "cause": (diagnosis.get("classification") or {}).get("cause"),
        "phase": diagnosis.get("phase"),
        "origin": {k: origin.get(k) for k in ("module", "op", "forward_op", "micro_batch", "kind")},
        "samples": {k: samples.get(k) for k in ("indices", "micro_batch")},
    }


def validate_expected(case: ModuleType) -> list[str]:
    """Problems with a case's protocol names (empty when it is well formed)."""
    problems = []
    name = case_name(case)
    src = getattr(case, "SOURCE", None)
    if not (isinstance(src, str) and src.startswith(("https://", "http://"))):
        problems.append(f"{name}: SOURCE must be a URL, got {src!r}")
    doc = (case.__doc__ or "").strip()
    if len(doc) < 40:
        problems.append(f"{name}: needs a docstring (title and the real bug)")
    exp = getattr(case, "EXPECTED", None)
    if not isinstance(exp, dict) or set(exp) != set(FIELDS):
        return problems + [f"{name}: EXPECTED must have exactly the keys {FIELDS}, got {exp!r}"]
    if not isinstance(exp["step"], int) or exp["step"] < 0:
        problems.append(f"{name}: EXPECTED step must be an int >= 0")
    if exp["phase"] not in PHASES:
        problems.append(f"{name}: EXPECTED phase {exp['phase']!r} not in {PHASES}")
    if exp["phase"] == "none" and exp["cause"] not in ("transient", "nondeterminism", "compiler"):
        problems.append(f"{name}: phase 'none' only when the eager replay is finite (transient, nondeterminism, compiler)")
    if exp["cause"] not in CAUSES:
        problems.append(f"{name}: EXPECTED cause {exp['cause']!r} not in {CAUSES}")
    if exp["module"] is not None and not isinstance(exp["module"], str):
        problems.append(f"{name}: EXPECTED module must be None or a FQN string")
    op = exp["op"]
    if op is not None and not (isinstance(op, str) or (isinstance(op, tuple) and op and all(isinstance(o, str) for o in op))):
        problems.append(f"{name}: EXPECTED op must be None, a name or a tuple of names")
    if exp["phase"] in ("input", "none") and (exp["module"] is not None or op is not None):
        problems.append(f"{name}: an {exp['phase']} birth has no module and no op")
    if exp["phase"] == "weights" and op is not None:
        problems.append(f"{name}: a weights birth has no op")
    s = exp["samples"]
    if s is not None and not (isinstance(s, list) and s and all(isinstance(i, int) and i >= 0 for i in s)):
        problems.append(f"{name}: EXPECTED samples must be None or a non-empty list of row indices")
    tags = getattr(case, "TAGS", None)
    if not (isinstance(tags, tuple) and tags and all(isinstance(t, str) for t in tags)):
        problems.append(f"{name}: TAGS must be a non-empty tuple of strings")
    for fn in ("make_model", "make_optimizer", "loss_fn", "batches"):
        if not callable(getattr(case, fn, None)):
            problems.append(f"{name}: missing {fn}()")
    rec = getattr(case, "RECORDER", {})
    if not isinstance(rec, dict):
        problems.append(f"{name}: RECORDER must be a dict")
    return problems
