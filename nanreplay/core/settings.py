"""A run's configuration as settings, and the difference between two runs (``nanreplay diff``).

A bundle records its run's configuration in a few places of its metadata, each written once:
``environment`` (the process: versions, numerics flags, environment variables;
:mod:`nanreplay.format.environment`), ``config`` (the run: optimizer hyper-parameters, reduce
dtypes, activation checkpointing, data digests; :mod:`nanreplay.capture.settings`), ``compile``
(:mod:`nanreplay.capture.compiled`), the failing step's ``autocast``, the parameters' dtypes and
the world size. :func:`settings_of` reads them all into one flat mapping of setting keys
(``"autocast"``, ``"numerics.tf32_matmul"``, ``"optimizer.lr"``, ``"env.NCCL_ALGO"``, ...) and
:func:`diff_settings` compares two of them.

:data:`SETTINGS` is the decision table: the first row whose pattern matches a key gives its
category, its numerics rank (the order ``diff`` lists differences in: what can change the
numbers of a step first), whether ``bisect --over config`` can change it in a replay
(:data:`nanreplay.engine.settings.TOGGLES` implements exactly those rows), and, in a few words,
how it changes numerics. Pure data: no torch; a bundle's values are untrusted and only compared.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .results import ConfigDiff, DiffSide, SettingDiff, UnknownSetting

__all__ = ["Rule", "SETTINGS", "CATEGORIES", "INFORMATIVE", "rule_for", "settings_of", "diff_settings", "show_value",
           "Recorded", "UNSET"]

#: the categories, in the order ``diff`` groups them when ranks tie
CATEGORIES = ("precision", "kernels", "optimizer", "training", "distributed", "versions", "environment variables", "data", "other")

#: the rank of settings that do not change numerics (listed last)
INFORMATIVE = 9

#: the value of a setting one run has and the other lacks within a family both record (an
#: environment variable not set, a library not installed, an inductor option not given)
UNSET = "(unset)"


@dataclass(frozen=True)
class Rule:
    """One row of :data:`SETTINGS`: ``pattern`` (``fnmatch`` over the setting key), ``category``
    (one of :data:`CATEGORIES`), ``rank`` (1 = most likely to change a step's numbers;
    :data:`INFORMATIVE` = not at all), ``replay`` (``bisect --over config`` can set it in a
    replay), ``why`` (how it changes numerics, a phrase)."""

    pattern: str
    category: str
    rank: int
    replay: bool
    why: str

    @property
    def numerics(self) -> bool:
        return self.rank < INFORMATIVE


def _r(pattern: str, category: str, rank: int, why: str, replay: bool = False) -> Rule:
    return Rule(pattern, category, rank, replay, why)


#: setting key pattern -> category, numerics rank, replayable, why; the first row that matches decides
SETTINGS: tuple[Rule, ...] = (
    # precision: the dtype the step computes in
    _r("autocast", "precision", 1, "the dtype autocast runs matmuls and convolutions in (float16 overflows above 65504)", True),
    _r("model.param_dtypes", "precision", 1, "the dtype of the weights, and of every op on them outside autocast"),
    _r("numerics.float32_matmul_precision", "precision", 1, "float32 matmuls in TF32 or bfloat16 ('high', 'medium') or in float32", True),
    _r("numerics.tf32_matmul", "precision", 1, "CUDA float32 matmuls in TF32 (10-bit mantissa)", True),
    _r("numerics.cudnn_tf32", "precision", 1, "cuDNN float32 convolutions in TF32", True),
    _r("numerics.fp16_reduced_precision_reduction", "precision", 1, "float16 matmul reductions in float16 instead of float32", True),
    _r("numerics.bf16_reduced_precision_reduction", "precision", 1, "bfloat16 matmul reductions in bfloat16 instead of float32", True),
    _r("numerics.*fp32_precision", "precision", 1, "float32 math in TF32 or bfloat16 (torch's fp32_precision flags)"),
    _r("distributed.reduce_dtype", "precision", 1, "the dtype gradients are reduced in across ranks"),
    _r("distributed.param_dtype", "precision", 1, "the dtype FSDP unshards parameters to for compute"),
    _r("distributed.comm_hook", "precision", 1, "a DDP comm hook that compresses gradients (fp16 / bf16 compression)"),
    # kernels: which implementation runs
    _r("compile.compiled", "kernels", 2, "compiled (fused, reordered) kernels instead of eager ones", True),
    _r("compile.backend", "kernels", 2, "the compiler backend (inductor generates its own kernels)", True),
    _r("compile.mode", "kernels", 2, "inductor's mode (autotuned kernels, CUDA graphs)", True),
    _r("compile.options.*", "kernels", 2, "an inductor option (fusion, precision of intermediates)", True),
    _r("compile.*", "kernels", 2, "how torch.compile traced the model"),
    _r("numerics.sdpa_*", "kernels", 2, "which scaled-dot-product-attention kernel runs (flash, memory-efficient, math, cuDNN)", True),
    _r("optimizer.fused", "kernels", 2, "the fused optimizer kernel (one kernel per step, its own accumulation order)", True),
    _r("optimizer.foreach", "kernels", 2, "the multi-tensor (foreach) optimizer kernels", True),
    _r("optimizer.capturable", "kernels", 2, "the optimizer's capturable (device-side step count) path"),
    _r("numerics.deterministic_algorithms", "kernels", 2, "deterministic kernels instead of atomics-based ones", True),
    _r("numerics.cudnn_deterministic", "kernels", 2, "deterministic cuDNN algorithms", True),
    _r("numerics.cudnn_benchmark", "kernels", 2, "cuDNN's autotuned algorithm choice", True),
    _r("numerics.cudnn_enabled", "kernels", 2, "cuDNN kernels or torch's own", True),
    _r("numerics.mkldnn_enabled", "kernels", 2, "oneDNN (MKL-DNN) CPU kernels or torch's own", True),
    _r("training.checkpointing", "kernels", 2, "activation checkpointing: the forward is recomputed in the backward pass"),
    # the optimizer and the training loop
    _r("optimizer.class", "optimizer", 3, "the optimizer's update rule"),
    _r("optimizer.*", "optimizer", 3, "an optimizer hyper-parameter (learning rate, eps, betas, weight decay)"),
    _r("training.micro_batches", "training", 3, "gradient accumulation: micro-batches summed per optimizer step"),
    _r("distributed.world_size", "distributed", 3, "the number of ranks: the global batch and the reduction order"),
    _r("distributed.*", "distributed", 3, "how gradients are reduced across ranks"),
    # versions and the variables that change kernels
    _r("version.nanreplay", "other", INFORMATIVE, "the recorder's version"),
    _r("version.platform", "other", INFORMATIVE, "the operating system"),
    _r("version.python", "versions", 8, "the Python interpreter (rarely numerics)"),
    _r("version.*", "versions", 4, "a library whose kernels or defaults the step runs"),
    # variables naming places and logs: no kernel reads them (torch sets TORCHINDUCTOR_CACHE_DIR itself)
    _r("env.*_DIR", "environment variables", INFORMATIVE, "a directory (caches, logs)"),
    _r("env.*CACHE*", "environment variables", INFORMATIVE, "a cache setting"),
    _r("env.*_PATH", "environment variables", INFORMATIVE, "a search path"),
    _r("env.*LOG*", "environment variables", INFORMATIVE, "logging"),
    _r("env.*DEBUG*", "environment variables", INFORMATIVE, "debugging output"),
    _r("env.*VERBOSE*", "environment variables", INFORMATIVE, "logging"),
    _r("env.*TRACE*", "environment variables", INFORMATIVE, "tracing"),
    _r("env.NVIDIA_TF32_OVERRIDE", "environment variables", 4, "overrides TF32 in every CUDA library"),
    _r("env.TORCH_ALLOW_TF32*", "environment variables", 4, "overrides torch's TF32 flags"),
    _r("env.CUBLAS*", "environment variables", 4, "cuBLAS's workspace and algorithm choice"),
    _r("env.CUDNN*", "environment variables", 4, "cuDNN's algorithm choice"),
    _r("env.TORCH_CUDNN*", "environment variables", 4, "cuDNN's algorithm choice"),
    _r("env.TORCH_BLAS*", "environment variables", 4, "torch's BLAS backend choice"),
    _r("env.NCCL_ALGO", "environment variables", 4, "NCCL's reduction algorithm (the order gradients are summed in)"),
    _r("env.NCCL_PROTO", "environment variables", 4, "NCCL's protocol (the order gradients are summed in)"),
    _r("env.TORCHINDUCTOR_*", "environment variables", 4, "an inductor option"),
    _r("env.TORCH_*", "environment variables", 6, "a torch option (most change logging or memory, some kernels)"),
    _r("env.PYTORCH_*", "environment variables", 7, "a torch option (most change memory)"),
    _r("env.NVTE_*", "environment variables", 4, "a Transformer Engine option (FP8 recipes, fused attention)"),
    _r("env.OMP_NUM_THREADS", "environment variables", 6, "CPU threads: the order CPU reductions sum in"),
    _r("env.MKL_*", "environment variables", 6, "MKL's threads and code paths"),
    _r("numerics.num_threads", "kernels", 6, "CPU threads: the order CPU reductions sum in"),
    _r("numerics.deterministic_warn_only", "other", INFORMATIVE, "whether a nondeterministic op warns or raises"),
    # the data each step read
    _r("data.*", "data", 5, "the batches the steps read (SHA-256 of their bytes)"),
    _r("env.*", "environment variables", INFORMATIVE, "read by a library, not by a kernel's numerics"),
    _r("*", "other", INFORMATIVE, "informative"),
)


def rule_for(key: str) -> Rule:
    """The first row of :data:`SETTINGS` whose pattern matches ``key`` (the last row matches any)."""
    for row in SETTINGS:
        if fnmatch.fnmatchcase(key, row.pattern):
            return row
    return SETTINGS[-1]


@dataclass
class Recorded:
    """A run's settings: ``values`` (key -> JSON value) and ``families``, the key prefixes the run
    records as a whole (``"env."``, ``"version."``, ``"compile.options."``): within a family
    recorded by both runs, a key only one has is :data:`UNSET` in the other."""

    values: dict[str, Any]
    families: set[str]
    data: dict[int, str]


def _obj(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _scalar(v: Any) -> Any:
    """A value as compared: JSON scalars as they are, lists and objects as their JSON text."""
    if isinstance(v, str):
        return str(v)  # a str subclass (torch's TorchVersion) compares as its text
    if v is None or isinstance(v, (bool, int, float)):
        return v
    return json.dumps(v, sort_keys=True, default=str)[:2048]


def _failing_step(meta: Mapping[str, Any]) -> dict:
    failing = meta.get("failing_step")
    return next((s for s in meta.get("steps") or [] if isinstance(s, dict) and s.get("step") == failing), {})


def settings_of(meta: Mapping[str, Any]) -> Recorded:
    """The settings a bundle's metadata records (already validated by :mod:`nanreplay.format.meta`),
    as one flat mapping; see the module docstring. Missing records give no keys (an older bundle
    compares on what it has)."""
    v: dict[str, Any] = {}
    families: set[str] = set()
    env = _obj(meta.get("environment"))
    for k in ("torch", "cuda", "cudnn", "numpy", "python", "platform", "nanreplay"):
        if k in env:
            v[f"version.{k}"] = _scalar(env[k])
    if isinstance(env.get("libraries"), dict):
        families.add("version.")
        v.update({f"version.{k}": _scalar(x) for k, x in env["libraries"].items()})
    for k, x in {**_obj(env.get("determinism")), **_obj(env.get("numerics"))}.items():
        v[f"numerics.{k}"] = _scalar(x)
    if "num_threads" in env:
        v["numerics.num_threads"] = _scalar(env["num_threads"])
    if isinstance(env.get("variables"), dict):
        families.add("env.")
        v.update({f"env.{k}": _scalar(x) for k, x in env["variables"].items()})
    step = _failing_step(meta)
    if step:
        ac = step.get("autocast")
        v["autocast"] = ac.get("dtype") if isinstance(ac, dict) else "off"
        v["training.micro_batches"] = max(len(step.get("forwards") or []), len(step.get("batches") or []))
    params = _obj(_obj(meta.get("model")).get("params"))
    if params:
        v["model.param_dtypes"] = ", ".join(sorted({str(_obj(p).get("dtype")) for p in params.values()}))
    comp = meta.get("compile")
    if isinstance(comp, dict):
        _compile_settings(comp, v, families)
    _config_settings(meta, v)
    if isinstance(meta.get("config"), dict):
        families.add("distributed.")  # the run's side is recorded: a reduce dtype it lacks was not set
    data = {}
    for row in _obj(meta.get("config")).get("data") or []:
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("sha256"), str):
            data[row["step"]] = row["sha256"]
    return Recorded(v, families, data)


def _compile_settings(comp: dict, v: dict[str, Any], families: set[str]) -> None:
    v["compile.compiled"] = bool(comp.get("compiled"))
    if not comp.get("compiled"):
        return
    for k in ("backend", "mode", "dynamic", "fullgraph"):
        v[f"compile.{k}"] = _scalar(comp.get(k))
    v["compile.modules"] = ", ".join(str(m) or "(model)" for m in comp.get("modules") or [])
    if isinstance(comp.get("options"), dict):
        families.add("compile.options.")
        v.update({f"compile.options.{k}": _scalar(x) for k, x in comp["options"].items()})


def _config_settings(meta: Mapping[str, Any], v: dict[str, Any]) -> None:
    """The run's side: the optimizer (class, each hyper-parameter: one value when every param
    group has it, else the list by group), activation checkpointing, the ranks and reduce dtypes."""
    opt = _obj(meta.get("optimizer"))
    if opt.get("class") is not None:
        v["optimizer.class"] = _scalar(opt["class"])
    cfg = _obj(meta.get("config"))
    groups = [g for g in _obj(cfg.get("optimizer")).get("param_groups") or [] if isinstance(g, dict)]
    if not groups and isinstance(opt.get("defaults"), dict):
        groups = [opt["defaults"]]  # an older bundle: the constructor's defaults
    for k in sorted({k for g in groups for k in g}):
        vals = [_scalar(g.get(k)) for g in groups]
        v[f"optimizer.{k}"] = vals[0] if len(set(map(str, vals))) == 1 else _scalar(vals)
    training = _obj(cfg.get("training"))
    ckpt = _obj(training.get("checkpointing"))
    wrapped = sum(1 for row in _obj(meta.get("model")).get("modules") or [] if isinstance(row, list) and len(row) == 2
                  and row[1] in ("CheckpointWrapper", "CheckpointImpl"))
    if ckpt or wrapped:
        parts = [f"{wrapped} module(s) wrapped by checkpoint_wrapper"] if wrapped else []
        if ckpt.get("gradient_checkpointing"):
            parts.append(f"gradient_checkpointing on {len(ckpt['gradient_checkpointing'])} module(s)")
        v["training.checkpointing"] = "; ".join(parts) or "off"
    elif "training" in cfg:
        v["training.checkpointing"] = "off"
    dist = _obj(meta.get("distributed"))
    ws = meta.get("world_size") if meta.get("world_size") is not None else dist.get("world_size")
    if ws is not None or "config" in meta:
        v["distributed.world_size"] = ws if isinstance(ws, int) else 1
    for k, x in _obj(cfg.get("distributed")).items():  # a run with a config and no distributed entry ran in one process
        v[f"distributed.{k}"] = _scalar(x)


def show_value(x: Any) -> str:
    """A setting's value as a table shows it: ``None`` as ``none``, booleans as ``true`` /
    ``false``, everything else as its text, cut to 120 characters."""
    if x is None:
        return "none"
    if isinstance(x, bool):
        return "true" if x else "false"
    s = str(x)
    return s if len(s) <= 120 else s[:117] + "..."


def _side(name: str, meta: Optional[Mapping[str, Any]], here: bool) -> DiffSide:
    return {"bundle": name, "step": None if here or meta is None else meta.get("failing_step"), "here": here}


def diff_settings(a: Mapping[str, Any], b: Mapping[str, Any], *, a_name: str = "A", b_name: str = "B",
                  b_here: bool = False) -> ConfigDiff:
    """The settings two runs differ in, the numerics-relevant first.

    Args:
        a, b: the metadata of two bundles (``Bundle.meta``); ``b`` may be the current process's
            (``{"environment": environment()}``, with ``b_here``): then only the process's
            settings are compared.
        a_name, b_name: how the result names them (the bundles' paths).

    Returns:
        a :class:`~nanreplay.core.results.ConfigDiff`: ``differences`` sorted by numerics rank, then
        by :data:`SETTINGS` row and key (each with its category, whether ``bisect --over config``
        can toggle it, and why it matters), ``same`` (how many settings are equal), ``unknown``
        (settings only one side records), ``notes``.
    """
    ra, rb = settings_of(a), settings_of(b)
    rows: list[tuple[tuple, SettingDiff]] = []
    unknown: list[UnknownSetting] = []
    same = 0
    order = {r.pattern: i for i, r in enumerate(SETTINGS)}
    for key in sorted(set(ra.values) | set(rb.values)):
        in_a, in_b = key in ra.values, key in rb.values
        if not (in_a and in_b):
            fam = next((f for f in ra.families & rb.families if key.startswith(f)), None)
            if fam is None:
                if not b_here:
                    unknown.append({"key": key, "recorded_in": "a" if in_a else "b"})
                continue
        va, vb = ra.values.get(key, UNSET), rb.values.get(key, UNSET)
        if va == vb and type(va) is type(vb):
            same += 1
            continue
        rule = rule_for(key)
        rows.append(((rule.rank, order[rule.pattern], key), {
            "key": key, "category": rule.category, "rank": rule.rank, "numerics": rule.numerics, "a": va, "b": vb,
            "replayable": rule.replay, "why": rule.why}))
    data_row = _data_row(ra.data, rb.data)
    if data_row is not None:
        rule = rule_for("data.batches")
        rows.append(((rule.rank, order[rule.pattern], "data.batches"), data_row))
    elif set(ra.data) & set(rb.data):
        same += 1
    rows.sort(key=lambda r: r[0])
    notes = []
    if b_here:
        notes.append("compared with this process: versions, flags and environment variables only (autocast, the optimizer, "
                     "compile and the data are the run's, compared between two bundles); the flags are this process's defaults "
                     "unless the training script sets them the same way")
    return {"a": _side(a_name, a, False), "b": _side(b_name, b, b_here), "differences": [r for _, r in rows], "same": same,
            "unknown": unknown, "notes": notes}


def _data_row(a: dict[int, str], b: dict[int, str]) -> Optional[SettingDiff]:
    """One row for the data digests of the steps both bundles hold, when any differs."""
    both = sorted(set(a) & set(b))
    differ = [s for s in both if a[s] != b[s]]
    if not differ:
        return None
    rule = rule_for("data.batches")
    shown = ", ".join(map(str, differ[:8])) + (", ..." if len(differ) > 8 else "")
    return {"key": "data.batches", "category": rule.category, "rank": rule.rank, "numerics": rule.numerics,
            "a": [a[s][:12] for s in differ[:8]], "b": [b[s][:12] for s in differ[:8]], "replayable": False,
            "why": f"{len(differ)} of the {len(both)} step(s) both bundles hold read different data (steps {shown})"}
