"""The verdict where the run is logged: the Recorder's bundles and spike warnings sent to the
experiment tracker the user already configured (``Recorder(..., log_to=...)``; the Lightning and
Hugging Face callbacks find the trainer's own loggers).

One event per bundle written (non-finite step, exploding step, spike bundle) and per spike
episode, as each tracker keeps things:

=============  ==============================  ==============================  ============================
tracker        the sentence                    step, phase, cause, score       bundle and HTML report
=============  ==============================  ==============================  ============================
TensorBoard    ``add_text("nanreplay/...")``   ``add_scalar`` at the step;     the bundle's path in the
                                               phase, cause in the text        text (no artifact store)
W&B            ``run.summary``                 ``run.log`` scalars;            ``run.log_artifact`` of
                                               ``run.summary`` tags            type ``nanreplay-bundle``
MLflow         ``log_text`` (an artifact)      ``log_metric``; ``set_tag``     ``log_artifact`` under
                                                                               ``nanreplay/``
a callable     ``fn(event)`` with the :class:`TrackerEvent`
=============  ==============================  ==============================  ============================

What ``log_to`` accepts (:func:`resolve`): a ``torch.utils.tensorboard.SummaryWriter`` (or any
writer with ``add_text`` and ``add_scalar``, e.g. tensorboardX), a W&B run (``wandb.init()``'s),
an MLflow run (``mlflow.start_run()``'s ``ActiveRun``, run in the current tracking URI), the
``mlflow`` module itself (its active run at each event), a Lightning logger
(``TensorBoardLogger``, ``WandbLogger``, ``MLFlowLogger``), a :class:`Tracker`, a callable
``fn(event)``, or a list of these. Nothing here imports a tracker library: each is recognised by
the module of its class, and imported (lazily) only by the code that already made its object.

The bundle is an artifact only where the tracker keeps artifacts and only up to
:data:`ARTIFACT_MAX_BYTES` (a larger one is named by its path, and the event says it was not
copied: a multi-GiB bundle copied into a tracker's store at every incident would cost more than
the incident). The HTML report (``nanreplay report``'s page, from the stored diagnosis, no replay)
goes with it when matplotlib (the ``report`` extra) is installed and the event has a diagnosis;
rendering it takes about 1 s on 2 CPU cores, nearly all of an event's cost (``bench/trackers.py``). A tracker that fails logs one warning and never stops
training (:meth:`Trackers.emit`); the command line (``nanreplay log``) asks for the failures
instead, to exit with them.

Every string a tracker gets is escaped for Markdown and HTML (:func:`_text`,
:func:`nanreplay.core.inert.inert_markdown`): a bundle's text is untrusted and TensorBoard, W&B and
MLflow render Markdown, so a stored image or link shows as text. A callable gets the raw event.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..core.inert import inert_markdown

__all__ = ["TrackerEvent", "Tracker", "Trackers", "TensorBoardTracker", "WandbTracker", "MlflowTracker", "CallableTracker", "LazyTracker",
           "resolve", "event_for_bundle", "event_for_spike", "event_from_meta", "parse_spec", "open_tracker", "ARTIFACT_MAX_BYTES",
           "TRACKER_KINDS"]

logger = logging.getLogger(__name__)

#: bundles larger than this (bytes) are not copied into a tracker's artifact store, only named
ARTIFACT_MAX_BYTES = 512 << 20
#: the longest text sent as one tag or summary value (characters; MLflow caps tags at 8000)
TEXT_MAX_CHARS = 4000
#: the ``--to KIND:TARGET`` kinds of ``nanreplay log`` -> (TARGET's metavar, what it is)
TRACKER_KINDS = {"tensorboard": ("DIR", "a log directory"), "wandb": ("PROJECT", "a project name"), "mlflow": ("URI", "a tracking URI")}


@dataclass
class TrackerEvent:
    """One thing the Recorder has to say to a tracker.

    Attributes:
        kind: ``"nonfinite"`` (a bundle for a non-finite or exploding step) or ``"spike"`` (a
            finite step out of its band: the first of an episode).
        step: the training step (the Recorder's, which is the trainer's global step with
            ``step_offset``).
        sentence: the one-line verdict (the diagnosis's ``summary``, else what was found).
        scalars: numbers by name: ``nonfinite_step`` or ``spike_step`` (the step), ``spike_score``
            (spreads above the band, or the drift ratio).
        tags: strings by name: ``event`` (the kind); with a diagnosis ``phase``, ``cause`` (the
            cause's name, e.g. ``numerics``), ``detail``, ``module`` (the origin's FQN), ``op`` (the
            aten op), ``reproduction``; for a spike ``signal`` and ``rollback``; ``bundle`` (its path).
        bundle: the bundle written, else ``None``. diagnosis: its diagnosis dict, else ``None``.
        meta: the bundle's metadata (for the HTML report's environment section), else ``None``.
    """

    kind: str
    step: int
    sentence: str
    scalars: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    bundle: Optional[Path] = None
    diagnosis: Optional[dict] = None
    meta: Optional[dict] = None

    @property
    def name(self) -> str:
        """``nanreplay-step<N>`` or ``nanreplay-spike-step<N>``: the artifact's name."""
        return f"nanreplay-{'spike-' if self.kind == 'spike' else ''}step{self.step}"

    def markdown(self) -> str:
        """The sentence and the tags as Markdown lines (TensorBoard's text plugin renders it),
        every value escaped (:func:`_text`)."""
        lines = [_text(self.sentence), ""]
        lines += [f"* {_text(k)}: {_text(v)}" for k, v in self.tags.items() if k != "event" and v]
        return "\n".join(lines)


def _text(s: Any) -> str:
    """A string for a tracker: the bundle's text is untrusted and trackers render Markdown and
    HTML, so it is escaped for both (:func:`nanreplay.core.inert.inert_markdown`: no link, no
    image, no markup, no control or invisible character), at most :data:`TEXT_MAX_CHARS`."""
    return inert_markdown(s, limit=TEXT_MAX_CHARS)


def _field(d: Any, key: str) -> Any:
    """``d[key]`` when ``d`` is a dict (a stored diagnosis is untrusted input: any shape), else ``None``."""
    return d.get(key) if isinstance(d, dict) else None


def event_for_bundle(path: Optional[Path], *, step: int, diagnosis: Optional[dict], reason: Optional[dict] = None,
                     meta: Optional[dict] = None) -> TrackerEvent:
    """The event of a bundle written for a non-finite (or exploding) step: the diagnosis's
    sentence, phase and cause when the bundle has one, else what the check found (``reason``)."""
    reason = reason or {}
    if diagnosis:
        sentence = str(diagnosis.get("summary") or f"step {step}: non-finite values (see the bundle)")
        cls, origin = diagnosis.get("classification"), diagnosis.get("origin")
        tags = {"phase": diagnosis.get("phase"), "cause": _field(cls, "cause"), "detail": _field(cls, "detail"),
                "module": _field(origin, "module"), "op": _field(origin, "aten") or _field(origin, "op"),
                "reproduction": _field(diagnosis.get("reproduction"), "verdict")}
    else:
        what = " and ".join(w for w, k in (("gradients", "nonfinite_grad"), ("loss", "nonfinite_loss"), ("update", "nonfinite_update"))
                            if reason.get(k)) or "values"
        head = reason.get("message") or f"non-finite {what}"
        sentence = f"{head} at step {step}; not diagnosed yet: `nanreplay replay {path}`" if path else f"{head} at step {step}"
        tags = {}
    tags = {"event": "nonfinite", **{k: str(v) for k, v in tags.items() if v is not None}}
    if path is not None:
        tags["bundle"] = os.path.abspath(path)
    return TrackerEvent("nonfinite", step, sentence, scalars={"nonfinite_step": float(step)}, tags=tags, bundle=path,
                        diagnosis=dict(diagnosis) if diagnosis else None, meta=meta)


def event_for_spike(step: int, rows: list, *, message: str, rollback: Optional[dict] = None, bundle: Optional[Path] = None,
                    meta: Optional[dict] = None) -> TrackerEvent:
    """The event of a spike episode's first step: ``rows`` are its :attr:`Recorder.spikes` rows
    (``signal``, ``kind``, ``value``, ``baseline``, ``score``), ``message`` the warning's line."""
    scores = [float(r["score"]) for r in rows if isinstance(r.get("score"), (int, float)) and math.isfinite(r["score"])]
    scalars = {"spike_step": float(step), **({"spike_score": max(scores)} if scores else {})}
    tags = {"event": "spike", "signal": ", ".join(f"{r.get('signal')} ({r.get('kind')})" for r in rows)}
    if rollback and rollback.get("restore_step") is not None:
        tags["rollback"] = f"restore step {rollback['restore_step']} ({rollback.get('source')}), skip steps {rollback.get('first_abnormal_step')}..{rollback.get('step')}"
    if bundle is not None:
        tags["bundle"] = os.path.abspath(bundle)
    return TrackerEvent("spike", step, message, scalars=scalars, tags=tags, bundle=bundle, meta=meta)


def event_from_meta(path: Path, meta: dict) -> TrackerEvent:
    """The event of a bundle already written, from its metadata only (``Bundle.meta``: the stored
    diagnosis, or the spike rows of a spike bundle); nothing is replayed and no code runs, so an
    untrusted bundle is safe. ``nanreplay log`` sends it."""
    reason = meta.get("reason") if isinstance(meta.get("reason"), dict) else {}
    step = meta.get("failing_step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else -1
    diag = meta.get("diagnosis") if isinstance(meta.get("diagnosis"), dict) else None
    spikes = reason.get("spike")
    if diag is None and isinstance(spikes, list) and spikes and all(isinstance(r, dict) for r in spikes):
        return event_for_spike(step, spikes, message=str(reason.get("message") or f"spike at step {step}"),
                               rollback=reason.get("rollback") if isinstance(reason.get("rollback"), dict) else None, bundle=path, meta=meta)
    return event_for_bundle(path, step=step, diagnosis=diag, reason=reason, meta=meta)


# -- the trackers ---------------------------------------------------------------------------------
class Tracker:
    """One place to log to. Subclasses implement :meth:`log`.

    Attributes:
        name: how messages name it (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ...).
        artifacts: whether it keeps files (the bundle, the HTML report).
    """

    name = "tracker"
    artifacts = False

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        """Log ``event``; ``files``: the bundle and the HTML report to keep as artifacts (empty
        where they are not kept or were skipped)."""
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """A ``SummaryWriter`` (``torch.utils.tensorboard`` or tensorboardX): the sentence and tags
    as text under ``nanreplay/<kind>``, the scalars under ``nanreplay/<name>``, at the event's
    step; then ``flush()`` so that a run that stops right after still has them on disk."""

    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        w = self.writer
        w.add_text(f"nanreplay/{event.kind}", event.markdown(), global_step=event.step)
        for k, v in event.scalars.items():
            w.add_scalar(f"nanreplay/{k}", v, global_step=event.step)
        if callable(getattr(w, "flush", None)):
            w.flush()


class WandbTracker(Tracker):
    """A W&B run (``wandb.init()``'s, online or offline): the scalars with ``run.log`` (no
    ``step=``, so the trainer's own step numbering is left alone), the sentence and tags in
    ``run.summary`` under ``nanreplay/``, the files as one artifact of type ``nanreplay-bundle``."""

    name = "wandb"
    artifacts = True

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        run = self.run
        run.log({f"nanreplay/{k}": v for k, v in event.scalars.items()})
        run.summary.update({f"nanreplay/{event.kind}": _text(event.sentence), **{f"nanreplay/{k}": _text(v) for k, v in event.tags.items()}})
        if files:
            wandb = sys.modules.get("wandb") or __import__("wandb")
            art = wandb.Artifact(event.name, type="nanreplay-bundle", description=_text(event.sentence),
                                 metadata={"step": event.step, **{k: _text(v) for k, v in event.tags.items()}})
            for f in files:
                art.add_file(str(f), name=f.name)
            run.log_artifact(art)


class MlflowTracker(Tracker):
    """An MLflow run, through ``MlflowClient``: the scalars with ``log_metric`` at the event's
    step (``nanreplay.<name>``), the tags with ``set_tag`` (``nanreplay.<name>``), the sentence
    as ``nanreplay/<artifact name>.txt`` and the files under ``nanreplay/``.

    Args:
        client: an ``MlflowClient``, or ``None`` for one on the current tracking URI.
        run_id: the run's id, or ``None`` for ``mlflow.active_run()`` at each event.
    """

    name = "mlflow"
    artifacts = True

    def __init__(self, client: Any = None, run_id: Optional[str] = None) -> None:
        self.client, self.run_id = client, run_id

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        mlflow = sys.modules.get("mlflow") or __import__("mlflow")
        run_id = self.run_id
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise RuntimeError("no active MLflow run (mlflow.active_run() is None); pass log_to=mlflow.start_run()'s run")
            run_id = active.info.run_id
        client = self.client if self.client is not None else mlflow.MlflowClient()
        for k, v in event.scalars.items():
            client.log_metric(run_id, f"nanreplay.{k}", v, step=max(event.step, 0))
        for k, v in event.tags.items():
            client.set_tag(run_id, f"nanreplay.{k}", _text(v))
        client.log_text(run_id, event.markdown(), f"nanreplay/{event.name}.md")
        for f in files:
            client.log_artifact(run_id, str(f), "nanreplay")


class CallableTracker(Tracker):
    """A user's function ``fn(event: TrackerEvent)`` (files in ``event.bundle``)."""

    def __init__(self, fn: Callable[[TrackerEvent], Any]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        self.fn(event)


class LazyTracker(Tracker):
    """A tracker found only when the first event comes (a framework's logging callback creates
    its writer or run when training begins): ``find()`` returns the object to :func:`resolve`,
    or ``None`` when there is none yet (then the event is not logged there)."""

    def __init__(self, find: Callable[[], Any], name: str) -> None:
        self.find, self.name = find, name
        self._inner: Optional[list[Tracker]] = None

    def _trackers(self) -> list[Tracker]:
        if self._inner is None:
            obj = self.find()
            if obj is None:
                return []
            self._inner = resolve(obj, strict=False)
        return self._inner

    @property
    def artifacts(self) -> bool:  # type: ignore[override]
        return any(t.artifacts for t in self._trackers())

    def log(self, event: TrackerEvent, files: list[Path]) -> None:
        found = self._trackers()
        if not found:
            logger.info("nanreplay: no %s writer or run to log step %d to", self.name, event.step)
        for t in found:
            t.log(event, files if t.artifacts else [])


def _module(obj: Any) -> str:
    return type(obj).__module__ or ""


def _lightning_logger(obj: Any) -> Optional[list[Tracker]]:
    """The trackers of a Lightning logger (``TensorBoardLogger``, ``WandbLogger``,
    ``MLFlowLogger``), ``[]`` for another Lightning logger (CSV...), ``None`` if not one."""
    mod = _module(obj)
    if not (mod.startswith("lightning.pytorch.loggers") or mod.startswith("pytorch_lightning.loggers")
            or mod.startswith("lightning.fabric.loggers")):
        return None
    cls = type(obj).__name__
    if cls == "MLFlowLogger":
        return [MlflowTracker(obj.experiment, obj.run_id)]
    if cls in ("TensorBoardLogger", "WandbLogger"):
        exp = obj.experiment  # a dummy on ranks other than 0: then nothing is logged there
        return resolve(exp, strict=False)
    return []


def resolve(log_to: Any, *, strict: bool = True) -> list[Tracker]:
    """The :class:`Tracker` list for a ``log_to`` value (see the module docstring).

    Args:
        strict: an object that is no known tracker raises (``log_to`` given by the user); with
            ``False`` it is skipped (a logger a framework callback found: a CSV logger, or a
            dummy on another rank).

    Raises:
        TypeError: (``strict``) an object that is none of the accepted kinds.
    """
    if log_to is None:
        return []
    if isinstance(log_to, (list, tuple)):
        return [t for x in log_to for t in resolve(x, strict=strict)]
    if isinstance(log_to, Tracker):
        return [log_to]
    found = _lightning_logger(log_to)
    if found is not None:
        return found
    mod = _module(log_to)
    if callable(getattr(log_to, "add_text", None)) and callable(getattr(log_to, "add_scalar", None)):
        return [TensorBoardTracker(log_to)]
    if mod.startswith("wandb") and callable(getattr(log_to, "log", None)) and hasattr(log_to, "summary"):
        return [WandbTracker(log_to)]
    if getattr(log_to, "__name__", None) == "mlflow" and callable(getattr(log_to, "active_run", None)):
        return [MlflowTracker()]  # the mlflow module: its active run at each event
    if mod.startswith("mlflow"):
        run_id = getattr(getattr(log_to, "info", None), "run_id", None)
        if isinstance(run_id, str):
            return [MlflowTracker(None, run_id)]  # mlflow.start_run()'s ActiveRun, or an entities.Run
    if callable(log_to) and not isinstance(log_to, type):
        return [CallableTracker(log_to)]
    if not strict:
        return []
    raise TypeError(
        f"log_to: expected a TensorBoard SummaryWriter, a W&B run (wandb.init()), an MLflow run (mlflow.start_run()) or the "
        f"mlflow module, a Lightning logger, a function fn(event), or a list of these; found {type(log_to).__module__}."
        f"{type(log_to).__qualname__}; pass one of those (docs/trackers.md)")


class Trackers:
    """The trackers of one Recorder (or one ``nanreplay log``), and the events sent to them.

    Args:
        log_to: what :func:`resolve` accepts. strict: see :func:`resolve`.
        artifact_max_bytes: the largest bundle copied as an artifact (:data:`ARTIFACT_MAX_BYTES`).
        html: attach the HTML report where artifacts are kept (``None``: when matplotlib is installed).

    Attributes:
        trackers: the resolved :class:`Tracker` list. sent: events sent so far (each counted once,
            whatever the number of trackers). failures: ``(tracker name, error)`` of the failed logs.
    """

    def __init__(self, log_to: Any, *, strict: bool = True, artifact_max_bytes: int = ARTIFACT_MAX_BYTES, html: Optional[bool] = None) -> None:
        self.trackers = resolve(log_to, strict=strict)
        self.artifact_max_bytes = artifact_max_bytes
        self.html = html
        self.sent = 0
        self.failures: list[tuple[str, str]] = []

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def emit(self, event: TrackerEvent) -> None:
        """Send ``event`` to every tracker. Never raises: a tracker that fails is logged (one
        warning naming it and the error) and recorded in :attr:`failures`; the others still get
        the event."""
        if not self.trackers:
            return
        self.sent += 1
        try:
            with tempfile.TemporaryDirectory(prefix="nanreplay-trk-") as tmp:
                files = self._files(event, Path(tmp)) if any(t.artifacts for t in self.trackers) else []
                for t in self.trackers:
                    try:
                        t.log(event, files if t.artifacts else [])
                    except Exception as e:  # a tracker must never stop training
                        self.failures.append((t.name, f"{type(e).__name__}: {e}"))
                        logger.warning("nanreplay: could not log step %d's %s to %s (%s: %s); training goes on", event.step,
                                       event.kind, t.name, type(e).__name__, e)
        except Exception as e:  # the temporary directory itself (a full disk): nothing was logged
            self.failures.append(("files", f"{type(e).__name__}: {e}"))
            logger.warning("nanreplay: could not prepare step %d's files for the trackers (%s: %s)", event.step, type(e).__name__, e)

    def _files(self, event: TrackerEvent, tmp: Path) -> list[Path]:
        """The bundle (when at most ``artifact_max_bytes``) and the HTML report (when it can be
        rendered cheaply) to keep as artifacts."""
        files: list[Path] = []
        if event.bundle is not None:
            try:
                size = os.path.getsize(event.bundle)
            except OSError as e:
                logger.warning("nanreplay: the bundle %s cannot be read for the trackers (%s)", event.bundle, e)
                size = None
            if size is not None and size <= self.artifact_max_bytes:
                files.append(Path(event.bundle))
            elif size is not None:
                event.tags["bundle_artifact"] = f"not copied: {size / 2**20:.0f} MiB > {self.artifact_max_bytes / 2**20:.0f} MiB"
                logger.warning("nanreplay: %s is %.0f MiB, over the %.0f MiB copied to a tracker's artifacts; the trackers get its path",
                               event.bundle, size / 2**20, self.artifact_max_bytes / 2**20)
        page = self._html(event)
        if page is not None:
            out = tmp / f"{event.name}.html"
            out.write_text(page, encoding="utf-8")
            files.append(out)
        return files

    def _html(self, event: TrackerEvent) -> Optional[str]:
        if self.html is False or not event.diagnosis:
            return None
        from ..report.html import render_html  # the page of `nanreplay report`, from the diagnosis alone
        from ..errors import MissingExtraError

        try:
            return render_html(event.diagnosis, meta=event.meta, bundle_name=event.bundle.name if event.bundle else None)  # type: ignore[arg-type]
        except MissingExtraError:
            if self.html:
                raise
            return None  # matplotlib (the report extra) is not installed: the bundle goes alone
        except Exception as e:  # a report that cannot be drawn must not lose the event
            logger.warning("nanreplay: the HTML report of step %d could not be rendered for the trackers (%s: %s)", event.step,
                           type(e).__name__, e)
            return None

    def close(self) -> None:
        """Flush the writers that buffer (TensorBoard); the trackers themselves stay open (they are the user's)."""
        for t in self.trackers:
            w = getattr(t, "writer", None)
            try:
                if w is not None and callable(getattr(w, "flush", None)):
                    w.flush()
            except Exception as e:
                logger.warning("nanreplay: could not flush %s (%s)", t.name, e)


# -- `nanreplay log --to KIND:TARGET` ----------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, str]:
    """``"KIND:TARGET"`` -> ``(kind, target)``, kind one of :data:`TRACKER_KINDS`.

    Raises:
        ValueError: no ``:``, an unknown kind, or an empty target; the message lists the forms.
    """
    kind, sep, target = spec.partition(":")
    forms = " | ".join(f"{k}:{v[0]}" for k, v in TRACKER_KINDS.items())
    if not sep or kind not in TRACKER_KINDS or not target:
        what = "no KIND: prefix" if not sep else (f"unknown tracker {kind!r}" if kind not in TRACKER_KINDS else f"{TRACKER_KINDS[kind][1]} is missing")
        raise ValueError(f"--to {spec!r}: {what}; expected one of {forms} (e.g. --to tensorboard:runs/exp1)")
    return kind, target


def open_tracker(spec: str, *, run_name: str, run_id: Optional[str] = None) -> tuple[Any, Callable[[], None]]:
    """Open the tracker ``spec`` names (``tensorboard:DIR``, ``wandb:PROJECT``, ``mlflow:URI``) for
    ``nanreplay log``: returns ``(object for log_to, close)``. ``run_id``: log into that W&B or
    MLflow run (resumed) instead of a new run named ``run_name``. W&B honours ``WANDB_MODE``
    (``offline`` writes a local run directory under ``WANDB_DIR``).

    Raises:
        ValueError: a malformed spec (:func:`parse_spec`).
        MissingExtraError: the tracker's library is not installed (``pip install 'nanreplay[trackers]'``).
    """
    from ..errors import MissingExtraError

    kind, target = parse_spec(spec)
    package = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[kind]
    try:
        __import__(package)
    except ImportError as e:
        raise MissingExtraError(f"--to {kind}:... needs {package}, which is not installed: pip install 'nanreplay[trackers]' "
                                f"(or pip install {package if kind != 'mlflow' else 'mlflow-skinny'})", extra="trackers") from e
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=target)
        return writer, writer.close
    if kind == "wandb":
        import wandb

        run = wandb.init(project=target, name=None if run_id else run_name, id=run_id, resume="allow" if run_id else None,
                         job_type="nanreplay",
                         settings=wandb.Settings(silent=True))  # stderr carries only nanreplay's messages
        return run, run.finish
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=target)
    if run_id is None:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "nanreplay"
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        run_id = client.create_run(exp_id, run_name=run_name).info.run_id
        return MlflowTracker(client, run_id), lambda: client.set_terminated(run_id)
    return MlflowTracker(client, run_id), lambda: None
