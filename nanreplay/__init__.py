"""nanreplay: capture-and-replay forensics for non-finite values (NaN, Inf) in PyTorch training.

A :class:`Recorder` keeps a ring buffer of each step's batch, RNG states and learning rate; on
the first non-finite gradient it writes a self-contained bundle (HDF5 or safetensors) and
replays the step to name the module and op where the value was born.

The public names are imported on first use (PEP 562), so ``nanreplay --help`` does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Recorder": ".recorder",
    "RecorderConfig": ".recorder",
    "open_bundle": ".bundle",
    "write_bundle": ".bundle",
    "Bundle": ".bundle",
    "replay": ".replay",
    "bisect": ".bisect",
    "NanReplayError": ".errors",
    "BundleFormatError": ".errors",
    "NonFiniteGradientError": ".errors",
    "ModelMismatchError": ".errors",
    "ReplayError": ".errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanreplay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


class _Package(types.ModuleType):
    """Keeps ``nanreplay.replay`` / ``nanreplay.bisect`` the public functions: importing the
    submodule of the same name (``import nanreplay.bisect``) makes the import system set the
    package attribute to the module, which would shadow the function behind ``from nanreplay
    import replay``. The submodules stay importable through ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == "." + name and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # pragma: no cover
    from .bundle import Bundle, open_bundle, write_bundle
    from .errors import BundleFormatError, ModelMismatchError, NanReplayError, NonFiniteGradientError, ReplayError
    from .recorder import Recorder, RecorderConfig
    from .bisect import bisect
    from .replay import replay
