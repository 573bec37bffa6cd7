"""The process's side of a run's configuration (``meta["environment"]``): library versions, the
numerics flags that choose kernels, and the environment variables torch and its libraries read.

:func:`environment` reads them in the process that calls it: the Recorder's, at the dump (a
bundle rewritten later, by ``Dump.amend`` or by the merge of a sharded run, keeps the recording's
record: :func:`nanreplay.format.bundle.write_bundle`), or ``nanreplay diff A --here``'s own. The
run's side (optimizer hyper-parameters, reduce dtypes, activation checkpointing, the digests of
the data each step read) is ``meta["config"]``, which only the Recorder knows
(:mod:`nanreplay.capture.settings`); the two are compared key by key by
:mod:`nanreplay.core.settings` (``nanreplay diff``).

Nothing here imports a library that is not imported already: versions come from the installed
distributions' metadata (:func:`importlib.metadata.version`), and a flag is read only from a
torch module that is loaded. Secrets never reach a bundle: only variables with a prefix of
:data:`VARIABLE_PREFIXES` (or named in :data:`VARIABLE_NAMES`) are recorded at all, and of those,
a variable whose name looks like a credential (:func:`looks_secret`) is recorded with its value
dropped (``null``), and credentials inside a URL value (``scheme://user:password@host``) are cut.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import warnings
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from ..core.version import __version__

__all__ = ["environment", "numerics_flags", "NUMERICS_FLAGS", "library_versions", "recorded_variables", "looks_secret", "LIBRARIES",
           "VARIABLE_PREFIXES", "VARIABLE_NAMES", "SECRET_WORDS", "MAX_VARIABLES", "MAX_VALUE"]

#: the distributions whose versions a bundle records when installed (read from their metadata,
#: never imported): the frameworks around torch whose kernels or defaults change numerics
LIBRARIES = ("triton", "transformers", "lightning", "pytorch-lightning", "accelerate", "deepspeed", "megatron-core", "flash-attn",
             "xformers", "bitsandbytes", "peft", "torchao", "apex", "nvidia-cudnn-cu12", "nvidia-cublas-cu12", "nvidia-nccl-cu12")

#: the environment variables recorded: those torch, its compiler and its libraries read
VARIABLE_PREFIXES = ("TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "PYTORCH_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NCCL_", "CUDA_",
                     "NVIDIA_", "MKL_", "KMP_", "OMP_", "TF32_", "NVTE_")
#: variables recorded by exact name
VARIABLE_NAMES = ("OMP_NUM_THREADS", "NVIDIA_TF32_OVERRIDE", "LD_PRELOAD")

#: a recorded variable whose name holds one of these (upper-cased) is recorded with its value
#: dropped: a token, key, secret, password or credential never reaches a bundle
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASS", "PWD", "CREDENTIAL", "AUTH", "COOKIE", "SESSION", "PRIVATE", "CERT", "SIGNATURE", "SALT")

#: the most variables recorded, and the longest value kept (characters; longer ones are cut)
MAX_VARIABLES = 256
MAX_VALUE = 1024

#: ``scheme://user:password@`` in a value: the credentials part is cut
_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name looks like it holds a credential (one of
    :data:`SECRET_WORDS` in it, any case): ``HF_TOKEN``, ``WANDB_API_KEY``, ``NCCL_AUTH_SECRET``."""
    upper = name.upper()
    return any(w in upper for w in SECRET_WORDS)


def recorded_variables(env: Optional[Mapping[str, str]] = None) -> dict[str, Optional[str]]:
    """The environment variables a bundle records, name -> value (sorted by name): only names with
    a prefix of :data:`VARIABLE_PREFIXES` or in :data:`VARIABLE_NAMES`, at most
    :data:`MAX_VARIABLES`; a name that :func:`looks_secret` maps to ``None`` (its value is never
    read into the record); URL credentials in a value are replaced by ``***``; values are cut to
    :data:`MAX_VALUE` characters.

    >>> recorded_variables({"NCCL_ALGO": "Ring", "HF_TOKEN": "hf_x", "TORCH_API_TOKEN": "t", "HOME": "/h"})
    {'NCCL_ALGO': 'Ring', 'TORCH_API_TOKEN': None}
    """
    env = os.environ if env is None else env
    names = sorted(n for n in env if n.startswith(VARIABLE_PREFIXES) or n in VARIABLE_NAMES)[:MAX_VARIABLES]
    out: dict[str, Optional[str]] = {}
    for n in names:
        if looks_secret(n):
            out[n[:128]] = None
            continue
        out[n[:128]] = _URL_CREDENTIALS.sub(r"\1***@", str(env[n]))[:MAX_VALUE]
    return out


def library_versions() -> dict[str, str]:
    """The installed versions of :data:`LIBRARIES` (only those installed), from their metadata:
    nothing is imported."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = str(importlib.metadata.version(name))[:128]
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - a broken distribution's metadata: not recorded
            continue
    return out


def _read(fn: Callable[[], Any]) -> Any:
    """A flag's value, or ``None`` when this torch does not have it (an older or newer torch
    renamed it); a deprecation warning of the getter is not the user's business."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = fn()
    except Exception:  # noqa: BLE001 - a flag this torch lacks
        return None
    return v if isinstance(v, (bool, int, str)) or v is None else str(v)


#: the numerics flags recorded, name -> how to read it (``None`` when this torch lacks it); the
#: names are those of ``meta.environment.numerics`` and of :data:`nanreplay.core.settings.SETTINGS`
NUMERICS_FLAGS: dict[str, Callable[[], Any]] = {
    "float32_matmul_precision": lambda: torch.get_float32_matmul_precision(),
    "cudnn_tf32": lambda: bool(torch.backends.cudnn.allow_tf32),
    "fp16_reduced_precision_reduction": lambda: bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
    "bf16_reduced_precision_reduction": lambda: bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    "sdpa_flash": lambda: bool(torch.backends.cuda.flash_sdp_enabled()),
    "sdpa_mem_efficient": lambda: bool(torch.backends.cuda.mem_efficient_sdp_enabled()),
    "sdpa_math": lambda: bool(torch.backends.cuda.math_sdp_enabled()),
    "sdpa_cudnn": lambda: bool(torch.backends.cuda.cudnn_sdp_enabled()),
    "cudnn_enabled": lambda: bool(torch.backends.cudnn.enabled),
    "mkldnn_enabled": lambda: bool(torch.backends.mkldnn.enabled),
    "deterministic_warn_only": lambda: bool(torch.is_deterministic_algorithms_warn_only_enabled()),
    "fp32_precision": lambda: torch.backends.fp32_precision,
    "cuda_matmul_fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
    "cudnn_conv_fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,
    "mkldnn_matmul_fp32_precision": lambda: torch.backends.mkldnn.matmul.fp32_precision,
}


def numerics_flags() -> dict[str, Any]:
    """The process's numerics flags that choose kernels or their precision, by
    :data:`NUMERICS_FLAGS` name (those this torch has). Reading them changes nothing."""
    out = {}
    for name, fn in NUMERICS_FLAGS.items():
        v = _read(fn)
        if v is not None:
            out[name] = v
    return out


def _cudnn_version() -> Optional[int]:
    with contextlib.suppress(Exception):
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return int(v) if v is not None else None
    return None


def environment() -> dict:
    """The process's configuration, recorded in every bundle as ``meta["environment"]``
    (``docs/bundle-format.md``): versions (nanreplay, torch, numpy, Python, the platform, CUDA and
    cuDNN, ``libraries``: :func:`library_versions`), ``determinism`` (deterministic algorithms,
    cuDNN deterministic and benchmark, TF32 matmul), ``numerics`` (:func:`numerics_flags`),
    ``num_threads``, and ``variables`` (:func:`recorded_variables`; secrets never). Cost: under 10 ms
    (7 ms on a shared 2-core machine), once per bundle written; a rewrite keeps the record."""
    return {
        "nanreplay": __version__,
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": _cudnn_version(),
        "libraries": library_versions(),
        "determinism": {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "tf32_matmul": _read(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),  # None: torch refuses to read it (mixed TF32 APIs)
        },
        "numerics": numerics_flags(),
        "num_threads": torch.get_num_threads(),
        "variables": recorded_variables(),
    }
