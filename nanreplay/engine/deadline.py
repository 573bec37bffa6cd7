"""A time limit for a replay, checked cooperatively by the monitors (on every op and module) and
between replays, so a diagnosis stops within one op of its limit and leaves the live model as it
found it (the caller's ``finally`` blocks run)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Iterator, Optional

from ..errors import DiagnosisTimeout

__all__ = ["deadline", "check_deadline", "seconds_left", "replay_error"]

_DEADLINE: contextvars.ContextVar[Optional[tuple[float, float]]] = contextvars.ContextVar("nanreplay_deadline", default=None)


@contextlib.contextmanager
def deadline(seconds: Optional[float]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` raises :class:`~nanreplay.errors.DiagnosisTimeout`
    once ``seconds`` have passed (``None``: no deadline). The monitors check it on every op and
    module, so a replay stops within one op of its deadline."""
    token = _DEADLINE.set(None if seconds is None else (time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    """Raise :class:`~nanreplay.errors.DiagnosisTimeout` when the current :func:`deadline` passed."""
    d = _DEADLINE.get()
    if d is not None and time.monotonic() > d[0]:
        raise DiagnosisTimeout(f"the diagnosis ran past its limit of {d[1]:g} s (diagnose_timeout); the bundle holds everything "
                               "needed to run it again: nanreplay replay BUNDLE")


def seconds_left() -> Optional[float]:
    """Seconds until the current :func:`deadline` (``None``: no deadline), for work that can stop
    early with a partial answer rather than run into it (the compiled region's bisection)."""
    d = _DEADLINE.get()
    return None if d is None else d[0] - time.monotonic()


def replay_error(e: BaseException) -> str:
    """What a replay that raised ``e`` reports, ``"Type: message"``; a
    :class:`~nanreplay.errors.DiagnosisTimeout` is raised again instead. The one guard that lets
    the deadline through every ``except Exception`` of a replay the diagnosis can do without::

        try:
            res = run_step(...)
        except Exception as e:
            error = replay_error(e)
    """
    if isinstance(e, DiagnosisTimeout):
        raise e
    return f"{type(e).__name__}: {e}"
