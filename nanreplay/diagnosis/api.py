"""The diagnosis entry points: :func:`replay` (a bundle file, often in a new process) and
:func:`diagnose_live` (the recorder's in-process diagnosis right after detection), and
:func:`diagnose`, which turns one replay into the diagnosis dict (fields in ``docs/report.md``).

The flow: the cheap cases are read off the bundle (non-finite step-start weights, a non-finite
batch: no monitored replay is needed); otherwise one replay under the op monitor finds the births
and which of them reach what the step produces; the origin rule
(:mod:`nanreplay.diagnosis.origin`) names one; counterfactual replays (perturbed weights,
float64) run only where they can change the cause verdict
(:func:`nanreplay.diagnosis.classify.needs_perturbed_replay`,
:func:`~nanreplay.diagnosis.classify.needs_wide_replay`); the samples rule
(:mod:`nanreplay.diagnosis.samples`) names the samples; the cause rule
(:mod:`nanreplay.diagnosis.classify`) gives the verdict; the summary sentence is built from the
dict (:mod:`nanreplay.report.summary`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.allowlist import Allowlist
from ..core.digest import is_digest
from ..core.numerics import kinds
from ..core.quiet import quietly
from ..core.results import CompileCheck, DiagnosisDict, Origin, Reproduction, Samples
from ..core.state import load_buffers
from ..engine.compare import compare_grads, compare_loss
from ..engine.compiled import eager_modules
from ..engine.counterfactual import birth_signature, replay_perturbed, replay_redrawn, replay_wide
from ..engine.deadline import deadline, replay_error
from ..engine.sandbox import SandboxLimits, conforming, sandbox_plan
from ..engine.shards import describe_state
from ..engine.run import ReplayResult, StepInputs, discrete_leaves, nonfinite_leaves, nonfinite_state, preserve_live, run_step
from ..engine.gate import live_optimizer_info, resolved_optimizer_info
from ..engine.state import ReplayRequest, load_state, opened_subject, recorded_device
from ..errors import BundleFormatError, ReplayError
from ..format.bundle import Bundle, Types, environment, open_bundle
from ..format.records import BundleContent
from ..report.notebook import Diagnosis
from ..report.summary import summary_sentence
from ..format.records import scalar_history_records
from .classify import Features, classify, needs_data_perturbed_replay, needs_perturbed_replay, needs_redrawn_replay, needs_wide_replay, trigger
from .compiled import compile_requested, compiled_samples, replay_as_recorded
from .evidence import grad_norm_history
from .fidelity import StepReplays, assess, recorded_nonfinite
from .fix import propose_fix
from .optimizer import replay_optimizer_update, weights_evidence
from .origin import Found, find_origin, health_json, report_origin
from .samples import samples_for, step_batch_size
from .timeline import health_table, report_facts

logger = logging.getLogger(__name__)

__all__ = ["replay", "load_diagnosis", "bundle_step_inputs", "replay_step", "diagnose", "diagnose_live", "Progress"]

#: ``progress(message)``: told what the diagnosis is doing, for work that takes more than a moment
Progress = Callable[[str], None]

#: the ``cause`` sentence of each phase
PHASE_SENTENCES = {
    "input": "the recorded batch already holds non-finite values",
    "model input": ("the model's recorded forward input already holds non-finite values: code between record(batch) and the model "
                    "made them"),
    "weights": "the step-start weights are already non-finite",
    "forward": "a non-finite value is born in the forward pass",
    "loss": "the non-finite value is born in the loss, after the model's forward pass",
    "backward": "the forward pass and the loss are finite; the non-finite value is born in the backward pass",
    "optimizer": "the gradients are finite; the non-finite value is born in the optimizer update",
    "none": "no non-finite value in the replay",
}


def _silent(message: str) -> None:
    return None


def _event_json(e: dict) -> dict:
    return {k: health_json(v) for k, v in e.items() if k not in ("operands", "birth")}


def _compact(b: dict) -> dict:
    return {"phase": b["phase"], "op": b["op"], "node": b.get("node"), "module": b.get("module"), "source": b.get("source"),
            "kinds": kinds(b.get("output")), "op_index": b.get("op_index")}


def cheap_origin(inp: StepInputs) -> bool:
    """Whether the bundle alone shows the origin: non-finite step-start weights, or a batch that
    already holds NaN or +Inf."""
    if nonfinite_state(inp.state):
        return True
    trees = inp.record.batches if inp.uses_loss else [fw.inputs for fw in inp.record.forwards]
    return any(x["health"].nan or x["health"].posinf for t in trees for x in nonfinite_leaves(t, ""))


class _NoModules:
    """The module events of a step that was not replayed."""

    events: list = []

    def close(self) -> None:
        return None


def _unreplayed(inp: StepInputs) -> ReplayResult:
    """A replay result holding only what the bundle shows without replaying."""
    rec = inp.record
    weights = nonfinite_state(inp.state)
    if inp.uses_loss:
        mode = "loss_fn"
        inputs = [x for i, b in enumerate(rec.batches) for x in nonfinite_leaves(b, f"batch[{i}]" if len(rec.batches) > 1 else "batch")]
    else:
        mode = "cotangent" if rec.forwards and all(fw.cotangent is not None for fw in rec.forwards) else "forward-only"
        inputs = [x for i, fw in enumerate(rec.forwards) for x in nonfinite_leaves(fw.inputs, f"inputs[{i}]")]
    return ReplayResult(mode, _NoModules(), None, [], [], inputs, weights, {}, [])  # type: ignore[arg-type]


def diagnose(
    result: ReplayResult,
    inp: StepInputs,
    model: torch.nn.Module,
    *,
    device: Optional[torch.device] = None,
    samples: bool = True,
    counterfactuals: bool = True,
    replayed: bool = True,
    progress: Optional[Progress] = None,
    compiled: Optional[CompileCheck] = None,
) -> DiagnosisDict:
    """Turn one replay into the diagnosis dict (fields in ``docs/report.md``).

    The stages, in order: the reproduction verdict, the origin (:func:`find_origin`, which may
    replay the optimizer update), the facts the cause rules read (:class:`Features`), the
    counterfactual replays, the cause (:func:`classify`), the samples (:func:`samples_for`), the
    report's origin (:func:`report_origin`), the dict. A replay that raises is reported in
    ``errors`` and ``warnings``, never taken for a finite one.

    Args:
        result: the replay of the step (:func:`~nanreplay.engine.run.run_step`).
        inp: what the replay ran on; ``model`` holds the step-start weights.
        samples: allow per-sample replays when the birth op's output does not show the samples.
        counterfactuals: allow the perturbed-weights replay that tells a zero the batch carries
            from the model's own, the float64 replay that tells an underflow from a domain error,
            and, for a step the replay does not reproduce, the two repeats the verdict ladder
            compares bit for bit (:mod:`nanreplay.diagnosis.fidelity`; without them the ladder
            cannot say ``device fault``).
        replayed: ``False`` when ``result`` comes from the bundle alone (the cheap cases).
        compiled: the step replayed under ``torch.compile`` beside eagerly
            (:func:`nanreplay.engine.compiled.compile_check`); becomes the ``compile`` entry and
            decides the ``compiler`` cause when only the compiled replay is non-finite.
    """
    say = progress or _silent
    repro = _reproduction(result, inp, replayed)
    errors: list[dict] = []
    found = find_origin(result, inp, model, optimizer_replay=_optimizer_replay(inp, device, say, errors, result, repro))
    f = _features(found, inp, compiled, errors)
    f.compile_state = inp.compile_state
    if replayed:
        repro = _from_recorded_inputs(found, repro, model, inp, device, say, errors)
    if counterfactuals and replayed:
        _counterfactuals(f, model, inp, device, say)
        replay_as_recorded(f, repro, model, inp, device, say)  # the recording ran compiled: replay it so (check 1b)
    if replayed:
        _ladder(f, repro, result, model, inp, device, say, repeat=counterfactuals)
    cls = classify(f)
    smp = None
    if found is not None:
        smp = samples_for(found, inp, result, model, device=device, search=samples and replayed, cause=cls["cause"], progress=say)
    elif cls["cause"] == "compiler":  # the samples of the op found inside the compiled region
        smp = compiled_samples(f.compiled, f.batch_size)
    if smp and smp.get("rows") and smp.get("reason"):  # an embedding origin: which lookups read its non-finite rows
        cls["evidence"].append(smp["reason"])
    cls["trigger"] = trigger(f, smp)
    cls["fix"] = propose_fix(f, cls["cause"], model, inp, device=device, verify=counterfactuals and replayed, restore=lambda: _fresh(model, inp),
                             progress=say)
    diag = _diagnosis_dict(result, inp, f, cls, repro, smp, report_origin(found, result, inp, smp))
    diag.update(report_facts(result, inp))  # timeline, forward_modules, batch_leaves: for `nanreplay report`
    diag["summary"] = summary_sentence(diag)
    _note_rank(diag, (inp.reason or {}).get("distributed") or {})
    return diag


def _reproduction(result: ReplayResult, inp: StepInputs, replayed: bool) -> Reproduction:
    """The reproduction verdict: the replayed gradients and loss against the recorded ones."""
    if not replayed:
        return {"verdict": "not replayed", "max_abs_diff": None, "detail": "the recorded data shows the cause; nanreplay replay verifies it"}
    repro = compare_grads(inp.recorded_grads, result.grads)
    compare_loss(repro, inp.record.loss, result.loss_values)
    return repro


def _from_recorded_inputs(found: Optional[Found], repro: Reproduction, model: torch.nn.Module, inp: StepInputs,
                          device: Optional[torch.device], say: Progress, errors: list[dict]) -> Reproduction:
    """An origin in the model's recorded forward inputs (code between ``record(batch)`` and the
    model made them non-finite, :func:`~nanreplay.diagnosis.origin.find_origin`): the step replayed
    with the model fed those inputs (``run_step(model_inputs=True)``) against the recording; its
    verdict is the reproduction's, with ``replayed_from``. Other origins keep ``repro``."""
    if found is None or not found.origin.get("recorded_forward_inputs"):
        return repro
    say("replaying the step from the model's recorded forward inputs")
    try:
        res = run_step(model, inp, ops=False, device=device, model_inputs=True)
    except Exception as e:
        errors.append({"replay": "recorded inputs", "error": replay_error(e)})
        return repro
    finally:
        _fresh(model, inp)
    fed = _reproduction(res, inp, True)
    fed["replayed_from"] = "the model's recorded input"
    return fed


def _optimizer_replay(inp: StepInputs, device: Optional[torch.device], say: Progress, errors: list[dict], result: ReplayResult,
                      repro: Reproduction) -> Callable[[], Optional[dict]]:
    """The optimizer-update replay as the origin stage asks for it: run once, on demand; a
    replay that raised is added to ``errors``. It reads the recorded gradients; where the bundle
    keeps only their digests (``store_grads``), the replayed ones when the replay reproduced
    them exactly (same hashes), and no update replay otherwise."""
    cache: dict[str, Optional[dict]] = {}

    def run() -> Optional[dict]:
        if "opt" not in cache:
            grads = inp.recorded_grads
            if any(is_digest(g) for g in grads.values()):
                if repro.get("verdict") != "reproduced exactly":
                    cache["opt"] = None
                    return None
                grads = {n: result.grads[n] for n in grads}
            say("replaying the optimizer update")
            res = replay_optimizer_update(inp.state, grads, inp.optimizer_info, device=device, allow=inp.allow)
            if res is not None and res.get("error"):
                errors.append({"replay": "optimizer update", "error": res["error"]})
            cache["opt"] = res
        return cache["opt"]

    return run


def _features(found: Optional[Found], inp: StepInputs, compiled: Optional[dict], errors: list[dict]) -> Features:
    """The facts the cause rules (:data:`~nanreplay.diagnosis.classify.RULES`) read, from the
    origin and the bundle."""
    if found is None:
        return Features(phase="none", origin={}, history=_history(inp), batch_size=step_batch_size(inp.record, inp.uses_loss, None),
                        compiled=compiled, errors=errors)
    birth = found.birth
    f = Features(phase=found.phase, origin=found.origin, birth=birth, history=_history(inp), optimizer=found.extra.get("optimizer"),
                 batch_size=step_batch_size(inp.record, inp.uses_loss, (birth or {}).get("micro_batch")), compiled=compiled, errors=errors,
                 discrete=discrete_leaves(inp))
    if found.phase == "weights":
        f.weights = weights_evidence(inp, found.origin["tensor"], is_param=found.origin.get("kind") == "parameter")
    return f


def _history(inp: StepInputs) -> Optional[dict]:
    return grad_norm_history(inp.long_history(), inp.record.step) if inp.history or inp.scalars else None


def _diagnosis_dict(result: ReplayResult, inp: StepInputs, f: Features, cls: dict, repro: Reproduction, smp: Optional[Samples],
                    origin: Optional[Origin]) -> DiagnosisDict:
    """The diagnosis dict (``docs/report.md``) but its summary and report facts."""
    births = list(result.births) + list((f.optimizer or {}).get("births") or [])
    ob = f.birth
    chain = [_compact(b) for b in births if ob is None or b["op_index"] <= ob["op_index"]]
    forward_finite = bool(result.outputs) and all(h is not None and h.finite for h in result.outputs)
    ops = result.ops
    return {
        "step": inp.record.step,
        "phase": f.phase,
        "origin": origin,
        "cause": _phase_sentence(f.phase, result, forward_finite, f),
        "classification": {k: v for k, v in cls.items() if k != "rule"},
        "summary": "",
        "mode": result.mode,
        "reproduction": repro,
        "forward_finite": forward_finite,
        "chain": chain[:16],
        "births": [_event_json(b) for b in births[:16]],
        "allowed_births": len(ops.allowed) if ops is not None else None,
        "allowlist": ops.allow.to_json() if ops is not None else None,
        "propagated_ops": ops.propagated if ops is not None else None,
        "samples": smp,
        "optimizer": f.optimizer,
        "history": _with_weights_history(f),
        "rollback": inp.reason.get("rollback"),
        **({"loss_scale": _loss_scale(inp.reason)} if isinstance(inp.reason.get("scaler"), dict) else {}),
        "health": health_table(result, origin),
        "nonfinite_inputs": [_event_json(x) for x in result.inputs[:8]],
        "nonfinite_weights": [_event_json(x) for x in result.weights[:8]],
        "loss": [health_json(h) for h in result.losses],
        "counterfactuals": {"float64_finite": f.wide_finite, "persists_with_perturbed_weights": f.persists_perturbed,
                            "persists_with_perturbed_data": f.persists_data_perturbed, "persists_with_other_draws": f.persists_redrawn},
        "warnings": (list(result.warnings) + list((smp or {}).get("warnings", []))
                     + [f"the {e['replay']} replay failed: {e['error']}" for e in f.errors]),
        "errors": list(f.errors),
        "compile": f.compiled,
        "fidelity": f.fidelity,
    }


def _loss_scale(reason: dict) -> dict:
    """The GradScaler's part in the step (the bundle's ``reason.scaler``, ``docs/report.md``): the
    scale the step ran with and after it, its history, the consecutive skips, the failure."""
    s = reason["scaler"]
    history = [list(p) for p in s.get("scale_history") or []]
    scale = s.get("scale_before") if s.get("scale_before") is not None else (history[-1][1] if history else None)
    return {"skipped": s.get("skipped"), "scale": scale, "scale_after": s.get("scale_after"), "history": history,
            "consecutive_skips": s.get("consecutive_skips"), "failure": reason.get("scaler_failure")}


def _note_rank(diag: dict, d: dict) -> None:
    """A distributed run's bundle: say which rank's step was replayed and which ranks the
    non-finite values were born on (a sharded run's bundles replayed together,
    :mod:`nanreplay.engine.shards`; or a DDP origin rank's bundle)."""
    if d.get("rank") is None:
        return
    rank, world, origins = d["rank"], d.get("world_size"), list(d.get("origin_ranks") or [])
    state = d.get("state_origin") if rank in (d.get("state_ranks") or []) else None
    if not d.get("merged_from"):
        diag["distributed"] = {"rank": rank, "world_size": world, "origin_ranks": origins, "clean": d.get("clean"),
                               "rank_flags": d.get("rank_flags")}
        if rank in origins:
            born = f"its {describe_state(state)} at the start of the step" if state else "before the gradient all-reduce"
            diag["summary"] = f"{diag['summary'].rstrip()} [born on rank {rank} of {world}, {born}]"
        return
    coords = (d.get("origin_coordinates") or {}).get(str(rank))
    diag["distributed"] = {"rank": rank, "world_size": world, "origin_ranks": origins, "mesh_coordinate": coords,
                           "merged_from": list(d["merged_from"])}
    where = f"rank {rank} of {world}" + (f" (mesh coordinate {coords})" if coords else "")
    if rank in origins and state:
        note = f"born on {where}: its {describe_state(state)} at the start of the step"
    elif rank in origins:
        note = f"born on {where}, before the gradient reduce-scatter"
    else:
        note = f"rank {rank} of {world} replayed; origin rank(s) {origins or 'unknown'}"
    diag["summary"] = f"{diag['summary'].rstrip()} [{note}; full weights put together from {len(d['merged_from'])} rank bundles]"


def _with_weights_history(f: Features) -> Optional[dict]:
    """The ring buffer's history, with ``weights_nonfinite_since`` for a weights origin."""
    if f.weights is None or "nonfinite_since" not in f.weights:
        return f.history
    return dict(f.history or {}, weights_nonfinite_since=f.weights["nonfinite_since"])


def _phase_sentence(phase: str, result: ReplayResult, forward_finite: bool, f: Features) -> str:
    if phase == "input" and f.origin.get("recorded_forward_inputs"):
        return PHASE_SENTENCES["model input"]
    if phase == "loss":
        if f.origin.get("loss_replayed") is False:
            return "the non-finite value is born in the loss, which was not replayed (the recorded gradient w.r.t. the model output is non-finite)"
        return ("the model's forward pass is finite; " if forward_finite else "") + PHASE_SENTENCES["loss"]
    if phase == "optimizer" and f.optimizer:
        return f.optimizer.get("detail") or PHASE_SENTENCES["optimizer"]
    if phase == "none" and f.errors:
        return f"the {f.errors[0]['replay']} replay failed ({f.errors[0]['error']}): where the non-finite value is born is unknown"
    return PHASE_SENTENCES.get(phase, PHASE_SENTENCES["none"])


def _fresh(model: torch.nn.Module, inp: StepInputs) -> None:
    """Put back the step-start buffers after a replay (BatchNorm stats moved)."""
    load_buffers(model, inp.state.buffers)


def _counterfactuals(f: Features, model: torch.nn.Module, inp: StepInputs, device: Optional[torch.device], say: Progress) -> None:
    """The float64 replay first (a zero that is a rounding is an underflow, whoever carried it);
    then, if the zero is real, the perturbed-weights replay (does the batch or the weights decide it?).
    A counterfactual that cannot run (an op without a float64 kernel) is absent, its error in ``f.errors``."""
    if needs_wide_replay(f):
        say("replaying the step in float64 (is the zero an underflow?)")
        try:
            f.wide_finite = not replay_wide(model, inp, device=device)
        except Exception as e:
            f.errors.append({"replay": "float64", "error": replay_error(e)})
        finally:
            _fresh(model, inp)
    if f.wide_finite is not True and needs_perturbed_replay(f):
        f.persists_perturbed = _persists(f, model, inp, say, "perturbed weights (do the weights decide the zero?)", "perturbed-weights",
                                         lambda watch: replay_perturbed(model, inp, device=device, watch=watch))
    if f.wide_finite is not True and needs_redrawn_replay(f):
        f.persists_redrawn = _persists(f, model, inp, say, "other random draws (do the step's draws decide it?)", "other-draws",
                                       lambda watch: replay_redrawn(model, inp, device=device, watch=watch))
    if needs_data_perturbed_replay(f):
        f.persists_data_perturbed = _persists(
            f, model, inp, say, "perturbed weights and continuous data (do the labels or masks decide the zero?)", "perturbed-data",
            lambda watch: replay_perturbed(model, inp, device=device, watch=watch, data=True))


def _persists(f: Features, model: torch.nn.Module, inp: StepInputs, say: Progress, what: str, name: str,
              replay: Callable[[Optional[frozenset]], list]) -> Optional[bool]:
    """Whether the origin's birth persists in the counterfactual ``replay(watch)`` (the step with
    ``what`` changed; only the origin's op watched: one plain replay's cost); ``None`` when it
    could not run (its error in ``f.errors`` as the ``name`` replay). The model's buffers are put
    back after it."""
    say(f"replaying the step with {what}")
    try:
        sig = birth_signature(f.birth or {})
        return sig in replay(frozenset({sig[1]}) if sig[1] else None)
    except Exception as e:
        f.errors.append({"replay": name, "error": replay_error(e)})
        return None
    finally:
        _fresh(model, inp)


def _ladder(f: Features, repro: Reproduction, result: ReplayResult, model: torch.nn.Module, inp: StepInputs, device: Optional[torch.device],
            say: Progress, repeat: bool) -> None:
    """No birth, the recording non-finite, the replay not reproducing it (and not a compiler
    difference): the verdict ladder (:func:`nanreplay.diagnosis.fidelity.assess`) over this
    replay and, with ``repeat``, two more plain ones (``fidelity``). Replays that disagree on
    finiteness are nondeterminism; ``transient`` (a suspected device fault) only when the ladder
    says ``device fault``."""
    if not (f.phase == "none" and repro["verdict"] == "not reproduced" and recorded_nonfinite(inp)
            and not (f.compiled or {}).get("only_under_compile")):
        return
    replays = StepReplays()
    replays.add(result)
    if repeat:
        say("replaying the step twice more (do the replays agree bit for bit?)")
        for _ in range(2):
            _fresh(model, inp)
            replays.add(run_step(model, dataclasses.replace(inp, recorded_grads={}), ops=False, device=device))
        _fresh(model, inp)
        f.repeats = sum(replays.finite)
        repro["repeats"] = f.repeats
    f.nondeterministic = 0 < sum(replays.finite) < replays.count
    f.fidelity = assess(inp, replays, f.compiled)
    f.transient = f.fidelity["verdict"] == "device fault"


def replay_step(model: torch.nn.Module, inp: StepInputs, *, ops: bool = True, device: Optional[torch.device] = None, samples: bool = True,
                progress: Optional[Progress] = None, quick: bool = False, compiled: Optional[CompileCheck] = None) -> DiagnosisDict:
    """Replay one step on ``model`` (weights already loaded) and return the diagnosis dict.

    Args:
        ops: run the op monitor (births, source lines, provenance; slower).
        quick: when the bundle alone shows the origin (non-finite weights or batch), answer
            without replaying (the in-process diagnosis); else such steps get one plain replay
            that verifies the reproduction.
        compiled: the compile check of the step, passed on to :func:`diagnose`.
    """
    say = progress or _silent
    if cheap_origin(inp):
        if quick:
            return diagnose(_unreplayed(inp), inp, model, device=device, samples=False, counterfactuals=False, replayed=False, progress=say,
                            compiled=compiled)
        say(f"replaying step {inp.record.step} (the recorded data already shows the cause)")
        result = run_step(model, inp, ops=False, device=device)
        return diagnose(result, inp, model, device=device, samples=False, counterfactuals=False, progress=say, compiled=compiled)
    say(f"replaying step {inp.record.step}" + (" under the op monitor" if ops else ""))
    result = run_step(model, inp, ops=ops, device=device, settle=True)  # backward ops unchecked once a forward origin is settled
    _fresh(model, inp)
    return diagnose(result, inp, model, device=device, samples=samples, counterfactuals=ops, progress=say, compiled=compiled)


@quietly
def diagnose_live(model: torch.nn.Module, content: BundleContent, *, loss_fn: Optional[Callable] = None, allow: Sequence[Any] = (),
                  progress: Optional[Progress] = None, timeout: Optional[float] = None) -> DiagnosisDict:
    """In-process diagnosis, run by the Recorder right after detection: replays the failing step
    (``content.steps[-1]``) on the live ``model``, whose weights are still the pre-step weights,
    then puts back the live gradients, buffers, module modes and RNG states, so training can
    continue unchanged. The caller keeps its own hooks quiet meanwhile. The cheap cases
    (non-finite weights or batch) are answered without replaying.

    Args:
        model: the live model (the one the recorder hooks, unwrapped from DDP).
        content: the bundle content about to be written.
        loss_fn: ``loss_fn(model, batch) -> loss``, or ``None`` to drive backward with the
            recorded cotangent.
        allow: extra allowlist rules (``RecorderConfig.allow_nonfinite``).
        progress: told what the diagnosis is doing.
        timeout: seconds the diagnosis may take (``None``: no limit).

    Raises:
        DiagnosisTimeout: past ``timeout``; the live model is left as it was found.
    """
    rec = content.steps[-1]
    # trust rule: the optimizer class is the live optimizer's own (code this process runs)
    optimizer_info = live_optimizer_info(content.optimizer_info)
    inp = StepInputs(
        record=rec, state=content.state, recorded_grads=content.grads, loss_fn=loss_fn,
        scaler=content.state.extra.get("scaler"), grads_unscaled=(content.reason.get("scaler") or {}).get("grads_unscaled"),
        allow=Allowlist(allow), optimizer_info=optimizer_info,
        history=list(content.steps), reason=dict(content.reason),
        scalars=scalar_history_records(content.extra_meta.get("scalar_history")),
        attach_scan=content.extra_meta.get("attach_scan"), compile_state=content.extra_meta.get("compile"),
        setup={"model": "live", "loss": "live" if loss_fn is not None else None},  # the code that trained, in its process
    )
    with deadline(timeout), preserve_live(model), eager_modules(model):
        load_buffers(model, content.state.buffers)
        return replay_step(model, inp, progress=progress, quick=True)


@quietly
def replay(
    bundle: Union[str, Path, Bundle],
    *,
    model: Optional[torch.nn.Module] = None,
    model_factory: Union[str, Callable, None] = None,
    loss_fn: Union[str, Callable, None] = None,
    device: Union[str, torch.device, None] = None,
    ops: bool = True,
    use_loss_fn: bool = True,
    allow: Optional[Sequence[str]] = None,
    default_allow: bool = True,
    samples: bool = True,
    progress: Optional[Progress] = None,
    import_script: bool = False,
    trust: bool = False,
    batch_types: Types = None,
    compile: Union[bool, str, Sequence[str]] = False,
    sandbox: Optional[SandboxLimits] = None,
) -> Diagnosis:
    """Replay a bundle's failing step and diagnose it.

    Code the bundle names (its model factory or ``model_init`` class, loss function, optimizer
    class outside ``torch.optim``, batch types) runs only when the bundle is trusted: written by
    this user's Recorder on this machine, trusted with :func:`nanreplay.trust_bundle`, or
    ``trust=True``. Otherwise pass your own ``model`` / ``model_factory``, ``loss_fn`` (or
    ``use_loss_fn=False``) and ``batch_types``; see ``docs/security.md``.

    Args:
        bundle: a path or an open :class:`~nanreplay.format.bundle.Bundle`.
        model: a model of the recorded architecture; else ``model_factory`` (callable or import
            path), else the factory recorded in the bundle (trusted bundles only).
        loss_fn: ``loss_fn(model, batch) -> loss``; defaults to the recorded one (trusted bundles
            only). Without it (or with ``use_loss_fn=False``), the recorded cotangent drives the
            backward pass.
        device: where to replay (default: the recorded parameters' device when present here,
            else CPU).
        ops: run the op-level monitor (names the aten op, the source line, the autograd node and
            the provenance of its operands; runs under anomaly mode).
        allow: extra allowlist rules ``"MODULE:OP[:-inf]"`` for legitimate non-finite values, on
            top of those recorded in the bundle (``RecorderConfig.allow_nonfinite``).
        default_allow: keep the default rules (-Inf written by attention masking).
        samples: find the samples to blame by per-sample replay where the birth op's output does
            not show them directly (extra forward/backward passes, see
            :func:`nanreplay.diagnosis.samples.per_sample_replay`).
        progress: ``progress(message)`` is told what the replay is doing (rebuilding the model,
            replaying the step, each extra replay), for a status line.
        import_script: allow importing a factory or loss function from a script that runs code
            at import (a training script without an ``if __name__ == "__main__":`` guard would
            train again; see :func:`nanreplay.core.callables.import_callable`).
        trust: trust this bundle for this call (run the code it names); review
            ``nanreplay inspect`` first.
        batch_types: dataclass types / namedtuple classes (or ``{"module:QualName": cls}``) to
            rebuild the recorded typed batch nodes as; a trusted bundle's own are imported.
        compile: also replay the step under ``torch.compile`` (:mod:`nanreplay.diagnosis.compiled`):
            ``True`` compiles what the recording compiled, as it did (``meta["compile"]``:
            backend, mode, options, modules), else the model with inductor, and compares it with
            the eager replay and ``aot_eager``; a backend name (or a list of them, e.g.
            ``"aot_eager_decomp_partition"``) adds a column to that comparison (the recording's
            backend stays the main one; without one, the first named is). Same weights, batch
            and RNG states. Says whether the non-finite value appears only under compile (the
            ``compile`` entry; the ``compiler`` cause), which compiler stage brings it, and the
            op, source line and samples inside the compiled region (``compile.culprit``): a few
            more bare replays plus the compile time, and for inductor's kernels about
            ``log2(nodes)`` compilations of parts of a graph. Without it, a step the eager
            replay does not reproduce is replayed compiled all the same when the bundle says
            training ran compiled, with a backend of ``engine.compiled.BUNDLE_BACKENDS``
            (``compile["automatic"]`` is then true).
        sandbox: the limits of the sandbox (:class:`~nanreplay.engine.sandbox.SandboxLimits`:
            wall-clock seconds, default 600, and address space). The embedded program of a bundle
            that is not trusted, replayed without your own model or factory, runs in a child
            process under seccomp and these limits (``docs/security.md``, "The sandbox"), on the
            CPU, and only the validated diagnosis comes back; a trusted bundle, ``trust=True`` or
            your own code replays in this process, as before.

    Returns:
        the diagnosis (``docs/report.md``), with ``bundle``, ``device`` and ``model_source``
        added: a :class:`~nanreplay.report.notebook.Diagnosis`, the dict it always was, whose
        ``repr`` is the summary sentence and which shows the report inline in a notebook.

    Raises:
        FileNotFoundError, BundleFormatError: unreadable bundle.
        UntrustedBundleError: the bundle is not trusted and names code this call would run
            (nothing was run; the message lists it).
        ReplayError: no model could be built, or the loss function failed.
        ModelMismatchError: the model does not match the recorded one.
        SandboxError: the sandboxed replay died, or ran past a limit.
        SandboxUnavailableError: the program needs the sandbox and this machine has none.
    """
    say = progress or _silent
    request = ReplayRequest(model=model, model_factory=model_factory, loss_fn=loss_fn, use_loss_fn=use_loss_fn, device=device, trust=trust,
                            batch_types=batch_types, import_script=import_script)
    options = dict(allow=allow, default_allow=default_allow, ops=ops, samples=samples, compile=compile)
    with sandbox_plan(bundle, request) as (b, plan):
        if plan is None:
            return _replay(b, request, progress=say, **options)
        say("starting the sandboxed replay (the bundle is not trusted)")
        diag, _ = plan.run(lambda req, relay: dict(_replay(b, req, progress=relay, **options)), progress=say, limits=sandbox)
        diag = conforming(diag, "diagnosis", plan.path)
        diag["model_source"] = f"{diag.get('model_source')}, {SANDBOXED}"
        return Diagnosis(diag, meta=plan.meta)


#: what ``model_source`` adds when the replay ran in the sandbox (:mod:`nanreplay.engine.sandbox`)
SANDBOXED = "replayed in the sandbox (a child process under seccomp and resource limits: the bundle is not trusted)"


def _replay(bundle: Union[str, Path, Bundle], request: ReplayRequest, *, progress: Progress, allow: Optional[Sequence[str]],
            default_allow: bool, ops: bool, samples: bool, compile: Union[bool, str, Sequence[str]]) -> Diagnosis:
    """The body of :func:`replay`: in this process, or in the sandbox's child."""
    say = progress
    say("rebuilding the model")
    with opened_subject(bundle, request) as (b, subject, dev), eager_modules(subject.model):
        model, lf = subject.model, subject.loss_fn
        state = b.state(lazy_optimizer=True)  # read only if the diagnosis replays the optimizer update
        load_state(model, state)
        inp = bundle_step_inputs(b, state, lf, allow=allow, default_allow=default_allow)
        inp.setup = {"model": subject.code, "model_source": subject.source, "loss": subject.loss_code if lf is not None else None,
                     "recorded_environment": b.meta.get("environment") or {}, "environment": environment(),
                     "recorded_device": recorded_device(b).type, "device": dev.type}
        compiled = None
        if compile:  # the recording's compile state (else inductor), and any backend named beside it
            compiled = compile_requested(model, inp, compile, dev, say)
            load_state(model, state)
        diag = replay_step(model, inp, ops=ops, device=dev, samples=samples, progress=say, compiled=compiled)
        diag["bundle"] = str(b.path)
        diag["device"] = str(dev)
        diag["model_source"] = subject.source
        diag["warnings"] = list(subject.notes) + list(diag.get("warnings", []))
        return Diagnosis(diag, meta=dict(b.meta))


def bundle_step_inputs(b: Bundle, state: Any, loss_fn: Optional[Callable], *, allow: Optional[Sequence[str]] = None,
                       default_allow: bool = True) -> StepInputs:
    """What a replay of the bundle's failing step needs (:class:`~nanreplay.engine.run.StepInputs`):
    its record, the step-start ``state`` (``b.state()``), the recorded gradients, the ring buffer's
    steps and the scalar history, the allowlist (the rules recorded in the bundle, plus ``allow``)."""
    rules = list((b.meta.get("replay_options") or {}).get("allow_nonfinite", [])) + list(allow or [])
    reason = dict(b.meta.get("reason") or {})
    return StepInputs(
        record=b.step(b.failing_step), state=state, recorded_grads=b.grads(), loss_fn=loss_fn, allow=Allowlist(rules, defaults=default_allow),
        optimizer_info=resolved_optimizer_info(b), history=[b.step(k) for k in b.steps if k <= b.failing_step], reason=reason,
        scalars=scalar_history_records(b.meta.get("scalar_history")),
        attach_scan=b.meta.get("attach_scan") if isinstance(b.meta.get("attach_scan"), dict) else None,
        scaler=state.extra.get("scaler"), grads_unscaled=(reason.get("scaler") or {}).get("grads_unscaled"),
        compile_state=b.meta.get("compile"),
    )


def load_diagnosis(bundle: Union[str, Path, Bundle]) -> Diagnosis:
    """The diagnosis the Recorder stored in ``bundle`` (``meta["diagnosis"]``, the in-process
    diagnosis), without replaying: no code runs and the bundle need not be trusted.

    >>> load_diagnosis("nanreplay_bundles/nanreplay-step28.h5")  # doctest: +SKIP
    NaN born in ...; cause: ...; reproduced exactly.

    Raises:
        FileNotFoundError, BundleFormatError: unreadable bundle, or a stored diagnosis that is
            not an object.
        ReplayError: the bundle stores no diagnosis (``Recorder(..., diagnose=False)``, or the
            in-process diagnosis failed: ``meta["diagnosis_error"]`` says why); replay it instead.
    """
    if isinstance(bundle, Bundle):
        return _stored(bundle)
    with open_bundle(bundle) as b:
        return _stored(b)


def _stored(b: Bundle) -> Diagnosis:
    diag = b.meta.get("diagnosis")
    if diag is None:
        why = b.meta.get("diagnosis_error")
        raise ReplayError(f"{b.path}: expected a stored diagnosis, found none"
                          + (f" (the in-process diagnosis failed: {why})" if isinstance(why, str) else " (written with Recorder(..., diagnose=False)?)")
                          + "; replay the step instead: nanreplay.replay(bundle) or `nanreplay replay BUNDLE`")
    if not isinstance(diag, dict):
        raise BundleFormatError(f"{b.path}: expected the stored diagnosis to be an object (docs/report.md), found {type(diag).__name__}; "
                                "replay the step instead: nanreplay.replay(bundle)")
    return Diagnosis(diag, meta=dict(b.meta))

