"""The exceptions nanreplay raises.

One root, :class:`NanReplayError` (a :class:`RuntimeError`), and a few specific subclasses.
Builtins (``FileNotFoundError``, ``TypeError``, ``ValueError``) are used where they already fit.
Every message says what was expected, what was found, and how to fix it.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "NanReplayError",
    "BundleFormatError",
    "NonFiniteGradientError",
    "ModelMismatchError",
    "ReplayError",
    "DiagnosisTimeout",
    "MissingExtraError",
    "UntrustedBundleError",
    "SandboxError",
    "SandboxUnavailableError",
    "SpikeError",
]


class NanReplayError(RuntimeError):
    """Root of every error nanreplay raises on purpose.

    ``str(e)`` says the fix in Python terms (``verify=False``); an error whose fix reads
    differently on the command line carries the CLI wording too (:meth:`with_cli_fix`), and
    :meth:`describe` picks one. The CLI always prints ``describe(cli=True)``.
    """

    _cli_fix: Optional[tuple[str, str]] = None

    def with_cli_fix(self, python: str, cli: str) -> "NanReplayError":
        """Say ``cli`` instead of ``python`` (a part of the message) to command-line users; returns
        ``self``, for ``raise BundleFormatError(...).with_cli_fix(...)``."""
        self._cli_fix = (python, cli)
        return self

    def describe(self, *, cli: bool) -> str:
        """The message in the caller's terms: CLI commands and flags (``cli=True``) or Python
        keywords."""
        msg = str(self)
        if cli and self._cli_fix is not None:
            return msg.replace(*self._cli_fix)
        return msg


class BundleFormatError(NanReplayError):
    """A file is not a readable nanreplay bundle: truncated, corrupted, hand-edited, foreign,
    or written by an incompatible format version. Raised by :func:`nanreplay.open_bundle`
    instead of any raw h5py / safetensors / json error (the original is chained as ``__cause__``).
    """


class ModelMismatchError(NanReplayError):
    """The model (or optimizer) given to replay does not match what the bundle recorded:
    missing or unexpected parameter FQNs, or a shape / dtype that differs."""


class ReplayError(NanReplayError):
    """Replay could not run: a model factory or loss function could not be imported or called,
    or the bundle lacks what the requested replay needs (for example no batch was recorded)."""


class DiagnosisTimeout(ReplayError):
    """A replay or diagnosis ran past the time it was given (``RecorderConfig.diagnose_timeout``
    for the Recorder's in-process diagnosis). The bundle is written before the diagnosis starts,
    so nothing is lost: ``nanreplay replay BUNDLE`` runs it again without a cap."""


class MissingExtraError(NanReplayError):
    """An optional dependency is not installed (e.g. matplotlib for the HTML report). The message
    names the ``pip install 'nanreplay[EXTRA]'`` that fixes it.

    Attributes:
        extra: the extra to install (``"report"``).
    """

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra

class UntrustedBundleError(NanReplayError):
    """Replay (or bisect) would run code that a bundle names, and the bundle is not trusted.

    A bundle is trusted when this user's Recorder wrote it on this machine, or after
    ``nanreplay trust BUNDLE`` / :func:`nanreplay.trust_bundle`; for one call, ``trust=True``
    (``--trust``) trusts it too. Nothing was imported or called when this is raised.

    Attributes:
        path: the bundle file.
        names: what the bundle names that the call would import, e.g.
            ``{"model factory": ["pkg.models:make"], "batch types": ["pkg.data:Batch"]}``.
    """

    def __init__(self, path: Any, names: dict[str, list[str]]) -> None:
        self.path = str(path)
        self.names = {k: list(v) for k, v in names.items() if v}
        super().__init__(self.describe(cli=False))

    def listing(self) -> str:
        """The names, as ``model factory 'a:b'; loss function 'c:d'``: each by ``ascii()``, so a
        look-alike or invisible character shows as its escape (``'model\\u2024py:make'``)."""
        return "; ".join(f"{kind} " + ", ".join(ascii(n) for n in names) for kind, names in self.names.items())

    def describe(self, *, cli: bool) -> str:
        """The message in the caller's terms: CLI flags (``cli=True``) or Python keywords."""
        head = (
            f"{self.path}: refused: the bundle is not trusted and names code that would run: {self.listing()}. "
            "Code named by a bundle runs only when you name it yourself or trust the bundle (docs/security.md); "
        )
        if cli:
            return head + (
                f"review the names above, then run `nanreplay trust {self.path}` (or add --trust to this command), "
                "or name your own code with --model-factory, --loss-fn (or --no-loss-fn) and --batch-type"
            )
        return head + (
            "review the names above, then pass trust=True (or call nanreplay.trust_bundle(path) once), "
            "or pass your own model= / model_factory=, loss_fn= (or use_loss_fn=False) and batch_types="
        )


class SandboxError(ReplayError):
    """The sandboxed replay of an untrusted bundle's embedded program (``docs/security.md``, "The
    sandbox") ended without a result: the child process died of a signal or a resource limit, ran
    past its time limit, or sent something other than a result. The message is one sentence;
    nothing outside the sandbox was touched."""


class SandboxUnavailableError(UntrustedBundleError):
    """An untrusted bundle's embedded program may run only inside nanreplay's sandbox, and this
    machine cannot run it (not Linux, no ``pyseccomp`` or libseccomp, a kernel without seccomp).
    Nothing was run; trusting the bundle (after review) runs the program in this process.

    Attributes:
        path: the bundle file. reason: why the sandbox is unavailable.
    """

    def __init__(self, path: Any, reason: str) -> None:
        self.reason = reason
        super().__init__(path, {})

    def describe(self, *, cli: bool) -> str:
        head = (f"{self.path}: refused: the bundle is not trusted, and its embedded program runs only inside nanreplay's sandbox, "
                f"which this machine cannot run ({self.reason}); ")
        if cli:
            return head + (f"review `nanreplay inspect {self.path}`, then pass --trust to run the program in this process, "
                           "or replay with your own code: --model-factory")
        return head + "review nanreplay.open_bundle(path), then pass trust=True to run it in this process, or pass your own model_factory="


class NonFiniteGradientError(NanReplayError):
    """Raised by :class:`nanreplay.Recorder` with ``action="raise"`` (or after too many
    consecutive skips with ``action="skip"``) when a step's gradients or loss are non-finite.

    Attributes:
        step: the failing optimizer step index (0-based count of ``optimizer.step()`` calls seen).
        bundle_path: the bundle written for that step, or ``None`` when the dump failed.
        diagnosis: the in-process replay's diagnosis as a JSON-able dict, or ``None``.
        rollback: the rollback plan (``Recorder.rollback_plan()``: the episode, the restore
            point, the steps to skip) when the Recorder gave up after ``max_consecutive`` skips,
            else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        bundle_path: Optional[str] = None,
        diagnosis: Optional[dict[str, Any]] = None,
        rollback: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.bundle_path = bundle_path
        self.diagnosis = diagnosis
        self.rollback = rollback


class SpikeError(NanReplayError):
    """Raised by :class:`nanreplay.Recorder` with ``on_spike="raise"`` when the loss or the grad
    norm leaves its running band (:mod:`nanreplay.capture.early`), before the step's update.

    Attributes:
        step: the step (0-based count of ``optimizer.step()`` calls seen).
        spikes: its spike rows (``{"step", "signal", "kind", "value", "baseline", "score", ...}``).
        rollback: the rollback plan (``{"restore_step", "source", "skip_steps", ...}``), or ``None``.
    """

    def __init__(self, message: str, *, step: int, spikes: list, rollback: Optional[dict] = None) -> None:
        super().__init__(message)
        self.step = step
        self.spikes = list(spikes)
        self.rollback = rollback
