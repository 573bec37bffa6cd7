"""Keeping third-party noise out of nanreplay's own replays.

A replay runs the user's model again, often many times (per-sample replays, counterfactuals,
bisect) and under conditions training never saw (a batch of one sample, float64, torch.export,
torch.compile). Libraries then warn about things that are nanreplay's doing, not the user's:
``std(): degrees of freedom is <= 0`` on a one-sample batch, transformers' cache and deprecation
messages, torch.export / Dynamo / Inductor chatter. :func:`replay_quiet` silences exactly those,
for the duration of the call only: the warnings filters and logger levels are put back on exit,
and everything else (the user's own warnings, nanreplay's log) passes. With nanreplay's logger at
DEBUG (``nanreplay -vv``) nothing is silenced.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["replay_quiet", "quietly", "quiet_loggers", "NOISY_MESSAGES", "NOISY_MODULES", "NOISY_LOGGERS"]

#: warning messages (regular expressions, matched at the start) that a replay provokes
NOISY_MESSAGES: tuple[str, ...] = (
    r".*degrees of freedom is <= 0",                   # std()/var() on the one-sample batches of per-sample replay
    r".*does not have a deterministic implementation",  # replays run with deterministic algorithms (warn_only)
    r"Anomaly Detection has been enabled",               # the op monitor's source lines
    r"Error detected in \w+Backward",                    # anomaly mode's forward traceback of a replayed backward error (nanreplay reports the error itself)
    r".*DynamicCache",                                   # transformers' cache classes re-run under replay
    r".*past_key_values",
    r".*torch\.jit\.script_method. is deprecated",       # imported while torch.export / torch.compile load
    r"You are trying to `self\.log\(\)` but the `self\.trainer` reference is not registered",  # a LightningModule's step replayed without its Trainer
)

#: modules whose warnings a replay silences (regular expressions matched against the warning's module)
NOISY_MODULES: tuple[str, ...] = (
    r"torch\._dynamo(\..*)?", r"torch\._inductor(\..*)?", r"torch\._export(\..*)?", r"torch\.export(\..*)?",
    r"torch\.fx(\..*)?", r"torch\._functorch(\..*)?", r"transformers(\..*)?", r"accelerate(\..*)?",
)

#: loggers set to ERROR for the duration of a replay
NOISY_LOGGERS: tuple[str, ...] = (
    "torch._dynamo", "torch._inductor", "torch._export", "torch.export", "torch.fx", "torch._functorch",
    "transformers", "accelerate",
)


@contextlib.contextmanager
def replay_quiet() -> Iterator[None]:
    """Silence the third-party warnings and log messages of :data:`NOISY_MESSAGES`,
    :data:`NOISY_MODULES` and :data:`NOISY_LOGGERS` inside the block; restore the warnings
    filters and logger levels on exit (also on exceptions). A no-op when the ``nanreplay``
    logger is enabled for DEBUG."""
    if logging.getLogger("nanreplay").isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for msg in NOISY_MESSAGES:
            warnings.filterwarnings("ignore", message=msg)
        for mod in NOISY_MODULES:
            warnings.filterwarnings("ignore", module=mod)
        try:
            for lg in loggers:
                if lg.getEffectiveLevel() < logging.ERROR:
                    lg.setLevel(logging.ERROR)
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...]) -> Iterator[None]:
    """The loggers ``names`` and every logger below them say nothing inside the block (their
    levels, and those of the descendants that set one, are put back on exit). For code whose
    failure nanreplay reports itself in one sentence (torch's deserializer reading a bundle's
    program: its warnings and ``log.exception`` tracebacks would reach the user's stderr). A no-op
    when the ``nanreplay`` logger is enabled for DEBUG."""
    if logging.getLogger("nanreplay").isEnabledFor(logging.DEBUG):
        yield
        return
    manager = logging.Logger.manager
    loggers = [logging.getLogger(n) for n in names]
    loggers += [lg for key, lg in list(manager.loggerDict.items())
                if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET and any(key.startswith(n + ".") for n in names)]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


F = TypeVar("F", bound=Callable[..., Any])


def quietly(fn: F) -> F:
    """``fn`` run under :func:`replay_quiet` (a decorator for nanreplay's replay entry points)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with replay_quiet():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
