"""What the framework callbacks share: their options and the state every one of them keeps.

A framework callback (Lightning, the Hugging Face Trainer) drives one
:class:`~nanreplay.Recorder` whose ``action`` it manages itself: on the first non-finite step the
update is skipped, the bundle written, and training stopped (``on_nonfinite="stop"``) or the
error raised from the framework's loop (``"raise"``). Imports no framework.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ..capture.recorder import Recorder, RecorderConfig

__all__ = ["RecorderCallbackState", "patch_attribute"]


class RecorderCallbackState:
    """Options and state of a framework callback that drives a Recorder.

    Args:
        on_nonfinite: ``"stop"`` (stop training cleanly) or ``"raise"`` (raise
            :class:`~nanreplay.errors.NonFiniteGradientError` from the framework's loop).
        config: a :class:`~nanreplay.RecorderConfig` for the Recorder (``options`` go on top).
        **options: :class:`~nanreplay.RecorderConfig` fields; not ``action``, which the callback sets.

    Raises:
        ValueError: an unknown ``on_nonfinite``, or ``action`` among ``options``.
    """

    def __init__(self, *, on_nonfinite: str = "stop", config: Optional[RecorderConfig] = None, **options: Any) -> None:
        if on_nonfinite not in ("stop", "raise"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'raise', got {on_nonfinite!r}")
        if "action" in options:
            raise ValueError("action is set by NanReplayCallback (the step is skipped, then training stops); use on_nonfinite='stop' or 'raise'")
        self.on_nonfinite = on_nonfinite
        self._config = config
        self._options = options
        self.recorder: Optional[Recorder] = None
        self.bundle_path: Optional[str] = None

    def log_to(self, found: Any) -> dict:
        """``{"log_to": found}`` when the user chose no ``log_to`` (in ``options`` or ``config``),
        else ``{}``: the trainer's own loggers (``found``, :mod:`nanreplay.capture.trackers`
        objects) are used with no new configuration, and an explicit choice wins."""
        if "log_to" in self._options or (self._config is not None and self._config.log_to is not None) or not found:
            return {}
        return {"log_to": found}

    @property
    def numbers_steps(self) -> bool:
        """Whether the callback numbers the Recorder's steps by the trainer's global step: unless
        the user set ``step_offset`` (as an option or in ``config``)."""
        return "step_offset" not in self._options and (self._config is None or self._config.step_offset == 0)

    def align_steps(self, global_step: int) -> None:
        """Number the Recorder's steps from the trainer's ``global_step`` (the optimizer steps
        done before the Recorder's first, a resumed run's included), so that bundle names
        (``nanreplay-step<N>``), diagnoses and messages use the trainer's step numbers. Only before
        the Recorder's first step, and only when the user did not set ``step_offset``."""
        rec = self.recorder
        if rec is None or not self.numbers_steps or len(rec.ring) or rec.ring.current is not None or rec.step == int(global_step):
            return
        rec.step = int(global_step)
        rec.config = dataclasses.replace(rec.config, step_offset=int(global_step))
        scan = rec.extra_meta.get("attach_scan")
        if isinstance(scan, dict):
            scan["step"] = rec.step


class _Patch:
    """An attribute of one object replaced by a wrapper until :meth:`remove` puts back what was
    there (the instance's own attribute, or none: the class's again). Idempotent."""

    def __init__(self, obj: Any, name: str, wrapper: Callable) -> None:
        self.obj, self.name = obj, name
        self._had = name in vars(obj)
        self._old = vars(obj).get(name)
        setattr(obj, name, wrapper)

    def remove(self) -> None:
        if self.obj is None:
            return
        if self._had:
            setattr(self.obj, self.name, self._old)
        else:
            try:
                delattr(self.obj, self.name)
            except AttributeError:
                pass
        self.obj = None


def patch_attribute(obj: Any, name: str, wrap: Callable[[Callable], Callable]) -> _Patch:
    """Replace ``obj.name`` by ``wrap(obj.name)`` on the instance; the handle's ``remove()`` puts
    back what was there."""
    return _Patch(obj, name, wrap(getattr(obj, name)))
