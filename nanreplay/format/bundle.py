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

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ..core.callables import CallablePath, loss_kwargs_names, model_init_names, torch_optimizer_class
from ..core.digest import GradDigest, RecordedGrad, is_digest
from ..core.jsonable import fnum, unfnum
from ..core.rng import RNGState
from ..core.tree import accepted_types, tree_from_flat, tree_to_flat
from ..core.trust import is_trusted, mark_trusted, revoke_trust
from ..errors import BundleFormatError
from .container import FlatBundle, read_flat, write_flat
from .environment import environment
from .meta import MetaError, validate_step_meta
from .program import validate_program_record
from .records import BundleContent, ForwardRecord, Snapshot, StepRecord

__all__ = ["Bundle", "write_bundle", "open_bundle", "trust_bundle", "untrust_bundle", "environment", "Types"]

#: Typed batch node types a reader accepts: dataclass types and namedtuple classes, or a mapping
#: from the recorded ``module:QualName`` to one (see :func:`nanreplay.core.tree.accepted_types`).
Types = Union[Iterable[type], Mapping[str, type], None]


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


def _snapshot_from_flat(get: Callable, meta: dict, prefix: str, types: Types = None) -> Snapshot:
    return Snapshot(
        params={k: get(f"{prefix}params/{k}") for k in meta["params"]},
        buffers={k: get(f"{prefix}buffers/{k}") for k in meta["buffers"]},
        optimizer=_optimizer_from_flat(get, meta, prefix, types),
        extra={n: tree_from_flat(get, m, f"{prefix}extra/{n}/", types=types) for n, m in meta.get("extra", {}).items()},
    )


def _optimizer_from_flat(get: Callable, meta: dict, prefix: str, types: Types) -> Optional[dict]:
    return tree_from_flat(get, meta["optimizer"], f"{prefix}optimizer/", types=types) if meta.get("optimizer") else None


class _LazyOptimizerSnapshot(Snapshot):
    """A bundle's step-start state whose optimizer state (for AdamW, twice the parameters' bytes)
    is read, checksums included, at the first use of :attr:`optimizer`: a replay whose diagnosis
    never replays the optimizer update does not read it (``Bundle.state(lazy_optimizer=True)``).
    Setting :attr:`optimizer` replaces what would have been read."""

    def __init__(self, params: dict, buffers: dict, extra: dict, read_optimizer: Callable[[], Optional[dict]]) -> None:
        Snapshot.__init__(self, params=params, buffers=buffers, optimizer=None, extra=extra)
        self.__dict__["_read_optimizer"] = read_optimizer

    @property  # type: ignore[override]
    def optimizer(self) -> Optional[dict]:
        read = self.__dict__.get("_read_optimizer")
        if read is not None:
            self.__dict__["_optimizer"] = read()
            del self.__dict__["_read_optimizer"]
        return self.__dict__.get("_optimizer")

    @optimizer.setter
    def optimizer(self, value: Optional[dict]) -> None:
        self.__dict__.pop("_read_optimizer", None)
        self.__dict__["_optimizer"] = value


#: the key prefixes of the bundle's own layout (extra tensors go under their own, e.g. ``program/``)
_LAYOUT_PREFIXES = ("state/", "steps/", "grads/", "gradmask/")


def write_bundle(path: str | Path, content: BundleContent, *, fsync: bool = True, trusted: Optional[bool] = None) -> Path:
    """Write ``content`` to one bundle file; the format follows the extension (``.h5``/``.hdf5``
    or ``.safetensors``). The write is atomic (temporary name, then rename) and, with ``fsync``
    (default), durable; see :func:`nanreplay.format.container.write_flat`.

    Args:
        trusted: record the new bundle in this user's trust store, so the code it names
            (factory, loss function, classes) replays without ``--trust``. Default
            ``content.trusted``: true for content the Recorder built in this process, false for
            content read from an untrusted bundle. A failure to record it is logged, not raised.
            A bundle this call overwrites loses its trust entry (its old content is gone).

    Raises:
        ValueError: unknown extension. OSError: the file could not be written.
    """
    replaced = _trusted_digest(path)
    tensors: dict[str, torch.Tensor] = {}
    steps_meta = [_step_to_flat(rec, tensors) for rec in content.steps]
    state_meta = _snapshot_to_flat(content.state, "state/", tensors)
    digests = {}
    for k, g in content.grads.items():
        if is_digest(g):  # a gradient kept as its digest (core.digest): counts, norms, a hash, packed non-finite positions
            digests[k] = g.to_meta()
            tensors.update({f"gradmask/{kind}/{k}": m for kind, m in g.masks.items()})
        else:
            tensors[f"grads/{k}"] = g
    clash = sorted(k for k in content.extra_tensors if k in tensors or k.startswith(_LAYOUT_PREFIXES))
    if clash:
        raise ValueError(f"extra_tensors keys {clash[:5]} collide with the bundle layout; store them under their own prefix (e.g. program/)")
    tensors.update(content.extra_tensors)
    meta = {
        **content.extra_meta,
        "kind": "nanreplay.step",
        "created_unix": time.time(),
        # the recording's environment: a rewrite (Dump.amend, a sharded run's merge) keeps it
        "environment": content.extra_meta["environment"] if isinstance(content.extra_meta.get("environment"), dict) else environment(),
        "failing_step": content.failing_step,
        "reason": content.reason,
        "model": content.model_info,
        "optimizer": content.optimizer_info,
        "model_factory": None if content.model_factory is None else str(content.model_factory),
        "loss_fn": None if content.loss_fn is None else str(content.loss_fn),
        "steps": steps_meta,
        "state": state_meta,
        "grads": [k for k, g in content.grads.items() if not is_digest(g)],
        "diagnosis": content.diagnosis,
    }
    if digests:
        meta["grad_digests"] = digests
    if content.extra_tensors:
        meta["extra_tensors"] = sorted(content.extra_tensors)
    where = {k: p.extras() for k, p in (("model_factory", content.model_factory), ("loss_fn", content.loss_fn)) if isinstance(p, CallablePath) and p.extras()}
    if where:
        meta["callables"] = where  # where each was found when recording: sys.path root, __main__ script
    written = write_flat(path, tensors, meta, fsync=fsync, trusted=content.trusted if trusted is None else trusted)
    if replaced is not None:
        with contextlib.suppress(OSError):
            revoke_trust(replaced)
    return written


def _step_to_flat(rec: StepRecord, tensors: dict[str, torch.Tensor]) -> dict:
    """One step record's tensors into ``tensors`` (keys under ``steps/<step>/``); returns its
    ``meta["steps"]`` entry."""
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
    return {
        "step": rec.step,
        "rng": rng_m,
        "forwards": fwds,
        "batches": batches,
        "training": rec.training,
        "lrs": [fnum(x) for x in rec.lrs],
        "loss": fnum(rec.loss),
        "grad_norm": fnum(rec.grad_norm),
        **({"grad_norm_pre_clip": fnum(rec.grad_norm_pre_clip)} if rec.grad_norm_pre_clip is not None else {}),
        "finite": rec.finite,
        "buffers": bufm,
        "snapshot": snapm,
        "autocast": rec.autocast,
        "scaler_skipped": rec.scaler_skipped,
        "stale_inputs": rec.stale_inputs,
    }


def _trusted_digest(path: str | Path) -> Optional[bytes]:
    """The manifest digest of a trusted bundle already at ``path`` (``None`` when there is none,
    it is unreadable or not trusted): its trust entry goes when the file is overwritten."""
    if not Path(path).is_file():
        return None
    try:
        with open_bundle(path) as b:
            return b._flat.manifest_digest if b.trusted else None
    except (OSError, BundleFormatError):
        return None


def _import_root(kind: str, path: str) -> dict[str, list[str]]:
    """``{"<kind> imported from": [root]}`` when the recorded callable ``path`` carries the
    ``sys.path`` directory its module was imported from when recording (replay adds it to
    ``sys.path`` when the module does not import without it, so it decides which file runs)."""
    root = getattr(path, "root", None)
    return {f"{kind} imported from": [root]} if root else {}


class Bundle:
    """A read-only view of a bundle file; open it with :func:`open_bundle`.

    Reading imports and calls nothing the file names: the metadata is validated against the
    schema (:mod:`nanreplay.format.meta`) when the bundle is opened, tensors are read lazily and
    verified against their CRC-32, and typed batch nodes (namedtuples, dataclasses) come back as
    dicts of their fields unless their type was passed in ``types``. Every method raises
    :class:`~nanreplay.errors.BundleFormatError` when the file contradicts its own manifest.

    Attributes:
        path: the file. format: ``"hdf5"`` or ``"safetensors"``. meta: the validated JSON metadata.
        failing_step: the step whose gradients were non-finite.
    """

    def __init__(self, flat: FlatBundle, *, types: Types = None, trust: bool = False) -> None:
        self._flat = flat
        self.path = flat.path
        self.format = flat.format
        self.meta = flat.meta
        self._types = accepted_types(types)
        self._trust = bool(trust)

        def info(key: str) -> Optional[tuple[torch.dtype, tuple[int, ...]]]:
            if key not in flat:
                return None
            i = flat.info(key)
            return i.dtype, i.shape

        try:
            self._facts = validate_step_meta(self.meta, info)
            if self.meta.get("program") is not None:
                validate_program_record(self.meta["program"], info)
        except MetaError as e:
            raise BundleFormatError(
                f"{self.path}: invalid metadata: expected {e.expected} at {e.where}, found {e.found}; the bundle was "
                "hand-edited, damaged or written by another tool: record it again"
            ) from e
        self.failing_step: int = self.meta["failing_step"]
        self._steps = {s["step"]: s for s in self.meta["steps"]}
        self._state_meta = self.meta["state"]
        self._grad_keys = list(self.meta["grads"])
        self._digest_meta = dict(self.meta.get("grad_digests") or {})

    # -- context manager -------------------------------------------------------------------
    def close(self) -> None:
        self._flat.close()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- trust -----------------------------------------------------------------------------
    @property
    def trusted(self) -> bool:
        """Whether code this bundle names may run: opened with ``trust=True``, or this user's
        trust store holds its manifest (the Recorder wrote it here, or ``nanreplay trust``)."""
        return self._trust or is_trusted(self._flat.manifest_digest)

    def view(self, *, types: Types = None, trust: bool = False) -> "Bundle":
        """A view of the same open file whose reads also rebuild ``types`` and which, with
        ``trust``, is trusted (see :func:`open_bundle`). Closing either closes the file."""
        view = object.__new__(Bundle)
        view.__dict__.update(self.__dict__)
        view._types = {**self._types, **accepted_types(types)}
        view._trust = self._trust or bool(trust)
        return view

    def recorded_types(self, *, inputs_only: bool = True) -> list[str]:
        """The ``module:QualName`` of every typed node the bundle records (nothing is imported).

        Args:
            inputs_only: only those in the steps' batches and forward inputs (what replay feeds
                to the model and loss function); otherwise also cotangents and states.
        """
        out: list[str] = []
        for where, names in self._facts.types.items():
            if inputs_only and not (".batches[" in where or where.endswith(".inputs")):
                continue
            out.extend(n for n in names if n not in out)
        return out

    def named_code(self) -> dict[str, list[str]]:
        """Everything this bundle names that replay would import, by kind (nothing is imported):
        ``model factory`` (and ``model factory imported from``, the recorded directory replay puts
        on ``sys.path`` when the module does not import otherwise; the same for the loss
        function), ``model class (model_init)`` and every import path inside its JSON
        arguments (``imported by the model class (model_init.kwargs.model_class)``: nanreplay's
        own ``model_from_config`` imports the class its ``model_class`` names), ``loss function`` (and
        every import path among its recorded keyword arguments, ``imported by the loss function
        (loss_fn_kwargs.trainer_class)``), ``optimizer class``
        (only when it is not a ``torch.optim`` optimizer, which is looked up without importing
        anything) and ``batch types``."""
        out: dict[str, list[str]] = {}
        if self.model_factory:
            out["model factory"] = [self.model_factory]
            out.update(_import_root("model factory", self.model_factory))
        out.update(model_init_names(self.meta.get("model_init")))
        if self.loss_fn:
            out["loss function"] = [self.loss_fn]
            out.update(_import_root("loss function", self.loss_fn))
            out.update(loss_kwargs_names(self.loss_fn_kwargs))
        opt = (self.meta.get("optimizer") or {}).get("class")
        if opt and torch_optimizer_class(opt) is None:
            out["optimizer class"] = [opt]
        types = self.recorded_types()
        if types:
            out["batch types"] = types
        return out

    # -- access ----------------------------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        """One stored tensor (CPU, exact dtype and bits)."""
        if key not in self._flat:
            raise BundleFormatError(
                f"{self.path}: the metadata refers to tensor {key!r}, which the file does not hold; "
                "the bundle is inconsistent (hand-edited?): record it again"
            )
        return self._flat.get(key)

    def verify(self, key: str) -> None:
        """Check one tensor's CRC-32 without keeping its data (bounded memory)."""
        self._flat.verify(key)

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
        except (KeyError, TypeError, ValueError, IndexError, ArithmeticError, RecursionError, MemoryError) as e:
            raise BundleFormatError(
                f"{self.path}: the {what} data is malformed ({type(e).__name__}: {str(e)[:300]}); "
                "the bundle was hand-edited, damaged or is from an incompatible writer: record it again"
            ) from e

    def _types_for(self, types: Types) -> dict[str, type]:
        return self._types if types is None else {**self._types, **accepted_types(types)}

    def step(self, k: int, *, types: Types = None) -> StepRecord:
        """The ring-buffer record of step ``k``.

        Args:
            types: dataclass / namedtuple types to rebuild typed batch nodes as, on top of those
                given to :func:`open_bundle`; other typed nodes come back as dicts of their fields.

        Raises:
            KeyError: the bundle does not hold step ``k``.
            BundleFormatError: a tensor is damaged or the step's data is malformed.
        """
        if k not in self._steps:
            raise KeyError(f"step {k} is not in {self.path}; it holds steps {self.steps}")
        m = self._steps[k]
        p = f"steps/{k}/"
        get = self.tensor
        ty = self._types_for(types)

        def build() -> StepRecord:
            return StepRecord(
                step=k,
                rng=RNGState.from_flat(get, m["rng"], f"{p}rng/"),
                forwards=[
                    ForwardRecord(
                        inputs=tree_from_flat(get, f["inputs"], f"{p}forward/{i}/inputs/", types=ty),
                        cotangent=tree_from_flat(get, f["cotangent"], f"{p}forward/{i}/cotangent/", types=ty)
                        if f.get("cotangent")
                        else None,
                        rng=RNGState.from_flat(get, f["rng"], f"{p}forward/{i}/rng/") if f.get("rng") else None,
                    )
                    for i, f in enumerate(m["forwards"])
                ],
                batches=[tree_from_flat(get, b, f"{p}batch/{i}/", types=ty) for i, b in enumerate(m["batches"])],
                training=list(m.get("training", [])),
                lrs=[unfnum(x) for x in m["lrs"]],
                loss=unfnum(m.get("loss")),
                grad_norm=unfnum(m.get("grad_norm")),
                grad_norm_pre_clip=unfnum(m.get("grad_norm_pre_clip")),
                finite=m.get("finite"),
                buffers={b: get(f"{p}buffers/{b}") for b in m["buffers"]} if m.get("buffers") is not None else None,
                snapshot=_snapshot_from_flat(get, m["snapshot"], f"{p}snapshot/", ty) if m.get("snapshot") else None,
                autocast=_autocast_meta(m.get("autocast")),
                scaler_skipped=m.get("scaler_skipped"),
                stale_inputs=bool(m.get("stale_inputs", False)),
            )

        return self._guard(f"step {k}", build)

    def input_shapes(self, k: int) -> tuple[list, list]:
        """Step ``k``'s recorded batches and forward-call inputs (``(args, kwargs)``) with every
        tensor a ``meta`` tensor of the stored dtype and shape: the calls' structure and shapes,
        with no tensor data read (typed nodes come back as dicts of their fields).

        Raises:
            KeyError: the bundle does not hold step ``k``.
            BundleFormatError: the step's data is malformed.
        """
        m = self._steps[k]
        p = f"steps/{k}/"

        def get(key: str) -> torch.Tensor:
            if key not in self._flat:
                return self.tensor(key)  # raises BundleFormatError
            i = self._flat.info(key)
            return torch.empty(i.shape, dtype=i.dtype, device="meta")

        return self._guard(f"step {k}", lambda: (
            [tree_from_flat(get, b, f"{p}batch/{i}/") for i, b in enumerate(m["batches"])],
            [tree_from_flat(get, f["inputs"], f"{p}forward/{i}/inputs/") for i, f in enumerate(m["forwards"])]))

    def state(self, *, types: Types = None, lazy_optimizer: bool = False) -> Snapshot:
        """The failing step's pre-step weights, step-start buffers and optimizer state.

        Args:
            lazy_optimizer: read the optimizer state only when the snapshot's ``optimizer`` is
                first used (while this bundle is open; a damaged tensor then raises
                :class:`BundleFormatError` there): a replay that never replays the optimizer
                update skips its bytes (0.35 s of a 42M AdamW bundle's 0.55 s state read).

        Raises:
            BundleFormatError: a tensor is missing, damaged or malformed.
        """
        ty = self._types_for(types)
        meta = self._state_meta
        if not lazy_optimizer or not meta.get("optimizer"):
            return self._guard("state", lambda: _snapshot_from_flat(self.tensor, meta, "state/", ty))
        bare = self._guard("state", lambda: _snapshot_from_flat(self.tensor, dict(meta, optimizer=None), "state/", ty))
        return _LazyOptimizerSnapshot(bare.params, bare.buffers, bare.extra,
                                      lambda: self._guard("optimizer state", lambda: _optimizer_from_flat(self.tensor, meta, "state/", ty)))

    def grads(self) -> dict[str, RecordedGrad]:
        """The gradients the failing step produced, FQN -> tensor, or FQN ->
        :class:`~nanreplay.core.digest.GradDigest` for a gradient the bundle keeps as its digest
        (``Recorder(store_grads=...)``; :attr:`grads_digested` says which)."""
        out: dict[str, RecordedGrad] = {k: self.tensor(f"grads/{k}") for k in self._grad_keys}
        for k, m in self._digest_meta.items():
            out[k] = GradDigest.from_meta(m, {kind: self.tensor(f"gradmask/{kind}/{k}") for kind in m["masks"]})
        return out

    @property
    def grads_digested(self) -> list[str]:
        """FQNs of the gradients the bundle keeps as digests, not values (empty for whole ones)."""
        return list(self._digest_meta)

    def content(self, *, types: Types = None) -> BundleContent:
        """Everything the bundle holds, as the :class:`~nanreplay.format.records.BundleContent`
        that :func:`write_bundle` takes: ``write_bundle(path2, open_bundle(path).content())``
        writes a bundle with the same content (tensors bit-exact, the same metadata but for
        ``created_unix``, which is the new write's; ``environment`` stays the recording's; typed batch nodes
        not rebuilt through ``types`` are written as the dicts they were read as). The content's
        ``trusted`` is this bundle's :attr:`trusted`, so a rewrite keeps an untrusted bundle
        untrusted. Reads every tensor.

        Raises:
            BundleFormatError: the file contradicts its own manifest.
        """
        known = {"kind", "created_unix", "failing_step", "reason", "model", "optimizer",
                 "model_factory", "loss_fn", "steps", "state", "grads", "grad_digests", "diagnosis", "extra_tensors", "callables"}
        return BundleContent(
            failing_step=self.failing_step,
            steps=[self.step(k, types=types) for k in self.steps],
            state=self.state(types=types),
            grads=self.grads(),
            model_info=self.meta.get("model") or {},
            optimizer_info=self.meta.get("optimizer") or {},
            reason=self.meta.get("reason") or {},
            model_factory=self.model_factory,
            loss_fn=self.loss_fn,
            diagnosis=self.diagnosis,
            extra_meta={k: v for k, v in self.meta.items() if k not in known},
            extra_tensors={k: self.tensor(k) for k in self.meta.get("extra_tensors") or []},
            trusted=self.trusted,
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

    @property
    def loss_fn_kwargs(self) -> Optional[dict]:
        """The keyword arguments replay binds to the recorded loss function (``meta["loss_fn_kwargs"]``,
        a JSON object: a ``functools.partial`` recorded by its function and arguments, see
        :func:`nanreplay.core.callables.callable_record`), else ``None``."""
        kw = self.meta.get("loss_fn_kwargs")
        return dict(kw) if isinstance(kw, dict) and kw else None

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


def open_bundle(path: str | Path, *, types: Types = None, trust: bool = False) -> Bundle:
    """Open a bundle read-only. Safe on untrusted files: no pickle, nothing the file names is
    imported or called, memory and time are bounded by the file's size (``docs/security.md``).

    Args:
        path: the bundle; its container is recognised by its first bytes, whatever its name.
        types: dataclass types and namedtuple classes (or a mapping from the recorded
            ``module:QualName`` to one) that typed batch nodes are rebuilt as; any other typed
            node comes back as a dict of its fields. Never imported from the file.
        trust: treat the bundle as trusted for code that replay runs (see :attr:`Bundle.trusted`);
            reading itself never runs code either way.

    Raises:
        FileNotFoundError: no file at ``path``. IsADirectoryError: a directory.
        PermissionError: the file cannot be read.
        BundleFormatError: the file is not a regular file, or is truncated, corrupted, foreign or
            hand-edited (the schema of the manifest and of the metadata is checked here).
        TypeError: ``types`` holds something other than dataclass types and namedtuple classes.
    """
    accepted_types(types)  # a bad argument fails before the file is touched
    flat = read_flat(path)
    try:
        return Bundle(flat, types=types, trust=trust)
    except BaseException:
        flat.close()
        raise


def trust_bundle(path: str | Path) -> dict[str, list[str]]:
    """Record the bundle at ``path`` as trusted in this user's trust store (``nanreplay trust``):
    from now on replay may run the code it names, as long as its manifest is unchanged. Review
    what it names first (:meth:`Bundle.named_code`, ``nanreplay inspect``).

    Returns:
        what the bundle names (:meth:`Bundle.named_code`), now trusted.

    Raises:
        FileNotFoundError, BundleFormatError: as :func:`open_bundle`.
        PermissionError, OSError: the trust store cannot be written or is not private.
    """
    with open_bundle(path) as b:
        mark_trusted(b._flat.manifest_digest, note=str(Path(path).resolve()))
        return b.named_code()


def untrust_bundle(path: str | Path) -> bool:
    """Remove the bundle at ``path`` from this user's trust store; returns whether it was there.

    Raises:
        FileNotFoundError, BundleFormatError: as :func:`open_bundle`.
    """
    with open_bundle(path) as b:
        return revoke_trust(b._flat.manifest_digest)
