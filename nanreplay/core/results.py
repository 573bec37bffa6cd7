"""The typed results nanreplay hands out: the diagnosis (``nanreplay.replay()``, ``nanreplay replay
--json``, ``docs/report.md``) and the bisect result (``nanreplay.bisect()``, ``docs/bisect.md``).

They are ``TypedDict`` s: at run time each is the plain ``dict`` it always was (the JSON shape does
not change), and for a type checker and a reader each key is named once, here. ``diagnosis/``
builds a :class:`DiagnosisDict`, ``report/`` and ``cli.py`` read one; ``tests/core/test_results.py`` checks
``docs/report.md`` against these types (every documented field is a key here and every key is
documented), and :mod:`nanreplay.core.schema` turns them into the JSON Schema shipped in
``nanreplay/schema/``. A renamed key fails one of those tests.

Keys other engineers are adding (``classification.trigger``, ``classification.fix``,
``history.weights_nonfinite_since``, ``rollback``) are declared ``NotRequired``: a diagnosis
without them is still one.

Conventions: a float that may be non-finite is :data:`JFloat` (``core.jsonable`` writes NaN and
Inf as the strings ``"nan"``, ``"inf"``, ``"-inf"``); ``Optional`` means the key is present and
may be ``null``; ``NotRequired`` means the key may be absent. The objects listed in :data:`OPEN`
may hold keys beyond those declared (their content varies by case, e.g. the origin of an
optimizer update against a forward op); every other object holds only its declared keys.
"""

# no ``from __future__ import annotations``: a TypedDict reads NotRequired off evaluated annotations
import sys
from typing import Any, Literal, Optional, Union

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10: typing.TypedDict does not know NotRequired
    from typing_extensions import NotRequired, TypedDict

__all__ = [
    "SCHEMA_VERSION", "JFloat", "Phase", "Mode", "Health", "Source", "Origin", "Fix", "Classification", "Reproduction", "ChainLink",
    "Birth", "Samples", "OptimizerReplay", "History", "HealthRow", "NonfiniteLeaf", "Counterfactuals", "ReplayFailure",
    "CompileCheck", "CompiledReplay", "CompiledCulprit", "CompiledOperand", "CompiledRows", "TimelineStep", "ForwardModule", "BatchLeaf",
    "RecordedQuantity", "Difference", "Rung", "Fidelity", "DiagnosisDict", "BisectResult", "BisectWindow", "OPEN",
    "RollbackPlan", "Episode", "EpisodeRun", "RejectedState", "LrJump", "LossScale",
    "ConfigDiff", "DiffSide", "SettingDiff", "UnknownSetting",
]

#: the version of the JSON shape of :class:`DiagnosisDict` and :data:`BisectResult`, written as
#: ``schema_version`` by ``--json``: bump the minor version when a key is added, the major
#: version when one is renamed, removed or changes type
SCHEMA_VERSION = "1.4"

#: a float as JSON holds it: a number, or ``"nan"``, ``"inf"``, ``"-inf"`` (``core.jsonable``)
JFloat = Union[float, Literal["nan", "inf", "-inf"]]

#: where the first non-finite value was born
Phase = Literal["input", "weights", "forward", "loss", "backward", "optimizer", "none"]

#: how the step was replayed
Mode = Literal["loss_fn", "cotangent", "forward-only"]

#: the health of a tensor (``core.numerics``): counts of non-finite values, statistics of the finite ones
Health = TypedDict("Health", {
    "nan": int, "posinf": int, "neginf": int, "numel": int,
    "min": NotRequired[Optional[JFloat]], "max": NotRequired[Optional[JFloat]], "mean": NotRequired[Optional[JFloat]],
    "absmax": NotRequired[Optional[JFloat]], "dtype": NotRequired[str], "shape": NotRequired[list[int]],
})

#: the user's frame of an op
Source = TypedDict("Source", {"file": str, "line": Optional[int], "function": Optional[str], "code": NotRequired[Optional[str]]})

#: the producer of the first non-finite value (``docs/report.md``, "origin"); which keys are
#: present depends on the phase
Origin = TypedDict("Origin", {
    "module": Optional[str], "class": NotRequired[Optional[str]], "kind": NotRequired[Optional[str]],
    "op": NotRequired[Optional[str]], "aten": NotRequired[Optional[str]], "op_index": NotRequired[Optional[int]],
    "node": NotRequired[Optional[str]], "forward_op": NotRequired[Optional[str]], "source": NotRequired[Optional[Source]],
    "nonfinite": NotRequired[Optional[str]], "dtype": NotRequired[Optional[str]], "shape": NotRequired[Optional[list[int]]],
    "inputs": NotRequired[Any], "output": NotRequired[Any], "operands": NotRequired[Any],
    "samples": NotRequired[Optional[list[int]]], "micro_batch": NotRequired[Optional[int]], "leaf": NotRequired[Optional[str]],
    "tensor": NotRequired[Optional[str]], "first_nonfinite_gradient": NotRequired[Optional[str]],
    "param": NotRequired[Optional[str]], "state_key": NotRequired[Optional[str]], "optimizer": NotRequired[Optional[str]],
    "largest_gradient": NotRequired[Optional[JFloat]], "loss_replayed": NotRequired[bool],
    "between_record_and_model": NotRequired[Optional[str]], "recorded_forward_inputs": NotRequired[Optional[bool]],
})


class Fix(TypedDict):
    """The standard fix of the cause at the origin op, and the replay that verifies it
    (``diagnosis.fix.propose_fix``)."""

    description: str
    verified: Optional[bool]
    loss: Optional[JFloat]
    op: Optional[str]
    detail: Optional[str]


class Classification(TypedDict):
    """The cause verdict (``diagnosis.classify.classify``, less its rule index)."""

    cause: str
    detail: str
    evidence: list[str]
    trigger: NotRequired[Any]
    fix: NotRequired[Optional[Fix]]


class Reproduction(TypedDict):
    """The replayed gradients and loss against the recorded ones (``engine.compare``)."""

    verdict: str
    max_abs_diff: Optional[JFloat]
    nonfinite_recorded: NotRequired[Optional[int]]
    nonfinite_replayed: NotRequired[Optional[int]]
    detail: NotRequired[Optional[str]]
    loss_recorded: NotRequired[Any]
    grad_factor: NotRequired[Optional[JFloat]]
    norm_diff: NotRequired[Optional[JFloat]]
    repeats: NotRequired[int]
    replayed_from: NotRequired[str]


class ChainLink(TypedDict):
    """One birth of the causal chain, up to the origin."""

    phase: str
    op: Optional[str]
    node: Optional[str]
    module: Optional[str]
    source: Optional[Source]
    kinds: Optional[str]
    op_index: Optional[int]


class Birth(TypedDict):
    """One op-level birth (``engine.monitors``)."""

    phase: str
    op: Optional[str]
    aten: NotRequired[Optional[str]]
    module: NotRequired[Optional[str]]
    op_index: NotRequired[Optional[int]]
    micro_batch: NotRequired[Optional[int]]
    inputs: NotRequired[Any]
    output: NotRequired[Any]
    node: NotRequired[Optional[str]]
    forward_op: NotRequired[Optional[str]]
    source: NotRequired[Optional[Source]]
    wider: NotRequired[Any]
    input_zeros: NotRequired[Any]
    rows: NotRequired[Any]


class Samples(TypedDict):
    """The samples to blame (``diagnosis.samples``)."""

    indices: list[int]
    batch_size: Optional[int]
    method: Optional[str]
    count: NotRequired[int]
    batch_level: NotRequired[bool]
    runs: NotRequired[int]
    complete: NotRequired[bool]
    warnings: NotRequired[list[str]]
    micro_batch: NotRequired[Optional[int]]
    reason: NotRequired[Optional[str]]
    cannot_tell: NotRequired[Optional[str]]
    rows: NotRequired[list[int]]


OptimizerReplay = TypedDict("OptimizerReplay", {
    "class": NotRequired[Optional[str]], "nonfinite": NotRequired[Optional[bool]], "param": NotRequired[Optional[str]],
    "state_key": NotRequired[Optional[str]], "params": NotRequired[Any], "state": NotRequired[Any], "group": NotRequired[Any],
    "hyperparameters": NotRequired[Any], "births": NotRequired[Any], "detail": NotRequired[Optional[str]],
    "evidence": NotRequired[Any], "error": NotRequired[Optional[str]], "zero_state": NotRequired[Any],
})
OptimizerReplay.__doc__ = "The optimizer-update replay (``diagnosis.optimizer``)."


class History(TypedDict):
    """Ring-buffer evidence (``diagnosis.evidence.grad_norm_history``)."""

    grad_norms: list[list[Any]]
    losses: list[list[Any]]
    lrs: list[list[Any]]
    growth: Optional[JFloat]
    exploding: bool
    lr_spike: Optional[dict[str, Any]]
    nonfinite_lr: Any
    weights_nonfinite_since: NotRequired[Any]


HealthRow = TypedDict("HealthRow", {
    "index": int, "module": Optional[str], "class": Optional[str], "role": str, "inputs_finite": Optional[bool],
    "output": Optional[Health],
})


class NonfiniteLeaf(TypedDict, total=False):
    """A non-finite batch leaf or step-start tensor."""

    leaf: str
    health: Health
    samples: Any


class Counterfactuals(TypedDict):
    """What the counterfactual replays said (``null`` when they did not run)."""

    float64_finite: Optional[bool]
    persists_with_perturbed_weights: Optional[bool]
    persists_with_perturbed_data: NotRequired[Optional[bool]]
    persists_with_other_draws: NotRequired[Optional[bool]]


class ReplayFailure(TypedDict):
    """A replay of the diagnosis that raised."""

    replay: str
    error: str


class CompiledReplay(TypedDict):
    """One compiled replay of the comparison (``compile.backends``)."""

    backend: str
    mode: Optional[str]
    role: str
    compiled: Optional[bool]
    nonfinite: Optional[list[str]]
    kinds: Optional[str]
    reproduction: Optional[str]
    max_abs_diff: Optional[JFloat]
    error: Optional[str]


class CompiledOperand(TypedDict):
    """An operand of the compiled culprit, at its first non-finite element (``compile.culprit.operands``)."""

    node: str
    op: str
    compiled: Optional[JFloat]
    eager: NotRequired[Optional[JFloat]]


class CompiledRows(TypedDict):
    """The non-finite rows of the culprit's output (``engine.probes.nonfinite_rows``)."""

    size: int
    dim: int
    count: int
    indices: list[int]
    rows_per_sample: NotRequired[int]


class CompiledCulprit(TypedDict):
    """Where inside the compiled region the non-finite value is born (``engine.compiled_nodes``)."""

    node: str
    op: str
    aten: str
    original_op: Optional[str]
    module: Optional[str]
    source: Optional[Source]
    samples: Optional[CompiledRows]
    kinds: Optional[str]
    graph: str
    call: int
    calls: int
    stage: Optional[str]
    compilations: int
    operands: list[CompiledOperand]
    eager_value: NotRequired[Optional[JFloat]]
    compiled_value: NotRequired[Optional[JFloat]]


class CompileCheck(TypedDict):
    """The eager against the compiled replays (``engine.compiled.compile_check``)."""

    backend: str
    target: str
    eager: bool
    compiled: Optional[bool]
    only_under_compile: bool
    eager_nonfinite: Optional[list[str]]
    compiled_nonfinite: Optional[list[str]]
    eager_kinds: Optional[str]
    compiled_kinds: Optional[str]
    compiled_reproduction: Optional[str]
    max_abs_diff: Optional[JFloat]
    error: Optional[str]
    mode: Optional[str]
    automatic: bool
    options: NotRequired[Optional[dict[str, Any]]]
    dynamic: NotRequired[Optional[bool]]
    fullgraph: NotRequired[bool]
    backends: NotRequired[list[CompiledReplay]]
    stage: NotRequired[Optional[str]]
    stage_detail: NotRequired[Optional[str]]
    stage_backend: NotRequired[Optional[str]]
    culprit: NotRequired[Optional[CompiledCulprit]]
    localize_error: NotRequired[Optional[str]]
    replayed_as_recorded: NotRequired[Optional[bool]]
    differs: NotRequired[list[str]]


class TimelineStep(TypedDict):
    """One step of the ring buffer (``diagnosis.timeline``)."""

    step: int
    loss: Optional[JFloat]
    grad_norm: Optional[JFloat]
    lrs: list[JFloat]
    finite: Optional[bool]
    failing: bool


ForwardModule = TypedDict("ForwardModule", {
    "index": int, "module": str, "class": str, "depth": int, "role": str, "output": Optional[Health], "grad": Optional[Health],
    "allowed": dict[str, int],
})


class BatchLeaf(TypedDict):
    """One tensor leaf of the recorded batch (``diagnosis.timeline``)."""

    leaf: str
    micro_batch: Optional[int]
    shape: list[int]
    dtype: str
    floating: bool
    rows: list[int]
    nan: int
    posinf: int
    neginf: int


class EpisodeRun(TypedDict):
    """Steps of a non-finite episode alike (``capture.episode``)."""

    first: int
    last: int
    nonfinite: str
    update: str


class Episode(TypedDict):
    """The non-finite episode of a rollback plan (``capture.episode.Episode``)."""

    first_step: int
    last_step: int
    steps: int
    consecutive: int
    runs: list[EpisodeRun]
    weights_corrupted_at: Optional[int]


class RejectedState(TypedDict):
    """A snapshot or checkpoint the rollback plan refused, and why."""

    step: int
    source: str
    path: Optional[str]
    why: str


class LrJump(TypedDict):
    """A learning-rate jump the early warning found (``capture.early``)."""

    step: int
    lr: float
    previous: float


class RollbackPlan(TypedDict):
    """The Recorder's rollback plan (``Recorder.rollback_plan``, the bundle's ``reason.rollback``);
    the keys after ``data_position`` are absent in a bundle written before they existed."""

    step: Optional[int]
    first_abnormal_step: Optional[int]
    restore_step: Optional[int]
    source: Optional[str]
    skip_steps: list[int]
    data_position: Any
    path: NotRequired[Optional[str]]
    episode: NotRequired[Optional[Episode]]
    lr_jump: NotRequired[Optional[LrJump]]
    weights_corrupted: NotRequired[bool]
    rejected: NotRequired[list[RejectedState]]
    note: NotRequired[Optional[str]]


class LossScale(TypedDict):
    """The GradScaler's part in the failing step (the bundle's ``reason.scaler``)."""

    skipped: Optional[bool]
    scale: Optional[JFloat]
    scale_after: Optional[JFloat]
    history: list[list[Any]]
    consecutive_skips: Optional[int]
    failure: Optional[str]


class RecordedQuantity(TypedDict):
    """One quantity the recording kept, against the replay (``fidelity.compared``)."""

    quantity: Literal["loss", "gradient"]
    name: str                # the parameter FQN, or the loss's micro-batch ("micro-batch 0", "the step")
    agrees: Optional[bool]   # bit-equal in the replay (null: not recorded)
    detail: str


class Difference(TypedDict):
    """What differs between the recording and the replay (``fidelity.differences``): a kind of
    ``diagnosis.fidelity.DIFFERENCES``, what was found, and what to record or do to reproduce it."""

    kind: str
    detail: str
    record: str


class Rung(TypedDict):
    """One rung of the verdict ladder (``diagnosis.fidelity.RUNGS``) and whether it holds."""

    rung: str
    holds: bool


class Fidelity(TypedDict):
    """The verdict ladder of a step the replay does not reproduce (``diagnosis.fidelity``): is the
    replay shown faithful, and where does the recording depart from it."""

    verdict: Literal["device fault", "not reproduced"]
    rungs: list[Rung]
    replays: int
    finite_replays: int
    agree_bitwise: Optional[bool]
    compared: list[RecordedQuantity]
    first_difference: Optional[RecordedQuantity]
    differences: list[Difference]


class DiagnosisDict(TypedDict):
    """The diagnosis of one failing step (``docs/report.md``, "Top level")."""

    step: int
    phase: Phase
    origin: Optional[Origin]
    cause: str
    classification: Classification
    summary: str
    mode: Mode
    reproduction: Reproduction
    forward_finite: bool
    chain: list[ChainLink]
    births: list[Birth]
    allowed_births: Optional[int]
    allowlist: Optional[list[str]]
    propagated_ops: Optional[int]
    samples: Optional[Samples]
    optimizer: Optional[OptimizerReplay]
    history: Optional[History]
    health: list[HealthRow]
    nonfinite_inputs: list[NonfiniteLeaf]
    nonfinite_weights: list[NonfiniteLeaf]
    loss: list[Optional[Health]]
    counterfactuals: Counterfactuals
    warnings: list[str]
    errors: list[ReplayFailure]
    compile: Optional[CompileCheck]
    fidelity: NotRequired[Optional[Fidelity]]
    timeline: NotRequired[list[TimelineStep]]
    forward_modules: NotRequired[list[ForwardModule]]
    batch_leaves: NotRequired[list[BatchLeaf]]
    bundle: NotRequired[str]
    device: NotRequired[str]
    model_source: NotRequired[Optional[str]]
    rollback: NotRequired[Optional[RollbackPlan]]
    loss_scale: NotRequired[LossScale]
    schema_version: NotRequired[str]


class BisectWindow(TypedDict):
    """``bisect --over layers`` when the steps search finds an abnormal step before the failing
    one: the window searched and how the corruption spread (``docs/bisect.md``)."""

    first_abnormal_step: int
    anomalies: list[str]
    good_step: Optional[int]       # the last healthy pre-step state; None: no healthy snapshot held
    bad_step: int                  # the first abnormal pre-step state
    probe_step: int                # the step whose batch the search replays
    failing_step: int
    corrupted: list[str]           # layers whose weights are already abnormal at bad_step
    spread_to: list[str]           # layers abnormal at the failing step but not at bad_step
    history_onset: NotRequired[Optional[int]]


class BisectResult(TypedDict):
    """The result of ``nanreplay.bisect()`` (``docs/bisect.md``)."""

    over: str
    bundle: str
    step: Optional[int]
    status: str
    answer: str
    culprits: list[dict[str, Any]]
    replays: int
    max_replays: int
    device: str
    details: dict[str, Any]
    warnings: list[str]
    trials: list[dict[str, Any]]
    window: NotRequired[BisectWindow]
    model_source: NotRequired[Optional[str]]
    schema_version: NotRequired[str]


class DiffSide(TypedDict):
    """One side of ``nanreplay diff``: the bundle (its path), its failing step, or ``here``: this
    process's environment."""

    bundle: str
    step: Optional[int]
    here: bool


class SettingDiff(TypedDict):
    """One setting two runs differ in (``nanreplay diff``, ``docs/bisect.md``): its key (e.g.
    ``autocast``, ``numerics.tf32_matmul``, ``optimizer.lr``, ``env.NCCL_ALGO``), its category and
    numerics rank (:data:`nanreplay.core.settings.SETTINGS`: 1 = most likely to change a step's
    numbers, 9 = not at all), the two values (``"(unset)"``: not set in that run; a list for data
    digests and per-group hyper-parameters), whether ``bisect --over config`` can toggle it in a
    replay, and why it matters."""

    key: str
    category: str
    rank: int
    numerics: bool
    a: Any
    b: Any
    replayable: bool
    why: str


class UnknownSetting(TypedDict):
    """A setting only one of the two bundles records (an older writer, a record it lacks)."""

    key: str
    recorded_in: Literal["a", "b"]


class ConfigDiff(TypedDict):
    """The result of ``nanreplay diff A B`` / ``diff A --here`` (``docs/bisect.md``): the
    differences, numerics-relevant first, the count of settings equal in both, the settings only
    one side records, and notes."""

    a: DiffSide
    b: DiffSide
    differences: list[SettingDiff]
    same: int
    unknown: list[UnknownSetting]
    notes: list[str]
    schema_version: NotRequired[str]


#: the objects that may hold keys beyond those declared (their content varies by case)
OPEN: frozenset = frozenset({"Origin", "Reproduction", "Birth", "Samples", "OptimizerReplay", "NonfiniteLeaf"})
