"""The one sentence a diagnosis leads with, built from the diagnosis dict alone (no torch).

The sentence is: what was born and where (:data:`HEADS`, by phase and origin kind), the step, the
micro-batch and samples, what the rest of the step did (:data:`TAILS`), the cause verdict with its
detail, and the reproduction verdict (:func:`verdict_phrase`). Every part reads a field of the
dict; nothing is decided here.

>>> summary_sentence({"phase": "loss", "step": 3, "origin": {"module": None, "op": "div", "nonfinite": "NaN"},
...                   "classification": {"cause": "bad input data", "detail": "the divisor is 0"},
...                   "reproduction": {"verdict": "reproduced exactly"}, "forward_finite": True})
'NaN born in the loss, outside the model, in op div, step 3; the model\\'s forward pass was finite; cause: bad input data (the divisor is 0); reproduced exactly.'
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..core.results import DiagnosisDict, Fix, Origin, Reproduction, Source

__all__ = ["summary_sentence", "fix_sentence", "FIX_PHRASES", "verdict_phrase", "number_text", "reproduced", "difference_phrase", "culprit_phrase", "HEADS",
           "HEAD_KINDS", "TAILS", "COMPILE_PHRASES"]


def _where_src(src: Optional[Source]) -> str:
    return f" at {os.path.basename(src['file'])}:{src['line']}" if src else ""


def _in_module(o: Origin) -> str:
    mod = o.get("module")
    if mod is None:
        return ""
    return f" in module {mod or '(root module)'}" + (f" ({o['class']})" if o.get("class") else "")


#: how the sentence opens, by (phase, origin kind); the first key that matches (kind, then None)
HEADS: dict[tuple[str, Optional[str]], str] = {
    ("input", None): "non-finite value in the input data at {leaf}",
    ("weights", "buffer"): "non-finite buffer before the step ({tensor}){in_module}",
    ("weights", None): "non-finite weights before the step ({tensor}){in_module}",
    ("optimizer", None): "{kinds} born in the optimizer update ({optimizer}){op} of parameter {param}{state}{in_module}",
    ("backward", "explosion"): ("gradients exploded in backward: every gradient is finite but their float32 2-norm overflows; "
                                "the largest ({largest}) is in {param}{in_module}"),
    ("backward", None): "{kinds} born in backward of {forward_op}{node}{at}{in_module}",
    ("loss", "outside the model"): "{kinds} born in the loss, outside the model, which was not replayed (no loss function)",
    ("loss", None): "{kinds} born in the loss{outside}{op}{at}{in_module}",
    ("forward", None): "{kinds} born in the forward pass{op}{at}{in_module}",
    ("none", "compiled only"): ("step {step}: {compiled_kinds} only under torch.compile (backend {backend}){compiled_culprit}: the step "
                                "replayed eagerly is finite, replayed compiled its {compiled_parts} are not{compiled_vs_recording}"),
    ("none", "transient"): ("step {step}: {replays} replays of the step agree bit for bit and reproduce {agreeing} of the recording, "
                            "which departs at {departs}"),
    ("none", "nondeterminism"): "step {step}: the recording is non-finite, and the replays of the step disagree ({finite_replays} of {replays} finite)",
    ("none", "not reproduced"): ("step {step}: the recording is non-finite, {finite_replays} of {replays} replay(s) of the step are finite; "
                                 "recording and replay differ in: {differences}"),
    ("none", "replay failed"): "step {step}: the {failed_replay} replay failed, so the origin is unknown",
    ("none", None): "step {step}: the replay produced no non-finite value",
}

#: the HEADS row a diagnosis takes when a condition of the dict holds, before its origin's kind
#: (each a field of :func:`_fields` and the kind it selects; the first that holds wins)
HEAD_KINDS: tuple[tuple[str, str], ...] = (
    ("compiled_only", "compiled only"),
    ("transient", "transient"),
    ("nondeterministic", "nondeterminism"),
    ("replay_failed", "replay failed"),
    ("not_reproduced", "not reproduced"),
)

#: what the reproduction verdict adds, by head kind (the verdict is the eager replay's)
VERDICT_NOTES: dict[Optional[str], str] = {"compiled only": " eagerly"}

#: what the replay under torch.compile showed (``compile`` entry, ``--compile``), by (eager
#: non-finite, compiled non-finite); the compiled-only case is said by the head (HEAD_KINDS)
COMPILE_PHRASES: dict[tuple[bool, Optional[bool]], str] = {
    (True, True): "also non-finite under torch.compile (backend {backend})",
    (True, False): "finite under torch.compile (backend {backend}): only the eager code produces it",
    (True, None): "the replay under torch.compile (backend {backend}) failed: {compile_error}",
    (False, None): "the replay under torch.compile (backend {backend}) failed: {compile_error}",
    (False, False): "finite under torch.compile (backend {backend}) too",
}

#: what the rest of the step did, by phase (each a condition on the dict and its phrase)
TAILS: dict[str, tuple[tuple[str, str], ...]] = {
    "backward": (("masked_forward", "forward had {masked} that was masked before the output"), ("forward_finite", "forward was finite")),
    "loss": (("forward_finite", "the model's forward pass was finite"),),
}


def number_text(x: Any) -> str:
    """A number as the report says it: four significant digits (``1.147e-08``, ``0.5``); a string
    (``"nan"``, as the JSON keeps a non-finite float) as it is; ``-`` for ``None``."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.4g}"


def difference_phrase(repro: Reproduction, num: Callable[[Any], str] = str) -> str:
    """How far the replayed gradients' finite values are from the recorded ones: the max abs
    difference, or, where the bundle keeps gradient digests and the values differ, the largest
    difference of their 2-norms."""
    if repro.get("max_abs_diff") is None and repro.get("norm_diff") is not None:
        return f"finite gradient 2-norms differ by up to {num(repro['norm_diff'])} (the bundle keeps gradient digests, not values)"
    return f"max abs difference of finite gradient values: {num(repro.get('max_abs_diff'))}"


def reproduced(diag: DiagnosisDict) -> bool:
    """Whether the replay reproduced the failure: the reproduction verdict is not ``not
    reproduced``, or (``--compile``) the compiled replay's is ``reproduced...``. ``nanreplay
    replay`` and ``nanreplay report`` exit 3 when it is not, for a diagnosis made by a replay or
    in process (the one the Recorder stores, ``report --no-replay``) alike; a suspected device
    fault (``fidelity``) is a step not reproduced too."""
    compiled = str((diag.get("compile") or {}).get("compiled_reproduction") or "")
    return (diag.get("reproduction") or {}).get("verdict") != "not reproduced" or compiled.startswith("reproduced")


def verdict_phrase(repro: Reproduction) -> str:
    """The reproduction verdict as the summary says it: ``reproduced exactly``, ``reproduced (max
    abs difference X)``, ``reproduced up to one gradient factor C that the loop applied after
    backward`` (see :func:`nanreplay.engine.compare.common_factor`), ``not reproduced``, or
    ``not replayed`` (the in-process diagnosis answered from the recorded data alone); a step
    replayed from the model's recorded input (``replayed_from``) says so: ``reproduced exactly
    from the model's recorded input``."""
    said = _verdict(repro)
    return f"{said} from {repro['replayed_from']}" if repro.get("replayed_from") and said.startswith("reproduced") else said


def _verdict(repro: Reproduction) -> str:
    v = repro.get("verdict", "")
    if v == "reproduced" and repro.get("grad_factor") == "nan":
        return "reproduced (the loop then made every gradient NaN, as clip_grad_norm_ does with a non-finite total norm)"
    if v == "reproduced" and repro.get("grad_factor") is not None:
        return f"reproduced up to one gradient factor {number_text(repro['grad_factor'])} that the loop applied after backward"
    if v == "reproduced" and repro.get("max_abs_diff") is not None:
        return f"reproduced (max abs difference {number_text(repro['max_abs_diff'])})"
    if v == "reproduced" and repro.get("norm_diff") is not None:
        return f"reproduced (same non-finite positions; finite gradient 2-norms differ by up to {number_text(repro['norm_diff'])})"
    if v == "not replayed":
        return "not replayed (the recorded data shows the cause; nanreplay replay verifies it)"
    return v


def _fields(diag: DiagnosisDict) -> dict:
    """The values the sentence templates fill in: those of the origin, of the diagnosis' other
    parts (chain, classification, errors) and of the compiled replay."""
    return {**_origin_fields(diag.get("origin") or {}), **_diagnosis_fields(diag), **_compile_fields(diag), **_fidelity_fields(diag)}


def _origin_fields(o: Origin) -> dict:
    return {
        "leaf": str(o.get("leaf")) + (" (the model's recorded forward input: code between record(batch) and the model made it)"
                                       if o.get("recorded_forward_inputs") else ""),
        "tensor": o.get("tensor"),
        "kinds": o.get("nonfinite") or "non-finite value",
        "optimizer": o.get("optimizer"),
        "param": o.get("param"),
        "state": f", state {o['state_key']}" if o.get("state_key") else "",
        "largest": f"{o['largest_gradient']:.4g}" if isinstance(o.get("largest_gradient"), (int, float)) else "?",
        "forward_op": o.get("forward_op") or o.get("op") or "an op",
        "node": f" ({o['node']})" if o.get("node") else (f" (op {o['op']})" if o.get("op") and not o.get("forward_op") else ""),
        "op": f" in op {o['op']}" if o.get("op") else "",
        "at": _where_src(o.get("source")),
        "in_module": _in_module(o),
        "outside": ", outside the model," if o.get("module") is None else "",
    }


def _diagnosis_fields(diag: DiagnosisDict) -> dict:
    chain = diag.get("chain") or []
    fwd = next((c for c in chain if c.get("phase") in ("forward", "loss")), None)
    return {
        "step": diag.get("step"),
        "repeats": (diag.get("reproduction") or {}).get("repeats", 1),
        "masked": (f"{fwd['kinds']} born in {fwd['op']}" + _where_src(fwd.get("source"))) if fwd else "",
        "masked_forward": fwd is not None and diag.get("phase") == "backward",
        "forward_finite": bool(diag.get("forward_finite")),
        "transient": (diag.get("classification") or {}).get("cause") == "transient",
        "nondeterministic": (diag.get("classification") or {}).get("cause") == "nondeterminism",
        "replay_failed": bool(diag.get("errors")) and diag.get("phase") in (None, "none"),
        "failed_replay": (diag.get("errors") or [{}])[0].get("replay"),
    }


def culprit_phrase(comp: Any) -> str:
    """``rsqrt at model.py:14 in module norm (inductor's kernels (code generation), forward graph)``:
    the op inside the compiled region where the non-finite value is born (``compile.culprit``);
    ``""`` without one."""
    c = (comp or {}).get("culprit")
    if not c:
        return ""
    op = str(c.get("op")) + (f" (from {c['original_op']})" if c.get("original_op") else "")
    mod = c.get("module")
    return (f"{op}{_where_src(c.get('source'))}" + (f" in module {mod or '(root module)'}" if mod is not None else "")
            + f" ({comp.get('stage_detail') or c.get('stage')}, {c.get('graph')} graph)")


def _culprit_head(diag: DiagnosisDict) -> str:
    """``, born in op rsqrt at model.py:14 (...), samples [5]`` for the compiled-only head."""
    said = culprit_phrase(diag.get("compile"))
    if not said:
        return ""
    smp = diag.get("samples") or {}
    rows = (", every sample" if smp.get("batch_level") else f", samples {smp['indices']}" if smp.get("indices") else "")
    return f", born in op {said}{rows}"


def _fidelity_fields(diag: DiagnosisDict) -> dict:
    """The verdict ladder's findings (``fidelity``, :mod:`nanreplay.diagnosis.fidelity`)."""
    fid = diag.get("fidelity") or {}
    compared = fid.get("compared") or []
    grads = [q for q in compared if q["quantity"] == "gradient"]
    agreed = [q for q in grads if q.get("agrees")]
    loss = [q for q in compared if q["quantity"] == "loss" and q.get("agrees")]
    first = fid.get("first_difference") or {}
    return {
        "not_reproduced": fid.get("verdict") == "not reproduced" and (diag.get("classification") or {}).get("cause") == "unknown",
        "replays": fid.get("replays"),
        "finite_replays": fid.get("finite_replays"),
        "agreeing": " and ".join(["the loss"] * bool(loss) + ([f"{len(agreed)} of {len(grads)} gradients"] if agreed else [])) or "nothing",
        "departs": (f"{first['name']}'s gradient" if first.get("quantity") == "gradient" else f"the loss of {first.get('name')}") if first else "?",
        "differences": ", ".join(d["kind"] for d in fid.get("differences") or []) or "nothing found",
    }


def _compile_fields(diag: DiagnosisDict) -> dict:
    comp = diag.get("compile") or {}
    return {
        "compiled_culprit": _culprit_head(diag),
        "compiled_only": bool(comp.get("only_under_compile")) and diag.get("phase") in (None, "none"),
        "backend": comp.get("backend"),
        "compiled_kinds": comp.get("compiled_kinds") or "non-finite values",
        "compiled_parts": " and ".join(comp.get("compiled_nonfinite") or []) or "results",
        "compile_error": comp.get("error"),
        "compiled_vs_recording": f" (the compiled replay against the recording: {comp['compiled_reproduction']})" if comp.get("compiled_reproduction") else "",
    }


def summary_sentence(diag: DiagnosisDict) -> str:
    """The one actionable sentence, e.g. ``NaN born in backward of sqrt (SqrtBackward0) at
    model.py:41 in module encoder.norm, step 4711, samples [17]; forward was finite; cause:
    numerics (sqrt derivative at 0); reproduced exactly.``"""
    phase = diag.get("phase") or "none"
    o = diag.get("origin") or {}
    cls = diag.get("classification") or {}
    f = _fields(diag)
    kind = next((k for cond, k in HEAD_KINDS if f.get(cond)), o.get("kind"))
    head = HEADS.get((phase, kind)) or HEADS.get((phase, None)) or HEADS[("none", None)]
    parts = [head.format(**f)]
    if phase != "none":
        mb = o.get("micro_batch")
        smp = o.get("samples")
        parts[0] += f", step {f['step']}" + (f", micro-batch {mb}" if mb is not None else "") + (f", samples {smp}" if smp else "")
    for cond, phrase in TAILS.get(phase, ()):
        if f.get(cond) and o.get("kind") != "explosion":
            parts.append(phrase.format(**f))
            break
    comp = diag.get("compile")
    if comp and not f["compiled_only"]:
        parts.append(COMPILE_PHRASES[(bool(comp.get("eager")), comp.get("compiled"))].format(**f))
    if cls:
        parts.append(f"cause: {cls['cause']} ({cls['detail']})")
    return "; ".join(parts) + f"; {verdict_phrase(diag.get('reproduction') or {})}{VERDICT_NOTES.get(kind, '')}."


#: how ``classification.fix`` reads, by ``verified`` (true, false, null: not verified)
FIX_PHRASES: dict[Optional[bool], str] = {
    True: "fix verified: with {description}, step {step} replays finite{loss}",
    False: "fix not verified: with {description}, step {step} still replays non-finite",
    None: "fix (not verified): {description}{why}",
}


def fix_sentence(diag: DiagnosisDict) -> Optional[str]:
    """``classification.fix`` in words, e.g. ``fix verified: with sqrt(max(x, 1e-12)) at
    model.py:25, step 3 replays finite (loss 0.713)``; ``None`` without a fix. An unverified fix
    (``verified`` null) says why after its description (``fix["detail"]``).

    >>> fix_sentence({"step": 3, "classification": {"fix": {"description": "sqrt(max(x, 1e-12)) at model.py:25",
    ...               "verified": True, "loss": 0.7131, "op": "sqrt.default", "detail": None}}})
    'fix verified: with sqrt(max(x, 1e-12)) at model.py:25, step 3 replays finite (loss 0.7131)'
    """
    fix: Optional[Fix] = (diag.get("classification") or {}).get("fix")
    if not fix:
        return None
    loss = fix.get("loss")
    why = (fix.get("detail") or "").removeprefix("not verified: ")  # an unverified fix says why (the field's own words)
    return FIX_PHRASES[fix.get("verified")].format(description=fix.get("description"), step=diag.get("step"),
                                                    loss=f" (loss {loss:.4g})" if isinstance(loss, (int, float)) else "",
                                                    why=f"; {why}" if why else "")
