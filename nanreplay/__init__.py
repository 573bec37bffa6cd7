"""nanreplay: capture-and-replay forensics for non-finite values (NaN, Inf) in PyTorch training.

A :class:`Recorder` keeps a ring buffer of each step's batch, RNG states and learning rate; on
the first non-finite gradient it writes a self-contained bundle (HDF5 or safetensors) and
replays the step to name the module and op where the value was born.

The public names are imported on first use (PEP 562), so ``nanreplay --help`` does not pay for
importing torch. The code is layered (see ``docs/architecture.md``): ``core`` < ``report`` <
``format`` < ``engine`` < ``diagnosis`` < ``capture`` < ``search`` < ``integrations`` < ``cli``;
each package imports only from the ones before it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.version import __version__

_EXPORTS = {
    "Recorder": ".capture.recorder",
    "RecorderConfig": ".capture.recorder",
    "open_bundle": ".format.bundle",
    "write_bundle": ".format.bundle",
    "Bundle": ".format.bundle",
    "trust_bundle": ".format.bundle",
    "untrust_bundle": ".format.bundle",
    "BundleContent": ".format.records",
    "replay": ".diagnosis.api",
    "load_diagnosis": ".diagnosis.api",
    "Diagnosis": ".report.notebook",
    "bisect": ".search.api",
    "NanReplayError": ".errors",
    "BundleFormatError": ".errors",
    "NonFiniteGradientError": ".errors",
    "ModelMismatchError": ".errors",
    "ReplayError": ".errors",
    "UntrustedBundleError": ".errors",
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


if TYPE_CHECKING:  # pragma: no cover
    from .capture.recorder import Recorder, RecorderConfig
    from .diagnosis.api import load_diagnosis, replay
    from .errors import BundleFormatError, ModelMismatchError, NanReplayError, NonFiniteGradientError, ReplayError, UntrustedBundleError
    from .format.bundle import Bundle, open_bundle, trust_bundle, untrust_bundle, write_bundle
    from .format.records import BundleContent
    from .report.notebook import Diagnosis
    from .search.api import bisect
