"""Bundle files: :func:`write_bundle` writes a :class:`~nanreplay.format.records.BundleContent`
to one file and :func:`open_bundle` opens it again, read-only, as a :class:`Bundle` whose
:meth:`Bundle.content` is what :func:`write_bundle` takes (the pair is symmetric).

A bundle holds everything needed to re-execute one failing optimizer step on another machine:
the ring buffer's steps (batches, forward inputs and output cotangents, RNG states, learning
rates, losses, grad norms), the failing step's pre-step weights, step-start buffers and
optimizer state, the gradients the failing step produced, and the diagnosis. The key-by-key
layout is specified in ``docs/bundle-format.md`` ("Logical layout"); the container (HDF5 or
safetensors, manifest, checksums) is :mod:`nanreplay.format.container`.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import __version__
from ..core.callables import CallablePath
from ..core.jsonable import fnum, unfnum
from ..core.rng import RNGState
from ..core.tree import tree_from_flat, tree_to_flat
from ..errors import BundleFormatError
from .container import FlatBundle, read_flat, write_flat
from .records import BundleContent, ForwardRecord, Snapshot, StepRecord

__all__ = ["Bundle", "write_bundle", "open_bundle", "environment"]


def _snapshot_to_flat(snap: Snapshot, prefix: str, tensors: dict, ) -> dict:
    for k, v in snap.params.items():
        tensors[f"{prefix}params/{k}"] = v
    for k, v in snap.buffers.items():
        tensors[f"{prefix}buffers/{k}"] = v
    meta: dict[str, Any] = {"params": list(snap.params), "buffers": list(snap.buffers)}
    if snap.optimizer is not None:
        t, meta["optimizer"] = tree_to_flat(snap.optimizer, f"{prefix}optimizer/")
        tensors.update(t)
    extra = {}
    for name, sd in snap.extra.items():
        t, extra[name] = tree_to_flat(sd, f"{prefix}extra/{name}/")
        tensors.update(t)
    meta["extra"] = extra
    return meta


def _snapshot_from_flat(get: Callable, meta: dict, prefix: str) -> Snapshot:
    return Snapshot(
        params={k: get(f"{prefix}params/{k}") for k in meta["params"]},
        buffers={k: get(f"{prefix}buffers/{k}") for k in meta["buffers"]},
        optimizer=tree_from_flat(get, meta["optimizer"], f"{prefix}optimizer/") if meta.get("optimizer") else None,
        extra={n: tree_from_flat(get, m, f"{prefix}extra/{n}/") for n, m in meta.get("extra", {}).items()},
    )


def environment() -> dict:
    """Versions and determinism flags, recorded in every bundle."""
    return {
        "nanreplay": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "determinism": {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        },
        "num_threads": torch.get_num_threads(),
    }


def write_bundle(path: str | Path, content: BundleContent, *, fsync: bool = True) -> Path:
    """Write ``content`` to one bundle file; the format follows the extension (``.h5``/``.hdf5``
    or ``.safetensors``). The write is atomic (temporary name, then rename) and, with ``fsync``
    (default), durable; see :func:`nanreplay.format.container.write_flat`.

    Raises:
        ValueError: unknown extension. OSError: the file could not be written.
    """
    tensors: dict[str, torch.Tensor] = {}
    steps_meta = []
    for rec in content.steps:
        p = f"steps/{rec.step}/"
        rng_t, rng_m = rec.rng.to_flat(f"{p}rng/")
        tensors.update(rng_t)
        fwds = []
        for i, fw in enumerate(rec.forwards):
            t, im = tree_to_flat(fw.inputs, f"{p}forward/{i}/inputs/")
            tensors.update(t)
            cm = None
            if fw.cotangent is not None:
                t, cm = tree_to_flat(fw.cotangent, f"{p}forward/{i}/cotangent/")
                tensors.update(t)
            rm = None
            if fw.rng is not None:
                t, rm = fw.rng.to_flat(f"{p}forward/{i}/rng/")
                tensors.update(t)
            fwds.append({"inputs": im, "cotangent": cm, "rng": rm})
        batches = []
        for i, b in enumerate(rec.batches):
            t, bm = tree_to_flat(b, f"{p}batch/{i}/")
            tensors.update(t)
            batches.append(bm)
        bufm = None
        if rec.buffers is not None:
            bufm = list(rec.buffers)
            for k, v in rec.buffers.items():
                tensors[f"{p}buffers/{k}"] = v
        snapm = _snapshot_to_flat(rec.snapshot, f"{p}snapshot/", tensors) if rec.snapshot is not None else None
        steps_meta.append(
            {
                "step": rec.step,
                "rng": rng_m,
                "forwards": fwds,
                "batches": batches,
                "training": rec.training,
                "lrs": [fnum(x) for x in rec.lrs],
                "loss": fnum(rec.loss),
                "grad_norm": fnum(rec.grad_norm),
                "finite": rec.finite,
                "buffers": bufm,
                "snapshot": snapm,
                "autocast": rec.autocast,
                "scaler_skipped": rec.scaler_skipped,
                "stale_inputs": rec.stale_inputs,
            }
        )
    state_meta = _snapshot_to_flat(content.state, "state/", tensors)
    for k, g in content.grads.items():
        tensors[f"grads/{k}"] = g
    clash = sorted(k for k in content.extra_tensors if k in tensors)
    if clash:
        raise ValueError(f"extra_tensors keys {clash[:5]} collide with the bundle layout; store them under their own prefix (e.g. program/)")
    tensors.update(content.extra_tensors)
    meta = {
        **content.extra_meta,
        "kind": "nanreplay.step",
        "created_unix": time.time(),
        "environment": environment(),
        "failing_step": content.failing_step,
        "reason": content.reason,
        "model": content.model_info,
        "optimizer": content.optimizer_info,
        "model_factory": None if content.model_factory is None else str(content.model_factory),
        "loss_fn": None if content.loss_fn is None else str(content.loss_fn),
        "steps": steps_meta,
        "state": state_meta,
        "grads": list(content.grads),
        "diagnosis": content.diagnosis,
    }
    if content.extra_tensors:
        meta["extra_tensors"] = sorted(content.extra_tensors)
    where = {k: p.extras() for k, p in (("model_factory", content.model_factory), ("loss_fn", content.loss_fn)) if isinstance(p, CallablePath) and p.extras()}
    if where:
        meta["callables"] = where  # where each was found when recording: sys.path root, __main__ script
    return write_flat(path, tensors, meta, fsync=fsync)


class Bundle:
    """A read-only view of a bundle file; open it with :func:`open_bundle`.

    Tensors are read lazily and verified against their CRC-32. Every method raises
    :class:`~nanreplay.errors.BundleFormatError` when the file contradicts its own manifest.

    Attributes:
        path: the file. format: ``"hdf5"`` or ``"safetensors"``. meta: the JSON metadata.
        failing_step: the step whose gradients were non-finite.
    """

    def __init__(self, flat: FlatBundle) -> None:
        self._flat = flat
        self.path = flat.path
        self.format = flat.format
        self.meta = flat.meta
        try:
            if self.meta.get("kind") != "nanreplay.step":
                raise KeyError("kind")
            self.failing_step = int(self.meta["failing_step"])
            self._steps = {int(s["step"]): s for s in self.meta["steps"]}
            self._state_meta = self.meta["state"]
            self._grad_keys = list(self.meta["grads"])
        except (KeyError, TypeError, ValueError) as e:
            raise BundleFormatError(
                f"{self.path}: the metadata lacks or mangles the field {e}; expected a step bundle written by "
                "nanreplay.Recorder. The file was hand-edited or written by another tool: record it again."
            ) from e

    # -- context manager -------------------------------------------------------------------
    def close(self) -> None:
        self._flat.close()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- access ----------------------------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        """One stored tensor (CPU, exact dtype and bits)."""
        if key not in self._flat:
            raise BundleFormatError(
                f"{self.path}: the metadata refers to tensor {key!r}, which the file does not hold; "
                "the bundle is inconsistent (hand-edited?): record it again"
            )
        return self._flat.get(key)

    def keys(self) -> list[str]:
        return self._flat.keys()

    def info(self, key: str):
        return self._flat.info(key)

    @property
    def steps(self) -> list[int]:
        """Step indices held, oldest first."""
        return sorted(self._steps)

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BundleFormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BundleFormatError(
                f"{self.path}: the {what} metadata is malformed ({type(e).__name__}: {e}); "
                "the bundle was hand-edited or is from an incompatible writer: record it again"
            ) from e

    def step(self, k: int) -> StepRecord:
        """The ring-buffer record of step ``k`` (KeyError if the bundle does not hold it)."""
        if k not in self._steps:
            raise KeyError(f"step {k} is not in {self.path}; it holds steps {self.steps}")
        m = self._steps[k]
        p = f"steps/{k}/"
        get = self.tensor

        def build() -> StepRecord:
            return StepRecord(
                step=k,
                rng=RNGState.from_flat(get, m["rng"], f"{p}rng/"),
                forwards=[
                    ForwardRecord(
                        inputs=tree_from_flat(get, f["inputs"], f"{p}forward/{i}/inputs/"),
                        cotangent=tree_from_flat(get, f["cotangent"], f"{p}forward/{i}/cotangent/")
                        if f.get("cotangent")
                        else None,
                        rng=RNGState.from_flat(get, f["rng"], f"{p}forward/{i}/rng/") if f.get("rng") else None,
                    )
                    for i, f in enumerate(m["forwards"])
                ],
                batches=[tree_from_flat(get, b, f"{p}batch/{i}/") for i, b in enumerate(m["batches"])],
                training=list(m.get("training", [])),
                lrs=[unfnum(x) for x in m["lrs"]],
                loss=unfnum(m.get("loss")),
                grad_norm=unfnum(m.get("grad_norm")),
                finite=m.get("finite"),
                buffers={b: get(f"{p}buffers/{b}") for b in m["buffers"]} if m.get("buffers") is not None else None,
                snapshot=_snapshot_from_flat(get, m["snapshot"], f"{p}snapshot/") if m.get("snapshot") else None,
                autocast=_autocast_meta(m.get("autocast")),
                scaler_skipped=m.get("scaler_skipped"),
                stale_inputs=bool(m.get("stale_inputs", False)),
            )

        return self._guard(f"step {k}", build)

    def state(self) -> Snapshot:
        """The failing step's pre-step weights, step-start buffers and optimizer state."""
        return self._guard("state", lambda: _snapshot_from_flat(self.tensor, self._state_meta, "state/"))

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the failing step produced, FQN -> tensor."""
        return {k: self.tensor(f"grads/{k}") for k in self._grad_keys}

    def content(self) -> BundleContent:
        """Everything the bundle holds, as the :class:`~nanreplay.format.records.BundleContent`
        that :func:`write_bundle` takes: ``write_bundle(path2, open_bundle(path).content())``
        writes a bundle with the same content (tensors bit-exact, the same metadata but for
        ``created_unix`` and ``environment``, which describe the new write). Reads every tensor.

        Raises:
            BundleFormatError: the file contradicts its own manifest.
        """
        known = {"kind", "created_unix", "environment", "failing_step", "reason", "model", "optimizer",
                 "model_factory", "loss_fn", "steps", "state", "grads", "diagnosis", "extra_tensors", "callables"}
        return BundleContent(
            failing_step=self.failing_step,
            steps=[self.step(k) for k in self.steps],
            state=self.state(),
            grads=self.grads(),
            model_info=self.meta.get("model") or {},
            optimizer_info=self.meta.get("optimizer") or {},
            reason=self.meta.get("reason") or {},
            model_factory=self.model_factory,
            loss_fn=self.loss_fn,
            diagnosis=self.diagnosis,
            extra_meta={k: v for k, v in self.meta.items() if k not in known},
            extra_tensors={k: self.tensor(k) for k in self.meta.get("extra_tensors") or []},
        )

    @property
    def diagnosis(self) -> Optional[dict]:
        return self.meta.get("diagnosis")

    @property
    def model_factory(self) -> Optional[str]:
        """The recorded factory's import path; a :class:`~nanreplay.core.callables.CallablePath`
        carrying its recorded ``sys.path`` root / ``__main__`` script when the bundle has them."""
        return self._callable("model_factory")

    @property
    def loss_fn(self) -> Optional[str]:
        """The recorded loss function's import path (see :attr:`model_factory`)."""
        return self._callable("loss_fn")

    def _callable(self, key: str) -> Optional[str]:
        path = self.meta.get(key)
        extras = (self.meta.get("callables") or {}).get(key) if isinstance(self.meta.get("callables"), dict) else None
        return CallablePath.of(path, extras) if isinstance(path, str) else path


_AUTOCAST_DTYPES = ("float16", "bfloat16", "float32")


def _autocast_meta(m: Any) -> Optional[dict]:
    """Validate a step's ``autocast`` entry (untrusted input): None, or a device type and one of
    the autocast dtypes."""
    if m is None:
        return None
    if not isinstance(m, dict) or not isinstance(m.get("device_type"), str) or m.get("dtype") not in _AUTOCAST_DTYPES:
        raise ValueError(f"autocast entry {m!r}: expected {{'device_type': str, 'dtype': one of {_AUTOCAST_DTYPES}}}")
    return {"device_type": m["device_type"], "dtype": m["dtype"]}


def open_bundle(path: str | Path) -> Bundle:
    """Open a bundle read-only. Loading is safe on untrusted files: no pickle, no code runs.

    Raises:
        FileNotFoundError: no file at ``path``.
        BundleFormatError: the file is truncated, corrupted, foreign or hand-edited.
    """
    flat = read_flat(path)
    try:
        return Bundle(flat)
    except BaseException:
        flat.close()
        raise
