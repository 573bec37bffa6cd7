"""Values for strict JSON (``json.dumps(allow_nan=False)``), defined once for every writer of
nanreplay JSON: bundle metadata, the diagnosis dict, the CLI's ``--json`` output.

Non-finite floats are not JSON; they are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (Python's ``repr``), and read back with :func:`unfnum`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["fnum", "unfnum", "jsonable"]


def fnum(x: Optional[float]) -> Any:
    """A float for strict JSON: non-finite values become the strings ``'nan'``, ``'inf'``,
    ``'-inf'``; ``None`` stays ``None``.

    >>> fnum(1.5), fnum(float("nan")), fnum(None)
    (1.5, 'nan', None)
    """
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def unfnum(x: Any) -> Optional[float]:
    """Inverse of :func:`fnum`.

    Raises:
        ValueError: ``x`` is neither a number, ``None`` nor one of the strings fnum writes.
    """
    return None if x is None else float(x)


def jsonable(v: Any) -> Any:
    """``v`` as strict JSON: floats through :func:`fnum`, tuples and lists element-wise, dicts
    with string keys, tensors as (nested) lists, anything else as its ``repr`` string."""
    import torch

    if isinstance(v, torch.Tensor):
        return jsonable(v.tolist())
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return fnum(v)
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return repr(v)
