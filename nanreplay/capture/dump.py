"""The dump: a failing step's bundle, its embedded program, and its in-process diagnosis.

:class:`Dump` writes the bundle first (so nothing is lost if what follows fails or runs out of
time), then exports the step's program (``embed_program``, with
:func:`nanreplay.engine.program.program_content`) and, with ``diagnose`` on, replays the step in
process (:func:`nanreplay.diagnosis.api.diagnose_live`, within ``diagnose_timeout`` seconds), and
writes the bundle again with both. Nothing here raises into the training loop: a failure is
logged and training goes on.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ..core.callables import callable_path
from ..core.digest import maybe_digest
from ..core.jsonable import fnum, jsonable
from ..core.quiet import replay_quiet
from ..format.bundle import open_bundle, write_bundle
from ..format.records import BundleContent, Snapshot, StepRecord
from .config import RecorderConfig
from .inputs import InputCapture
from .program_cache import PendingEmbed, ProgramCache
from .ring import RingBuffer
from .snapshots import replace_snapshot
from .trackers import Trackers, event_for_bundle

logger = logging.getLogger(__name__)

__all__ = ["Dump", "model_info", "check_out_dir", "shell_path"]

#: a step's pre-step state, or a function returning the live one (called inside the dump's guard)
StateSource = Union[Snapshot, Callable[[], Snapshot]]


class Dump:
    """Writes bundles for one Recorder and keeps what they produced.

    Args:
        model: the unwrapped model; optimizer: its optimizer; config: the Recorder's options.
        ring: the ring buffer (the steps up to the failing one go into the bundle).
        inputs: the batch capture (it knows which kept references went stale).
        loss_fn: the loss function (or ``None``); loss_fn_path / model_factory_path: their import
            paths for the bundle's metadata.
        dist: the :class:`~nanreplay.capture.ddp.RankContext` under ``torch.distributed``, else ``None``.
        extra_meta: the Recorder's dict merged into every bundle's metadata (shared, not copied).

    Attributes:
        bundles: paths written so far. attempts: dumps tried, failed ones included.
        last_diagnosis: the last in-process diagnosis dict, else ``None``.
        replaying: ``True`` while the export or the diagnosis runs the live model (the Recorder's
            hooks stay quiet then).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RecorderConfig, *, ring: RingBuffer,
                 inputs: InputCapture, loss_fn: Any, loss_fn_path: Optional[str], model_factory_path: Optional[str],
                 dist: Any, extra_meta: dict) -> None:
        self.model, self.optimizer, self.config = model, optimizer, config
        self.ring, self.inputs, self.dist = ring, inputs, dist
        self.loss_fn, self.loss_fn_path, self.model_factory_path = loss_fn, loss_fn_path, model_factory_path
        self.extra_meta = extra_meta
        self._param_fqn = {id(p): n for n, p in model.named_parameters()}
        self.bundles: list[Path] = []
        self.attempts = 0
        self.last_diagnosis: Optional[dict] = None
        self.replaying = False
        self._embed_t0 = 0.0
        self.history: Any = None  # the Recorder's capture.early.ScalarHistory, stored in every bundle
        self.compile_state: Optional[Callable[[], dict]] = None  # the model's torch.compile state (capture.compiled), meta["compile"]
        self.run_config: Optional[Callable[[list], dict]] = None  # the run's configuration for these steps (capture.settings), meta["config"]
        self.spike_bundles: list[Path] = []
        self.spike_attempts = 0
        # log_to: the user's experiment trackers, told of every bundle and spike episode (capture.trackers)
        self.trackers = Trackers(config.log_to) if config.log_to is not None else None
        # the program exported at the first finite step, re-embedded at the dump (export_early)
        self.programs = ProgramCache(model, loss_fn, lambda on: setattr(self, "replaying", on))
        self.programs.tried = not (config.embed_program and config.export_early and config.check_every == 1
                                   and not (dist is not None and dist.sharded))

    @property
    def sharded(self) -> bool:
        """Whether the recorded model is sharded (FSDP2 / DTensor): its bundle keeps whole gradient
        shards, ranks wait for each other after a dump, and nothing is replayed in process."""
        return self.dist is not None and self.dist.sharded

    @property
    def spike_allowed(self) -> bool:
        """Whether another spike bundle may be tried (``max_dumps`` of them, counted apart)."""
        return self.spike_attempts < self.config.max_dumps

    @property
    def allowed(self) -> bool:
        """Whether another dump may be tried (``max_dumps`` bounds the attempts)."""
        return self.attempts < self.config.max_dumps

    def content(self, rec: StepRecord, grads: list, reason: dict, state: StateSource) -> BundleContent:
        """The content of the bundle for the failing step ``rec`` (references; nothing is copied).
        ``state``: its pre-step state (or a function returning it, when it is the live state); it
        is copied shallowly, never modified."""
        state = replace_snapshot(state() if callable(state) else state)
        if rec.buffers is not None:
            state.buffers = dict(rec.buffers)   # step-start values, not the post-forward ones
        grad_tensors = {n: g.detach() for n, g in grads}
        if self.dist is not None:
            grad_tensors = self.dist.local_grads(grads, grad_tensors)
        grad_tensors = maybe_digest(grad_tensors, "full" if self.sharded else self.config.store_grads,  # merge_run puts whole shards together
                                    loss_nonfinite=bool(reason.get("nonfinite_loss")))
        steps = self.ring.upto(rec.step)
        for r in steps:
            r.lrs = [float(x) for x in r.lrs]  # tensor learning rates are read on the host here, not per step
            # a reference whose version counter moved no longer holds what the step saw
            r.stale_inputs = self.inputs.stale(r.step)
            if r.stale_inputs:
                logger.warning("nanreplay: step %d's inputs were modified in place after capture; the bundle marks them stale", r.step)
        group_fqns = [[self._param_fqn.get(id(p), "") for p in g["params"]] for g in self.optimizer.param_groups]
        return BundleContent(
            failing_step=rec.step,
            steps=steps,
            state=state,
            grads=grad_tensors,
            model_info=model_info(self.model),
            optimizer_info={
                "class": callable_path(type(self.optimizer)),
                "param_groups_fqns": group_fqns,
                "defaults": {k: jsonable(v) for k, v in self.optimizer.defaults.items()},
            },
            reason=reason,
            model_factory=self.model_factory_path,
            loss_fn=self.loss_fn_path,
            extra_meta={"replay_options": {"allow_nonfinite": [str(r) for r in self.config.allow_nonfinite]}, **self.extra_meta,
                        **({"scalar_history": self.history.to_meta(rec.step)} if self.history is not None else {}),
                        **({"compile": self.compile_state()} if self.compile_state is not None else {}),
                        **({"config": self.run_config(steps)} if self.run_config is not None else {})},
        )

    def __call__(self, rec: StepRecord, grads: list, state: StateSource, *, bad_grad: bool = False, bad_loss: bool = False,
                 update: bool = False, cause: Optional[dict] = None, spike: bool = False) -> Optional[Path]:
        """:meth:`write` (under ``torch.distributed`` the Recorder then waits for every rank's bundle:
        :meth:`nanreplay.capture.ddp.RankContext.settle`)."""
        return self.write(rec, grads, state, bad_grad=bad_grad, bad_loss=bad_loss, update=update, cause=cause, spike=spike)

    def write(self, rec: StepRecord, grads: list, state: StateSource, *, bad_grad: bool = False, bad_loss: bool = False,
              update: bool = False, cause: Optional[dict] = None, spike: bool = False) -> Optional[Path]:
        """Write the bundle of step ``rec`` (pre-step ``state``, gradients ``grads``), then export
        its program and diagnose it in process, and write it again with both. Never raises: a
        failure is logged and ``None`` returned. ``spike``: a finite step out of its band
        (``on_spike="dump"``): named ``nanreplay-spike-step<N>``, counted apart from the
        non-finite bundles, not diagnosed (there is no non-finite value to trace)."""
        if spike:
            self.spike_attempts += 1
        else:
            self.attempts += 1
        t0 = time.perf_counter()
        reason = {
            "nonfinite_grad": bad_grad,
            "nonfinite_loss": bad_loss,
            "nonfinite_update": update,
            "grad_norm": fnum(rec.grad_norm),
            "loss": fnum(rec.loss),
            "action": self.config.action,
            **(cause or {}),
        }
        try:
            content = self.content(rec, grads, reason, state)
        except Exception:  # never let the recorder kill training by itself
            logger.exception("nanreplay: could not assemble the bundle for step %d", rec.step)
            return None
        path: Any = self.config.out_dir
        pending = self._start_embed(rec, content)  # the export overlaps the first write
        try:
            path = self._path(rec.step, "nanreplay-spike-step" if spike else "nanreplay-step")
            if self.dist is not None:
                # a new dict: the entry without the siblings and layouts is shared with reason["distributed"]
                content.extra_meta["distributed"] = {**(content.extra_meta.get("distributed") or {}), **self.dist.run_meta(self.model, path)}
            written = write_bundle(path, content)
        except Exception:
            logger.exception("nanreplay: could not write the bundle for step %d to %s; training goes on (%d of max_dumps=%d "
                             "dumps tried)", rec.step, path, self.attempts, self.config.max_dumps)
            if pending is not None:
                pending.join()  # nothing of the model runs while torch.export traces it
                self.replaying = False
            return None
        except BaseException:  # an interrupt: training stops, but not with the export still tracing the model
            if pending is not None:
                pending.join()
                self.replaying = False
            raise
        (self.spike_bundles if spike else self.bundles).append(written)
        logger.warning("nanreplay: wrote %s for %s step %d in %.2f s", written, "spike" if spike else "non-finite", rec.step,
                       time.perf_counter() - t0)
        if self.sharded:
            # the live model is sharded: an export or a replay on it would run collectives on this
            # rank alone and hang the others; the run's bundles replay together, offline
            logger.warning("nanreplay: sharded model: no in-process diagnosis; when every rank has written, run `nanreplay replay %s`",
                           shell_path(written.parent))
            self._track(written, content, spike)
            return written
        amended = pending is not None and self._embed_program(content, rec, pending)
        if self.config.diagnose and not spike:
            amended = self._diagnose_into(content, written) or amended
        if amended:
            try:
                write_bundle(written, content)
            except Exception:
                logger.exception("nanreplay: could not add the program and diagnosis to %s; the bundle stays as first written", written)
        self._track(written, content, spike)
        return written

    def amend(self, path: Path, reason: dict) -> bool:
        """Rewrite the bundle at ``path`` with ``reason``'s keys replaced in its ``reason`` (and
        ``reason["rollback"]`` in its stored diagnosis, and in :attr:`last_diagnosis` when that
        is this bundle's): used to bring a bundle's rollback plan up to date with its episode.
        Cost: one full rewrite (every tensor read and written again, atomically). Never raises:
        a failure is logged and ``False`` returned."""
        try:
            with open_bundle(path) as b:
                content = b.content()
                content.reason = {**content.reason, **reason}
                if "rollback" in reason and content.diagnosis is not None:
                    content.diagnosis = {**content.diagnosis, "rollback": reason["rollback"]}
                write_bundle(path, content)
        except Exception:
            logger.exception("nanreplay: could not bring %s's rollback plan up to date; it keeps the plan it was written with", path)
            return False
        if "rollback" in reason and self.last_diagnosis is not None and self.bundles and self.bundles[-1] == path:
            self.last_diagnosis["rollback"] = reason["rollback"]
        logger.info("nanreplay: %s's rollback plan now covers the episode", path)
        return True

    def _track(self, path: Path, content: BundleContent, spike: bool) -> None:
        """Tell ``log_to``'s trackers of a bundle written (a spike bundle is told with its
        episode, by :meth:`nanreplay.capture.early.SpikeWatch.judge`). Never raises."""
        if not self.trackers or spike:
            return
        meta = None
        if content.diagnosis is not None:  # the HTML report's environment section
            try:
                with open_bundle(path) as b:
                    meta = dict(b.meta)
            except Exception as e:
                logger.info("nanreplay: could not read %s's metadata back for the trackers (%s)", path, e)
        self.trackers.emit(event_for_bundle(path, step=content.failing_step, diagnosis=content.diagnosis, reason=content.reason, meta=meta))

    def _start_embed(self, rec: StepRecord, content: BundleContent) -> Optional[PendingEmbed]:
        """With ``embed_program`` on an unsharded model: start the program's export (or its
        re-embedding) on a thread (:class:`~nanreplay.capture.program_cache.PendingEmbed`), the
        Recorder's hooks quiet until :meth:`_embed_program` has verified it."""
        if not self.config.embed_program or self.sharded:
            return None
        from ..core.rng import sole_thread
        from ..engine.verify import verify_program

        def verify(meta: dict, tensors: dict) -> Optional[str]:  # the program's own loss: no code of the user's runs
            return verify_program(meta, tensors, content, None, private=False)

        self.replaying = True  # export runs the module hooks with fake tensors: keep the recorder quiet
        self._embed_t0 = time.perf_counter()
        # the replay may set the process-wide generators only while no thread but this one (writing) may draw
        return PendingEmbed(self.programs, rec, content, verify=verify if sole_thread() else None)

    def _embed_program(self, content: BundleContent, rec: StepRecord, pending: PendingEmbed) -> bool:
        """Put the failing step's program into ``content`` (see ``embed_program``): the one
        exported early when it still fits (:class:`~nanreplay.capture.program_cache.ProgramCache`),
        else the new export ``pending`` ran, verified against the step. Never raises; returns
        whether ``content`` changed."""
        from ..engine.program import PROGRAM_META_KEY
        from ..engine.verify import NOT_REPRODUCED, verify_program

        t0 = self._embed_t0
        self.replaying = True
        try:
            meta, tensors, verified = pending.result()
            if pending.checked:
                unfaithful = pending.unfaithful
            else:
                with replay_quiet():  # the verifying replay's warnings are about nanreplay's replay, not the user's loop
                    unfaithful = verify_program(meta, tensors, content, self.loss_fn) if meta and meta.get("kind") and not verified else None
            if unfaithful and unfaithful.startswith(NOT_REPRODUCED):
                unfaithful = self._against_eager(meta, tensors, content, unfaithful)
            if unfaithful:
                meta, tensors = {"kind": None, "error": unfaithful}, {}
        except Exception as e:  # export must never cost training
            meta, tensors = {"kind": None, "error": f"{type(e).__name__}: {e}"}, {}
        finally:
            pending.join()
            self.replaying = False
        content.extra_meta[PROGRAM_META_KEY] = meta
        content.extra_tensors.update(tensors)
        if meta and meta.get("kind"):
            logger.warning("nanreplay: embedded step %d's %s program in %.1f s", rec.step, meta["kind"], time.perf_counter() - t0)
        else:
            logger.warning("nanreplay: could not embed step %d's program (%s); replay will need the model factory",
                           rec.step, (meta or {}).get("error"))
        return True

    def _against_eager(self, meta: dict, tensors: dict, content: BundleContent, why: str) -> Optional[str]:
        """Where the program's replay does not reproduce the recording: compare it with a bare
        eager replay of the step on the live model (:func:`nanreplay.engine.verify.eager_grads`)
        instead. When the eager replay does not reproduce the recording either (a transient or
        device fault, random draws on a device the replay lacks), a program that agrees with it
        is faithful to the model and is kept (``meta["verified_against"]`` says so); else why it
        is not (``why``, the comparison with the recording, when the eager replay reproduces it).
        Cost, in that case only: one eager and one program replay of the step."""
        from ..engine.compare import compare_grads
        from ..engine.verify import RTOL, eager_grads, verify_program

        with replay_quiet():
            try:
                eager = eager_grads(self.model, content, self.loss_fn)
            except Exception as e:  # noqa: BLE001 - the program is then dropped, never raised into training
                return f"the exported program does not reproduce the step, and an eager replay to compare it with failed ({type(e).__name__}: {e})"
            if compare_grads(content.grads, eager)["verdict"] != "not reproduced":
                return why  # the model's own replay reproduces the step: the program is what differs
            against = verify_program(meta, tensors, content, self.loss_fn, reference=eager)
        if against is None:
            meta["verified_against"] = (f"an eager replay of the step on the live model, bit for bit or within {RTOL:g} of its largest "
                                        "gradient: the recorded gradients themselves do not reproduce")
            logger.info("nanreplay: the step's recorded gradients do not reproduce; the exported program agrees with an eager replay "
                        "of the step and is embedded")
        return against

    def _diagnose_into(self, content: BundleContent, path: Path) -> bool:
        """The in-process diagnosis of a written bundle, within ``diagnose_timeout`` seconds, into
        ``content.diagnosis`` (or, when it stops early, why into ``meta["diagnosis_error"]``);
        returns whether ``content`` changed."""
        from ..diagnosis.api import diagnose_live

        step = content.failing_step
        timeout = self.config.diagnose_timeout
        logger.warning("nanreplay: diagnosing step %d in process%s (skip it with Recorder(..., diagnose=False); "
                       "`nanreplay replay %s` does the same later)", step, f", at most {timeout:g} s" if timeout else "", shell_path(path))
        t0 = time.perf_counter()
        last = [t0]

        def progress(message: str) -> None:
            now = time.perf_counter()
            if now - last[0] >= 3.0:  # work over a few seconds is shown, not every stage
                last[0] = now
                logger.warning("nanreplay: diagnosis of step %d: %s (%.0f s)", step, message, now - t0)

        self.replaying = True  # keep the recorder's own hooks quiet during the replay
        try:
            diag = diagnose_live(self.model, content, loss_fn=self.loss_fn, allow=self.config.allow_nonfinite,
                                 progress=progress, timeout=timeout)
        except Exception as e:
            logger.warning("nanreplay: the in-process diagnosis of step %d stopped (%s: %s); the bundle %s holds everything: "
                           "run `nanreplay replay %s`", step, type(e).__name__, e, path, shell_path(path))
            content.extra_meta["diagnosis_error"] = f"{type(e).__name__}: {e}"[:2000]  # the bundle says why it has none
            return True
        finally:
            self.replaying = False
        if self.dist is not None:
            self.dist.annotate(diag)
        self.last_diagnosis = content.diagnosis = diag
        logger.warning("nanreplay: diagnosis of step %d (%.1f s): %s", step, time.perf_counter() - t0, diag.get("summary"))
        return True

    def _path(self, step: int, stem: str = "nanreplay-step") -> Path:
        """A new bundle path in ``out_dir``: ``{stem}{N}[-rank{r}of{w}].{ext}`` (stem
        ``nanreplay-step`` or ``nanreplay-spike-step``), with a
        ``-2``, ``-3``... suffix when a bundle of that name exists (never overwrite an older one)."""
        ext = ".h5" if self.config.bundle_format == "h5" else ".safetensors"
        suffix = self.dist.name_suffix() if self.dist is not None else ""
        out = Path(self.config.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{stem}{step}{suffix}{ext}"
        n = 2
        while path.exists():
            path = out / f"{stem}{step}{suffix}-{n}{ext}"
            n += 1
        return path

    def outcome(self, path: Optional[Path]) -> str:
        """The part of a message that says where the bundle is and what the diagnosis found."""
        summary = (self.last_diagnosis or {}).get("summary") if path else None
        return (
            (f"; bundle: {path}" if path else "; no bundle written")
            + (f"; diagnosis: {summary.rstrip('.')}" if summary else "")
            + (f"; replay it with: nanreplay replay {shell_path(path)}" if path else "")
        )


def model_info(model: torch.nn.Module) -> dict:
    """Architecture facts stored in the bundle and checked by replay: class, parameter and buffer
    FQNs with shape/dtype/device, and every module's FQN and class."""
    return {
        "class": callable_path(type(model)),
        "params": {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device)} for n, p in model.named_parameters()},
        "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", ""), "device": str(b.device)} for n, b in model.named_buffers()},
        "modules": [[n, type(m).__name__] for n, m in model.named_modules()],
    }


def check_out_dir(out_dir: Any) -> None:
    """``out_dir`` must be a directory that exists or can be created, and is writable.

    Raises:
        ValueError: it (or an ancestor) is a file, or it cannot be created or written; the message
            says which path is in the way.
    """
    p = Path(out_dir)
    probe = p
    while not probe.exists() and probe.parent != probe:  # the nearest existing ancestor decides
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "" if probe == p else f" (its ancestor {str(probe)!r} is a file)"
        raise ValueError(f"out_dir={str(p)!r} cannot be a directory for bundles{where if where else ': it is a file'}; pass another out_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "it" if probe == p else f"its ancestor {str(probe)!r}"
        raise ValueError(f"out_dir={str(p)!r} is not writable: {where} does not allow this user to write; pass an out_dir you can write to")


def shell_path(path: Any) -> str:
    """``path`` as it can be pasted into a shell."""
    return shlex.quote(str(path))
