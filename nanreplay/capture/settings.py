"""The run's side of its configuration (``meta["config"]``, docs/bundle-format.md), read at the dump.

What only the Recorder's objects know, read once per bundle, never per step:

* ``optimizer.param_groups``: each param group's hyper-parameters without its parameters
  (``lr``, ``betas``, ``eps``, ``weight_decay``, ``foreach``, ``fused``, ``capturable``, ...). A
  learning-rate scheduler is not reachable from the optimizer; its effect is the per-step ``lrs``
  every step record already holds.
* ``training.checkpointing``: activation checkpointing that can be seen on the model: the
  submodules with a true ``gradient_checkpointing`` attribute (Hugging Face models after
  ``gradient_checkpointing_enable()``). Modules wrapped by torch's ``checkpoint_wrapper`` are seen
  in ``meta.model.modules`` (their class, ``CheckpointWrapper``); a ``torch.utils.checkpoint``
  call inside a ``forward`` is not detected. Gradient accumulation is not recorded here: each step
  record holds its micro-batches (one forward or ``record()`` each).
* ``distributed``: how gradients are reduced: the DDP comm hooks the loop registered (their import
  paths; nanreplay's own origin hook left out), DDP's or FSDP2's mixed-precision ``param_dtype``
  and ``reduce_dtype``, the process group's backend. The world size is ``meta.world_size``.
* ``data``: one SHA-256 per step the bundle holds, of the bytes of the batches the step recorded
  (or, without ``record()``, of its forward inputs): computed here, at the dump, from the tensors
  the ring buffer holds anyway, so the per-step cost is nothing. Two runs that read the same data
  at a step have the same digest there.

Every value is made to fit the schema (:func:`nanreplay.format.meta.validate_step_meta`): JSON
scalars, short lists, bounded strings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Iterable, Optional

import torch

from ..core.callables import callable_path
from ..core.jsonable import fnum, jsonable
from ..core.tree import flatten_batch
from ..format.records import StepRecord

logger = logging.getLogger(__name__)

__all__ = ["run_config", "data_digest", "optimizer_groups", "checkpointing", "reduce_settings"]

#: bounds the schema holds the record to (format.meta)
_MAX_GROUPS, _MAX_KEYS, _MAX_STR, _MAX_LIST, _MAX_MODULES = 10_000, 64, 512, 16, 256


def _value(v: Any) -> Any:
    """A setting's value as the schema takes it: null, a boolean, an integer, a float (non-finite
    as ``core.jsonable`` writes it), a string of at most 512 characters, or a list of at most 16 of
    these; anything else as its cut text."""
    v = jsonable(v)
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return fnum(v)
    if isinstance(v, list) and len(v) <= _MAX_LIST and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return [x[:_MAX_STR] if isinstance(x, str) else x for x in v]
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s[:_MAX_STR]


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyper-parameters (every key but ``params``), as JSON values."""
    out = []
    for g in optimizer.param_groups[:_MAX_GROUPS]:
        keys = [k for k in g if k != "params" and isinstance(k, str)][:_MAX_KEYS]
        out.append({k[:128]: _value(g[k]) for k in keys})
    return out


def checkpointing(model: torch.nn.Module) -> dict:
    """The activation checkpointing visible on ``model``: ``gradient_checkpointing``, the FQNs of
    the modules whose ``gradient_checkpointing`` attribute is true (Hugging Face), at most 256."""
    on = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True][:_MAX_MODULES]
    return {"gradient_checkpointing": on} if on else {}


def _dtype(x: Any) -> Optional[str]:
    return str(x).replace("torch.", "") if isinstance(x, torch.dtype) else None


def _ddp(wrapper: Any) -> Optional[Any]:
    """The ``DistributedDataParallel`` around the model, looked for through ``torch.compile``'s
    ``_orig_mod`` and Lightning-style ``module`` wrappers (at most 4 deep)."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    m = wrapper
    for _ in range(4):
        if isinstance(m, ddp_type):
            return m
        m = getattr(m, "_orig_mod", None) or getattr(m, "module", None)
        if m is None:
            return None
    return None


def _user_hook(hook: Any) -> Optional[str]:
    """The import path (or name) of the comm hook the loop registered (nanreplay registers none:
    its origin detection works without one, :mod:`nanreplay.capture.ddp`); torch's default
    all-reduce, the hook DDP runs without one, is ``None``."""
    if getattr(hook, "__name__", None) == "allreduce_hook" and str(getattr(hook, "__module__", "")).startswith("torch.distributed"):
        return None
    return str(callable_path(hook) or getattr(hook, "__qualname__", None) or type(hook).__name__)


def reduce_settings(wrapper: Any, model: torch.nn.Module) -> dict:
    """How gradients are reduced across ranks: ``comm_hook`` (the import paths of the DDP comm
    hooks the loop registered), ``param_dtype`` / ``reduce_dtype`` (DDP's
    ``mixed_precision`` or the outermost FSDP2 module's ``MixedPrecisionPolicy``), ``backend`` (the
    default process group's). Empty when the run is not distributed."""
    out: dict[str, Any] = {}
    ddp = _ddp(wrapper)
    if ddp is not None:
        hooks = [_user_hook(h) for h, _ in getattr(ddp, "_comm_hooks", None) or []]
        hooks = [h for h in hooks if h is not None]
        out["comm_hook"] = ", ".join(map(str, hooks))[:_MAX_STR] if hooks else None
        mp = getattr(ddp, "mixed_precision", None)
        if mp is not None:
            out["param_dtype"], out["reduce_dtype"] = _dtype(getattr(mp, "param_dtype", None)), _dtype(getattr(mp, "reduce_dtype", None))
    for m in model.modules():
        state_of = getattr(m, "_get_fsdp_state", None)
        if state_of is None:
            continue
        try:
            mp = getattr(state_of(), "_mp_policy", None)
        except Exception:  # noqa: BLE001 - an FSDP version whose state is laid out otherwise
            mp = None
        if mp is not None:
            out["param_dtype"], out["reduce_dtype"] = _dtype(getattr(mp, "param_dtype", None)), _dtype(getattr(mp, "reduce_dtype", None))
        break
    if out and torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            out["backend"] = str(torch.distributed.get_backend())[:64]
        except Exception:  # noqa: BLE001 - no default group
            pass
    return out


def _leaf_bytes(h: Any, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        to_local = getattr(t, "to_local", None)
        if callable(to_local):  # a DTensor: this rank's shard is what it read
            t = to_local()
        h.update(f"{str(t.dtype)}{list(t.shape)}".encode())
        try:
            h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a layout without plain bytes (sparse, quantized): its text
            h.update(repr(t).encode())
    else:
        h.update(json.dumps(leaf, default=repr, sort_keys=True).encode())


def data_digest(trees: Iterable[Any]) -> str:
    """SHA-256 over ``trees`` (a step's batches or forward inputs) in order: each tree's spec, then
    each leaf: a tensor's dtype, shape and bytes (C order, on the host), any other leaf's JSON (or
    ``repr``). Equal data in equal structure gives equal digests, on any device."""
    h = hashlib.sha256()
    for tree in trees:
        leaves, spec = flatten_batch(tree)
        h.update(spec.encode())
        for leaf in leaves:
            _leaf_bytes(h, leaf)
    return h.hexdigest()


def _data(steps: Iterable[StepRecord]) -> list[dict]:
    rows = []
    for r in steps:
        if r.batches:
            rows.append({"step": r.step, "sha256": data_digest(r.batches), "of": "batches"})
        elif r.forwards:
            rows.append({"step": r.step, "sha256": data_digest(fw.inputs for fw in r.forwards), "of": "inputs"})
    return rows


def run_config(wrapper: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: Iterable[StepRecord]) -> dict:
    """``meta["config"]`` for a bundle of ``steps`` (the ring buffer's, up to the failing one):
    see the module docstring. Each part is read on its own: one that fails is logged and left
    out, never the dump."""
    out: dict[str, Any] = {}
    parts = (("optimizer", lambda: {"param_groups": optimizer_groups(optimizer)}),
             ("training", lambda: {"checkpointing": checkpointing(model)}),
             ("distributed", lambda: reduce_settings(wrapper, model)),
             ("data", lambda: _data(steps)))
    for name, read in parts:
        try:
            value = read()
        except Exception as e:  # noqa: BLE001 - the configuration is informative: the bundle is written without this part
            logger.warning("nanreplay: could not record the run's %s configuration (%s: %s)", name, type(e).__name__, e)
            continue
        if value:
            out[name] = value
    return out
