"""The step's program: exported at the failing step, or once before any step fails and re-embedded.

``torch.export`` takes seconds (a 42M-parameter GPT: 2-8 s on 2 CPU cores), and the verifying
replay of :mod:`nanreplay.engine.verify` about one more step. By default (``export_early=False``)
both happen at the dump, on the failing step only: a run that never fails never pays them, and
the terminal says what they cost when they run. The export there skips its own load check, since
the verifying replay that follows loads the program anyway.

With ``export_early=True``, :class:`ProgramCache` moves them to the first finite step of the run,
checked synchronously (``check_every=1``): the Recorder's ``check_step`` calls
:meth:`ProgramCache.early` there, once, with the step's pre-step weights still in the model and
its gradients in ``.grad``. The export traces with fake tensors and the verifying replay runs on
detached views of the weights under a :class:`~nanreplay.core.rng.ReplayRNG`, so neither changes
the step's results nor any RNG stream of the user's (``tests/capture/test_program_cache.py`` checks that
a run's losses are bit-identical with and without it). What it keeps: the program record (JSON, a
few hundred KiB) and the program's own tensors (constants ``torch.export`` lifted; the weights
and buffers are not kept: the program names the bundle's ``state/params/<fqn>`` and
``state/buffers/<fqn>``), bounded by ``max_bytes``. It is not done off the training
thread: ``torch.export`` patches ``torch.nn.Module.__call__`` and ``__getattr__`` for every thread
while it traces, so a training step running beside it would be traced too (and on a machine whose
cores training already uses, a second thread would only take their time).

At the dump, :meth:`ProgramCache.embed` re-embeds the cached record when it still fits the
failing step: the same modules (class, ``forward``, training mode), parameters and buffers (FQN,
shape, dtype, device), the same loss function, and every micro-batch of the structure, dtypes and
shapes the program was exported for (a dimension exported as dynamic may differ). Otherwise it
exports now. A failure to export is recorded (the bundle says why), never raised;
the early verification is strict (the step is finite, so its replayed gradients must agree with
the recorded ones in value); where it cannot run (a GradScaler's scaled gradients,
``torch.distributed``'s averaged ones) or does not pass, the dump verifies the program against
the failing step as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch

from ..core.quiet import replay_quiet
from ..core.tree import flatten_typed

logger = logging.getLogger(__name__)

__all__ = ["ProgramCache", "PendingEmbed", "model_signature", "model_kept"]


@contextlib.contextmanager
def model_kept(model: torch.nn.Module) -> Iterator[None]:
    """Whatever the export (or its verifying replay) inside does to ``model``, put back on the way
    out, raised or not: every module's parameter and buffer objects and the tensors behind them
    (``.data``, ``.grad``, ``requires_grad``), its training flag and its forward hooks. A failed
    ``torch.export`` has been seen to leave a wrapper's parameters swapped for its own views (FSDP1's
    flat parameters, on fake tensors: the next step then fails): the training loop must find the
    model exactly as it left it. Cost: one walk over the modules, at the export only."""
    saved = []
    for m in model.modules():
        params = {n: (p, p.data, p.grad, p.requires_grad) for n, p in m._parameters.items() if p is not None}
        saved.append((m, dict(m._parameters), dict(m._buffers), params, m.training, dict(m._forward_hooks), dict(m._forward_pre_hooks)))
    try:
        yield
    finally:
        changed = set()
        for m, param_objs, buffers, params, training, hooks, pre_hooks in saved:
            for attr, before in (("_parameters", param_objs), ("_buffers", buffers), ("_forward_hooks", hooks), ("_forward_pre_hooks", pre_hooks)):
                now = getattr(m, attr)
                if now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()):
                    changed.add(f"{type(m).__name__}.{attr}")
                    now.clear()
                    now.update(before)
            for n, (p, data, grad, req) in params.items():
                if not _same_tensor(p.data, data):
                    changed.add(n)
                    with torch.no_grad():
                        p.data = data
                if p.grad is not grad:
                    p.grad = grad
                if p.requires_grad != req:
                    p.requires_grad_(req)
            if m.training != training:
                m.training = training  # this module only (train() would recurse)
                changed.add(f"{type(m).__name__}.training")
        if changed:
            logger.warning("nanreplay: the program export changed the model (%s); put back as it was", ", ".join(sorted(changed)[:8]))


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b``'s storage, shape, dtype and device (a fake or meta tensor never is)."""
    try:
        return (type(a) is type(b) and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                and a.data_ptr() == b.data_ptr() and a.stride() == b.stride())
    except RuntimeError:  # a tensor without storage
        return False


def model_signature(model: torch.nn.Module, loss_fn: Any) -> tuple:
    """A cheap fingerprint of what an exported program depends on beside its inputs: every
    module's FQN, class, ``forward`` (an instance override included) and training flag; every
    parameter's and buffer's FQN, shape, dtype, device (and ``requires_grad``); the loss function
    object. A walk over the module tree, no tensor read; computed at the export and at the dump."""
    mods = tuple((n, type(m), getattr(type(m), "forward", None), m.__dict__.get("forward"), m.training) for n, m in model.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in model.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype, b.device) for n, b in model.named_buffers())
    return mods, params, bufs, loss_fn


def _inputs_signature(record: Any) -> tuple:
    """The structure, dtypes and shapes of a step's micro-batches and forward calls."""
    def one(tree: Any) -> tuple:
        leaves, _ = flatten_typed(tree)
        return tuple((str(t.dtype), tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t)[:200] for t in leaves)

    return tuple(one(b) for b in record.batches), tuple(one(fw.inputs) for fw in record.forwards)


class ProgramCache:
    """One Recorder's exported program, made early and re-embedded at the dump.

    Args:
        model: the unwrapped model; loss_fn: the Recorder's loss function (or ``None``).
        quiet: a function ``quiet(on: bool)`` that keeps the Recorder's own hooks quiet while
            the export traces the model (``Dump.replaying``).
        max_bytes: the most bytes of program tensors kept between the export and the dump; a
            program holding more is not kept (the dump exports it again).

    Attributes:
        step: the step the cached program was exported at, else ``None``.
        seconds: how long that export (and its verifying replay) took.
        tried: whether :meth:`early` ran (it runs once per Recorder).
        verified: whether the cached program reproduced its step's gradients.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Any, quiet: Callable[[bool], None], *, max_bytes: int = 64 << 20) -> None:
        self.model, self.loss_fn, self._quiet = model, loss_fn, quiet
        self.max_bytes = max_bytes
        self.tried = False
        self.step: Optional[int] = None
        self.seconds: Optional[float] = None
        self._meta: Optional[dict] = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._verified = False
        self._model_sig: Optional[tuple] = None
        self._inputs_sig: Optional[tuple] = None

    @property
    def verified(self) -> bool:
        """Whether the cached program reproduced its own step's gradients (then the dump does not
        replay it again)."""
        return self._verified

    # -- the early export ---------------------------------------------------------------------
    def early(self, rec: Any, grads: Optional[list], state: Callable[[], Any], *, verify: bool) -> None:
        """Export step ``rec``'s program now (once per Recorder), at a finite step whose pre-step
        weights are in the model. ``grads``: the step's ``(fqn, grad)`` pairs; ``state()``: the
        live pre-step state (a :class:`~nanreplay.format.records.Snapshot`); ``verify``: replay
        the step on the program and compare with ``grads`` now (else the dump does it against
        the failing step). Never raises."""
        if self.tried:
            return
        self.tried = True
        if not rec.batches and not rec.forwards:
            return
        if threading.current_thread() is not threading.main_thread():
            # torch.export saves and restores process-wide state (its "inside an export" flag, which
            # makes torch.compile a no-op); exports from two training threads at once were seen to
            # leave it set, so a Recorder on another thread exports only when it dumps
            logger.info("nanreplay: training runs on thread %r, not the main thread: the program is exported when a bundle "
                        "is written, not now", threading.current_thread().name)
            return
        from ..engine.program import program_content
        from ..engine.verify import verify_program

        t0 = time.perf_counter()
        logger.warning("nanreplay: exporting the model's program at step %d, once, so that a failing step only re-embeds it "
                       "(torch.export%s: seconds, longer for large models; Recorder(..., embed_program=False) skips it)",
                       rec.step, " and one verifying replay" if verify else "")
        self._quiet(True)
        try:
            with replay_quiet(), model_kept(self.model):
                meta, tensors = program_content(self.model, rec, self.loss_fn, verify=not verify)  # the replay below loads it
                if verify and meta and meta.get("kind"):
                    snap = state()
                    if rec.buffers is not None:
                        snap.buffers = dict(rec.buffers)  # step-start values, as the bundle holds them
                    content = SimpleNamespace(state=snap, steps=[rec], grads={n: g.detach() for n, g in grads or []}, reason={})
                    # a finite step: the gradients must agree in value, not only in where they are non-finite;
                    # when they do not, the dump verifies the program against the failing step instead
                    differs = verify_program(meta, tensors, content, self.loss_fn, strict=True)
                    if differs:
                        verify = False
                        logger.info("nanreplay: step %d's replay on the exported program: %s; the dump verifies it against the "
                                    "failing step", rec.step, differs)
        except Exception as e:  # noqa: BLE001 - an export must never cost training
            meta, tensors = {"kind": None, "error": f"{type(e).__name__}: {e}"[:2000]}, {}
        finally:
            self._quiet(False)
        self.seconds = time.perf_counter() - t0
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            logger.warning("nanreplay: the program exported at step %d holds %.1f MiB of its own tensors, over the %.0f MiB kept "
                           "between steps: not kept; a failing step exports it again", rec.step, size / 2**20, self.max_bytes / 2**20)
            return
        self.step = rec.step
        self._meta = meta
        self._meta["exported_at_step"] = rec.step
        self._tensors = {k: t.detach().clone() for k, t in tensors.items()}  # not the live tensors: the values at export
        self._verified = bool(verify)
        self._model_sig = model_signature(self.model, self.loss_fn)
        self._inputs_sig = _inputs_signature(rec)
        if meta.get("kind"):
            logger.warning("nanreplay: exported the %s program at step %d in %.1f s (%d KiB of JSON); a failing step re-embeds it",
                           meta["kind"], rec.step, self.seconds, (meta.get("json_bytes") or 0) // 1024)
        else:
            logger.warning("nanreplay: could not export the model's program at step %d (%s); recorded: a bundle will say why, and "
                           "replay will need the model factory; training goes on", rec.step, str(meta.get("error"))[:300])

    # -- at the dump ----------------------------------------------------------------------------
    def fits(self, rec: Any) -> bool:
        """Whether the cached program (or the cached export failure) holds for step ``rec``."""
        if self._meta is None or model_signature(self.model, self.loss_fn) != self._model_sig:
            return False
        kind = self._meta.get("kind")
        if kind is None:  # the same failure is expected for inputs of the same structure and shapes
            return _inputs_signature(rec) == self._inputs_sig
        from ..engine.program import program_accepts

        trees = rec.batches if kind == "loss" else [fw.inputs for fw in rec.forwards]
        if kind == "forward" and self.loss_fn is not None and rec.batches and "loss_error" not in self._meta:
            return False  # exported without a batch; the failing step has one: export the loss too
        return bool(trees) and all(program_accepts(self._meta, t) for t in trees)

    def embed(self, rec: Any, content: Any) -> tuple[Optional[dict], dict[str, torch.Tensor], bool]:
        """``(meta, tensors, verified)`` for the bundle of step ``rec``: the cached program when
        it fits (see :meth:`fits`), else a fresh export (unverified: the caller verifies it
        against ``content``). Never raises."""
        try:
            if self.fits(rec):
                logger.warning("nanreplay: embedding step %d's program: the one exported at step %d fits (same modules, weights' "
                               "shapes, loss function and input shapes), re-embedded without a new export", rec.step, self.step)
                return dict(self._meta), dict(self._tensors), self._verified  # type: ignore[arg-type]
            if self._meta is not None:
                logger.warning("nanreplay: the program exported at step %d does not fit step %d (the model, its modes, the loss "
                               "function or the input shapes changed): exporting again", self.step, rec.step)
        except Exception:  # noqa: BLE001 - a broken cache only costs a new export
            logger.debug("program cache check failed", exc_info=True)
        from ..engine.program import program_content

        logger.warning("nanreplay: embedding step %d's program in the bundle, now that a step failed (torch.export and one "
                       "verifying replay: seconds, longer for large models; Recorder(..., embed_program=False) skips it, and replay "
                       "then needs the model factory)", rec.step)

        with model_kept(self.model):
            meta, tensors = program_content(self.model, rec, self.loss_fn, verify=False)  # the dump's verifying replay loads it
        return meta, tensors, False


class PendingEmbed:
    """:meth:`ProgramCache.embed` (and the verifying replay of a ``"loss"`` program) running on a
    thread of its own while the dump writes the bundle's first version: the export is Python work
    under the GIL, the write mostly I/O, CRCs and the gradients' digests, which release it, so the
    two overlap (at 42M parameters the export and its replay take about as long as that write).
    Safe only while the calling thread runs no module and draws no random number: ``torch.export``
    patches ``torch.nn.Module.__call__`` and ``__getattr__`` for every thread while it traces, and
    the replay sets the process-wide generators (the dump asks for it only when no other thread
    that may draw is alive); the dump joins (:meth:`result`) before anything else touches the
    model, and training does not go on before the dump returns.

    Args:
        cache: the :class:`ProgramCache`; rec, content: the failing step and its bundle content.
        verify: ``verify(meta, tensors) -> why unfaithful or None``, run on the thread after the
            export when the program is of kind ``"loss"`` and not verified yet (it runs no code of
            the user's: only the program and its loss); ``None``: the dump verifies it.

    Attributes:
        checked: whether ``verify`` ran; unfaithful: what it said.
    """

    def __init__(self, cache: ProgramCache, rec: Any, content: Any, verify: Optional[Callable[[dict, dict], Optional[str]]] = None) -> None:
        self._out: Optional[tuple] = None
        self._error: Optional[BaseException] = None
        self.checked = False
        self.unfaithful: Optional[str] = None
        self._thread = threading.Thread(target=self._run, args=(cache, rec, content, verify), name="nanreplay-export", daemon=True)
        self._thread.start()

    def _run(self, cache: ProgramCache, rec: Any, content: Any, verify: Optional[Callable[[dict, dict], Optional[str]]]) -> None:
        try:
            with replay_quiet():  # torch.export's own warnings are about nanreplay's export, not the user's loop
                self._out = meta, tensors, verified = cache.embed(rec, content)
                if verify is not None and meta and meta.get("kind") == "loss" and not verified:
                    self.unfaithful, self.checked = verify(meta, tensors), True
        except BaseException as e:  # noqa: BLE001 - handed to result(), in the dump's thread
            self._error = e

    def join(self) -> None:
        """Wait for the export to end (idempotent)."""
        self._thread.join()

    def result(self) -> tuple[Optional[dict], dict[str, torch.Tensor], bool]:
        """:meth:`ProgramCache.embed`'s ``(meta, tensors, verified)``, once the thread ends.

        Raises:
            Exception: what the export raised (the dump records it in the bundle)."""
        self.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out
