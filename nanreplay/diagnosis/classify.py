"""The cause verdict of a diagnosis, with its evidence.

:data:`RULES` is the decision as a table: each row is a cause, the condition on the origin's
:class:`Features` under which it holds, and how its detail and evidence read; the first row whose
condition holds decides. Causes:

* ``bad input data``: the batch value itself is invalid for what the code assumes: it already
  holds NaN/Inf; or the operand at fault derives only from the batch's discrete parts (integer or
  bool leaves: labels, masks, lengths, counts, indices; no weight, no random draw, no table of
  the code they index); or the batch's size or composition decided the domain error: a row whose
  every position a mask from the batch hid, a statistic over too few elements of a batch, an
  empty selection made by the batch, a target no alignment can produce, a loss whose every
  target the batch marks ignored;
* ``optimizer update``: the update from finite gradients, or weights an earlier update corrupted;
* ``explosion``: values grew step over step (grad-norm history, learning-rate spike) past the range;
* ``overflow``: a value out of its dtype's range that is finite in a wider dtype;
* ``underflow``: a value that rounded to 0 (or onto a domain boundary) in its dtype, where the
  step replayed in float64 is finite;
* ``numerics``: valid values reach the op's singular point or an ill-conditioned formula: on
  values from the weights or the code, on continuous batch values (a distance exactly 0 for a
  duplicate pair, a silent clip's magnitude 0), on a valid discrete value that selects a table
  entry at the singular point (a sampled diffusion timestep whose SNR is 0), or in the derivative
  of a legitimate -Inf (the backward of logsumexp over a fully masked row): the fix is in the
  formula (an eps, a clamp, a safe reduction), and the batch value is the trigger;
* ``compiler``: the eager replay is finite and the replay under ``torch.compile`` is not (with
  ``replay(..., compile=True)`` / ``nanreplay replay --compile``, or on its own when the bundle
  says the recording ran compiled and the eager replay does not reproduce it); the detail names
  the compiler stage and the op, source line and module inside the compiled region
  (:func:`nanreplay.diagnosis.compiled.compiler_verdict`);
* ``nondeterminism``: no birth in the monitored replay, and repeated plain replays of the step on
  the same device disagree (some finite, some not);
* ``transient``: a suspected device fault, only on positive evidence: the verdict ladder
  (:mod:`nanreplay.diagnosis.fidelity`) shows the replay faithful (the same code, replays bit-equal
  to each other, the recording reproduced up to a point) and the recording departing from it in
  a few elements, and names the first recorded quantity that differs;
* ``unknown``: nothing above can be shown; for a step the replay does not reproduce, the detail
  says ``not reproduced`` and what differs between recording and replay (``fidelity``), never a
  device fault for want of anything else.

The cause says what to fix; :func:`trigger` says what set it off: the samples and the batch
property (``classification.trigger``), for every cause the batch took part in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..core.numerics import kinds
from .compiled import compile_evidence, compiler_verdict
from .evidence import describe_sources, domain_of, explanation, offending_operand, sources

__all__ = ["CAUSES", "Features", "RULES", "classify", "trigger", "needs_data_perturbed_replay"]

CAUSES = ("bad input data", "optimizer update", "explosion", "overflow", "underflow", "numerics", "compiler", "nondeterminism", "transient",
          "unknown")


@dataclass
class Features:
    """What the cause rules look at."""

    phase: str
    origin: dict
    birth: Optional[dict] = None
    history: Optional[dict] = None
    optimizer: Optional[dict] = None          # the optimizer-update replay
    weights: Optional[dict] = None            # weights_evidence for a weights origin
    wide_finite: Optional[bool] = None        # the step in float64 is finite (None: not tried)
    persists_perturbed: Optional[bool] = None  # the birth persists with perturbed weights (None: not tried)
    persists_data_perturbed: Optional[bool] = None  # ... with the weights and the batch's continuous leaves perturbed
    persists_redrawn: Optional[bool] = None   # ... with other random draws (the step's RNG states replaced)
    transient: bool = False                   # recorded non-finite, every replay finite
    nondeterministic: bool = False            # recorded non-finite, the repeat replays disagree
    compiled: Optional[dict] = None           # the compile check (nanreplay.engine.compiled), asked for or run as recorded
    compile_state: Optional[dict] = None      # the recording's torch.compile state (meta["compile"])
    repeats: int = 0
    fidelity: Optional[dict] = None           # the verdict ladder of a step the replay does not reproduce (diagnosis.fidelity)
    batch_size: Optional[int] = None
    discrete: dict[str, bool] = field(default_factory=dict)  # batch leaf path -> integer/bool dtype (discrete_leaves)
    evidence: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # replays that raised: {"replay", "error"}

    # -- derived ---------------------------------------------------------------------------
    @property
    def operand(self) -> Optional[dict]:
        return offending_operand(self.birth) if self.birth else None

    @property
    def sources(self) -> dict:
        return sources(self.operand)

    @property
    def domain_kind(self) -> Optional[str]:
        d = domain_of(self.birth) if self.birth else None
        return d[1].kind if d else None

    @property
    def overflow(self) -> bool:
        w = (self.birth or {}).get("wider")
        return bool(w and w.get("finite"))

    @property
    def overflow_past_wider(self) -> bool:
        """An op whose only way to a non-finite value is a result too large (``exp``: domain kind
        ``large``) gave an Inf even recomputed in the wider dtype: its input is past even that
        dtype's range. Still an overflow, not a domain error: which side of float64's range an
        outlier lands on (``exp(700)`` or ``exp(800)``) does not change the cause."""
        out = (self.birth or {}).get("output") or {}
        return self.domain_kind == "large" and bool(_field(out, "posinf") or _field(out, "neginf"))

    @property
    def fits_in_range(self) -> bool:
        """The wider-dtype result is within the op's own dtype's range: the non-finite value came
        from an intermediate of the op, not from a result too large for the dtype."""
        w = (self.birth or {}).get("wider") or {}
        dtype = _field((self.birth or {}).get("output"), "dtype")
        t = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not w.get("finite") or w.get("absmax") is None or not isinstance(t, torch.dtype) or not (t.is_floating_point or t.is_complex):
            return False
        return w["absmax"] <= torch.finfo(t).max

    @property
    def exploding(self) -> bool:
        h = self.history or {}
        return bool(h.get("exploding") or h.get("lr_spike"))

    @property
    def narrow(self) -> bool:
        """The operand at fault (or the op's output) is in a dtype narrower than float64/complex128."""
        op = self.operand or {}
        dtype = op.get("dtype") or _field((self.birth or {}).get("output"), "dtype")
        return dtype not in (None, "float64", "complex128")

    @property
    def only_discrete_batch(self) -> bool:
        """The operand at fault derives only from the batch, and only from its discrete leaves
        (integer or bool: labels, masks, lengths, counts, indices), not through a lookup of a table
        of the code (``alphas_cumprod[t]``: the batch chose a valid entry, the table holds the
        singular value)."""
        src = self.sources
        return (bool(src["batch"]) and not src["weights"] and not src["rng"] and not src["buffers"] and not src["lookup"]
                and all(self.discrete.get(leaf, False) for leaf in src["batch"]))

    @property
    def from_batch(self) -> bool:
        """The batch is invalid for what the code assumes (see the module docstring): its
        composition decided the domain error (a fully masked row, a count, an empty selection,
        every target ignored), or the operand derives only from its discrete parts. Continuous
        batch values at an op's singular point are not, nor a valid batch value that selects a
        table entry at the singular point, nor the derivative of a legitimate -Inf (a log of 0, a
        logsumexp over a fully masked row) in the backward pass: that is ``numerics``, the batch
        value its trigger (:func:`trigger`)."""
        op = self.operand or {}
        kind = self.domain_kind
        operands = ((self.birth or {}).get("operands") or {}).get("tensors") or []
        batch_in = lambda prov: any(p.startswith("batch:") for p in prov or [])  # noqa: E731
        if kind in ("inf", "masked") and (self.birth or {}).get("phase") == "backward":
            return False  # the forward pass held the -Inf without harm: its derivative is the formula's to guard
        if kind == "masked":
            return batch_in(op.get("masked_by"))
        if kind in ("ignored", "count", "empty"):
            return any(batch_in(o.get("prov")) for o in operands)
        if kind == "zero":
            return bool(op.get("zeros")) and (self.only_discrete_batch or (self.persists_data_perturbed is True and not self.sources["lookup"]))
        return self.only_discrete_batch

    @property
    def discrete_sources(self) -> list[str]:
        """The batch's discrete leaves (integer, bool) the operand at fault derives from."""
        return [leaf for leaf in self.sources["batch"] if self.discrete.get(leaf, False)]


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def _field(h: object, key: str) -> object:
    """A field of a health record, whether a :class:`~nanreplay.core.numerics.Health` or its JSON dict."""
    return h.get(key) if isinstance(h, dict) else getattr(h, key, None)


# -- details and evidence, one per cause -----------------------------------------------------

def _input(f: Features) -> tuple[str, list[str]]:
    o = f.origin
    if o.get("recorded_forward_inputs"):
        return (f"non-finite value in the model's recorded forward input {o.get('leaf')}, made by code between record(batch) and the model",
                [o["between_record_and_model"]])
    return (f"non-finite value in the recorded batch at {o.get('leaf')}",
            [f"the batch leaf {o.get('leaf')} holds {o.get('nonfinite') or 'non-finite values'} before any op runs"
             + (f", in samples {o.get('samples')}" if o.get("samples") else "")])


def _optimizer(f: Features) -> tuple[str, list[str]]:
    res = f.optimizer or {}
    ev = list(res.get("evidence", []))
    return res.get("detail") or "the update", ev or ["the gradients are finite, the updated weights or optimizer state are not"]


def _weights(f: Features) -> tuple[str, list[str]]:
    w = f.weights or {}
    return w.get("detail", "the step-start weights are already non-finite"), list(w.get("evidence", []))


def _explosion_grad_norm(f: Features) -> tuple[str, list[str]]:
    o = f.origin
    return ("every gradient is finite but their float32 2-norm overflows",
            [f"the largest gradient ({_g(o.get('largest_gradient'))}) is in {o.get('param')}"] + _history_evidence(f))


def _ladder_evidence(f: Features) -> list[str]:
    """What the not-reproduced verdicts rest on: each rung of the verdict ladder, the recorded
    quantities compared, and each difference found (:mod:`nanreplay.diagnosis.fidelity`)."""
    fid = f.fidelity or {}
    ev = [f"{'holds' if r['holds'] else 'does not hold'}: {r['rung']}" for r in fid.get("rungs") or []]
    agreed = [q for q in fid.get("compared") or [] if q.get("agrees")]
    if agreed:
        ev.append(f"bit-equal in the replays: {_quantities(agreed)}")
    first = fid.get("first_difference")
    if first:
        ev.append(f"the recording departs at {_quantity(first)}: {first['detail']}")
    ev += [f"{d['kind']}: {d['detail']}" for d in fid.get("differences") or []]
    return ev + [compile_evidence(f.compile_state, f.compiled)]


def _quantity(q: dict) -> str:
    return f"{q['name']}'s gradient" if q["quantity"] == "gradient" else f"the loss of {q['name']}"


def _quantities(qs: list[dict]) -> str:
    losses = [q for q in qs if q["quantity"] == "loss"]
    grads = [q["name"] for q in qs if q["quantity"] == "gradient"]
    parts = ["the loss"] * bool(losses) + ([f"the gradients of {len(grads)} parameter(s) ({', '.join(grads[:4])}{' ...' if len(grads) > 4 else ''})"] if grads else [])
    return " and ".join(parts)


def _transient(f: Features) -> tuple[str, list[str]]:
    fid = f.fidelity or {}
    first = fid.get("first_difference") or {}
    return f"suspected device fault in {_quantity(first) if first else '?'}: {first.get('detail')}", _ladder_evidence(f)


def _nondeterminism(f: Features) -> tuple[str, list[str]]:
    fid = f.fidelity or {}
    return (f"{fid.get('finite_replays', f.repeats)} of {fid.get('replays', 3)} replays of the step on this device are finite, the others "
            "are not: nondeterministic kernels or a race, not the data or the weights (torch.use_deterministic_algorithms(True) makes "
            "the replays comparable)", _ladder_evidence(f))


def _not_reproduced(f: Features) -> tuple[str, list[str]]:
    diffs = (f.fidelity or {}).get("differences") or []
    return (f"not reproduced: what differs between the recording and the replay: {', '.join(d['kind'] for d in diffs) or 'nothing found'}"
            "; nothing shows a device fault", _ladder_evidence(f))


def _compiler(f: Features) -> tuple[str, list[str]]:
    return compiler_verdict(f)


def _unknown(f: Features) -> tuple[str, list[str]]:
    if f.phase == "none" and f.errors:
        return f.errors[0]["error"], [f"the {x['replay']} replay raised {x['error']}" for x in f.errors]
    if f.phase == "none" and f.fidelity:
        return _not_reproduced(f)
    if f.phase == "none":
        return "no non-finite value in the replay", []
    if f.origin.get("loss_replayed") is False:
        return ("the loss was not replayed (no loss function): the recorded gradient w.r.t. the model output is already non-finite, "
                "so the op is in code the replay did not run; give the loss function (Recorder(loss_fn=...), or `nanreplay replay "
                "--loss-fn`) to name it"), _history_evidence(f)
    return "no op-level birth was recorded (the op monitor was off)", _history_evidence(f)


def _op_evidence(f: Features) -> list[str]:
    """What the birth op's operands showed, true by construction."""
    b = f.birth or {}
    ev: list[str] = []
    op = f.operand
    if op is not None:
        where = f"operand {op.get('name') or ''} ({op.get('dtype')} {op.get('shape')})".replace("  ", " ")
        counts = [f"{op[k]} {label if op[k] != 1 else one}" for k, label, one in
                  (("zeros", "zeros", "zero"), ("negatives", "negatives", "negative"), ("nan", "NaN", "NaN"), ("posinf", "+Inf", "+Inf"),
                   ("neginf", "-Inf", "-Inf")) if op.get(k)]
        if counts:
            ev.append(f"{where} holds {', '.join(counts)} of {op.get('numel')}")
        ev.append(f"{where} derives from {describe_sources(f.sources)}" + (f", last made by {op.get('producer')}" if op.get("producer") else ""))
    expl = explanation(b) if b else None
    if expl:
        ev.append(f"{'backward of ' + (b.get('forward_op') or b['op']) if b.get('phase') == 'backward' else b['op']}: {expl}")
    return ev


def _history_evidence(f: Features) -> list[str]:
    h = f.history or {}
    ev = []
    if h.get("exploding") and h.get("grad_norms"):
        last = h["grad_norms"][-1]
        ev.append(f"grad norm rose to {last[1]:.4g} at step {last[0]}, {float(h['growth']):.3g}x the median of the earlier steps held")
    if h.get("lr_spike"):
        sp = h["lr_spike"]
        ev.append(f"learning rate {float(sp['lr']):.4g} at step {sp['step']}, vs {sp['min_lr']:.4g} in the last steps held")
    return ev


def _overflow_evidence(f: Features) -> list[str]:
    b = f.birth or {}
    w = b.get("wider") or {}
    out = b.get("output")
    dtype = _field(out, "dtype")
    fmax = torch.finfo(getattr(torch, dtype)).max if isinstance(dtype, str) and getattr(torch, dtype, None) is not None and getattr(torch, dtype).is_floating_point else None
    absmax = w.get("absmax")
    if w and not w.get("finite"):
        line = f"{b['op']} gives {kinds(out)} in {dtype} and in {w.get('dtype')} too: its result is past even {w.get('dtype')}'s range"
    elif not w:
        line = f"{b['op']} gives {kinds(out)} in {dtype}: a result too large for the dtype"
    else:
        line = f"{b['op']} gives {kinds(out)} in {dtype} but is finite in {w.get('dtype')}"
    if w.get("finite") and absmax is not None and fmax is not None:
        line += (f" (largest magnitude {absmax:.4g}, past the {dtype} maximum {fmax:.4g})" if absmax > fmax
                 else f" (largest output magnitude {absmax:.4g}, within {dtype}'s range: an intermediate of the op overflows)")
    ev = [line]
    in_max = _field(b.get("inputs"), "absmax")
    if in_max is not None:
        ev.append(f"its inputs reach magnitude {in_max:.4g}")
    return ev


def _overflow(f: Features) -> tuple[str, list[str]]:
    b = f.birth or {}
    return f"{b.get('op')} overflows {_field(b.get('output'), 'dtype')}", _overflow_evidence(f)


def _explosion(f: Features) -> tuple[str, list[str]]:
    if f.overflow:
        b = f.birth or {}
        return f"values grew past the {_field(b.get('output'), 'dtype')} range", _history_evidence(f) + _overflow_evidence(f)
    return "values grew across steps", _history_evidence(f) + _op_evidence(f)


def _underflow(f: Features) -> tuple[str, list[str]]:
    b = f.birth or {}
    op = f.operand or {}
    dtype = op.get("dtype") or _field(b.get("output"), "dtype")
    made = f", made by {op.get('producer')}" if op.get("producer") and op.get("producer") not in ("const",) else ""
    name = b.get("forward_op") or b.get("op")
    if op.get("zeros"):
        detail = f"{name} of a value that rounded to 0 in {dtype}{made}"
        why = f"the zero is a rounding of a non-zero value in {dtype}, not a true zero"
    else:
        detail = f"{name} of values so small that an intermediate rounds to 0 in {dtype}{made}"
        why = f"the values are too small for {dtype}, not zero"
    return detail, _op_evidence(f) + [f"the step replayed in float64 (every down-cast kept wide) is finite: {why}"]


def _masked_detail(f: Features, b: dict, op: dict, src: str) -> str:
    m = (b.get("operands") or {}).get("masked_rows") or {}
    rows = m.get("rows")
    mask = ", ".join(p[len("batch:"):] for p in op.get("masked_by") or [] if p.startswith("batch:"))
    return (f"{m.get('count', '?')} row(s) of the {b['op']} input have every position masked (-Inf)"
            + (f", in sample(s) {rows}" if rows else "") + f": the mask comes from {mask or src}")


def _ignored_detail(f: Features, b: dict, op: dict, src: str) -> str:
    tgt = next((o for o in (b.get("operands") or {}).get("tensors", []) if o.get("name") == "target"), {})
    scal = (b.get("operands") or {}).get("scalars") or {}
    return (f"every target of {', '.join(sources(tgt)['batch']) or 'the batch'} is ignore_index ({scal.get('ignore_index')}): "
            "the mean is over 0 targets")


def _empty_detail(f: Features, b: dict, op: dict, src: str) -> str:
    return f"{b['op']} over an empty selection (0 elements): the selection comes from {src}"


def _count_detail(f: Features, b: dict, op: dict, src: str) -> str:
    if b["op"].strip("_") not in ("std", "var", "std_mean", "var_mean"):
        return f"{explanation(b)}: the values come from {src}"
    n_in = op.get("numel") or 0
    n_out = _field(b.get("output"), "numel") or 1
    per = n_in // max(n_out, 1) if n_in else 0
    scal = (b.get("operands") or {}).get("scalars") or {}
    corr = scal.get("correction", scal.get("unbiased"))
    return (f"{b['op']} with correction {1 if corr in (None, True) else corr} over {per} element(s) per output"
            + (f" (a batch of {f.batch_size})" if f.batch_size is not None and per <= 1 else "") + f": the values come from {src}")


def _zero_detail(f: Features, b: dict, op: dict, src: str) -> Optional[str]:
    if not op.get("zeros"):
        return None
    name = "divisor" if op.get("name") == "other" and b["op"].strip("_") == "div" else f"operand {op.get('name') or ''}".strip()
    if not f.sources["weights"]:
        carried = f"derives only from {src}"
    elif f.persists_perturbed:
        carried = f"derives from {src} and stays 0 with the weights perturbed"
    else:
        carried = f"derives from {src}"
    return f"the {name} is 0 at {op['zeros']} of its {op.get('numel')} entries and {carried}" + (": this batch makes it 0" if f.from_batch else "")


#: how the batch's part is said, by the domain kind of the birth op (a row answering ``None``
#: falls back to the op's explanation)
BATCH_DETAILS: dict[str, Callable[[Features, dict, dict, str], Optional[str]]] = {
    "masked": _masked_detail,
    "ignored": _ignored_detail,
    "empty": _empty_detail,
    "count": _count_detail,
    "zero": _zero_detail,
    "negative": _zero_detail,
}


def _batch_detail(f: Features) -> str:
    b = f.birth or {}
    src = describe_sources(f.sources)
    detail = BATCH_DETAILS.get(f.domain_kind or "")
    said = detail(f, b, f.operand or {}, src) if detail is not None else None
    return said if said is not None else f"{explanation(b) or b.get('op')} on values from {src}"


def _bad_input(f: Features) -> tuple[str, list[str]]:
    ev = _op_evidence(f)
    if f.persists_data_perturbed:
        ev.append(f"with every weight and every continuous batch leaf perturbed by 1% of its spread the same op still gives a non-finite "
                  f"value: the batch's discrete parts ({', '.join(f.discrete_sources)}) decide it")
    elif f.persists_perturbed:
        ev.append("with every weight perturbed by 1% of its spread the same op still gives a non-finite value: the weights do not decide it")
    elif f.sources["batch"] and f.only_discrete_batch:
        ev.append(f"the operand derives only from the batch's discrete parts ({', '.join(f.discrete_sources)}: integer or bool leaves)")
    return _batch_detail(f), ev


def _continuous(f: Features) -> str:
    leaves = [x for x in f.sources["batch"] if not f.discrete.get(x, False)]
    return ", ".join(leaves)


def _numerics(f: Features) -> tuple[str, list[str]]:
    b = f.birth or {}
    ev = _op_evidence(f)
    if f.sources["batch"] and _continuous(f):
        trigger = "the step's random draws" if f.persists_redrawn is False else "the samples"
        ev.append(f"the batch values it derives from ({_continuous(f)}) are continuous and finite: valid data that reach the op's "
                  f"singular point; the fix is in the formula (an eps, a clamp), {trigger} are its trigger")
    if f.domain_kind in ("inf", "masked") and b.get("phase") == "backward":
        ev.append("the forward pass held the -Inf without harm (a log of 0, a reduction over a fully masked row); its derivative "
                  "is NaN: guard the formula (a safe logsumexp or softmax, finfo.min for log 0), the samples are its trigger")
    w = b.get("wider")
    if w is not None and not w.get("finite"):
        ev.append(f"{b['op']} is non-finite in {w.get('dtype')} too: a domain error, not a range problem")
    if f.wide_finite is False:
        ev.append("the step replayed in float64 fails the same way")
    if f.persists_perturbed is False:
        ev.append("with every weight perturbed by 1% of its spread the op is finite: these weights put it outside its domain")
    elif f.persists_perturbed is True:
        ev.append("with every weight perturbed by 1% of its spread the same op still gives a non-finite value: the batch triggers "
                  "the singular point, the weights do not decide it")
    if f.persists_data_perturbed is False:
        ev.append("with the batch's continuous leaves perturbed too (its discrete parts kept) the op is finite: the values, not the "
                  "labels or masks, reach the singular point")
    ev.extend(_draws_evidence(f))
    return explanation(b) or f"{b.get('op')} outside its domain", ev


def _draws_evidence(f: Features) -> list[str]:
    """What the replay with other random draws said (:func:`needs_redrawn_replay`), if it ran."""
    if f.persists_redrawn is False:
        return ["replayed with other random draws (the step's recorded RNG states replaced) the op is finite: this step's draws "
                "(a dropout mask, a sampled value) put it outside its domain, with these samples and weights"]
    if f.persists_redrawn is True:
        return ["with other random draws the same op still gives a non-finite value: the step's random draws do not decide it"]
    return []


Rule = tuple[str, Callable[[Features], bool], Callable[[Features], tuple[str, list[str]]]]

#: the cause rule: the first row whose condition holds decides
RULES: tuple[Rule, ...] = (
    ("bad input data", lambda f: f.phase == "input", _input),
    ("optimizer update", lambda f: f.phase == "optimizer", _optimizer),
    ("unknown", lambda f: f.phase == "weights" and (f.weights or {}).get("nonfinite_since") == "before recording", _weights),
    ("optimizer update", lambda f: f.phase == "weights" and f.origin.get("kind") == "parameter", _weights),
    ("numerics", lambda f: f.phase == "weights", _weights),
    ("explosion", lambda f: f.origin.get("kind") == "explosion", _explosion_grad_norm),
    ("compiler", lambda f: f.phase == "none" and bool((f.compiled or {}).get("only_under_compile")), _compiler),
    ("nondeterminism", lambda f: f.phase == "none" and f.nondeterministic, _nondeterminism),
    ("transient", lambda f: f.phase == "none" and f.transient and (f.fidelity or {}).get("verdict") == "device fault", _transient),
    ("unknown", lambda f: f.phase == "none" or f.birth is None, _unknown),
    ("explosion", lambda f: f.overflow and f.exploding, _explosion),
    # a division whose true result fits the dtype, yet gives Inf: its divisor (or an intermediate
    # of it, e.g. |z|^2 inside a complex division) rounded to 0: underflow, not overflow
    ("underflow", lambda f: f.domain_kind == "zero" and f.overflow and f.fits_in_range, _underflow),
    ("overflow", lambda f: f.overflow, _overflow),
    ("overflow", lambda f: f.overflow_past_wider, _overflow),
    ("underflow", lambda f: f.domain_kind == "zero" and f.wide_finite is True, _underflow),
    ("bad input data", lambda f: f.domain_kind is not None and f.from_batch, _bad_input),
    ("explosion", lambda f: f.exploding and f.sources["weights"], _explosion),
    ("numerics", lambda f: True, _numerics),
)


def classify(f: Features) -> dict:
    """``{"cause": one of CAUSES, "detail": str, "evidence": [str], "rule": int}`` by :data:`RULES`."""
    for i, (cause, holds, describe) in enumerate(RULES):
        if holds(f):
            detail, ev = describe(f)
            return {"cause": cause, "detail": detail, "evidence": ev + f.evidence, "rule": i}
    raise AssertionError("the last rule always holds")  # pragma: no cover


def trigger(f: Features, samples: Optional[dict]) -> Optional[dict]:
    """What set the failure off, apart from what to fix: ``{"samples", "batch_level",
    "batch_size", "property"}`` (``property``: what the batch does at the origin, in words, when
    the operand at fault derives from the batch); ``None`` when neither the samples nor the batch
    take part (weights, the update, an explosion)."""
    smp = samples or {}
    prop: Optional[str] = None
    if f.phase == "input":
        prop = f"the batch leaf {f.origin.get('leaf')} holds {f.origin.get('nonfinite') or 'non-finite values'}"
    elif f.birth is not None and (f.sources["batch"] or f.from_batch):
        prop = _batch_detail(f)
    if not smp and prop is None:
        return None
    return {"samples": list(smp.get("indices") or []), "batch_level": bool(smp.get("batch_level")), "batch_size": smp.get("batch_size", f.batch_size),
            "property": prop}


def needs_perturbed_replay(f: Features) -> bool:
    """Whether the perturbed-weights replay can change the verdict: a zero-domain birth whose
    operand at fault derives from the batch and the weights (and no random draw)."""
    op = f.operand or {}
    src = f.sources
    return (f.birth is not None and not f.overflow and f.domain_kind == "zero" and bool(op.get("zeros"))
            and bool(src["batch"]) and src["weights"] and not src["rng"])


def needs_data_perturbed_replay(f: Features) -> bool:
    """Whether the replay with the weights and the batch's continuous leaves perturbed can change
    the verdict: a zero that persists with the weights perturbed, on an operand that derives from
    discrete batch leaves and continuous ones (do the labels/masks decide it, or the values?)."""
    return (f.persists_perturbed is True and f.domain_kind == "zero" and bool(f.discrete_sources)
            and not f.only_discrete_batch and not f.sources["rng"])


def needs_redrawn_replay(f: Features) -> bool:
    """Whether the replay with other random draws can change the verdict: a domain error whose
    operand at fault derives from the step's random draws (dropout, a sampled value or index)."""
    return f.birth is not None and not f.overflow and f.domain_kind is not None and f.sources["rng"]


def needs_wide_replay(f: Features) -> bool:
    """Whether the float64 replay can change the verdict: a domain error at 0 in a dtype narrower
    than float64 that is not an overflow, on an operand that does not derive from the batch alone."""
    src = f.sources
    only_batch = bool(src["batch"]) and not src["weights"] and not src["rng"]
    return f.birth is not None and not f.overflow and f.domain_kind == "zero" and f.narrow and not only_batch
