"""Counterfactual replays: the failing step again with one thing changed, to learn what the birth
depends on. Each leaves the model as it found it (weights, dtypes, gradients, the hooks on them).

* :func:`replay_wide`: the whole step in float64 (complex128): weights, buffers and batch upcast,
  and every down-cast the step makes (autocast, ``.half()``, ``.float()``) kept wide by a dispatch
  mode. A birth that disappears there was a precision problem (a value that underflowed to 0, or
  rounded onto a domain boundary, in the narrower dtype).
* :func:`replay_perturbed`: the step with every floating weight nudged by 1% of its spread (seeded,
  from a private generator). A birth that persists does not depend on the exact weights: the batch
  put the op outside its domain (a zero the data carries through the model).
* :func:`replay_redrawn`: the step with its recorded RNG states replaced by other (seeded) ones. A
  birth that disappears was decided by the step's random draws (a dropout mask that drops a whole
  row before a normalisation, a sampled index); one that persists does not depend on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.rng import RNGState
from ..core.tree import map_tensors
from .program import widened_inputs
from .run import StepInputs, run_step

__all__ = ["replay_wide", "replay_perturbed", "replay_redrawn", "birth_signature"]

_WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64, torch.complex64: torch.complex128}
_NARROW = {torch.float16, torch.bfloat16, torch.float32, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2}


@contextlib.contextmanager
def _params_as(model: torch.nn.Module, change: Callable[[torch.Tensor], torch.Tensor], *, buffers: bool) -> Iterator[None]:
    """Within the block the model runs with ``change(t)`` in place of every floating parameter
    (and buffer, with ``buffers``): new leaf tensors (``requires_grad`` as the originals) swapped
    in by module reparametrization, the mechanism of ``torch.func.functional_call``. The live
    parameters are never touched: their data, dtype, gradients and the hooks on their gradient
    accumulators (DDP's, the user's) stay as they are."""
    from torch.nn.utils.stateless import _reparametrize_module

    new: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.is_floating_point() or p.is_complex():
                new[n] = change(p.detach()).detach().requires_grad_(p.requires_grad)
        if buffers:
            for n, b in model.named_buffers():
                if b.is_floating_point() or b.is_complex():
                    new[n] = change(b.detach()).detach()
    inner = getattr(model, "_inner", None)  # a model rebuilt from a program: its graph reads root-level tensors there
    top = {n: t for n, t in new.items() if "." not in n}
    with _reparametrize_module(model, new, tie_weights=True), \
            (_reparametrize_module(inner, top) if isinstance(inner, torch.nn.Module) and top else contextlib.nullcontext()):
        yield


class _KeepWide(TorchDispatchMode):
    """Keeps every float64/complex128 tensor wide: a cast of one to a narrower dtype (autocast,
    ``.half()``, ``.float()``, ``.to(dtype)``) returns it in its wide dtype instead."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
        if name in ("_to_copy", "to", "_autocast_to_reduced_precision") and kwargs.get("dtype") in _NARROW:
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if src is not None and src.dtype in (torch.float64, torch.complex128):
                kwargs["dtype"] = src.dtype
        return func(*args, **kwargs)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(_WIDE.get(t.dtype, t.dtype))


def replay_wide(model: torch.nn.Module, inp: StepInputs, *, device: Optional[torch.device] = None) -> bool:
    """Replay the step in float64 and say whether what it produces (losses, gradients, model
    outputs) is still non-finite. No monitors: one plain replay at float64 speed.

    Raises:
        ReplayError: as :func:`~nanreplay.engine.run.run_step`.
    """
    rec = inp.record
    wide_rec = dataclasses.replace(
        rec,
        batches=[map_tensors(_wide, b) for b in rec.batches],
        forwards=[dataclasses.replace(fw, inputs=map_tensors(_wide, fw.inputs),
                                      cotangent=map_tensors(_wide, fw.cotangent) if fw.cotangent is not None else None) for fw in rec.forwards],
        autocast=None,
    )
    sub = dataclasses.replace(inp, record=wide_rec, recorded_grads={}, scaler=None)
    with _params_as(model, _wide, buffers=True), torch.autocast(device.type if device is not None else "cpu", enabled=False), _KeepWide(), \
            widened_inputs():
        res = run_step(model, sub, ops=False, device=device)
        bad = res.products_nonfinite()
    return bad


def replay_perturbed(model: torch.nn.Module, inp: StepInputs, *, device: Optional[torch.device] = None, scale: float = 1e-2,
                     seed: int = 0, watch: Optional[frozenset] = None, data: bool = False) -> list[tuple]:
    """Replay the step under the op monitor with every floating weight ``w`` replaced by
    ``w + scale * std(w) * noise`` (noise from a private generator seeded with ``seed``), and
    return the signatures (:func:`birth_signature`) of the births that reach what it produces.

    With ``data`` every floating (continuous) leaf of the recorded batches and forward inputs is
    perturbed the same way too, so only the batch's discrete leaves (integer, bool: labels, masks,
    lengths, indices) keep their recorded values: a birth that persists is decided by them.

    With ``watch`` (aten op names, e.g. the origin's op) only those ops are checked, which costs a
    plain replay plus one health read per watched op instead of the full op monitor; every birth
    of a watched op is returned then (whether it reaches the products is not tracked)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def nudge(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t.clone()
        spread = t.detach().float().std() if t.numel() > 1 else t.detach().float().abs()
        spread = spread if bool(torch.isfinite(spread)) and float(spread) > 0 else torch.tensor(1.0)
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device)
        return (t.float() + scale * spread.to(t.device) * noise).to(t.dtype)

    sub = dataclasses.replace(inp, recorded_grads={})
    if data:
        cont = lambda t: nudge(t) if (t.is_floating_point() or t.is_complex()) else t  # noqa: E731
        rec = sub.record
        sub = dataclasses.replace(sub, record=dataclasses.replace(
            rec, batches=[map_tensors(cont, b) for b in rec.batches],
            forwards=[dataclasses.replace(fw, inputs=map_tensors(cont, fw.inputs)) for fw in rec.forwards]))
    with _params_as(model, nudge, buffers=False):
        res = run_step(model, sub, ops=True, device=device, sources=False, watch=watch)  # signatures only: no anomaly-mode stacks
    return _signatures(res, watch)


def other_draws(state: RNGState, seed: int) -> RNGState:
    """RNG states other than ``state`` for every generator it holds: Python's, NumPy's and torch's
    CPU generator seeded with ``seed``, and each CUDA generator it holds (when CUDA is here: a replay
    off CUDA drops them anyway) with ``seed`` plus its index."""
    cuda = ([torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state() for i in range(min(len(state.torch_cuda), torch.cuda.device_count()))]
            if state.torch_cuda and torch.cuda.is_available() else [])
    return RNGState(python=random.Random(seed).getstate(), numpy=np.random.RandomState(seed % 2**32).get_state(),
                    torch_cpu=torch.Generator().manual_seed(seed).get_state(), torch_cuda=cuda)


def replay_redrawn(model: torch.nn.Module, inp: StepInputs, *, device: Optional[torch.device] = None, seed: int = 1,
                   watch: Optional[frozenset] = None) -> list[tuple]:
    """Replay the step under the op monitor with other random draws: the recorded RNG states of
    the step and of each of its forwards replaced by :func:`other_draws` (``seed``, ``seed + 1``...),
    so dropout masks and every other draw of the step differ while the weights and the batch are as
    recorded; returns the signatures of the births, as :func:`replay_perturbed` (``watch``: only
    those aten ops checked, every birth of theirs returned)."""
    rec = inp.record
    forwards = [dataclasses.replace(fw, rng=other_draws(fw.rng, seed + 1 + i) if fw.rng is not None else None)
                for i, fw in enumerate(rec.forwards)]
    sub = dataclasses.replace(inp, recorded_grads={}, record=dataclasses.replace(rec, rng=other_draws(rec.rng, seed), forwards=forwards))
    res = run_step(model, sub, ops=True, device=device, sources=False, watch=watch)
    return _signatures(res, watch)


def _signatures(res: Any, watch: Optional[frozenset]) -> list[tuple]:
    """The signatures of a counterfactual replay's births: with ``watch``, every birth of the
    watched ops (whether it reaches the products is not tracked then); else those that reach
    what the step produces."""
    if watch is not None:
        return [birth_signature(b) for b in res.births]
    reaching = res.reaching or frozenset()
    return [birth_signature(b) for b in res.births if b.get("birth") in reaching]


def birth_signature(b: dict) -> tuple:
    """What identifies a birth across replays: phase, op, autograd node, module."""
    return (b.get("phase"), b.get("op"), b.get("node"), b.get("module"))

