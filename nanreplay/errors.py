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
]


class NanReplayError(RuntimeError):
    """Root of every error nanreplay raises on purpose."""


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



class NonFiniteGradientError(NanReplayError):
    """Raised by :class:`nanreplay.Recorder` with ``action="raise"`` (or after too many
    consecutive skips with ``action="skip"``) when a step's gradients or loss are non-finite.

    Attributes:
        step: the failing optimizer step index (0-based count of ``optimizer.step()`` calls seen).
        bundle_path: the bundle written for that step, or ``None`` when the dump failed.
        diagnosis: the in-process replay's diagnosis as a JSON-able dict, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        bundle_path: Optional[str] = None,
        diagnosis: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.bundle_path = bundle_path
        self.diagnosis = diagnosis
