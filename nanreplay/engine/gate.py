"""The trust rule for code named by a bundle: nothing a bundle names is imported or called unless
the user named it or trusts the bundle (``docs/security.md``).

A bundle may name a model factory, a model class with JSON arguments (``model_init``), a loss
function, an optimizer class and the types of typed batch nodes. Before replay or bisect runs
anything, :func:`require_trust` lists what the call would import by the bundle's names (the user's
own callables, ``--model-factory`` / ``--loss-fn`` / ``--batch-type``, replace them) and refuses
with :class:`~nanreplay.errors.UntrustedBundleError` when the bundle is not trusted.
``torch.optim`` optimizers are looked up by attribute without importing anything, so they never
need trust. The other helpers resolve the names once the rule has been checked.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

import torch

from ..core.callables import import_callable, model_init_names, torch_optimizer_class
from ..core.tree import accepted_types
from ..errors import ReplayError, UntrustedBundleError
from ..format.bundle import Bundle, Types

logger = logging.getLogger(__name__)

__all__ = ["require_trust", "bundle_types", "recorded_callable", "OptimizerInfo", "resolve_optimizer", "resolved_optimizer_info",
           "live_optimizer_info"]


def require_trust(b: Bundle, *, model: bool, loss: bool, types: Types = None, optimizer: bool = False) -> None:
    """Refuse a call that would run code the untrusted bundle ``b`` names.

    Args:
        b: the bundle (trusted when opened with ``trust=True`` or found in the trust store).
        model: the caller brings its own model or model factory (the recorded ones are not used).
        loss: the caller brings its own loss function, or runs without one.
        types: typed batch node types the caller accepts (the recorded ones it covers are not
            imported).
        optimizer: the call rebuilds the recorded optimizer (``bisect --over steps``); a
            ``torch.optim`` class needs no trust.

    Raises:
        UntrustedBundleError: ``b`` is not trusted and names code the call would run; it lists
            that code and says how to trust the bundle or replace the code.
    """
    if b.trusted:
        return
    needed: dict[str, list[str]] = {}
    code = b.named_code()
    if not model:
        if "model factory" in code:
            needed.update({k: code[k] for k in ("model factory", "model factory imported from") if k in code})
        else:  # the model_init class and every name its JSON arguments hold (model_from_config imports model_class)
            needed.update(model_init_names(b.meta.get("model_init")))
    if not loss and "loss function" in code:
        needed.update({k: v for k, v in code.items() if k in ("loss function", "loss function imported from")
                       or k.startswith("imported by the loss function")})
    if optimizer and "optimizer class" in code:
        needed["optimizer class"] = code["optimizer class"]
    covered = accepted_types(types)
    missing = [t for t in code.get("batch types", []) if t not in covered]
    if missing:
        needed["batch types"] = missing
    if needed:
        raise UntrustedBundleError(b.path, needed)


def bundle_types(b: Bundle, types: Types = None) -> dict[str, type]:
    """The types to read ``b``'s batches with: the caller's, plus, only for a trusted bundle, the
    recorded types it does not cover, imported by name and kept only when they are dataclass types
    or namedtuple classes (a name resolving to any other callable is never used: such nodes stay
    dicts)."""
    out = accepted_types(types)
    if not b.trusted:
        return out
    for name in b.recorded_types(inputs_only=False):
        if name in out:
            continue
        try:
            cls = import_callable(name)
            out.update(accepted_types({name: cls}))
        except (ReplayError, TypeError) as e:
            logger.warning("%s: batch type %s is not rebuilt (%s); its nodes are read as dicts", b.path, name, e)
    return out


def recorded_callable(b: Bundle, kind: str, path: str) -> Callable:
    """Import a callable the bundle names (``kind``: e.g. ``"loss function"``), after checking
    the trust rule again (defence in depth: callers run :func:`require_trust` first).

    Raises:
        UntrustedBundleError: ``b`` is not trusted.
        ReplayError: the path cannot be imported.
    """
    if not b.trusted:
        raise UntrustedBundleError(b.path, {kind: [path]})
    return import_callable(path)


class OptimizerInfo(dict):
    """A bundle's ``meta["optimizer"]`` (a plain dict, JSON as recorded) that also carries the
    optimizer class resolved under the trust rule, as :attr:`resolved`. JSON can never produce
    this type, so a file cannot forge a resolution.

    Args:
        info: the recorded ``meta["optimizer"]``.
        resolver: called once, on the first read of :attr:`resolved` (so a module is imported only
            when the optimizer is actually rebuilt); its ``ReplayError`` or
            ``UntrustedBundleError`` leaves the class unresolved.
    """

    def __init__(self, info: Mapping[str, Any], *, resolver: Optional[Callable[[], type]] = None) -> None:
        super().__init__(info)
        self._resolver = resolver
        self._resolved: Optional[type] = None
        self.error: Optional[Exception] = None  # why the resolver did not resolve it

    @property
    def resolved(self) -> Optional[type]:
        if self._resolver is not None:
            resolver, self._resolver = self._resolver, None
            try:
                self._resolved = resolver()
            except (ReplayError, UntrustedBundleError) as e:
                self.error = e
                logger.info("the recorded optimizer class is not rebuilt: %s", e)
        return self._resolved


def resolve_optimizer(info: Mapping[str, Any], *, trusted: bool, source: str = "the bundle") -> type:
    """The optimizer class ``info["class"]`` names: a ``torch.optim`` optimizer (looked up by
    attribute, no import, no trust needed), a class already resolved by the caller
    (:class:`OptimizerInfo`), or, for a trusted bundle only, any importable optimizer class.

    Raises:
        ReplayError: no class recorded, or the name does not resolve to a
            ``torch.optim.Optimizer`` subclass.
        UntrustedBundleError: the class is not in ``torch.optim`` and the bundle is not trusted.
    """
    resolved = getattr(info, "resolved", None)
    if isinstance(resolved, type) and issubclass(resolved, torch.optim.Optimizer):
        return resolved
    if isinstance(info, OptimizerInfo) and info.error is not None:
        raise info.error  # the caller's resolution already decided (and said why)
    path = info.get("class")
    if not isinstance(path, str) or not path:
        raise ReplayError(f"{source} records no optimizer class; record with a nanreplay.Recorder that saw the optimizer")
    cls = torch_optimizer_class(path)
    if cls is not None:
        return cls
    if not trusted:
        raise UntrustedBundleError(source, {"optimizer class": [path]})
    cls = import_callable(path)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ReplayError(f"{source}: the optimizer class {path!r} names a {type(cls).__name__}, not a torch.optim.Optimizer subclass")
    return cls


def resolved_optimizer_info(b: Bundle) -> Optional[OptimizerInfo]:
    """``b.meta["optimizer"]`` as an :class:`OptimizerInfo` whose class is resolved, when first
    needed, as far as the trust rule allows (else left unresolved: rebuilding it then raises the
    refusal, which the optimizer update check reports instead of running anything)."""
    info = b.meta.get("optimizer")
    if not info:
        return None
    plain, trusted, source = dict(info), b.trusted, str(b.path)
    return OptimizerInfo(info, resolver=lambda: resolve_optimizer(plain, trusted=trusted, source=source))


def live_optimizer_info(info: Optional[Mapping[str, Any]]) -> OptimizerInfo:
    """The Recorder's own ``optimizer_info`` (in the training process): its class is the live
    optimizer's, code this process already runs, so it is resolved as trusted, when first needed."""
    plain = dict(info or {})
    return OptimizerInfo(plain, resolver=(lambda: resolve_optimizer(plain, trusted=True)) if plain.get("class") else None)
