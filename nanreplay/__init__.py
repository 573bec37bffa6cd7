"""nanreplay: capture-and-replay forensics for non-finite values (NaN, Inf) in PyTorch training.

A :class:`Recorder` keeps a ring buffer of each step's batch, RNG states and learning rate; on
the first non-finite gradient it writes a self-contained bundle (HDF5 or safetensors) and
replays the step to name the module and op where the value was born.
"""

__version__ = "0.1.0"

from .bundle import Bundle, open_bundle, write_bundle
from .errors import BundleFormatError, ModelMismatchError, NanReplayError, NonFiniteGradientError, ReplayError
from .recorder import Recorder, RecorderConfig
from .replay import replay

__all__ = [
    "Recorder",
    "RecorderConfig",
    "open_bundle",
    "write_bundle",
    "Bundle",
    "replay",
    "NanReplayError",
    "BundleFormatError",
    "NonFiniteGradientError",
    "ModelMismatchError",
    "ReplayError",
]
