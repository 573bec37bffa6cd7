"""The Recorder's options, validated when built (the way torchtitan's ``JobConfig`` validates:
keyword-only dataclass fields, one docstring entry each, a ``__post_init__`` that names the bad value)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["RecorderConfig", "ACTIONS"]

#: what the Recorder does on a non-finite step: the names of :data:`nanreplay.capture.actions.ACTIONS`
ACTIONS = ("raise", "skip", "warn")


@dataclass(kw_only=True)
class RecorderConfig:
    """Options of :class:`Recorder`; every field can also be passed to ``Recorder(...)`` directly.

    Attributes:
        action: what to do on a non-finite step. ``"raise"`` (default): dump, then raise
            :class:`~nanreplay.errors.NonFiniteGradientError` from ``optimizer.step()`` before any
            weight changes. ``"skip"``: dump on the first occurrence, drop this step's gradients so
            the optimizer leaves weights and state untouched, raise after ``max_consecutive``
            consecutive skips. Both put back the step-start buffers (BatchNorm running stats the
            failing forward already wrote). ``"warn"``: dump, log a warning, let the step proceed.
        capacity: steps kept in the ring buffer (>= 1). Each step costs references to its batch
            and cotangents (their bytes count against ``memory_budget``) and ~5 KiB of RNG state.
        snapshot_every: every N steps, copy the step-start weights, buffers and optimizer state
            into the ring buffer (0 = never). Costs one copy of params + optimizer state per
            snapshot (about 3x the parameter bytes for Adam) in time and memory; ``nanreplay
            bisect`` needs it to compare the failing step with an earlier, finite one. The failing
            step's own pre-step state is always saved, at no per-step cost.
        memory_budget: bytes the Recorder may keep alive beyond what training holds anyway, a cap
            in every mode: past steps' batches and forward inputs (a kept reference holds the
            loader's tensor too), cotangents, copied buffers, weight snapshots, the recycled
            snapshot slot, ``check_update``'s pre-step copy and ``check_every``'s latch. Oldest
            snapshots, the spare slot, then oldest steps are evicted to stay within it; the step
            in progress is kept whole, and unchecked steps (``check_every``) are read early
            rather than evicted (``held_bytes()`` says what is held now). A budget below the copy
            ``check_update`` or ``check_every`` needs is refused at construction (``ValueError``
            with the minimum in bytes and MiB); when optimizer state created at its first step
            makes the copy outgrow the budget, that mode is turned off with one warning naming
            the budget it needs (``check_update`` stops; ``check_every`` reads on the host every
            step).
        step_offset: the number of the first step the Recorder sees (the trainer's global step when
            it attaches, e.g. on resuming from a checkpoint), so step numbers in bundles and
            reports are the trainer's, not a count from the Recorder's creation (>= 0).
        out_dir: directory for bundles (created on first dump).
        bundle_format: ``"h5"`` (HDF5) or ``"safetensors"``.
        max_consecutive: with ``action="skip"``, raise after this many consecutive skipped steps.
        max_dumps: bundles written per Recorder (the first non-finite steps), to keep ``warn`` and
            ``skip`` runs from filling the disk.
        diagnose: replay the failing step in process right after detection and store the
            diagnosis in the bundle and the exception message.
        copy_batch: ``None`` (auto: keep references, switch to copies once a batch tensor is seen
            reused or modified in place), ``True`` (always copy), ``False`` (never copy).
        capture_cotangent: keep the gradient w.r.t. the model's outputs (the cotangent: as many
            bytes per step as the model's floating outputs, e.g. 4 x batch x sequence x vocabulary
            bytes for a float32 language model's logits), so a model-only replay works without the
            loss function. ``None`` (default): kept in the ring buffer only when the replay will
            need it, i.e. when the Recorder has no ``loss_fn`` or the step recorded no batch
            (``record``); with both, the replay runs the loss function, and a step's cotangent is
            kept only until the step is checked finite (so the failing step's bundle still has it,
            for a replay whose loss function cannot run, e.g. when only the forward program
            exported). ``True``: kept for every step in the ring buffer; ``False``: never.
        store_grads: what the bundle keeps of the failing step's gradients. ``"auto"``
            (default): their digests (:class:`~nanreplay.core.digest.GradDigest`: NaN/+Inf/-Inf
            counts, the positions of each as packed bits, the finite values' sum, 2-norm, largest
            magnitude and SHA-256; a few hundred bytes plus ``numel / 8`` bytes per kind for a
            gradient that is only partly non-finite) when any gradient is non-finite or the loss
            given to :meth:`Recorder.log_loss` is (a mean over no targets is NaN with zero
            gradients), since the replay recomputes them and the digests say whether it
            reproduced them (exactly, when the hashes agree); the whole gradients when the loss
            and all gradients are finite (an exploding step, a failing optimizer update, a
            spike), whose replay of the update reads them. With digests the bundle is about the
            parameters plus the optimizer state (1.0x fp32 AdamW's training state); whole
            gradients add the parameter bytes again (1.33x).
            ``"full"``: always the whole gradients (the replay's differences are then exact
            values, not a lower bound from the norms). ``"digest"``: always digests. Sharded
            (FSDP2 / DTensor) runs keep whole gradient shards, which ``nanreplay`` puts together.
        check_loss: also check the loss given to :meth:`Recorder.log_loss`.
        check_in_optimizer_step: run the check in the optimizer's step pre-hook (default). Turn it
            off when the loop runs forward and backward *inside* ``optimizer.step(closure)``
            (Lightning does), and call :meth:`Recorder.check_step` where the gradients are ready.
        origin_hook: under ``torch.distributed``, find the rank where a non-finite value was born
            (:mod:`nanreplay.capture.ddp`): with a ``DistributedDataParallel`` model, each rank's
            own gradients are flagged at the end of the backward pass, before DDP copies the reduced
            ones back (no comm hook: yours, e.g. ``fp16_compress_hook``, registered before or after
            the Recorder, runs unchanged), and kept by reference for the bundle; with FSDP2, a
            wrapped reduce-scatter flags the unsharded gradients. ``False`` turns it off: logged
            once, recorded in every bundle (``distributed.detection``), and the origin rank is then
            known only from a rank's own non-finite loss.
        min_scale: with a GradScaler, the floor of the loss scale (default 1: at scale 1 nothing is
            scaled): a skipped step whose gradients are still non-finite after unscaling at a scale
            at or below it (or at or below the scaler's own minimum, when larger) is a failure
            (``scaler_failure: "scale collapsed"``). Skips at a larger, falling scale are routine,
            however many (:mod:`nanreplay.capture.amp`); a non-finite loss is a failure at once.
        max_scaler_skips: with a GradScaler, consecutive skipped steps tolerated at a scale that
            does not fall (a scaler at its own minimum, or with hysteresis that stopped backing
            off); one more is a failure (``"scale stalled"``). Until this version it counted every
            consecutive skip, which failed healthy runs whose scale starts high (Megatron-LM's
            ``init_scale=2**32`` skips about 20 steps in a row); skips at a falling scale no longer
            count, so the same value now only catches a stuck scale. Default 10.
        check_every: read the check's verdict on the host every N steps (1 = every step, one host
            sync per step). With N > 1 the check is sync-free: each step's grad norm (and loss)
            stays a device scalar, copied on CUDA to pinned host memory as it is made, and a
            device-side latch copies the step's pre-step weights, optimizer state tensors and
            gradients into one preallocated slot, with ``torch.where`` under the latch, until a
            non-finite step sets it; from then on the slot is frozen. With a fused optimizer
            (``fused=True``) and ``"raise"`` or ``"skip"`` only the gradients are copied: the
            optimizer gets the latch as its ``found_inf`` (as under a GradScaler) and skips its own
            update from the first non-finite step on. The host reads the verdicts of N steps in the
            optimizer pre-hook of the step after them, before that step's own, so on CUDA it waits
            only for an event that step's queued forward and backward pass follow (no stream
            sync: the device never runs dry), and at :meth:`Recorder.close`. When it finds the
            first non-finite step k, the bundle holds step k's batch, RNG states, learning rates,
            step-start buffers (from the ring buffer, whose unchecked steps are never evicted),
            pre-step weights, optimizer state and gradients (from the slot): the same content as
            with N = 1. What differs: steps k+1 .. up to N later ran on the corrupted (or, frozen,
            on step k's) weights until the host learned of it; ``"raise"`` and ``"skip"`` put the
            weights and optimizer state back to step k's pre-step values (``"skip"`` then goes on
            from there, so the updates of step k and those after it up to the read are dropped),
            ``"warn"`` leaves them. Cost per step: one masked copy of params + optimizer state +
            gradients (read 2x, write 1x; about 4x the parameter bytes for Adam, held once), of
            the gradients alone with a fused optimizer. Worth it where a host sync costs more
            than that copy (GPUs); on CPU a sync is free and N = 1 is cheaper.
        check_update: also check the optimizer update (off by default). Every step, the
            pre-step weights and optimizer state are copied in the step pre-hook (one copy of
            params + optimizer state: about 3x the parameter bytes for Adam, in memory and in
            device copy time per step), and after ``optimizer.step()`` one fused
            ``_foreach_norm`` over the updated parameters and floating optimizer state with one
            host read tells whether the update made them non-finite. Then the pre-step weights and
            state are put back (for ``raise`` and ``skip``; ``warn`` keeps the update), a bundle is
            written with the pre-step state and the (finite) gradients, and the diagnosis replays
            the update to name the parameter and the state key.
        allow_nonfinite: extra allowlist rules for legitimate non-finite values, ``"MODULE:OP"``
            or ``"MODULE:OP:-inf"`` (fnmatch patterns, see :class:`nanreplay.core.allowlist.AllowRule`),
            on top of the default rules for -Inf attention masks; stored in the bundle
            (``meta["replay_options"]``) for later replays.
        diagnose_timeout: seconds the in-process diagnosis may take (``None``: no cap). The
            bundle is written before the diagnosis starts, so a diagnosis cut short loses
            nothing: the bundle then says the diagnosis timed out, and ``nanreplay replay``
            runs it out of process with no cap.
        dump_barrier_timeout: under ``torch.distributed``, seconds every rank waits, after writing
            its bundle, for the others to have written theirs before the action runs (default 300).
            It keeps a rank that raises first from ending the job (``torchrun`` then stops the other
            ranks) while a sibling bundle is still being written. On timeout the rank logs which
            ranks did not finish and goes on.
        embed_program: export the step's forward, and the loss function when one is given, as a
            ``torch.export`` program stored in the bundle (JSON, weights shared with the pre-step
            state, no pickle), so ``nanreplay replay`` needs none of the user's code. Costs the
            export time once (about 1 s for a 4M-parameter model, 15 s for GPT-2 124M on 2 CPU
            cores, see ``bench/README.md``) and a few hundred KiB of JSON; a model that cannot be
            exported is written without it, and the bundle says why.
        export_early: with ``embed_program``, export the program at the first finite step
            (checked with ``check_every=1``), not at the failing one, and keep it
            (:mod:`nanreplay.capture.program_cache`): a failing step then only re-embeds it, unless
            the model, the loss function or the input shapes changed since. ``False`` (default):
            export at the dump only, so a run that never fails never pays the export (seconds at
            start-up: 2-8 s for a 42M-parameter GPT on 2 CPU cores, several plain steps), and the
            failing step pays it instead. The export traces the
            model with fake tensors: forward hooks of yours on the model run once then, seeing
            fake tensors (leave it ``False`` if a hook keeps what it sees). Only a Recorder on the
            main thread exports early: torch.export changes process-wide state while it runs, and
            exports from two training threads at once were seen to leave torch.compile disabled
            for the process; on another thread the export waits for the dump.
        dump_on_explosion: also write a bundle on a step whose gradients are all finite but
            whose 2-norm overflows float32 (an exploding step). By default such a step is
            logged as a warning with the grad-norm history and training goes on; the bundle is
            written at the first truly non-finite gradient, whose history then shows the
            explosion.
        on_spike: what to do when a finite step's loss or grad norm leaves its running band (the
            early warning, :mod:`nanreplay.capture.early`; every spike is listed in
            :attr:`Recorder.spikes`). ``"warn"`` (default): one log line per episode with the
            step, the signal, how far out it is and the rollback plan. ``"dump"``: also write a
            ``nanreplay-spike-step<N>`` bundle (the ring buffer, the step's pre-step state, the
            scalar history) at the first step of each episode, at most ``max_dumps`` of them
            (counted apart from the non-finite bundles), and go on. ``"skip"``: drop the spike
            step's gradients, as ``action="skip"`` does. ``"raise"``: raise
            :class:`~nanreplay.errors.SpikeError` before the update. ``None``: off. Cost: none on
            the device; on the host a few float operations per step on the values the check
            already read. With ``"warn"`` or ``None`` (and no weight snapshots), finite steps are
            judged together, up to 64 steps or 1 s after their own step
            (``nanreplay.capture.recorder.WAIT_STEPS`` / ``WAIT_SECONDS``), and always before anything
            reads the result (a non-finite step, a bundle, :attr:`Recorder.spikes`, the rollback
            plan, ``close()``): the log line names the spike's own step. With ``check_every > 1``,
            judged when the verdicts are read, so a warning
            comes up to ``check_every - 1`` steps later and ``"dump"`` / ``"skip"`` act as ``"warn"``).
        history_steps: steps of scalar history kept (loss, grad norm, learning rates, verdict),
            independent of ``capacity``; about 50 bytes a step on the host, stored in every bundle.
        log_to: the experiment tracker(s) to tell of every bundle written and every spike episode
            (:mod:`nanreplay.capture.trackers`, ``docs/trackers.md``): a TensorBoard
            ``SummaryWriter``, a W&B run, an MLflow run (or the ``mlflow`` module: its active run),
            a Lightning logger, a function ``fn(event)``, or a list of these. Each gets the
            sentence as text, the step, phase, cause and spike score as scalars or tags, and, where
            it keeps artifacts, the bundle (up to 512 MiB) and the HTML report (with the ``report``
            extra). A tracker that fails logs a warning; training goes on. ``None``: none (the
            Lightning and Hugging Face callbacks fill it with the trainer's own loggers).
    """

    action: str = "raise"
    capacity: int = 4
    snapshot_every: int = 0
    memory_budget: int = 2 << 30
    out_dir: Union[str, Path] = "nanreplay_bundles"
    bundle_format: str = "h5"
    max_consecutive: int = 3
    max_dumps: int = 1
    diagnose: bool = True
    copy_batch: Optional[bool] = None
    capture_cotangent: Optional[bool] = None
    store_grads: str = "auto"
    check_loss: bool = True
    check_in_optimizer_step: bool = True
    origin_hook: bool = True
    min_scale: float = 1.0
    max_scaler_skips: int = 10
    check_every: int = 1
    check_update: bool = False
    allow_nonfinite: tuple = ()
    diagnose_timeout: Optional[float] = 120.0
    dump_barrier_timeout: float = 300.0
    embed_program: bool = True
    export_early: bool = False
    dump_on_explosion: bool = False
    on_spike: Optional[str] = "warn"
    history_steps: int = 1024
    step_offset: int = 0
    log_to: Any = None

    def __post_init__(self) -> None:
        from ..core.allowlist import AllowRule

        self.allow_nonfinite = tuple(self.allow_nonfinite)
        for r in self.allow_nonfinite:
            if not isinstance(r, AllowRule):
                AllowRule.parse(str(r))  # raises ValueError naming the bad rule
        from .actions import ACTIONS as table

        if self.action not in table:
            raise ValueError(f"action must be one of {tuple(table)}, got {self.action!r}")
        if isinstance(self.step_offset, bool) or not isinstance(self.step_offset, int) or self.step_offset < 0:
            raise ValueError(f"step_offset must be an int >= 0 (the trainer's global step when the Recorder attaches), got {self.step_offset!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 step, got {self.capacity}")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 = off), got {self.snapshot_every}")
        if self.memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {self.memory_budget}")
        if self.bundle_format not in ("h5", "safetensors"):
            raise ValueError(f"bundle_format must be 'h5' or 'safetensors', got {self.bundle_format!r}")
        if self.store_grads not in ("auto", "full", "digest"):
            raise ValueError(f"store_grads must be 'auto', 'full' or 'digest', got {self.store_grads!r}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.max_scaler_skips < 1:
            raise ValueError(f"max_scaler_skips must be >= 1, got {self.max_scaler_skips}")
        if not self.min_scale >= 0:
            raise ValueError(f"min_scale must be a loss scale >= 0, got {self.min_scale}")
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1 step (1 = check on the host every step), got {self.check_every}")
        if not self.dump_barrier_timeout > 0:
            raise ValueError(f"dump_barrier_timeout must be a number of seconds > 0, got {self.dump_barrier_timeout}")
        from .actions import SPIKE_ACTIONS

        if self.on_spike is not None and self.on_spike not in SPIKE_ACTIONS:
            raise ValueError(f"on_spike must be one of {tuple(SPIKE_ACTIONS)} or None (off), got {self.on_spike!r}")
        if self.history_steps < 0:
            raise ValueError(f"history_steps must be >= 0 steps (0 = no scalar history), got {self.history_steps}")
        if self.log_to is not None:
            from .trackers import resolve

            resolve(self.log_to)  # raises TypeError naming what it found and what it accepts
        if self.diagnose_timeout is not None and not self.diagnose_timeout > 0:
            raise ValueError(f"diagnose_timeout must be a number of seconds > 0, or None for no cap; got {self.diagnose_timeout}")
