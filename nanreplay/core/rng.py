"""RNG state as a small object with capture / restore, the way torchsnapshot treats it
(``torchsnapshot/rng_state.py``): one value holding every generator a training step can draw from.

Generators covered:

* Python's ``random`` module (Mersenne Twister, 625 words),
* NumPy's legacy global generator (``np.random.get_state``, MT19937),
* torch's default CPU generator (``torch.get_rng_state``, a uint8 tensor),
* torch's CUDA generators, one per device, captured only when CUDA is already initialised
  (capturing must never initialise CUDA as a side effect).

Capture costs a few microseconds on the host and never synchronises a GPU: the CUDA state
is the Philox seed and offset, kept on the host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

__all__ = ["RNGState"]


@dataclass
class RNGState:
    """Every RNG state one training step may draw from.

    Attributes:
        python: ``random.getstate()`` (version, 625-tuple of ints, gauss_next).
        numpy: ``np.random.get_state()`` as a tuple (name, uint32[624] keys, pos, has_gauss, cached_gaussian).
        torch_cpu: the CPU generator state, a uint8 tensor on the CPU.
        torch_cuda: one uint8 CPU tensor per CUDA device, or empty when CUDA was not initialised.
    """

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls) -> "RNGState":
        """Snapshot every generator now. Never initialises CUDA; never syncs a device."""
        cuda: list[torch.Tensor] = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = list(torch.cuda.get_rng_state_all())
        return cls(
            python=random.getstate(),
            numpy=np.random.get_state(),
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
        )

    def restore(self) -> None:
        """Put every generator back to this state, so the next draw equals the draw that
        followed :meth:`capture`. CUDA states are restored for as many devices as were
        captured and are present now.

        Raises:
            ValueError: a CUDA state was captured but this process has fewer CUDA devices.
        """
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() < len(self.torch_cuda):
                found = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise ValueError(
                    f"the RNG state holds {len(self.torch_cuda)} CUDA generator(s) but this process "
                    f"has {found} CUDA device(s); replay on a machine with at least "
                    f"{len(self.torch_cuda)} GPU(s), or pass --device cpu to replay without them "
                    "(dropout on CUDA will then draw different masks)"
                )
            torch.cuda.set_rng_state_all(self.torch_cuda)

    # -- serialisation: tensors + JSON, never pickle ---------------------------------------

    def to_flat(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Split into tensors (keys under ``prefix``) and a JSON-able dict.

        Tensors: ``{prefix}python`` int64[625], ``{prefix}numpy`` uint32 keys as int64[624],
        ``{prefix}torch_cpu`` uint8, ``{prefix}cuda/{i}`` uint8 per device.
        """
        version, words, gauss_next = self.python
        name, keys, pos, has_gauss, cached = self.numpy
        tensors = {
            f"{prefix}python": torch.tensor(list(words), dtype=torch.int64),
            f"{prefix}numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            f"{prefix}torch_cpu": self.torch_cpu.clone(),
        }
        for i, s in enumerate(self.torch_cuda):
            tensors[f"{prefix}cuda/{i}"] = s.clone()
        meta = {
            "python_version": int(version),
            "python_gauss_next": gauss_next,
            "numpy_name": str(name),
            "numpy_pos": int(pos),
            "numpy_has_gauss": int(has_gauss),
            "numpy_cached_gaussian": float(cached),
            "cuda_devices": len(self.torch_cuda),
        }
        return tensors, meta

    @classmethod
    def from_flat(cls, get: Callable[[str], torch.Tensor], meta: Mapping[str, Any], prefix: str) -> "RNGState":
        """Inverse of :meth:`to_flat`. ``get(key)`` returns a stored tensor. The states are
        checked by restoring them into scratch generators (never the process's own), so a damaged
        state fails here, not in the middle of a replay.

        Raises:
            ValueError: the stored state has the wrong length, dtype or values (hand-edited or
                damaged bundle).
        """
        words = get(f"{prefix}python")
        keys = get(f"{prefix}numpy")
        cpu = get(f"{prefix}torch_cpu")
        if words.shape != (625,) or keys.shape != (624,) or words.dtype != torch.int64 or keys.dtype != torch.int64 or cpu.dtype != torch.uint8 or cpu.dim() != 1:
            raise ValueError(
                f"RNG state under {prefix!r} is malformed: expected python int64[625], numpy int64[624], "
                f"torch_cpu uint8[N]; found {words.dtype} {tuple(words.shape)}, {keys.dtype} {tuple(keys.shape)}, {cpu.dtype} {tuple(cpu.shape)}"
            )
        gauss = meta.get("python_gauss_next")
        if gauss is not None and not isinstance(gauss, (int, float)):
            raise ValueError(f"RNG state under {prefix!r}: python_gauss_next must be a number or null, found {gauss!r}")
        python = (int(meta["python_version"]), tuple(int(w) for w in words.tolist()), None if gauss is None else float(gauss))
        if int(keys.min()) < 0 or int(keys.max()) >= 2**32:
            raise ValueError(f"RNG state under {prefix!r}: the NumPy MT19937 keys must be uint32 values")
        numpy_state = (
            str(meta["numpy_name"]),
            keys.numpy().astype(np.uint32),
            int(meta["numpy_pos"]),
            int(meta["numpy_has_gauss"]),
            float(meta["numpy_cached_gaussian"]),
        )
        cuda = [get(f"{prefix}cuda/{i}") for i in range(int(meta.get("cuda_devices", 0)))]
        if any(c.dtype != torch.uint8 or c.dim() != 1 for c in cuda):
            raise ValueError(f"RNG state under {prefix!r}: CUDA generator states must be 1-D uint8 tensors")
        try:
            random.Random().setstate(python)
            np.random.RandomState().set_state(numpy_state)
            torch.Generator().set_state(cpu)
        except (ValueError, TypeError, OverflowError, RuntimeError) as e:
            raise ValueError(f"RNG state under {prefix!r} cannot be restored: {type(e).__name__}: {e}") from e
        return cls(python=python, numpy=numpy_state, torch_cpu=cpu, torch_cuda=cuda)
