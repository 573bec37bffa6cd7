"""Delta debugging: the smallest failing subset of a configuration (Zeller and Hildebrandt,
"Simplifying and Isolating Failure-Inducing Input", IEEE TSE 28(2), 2002).

Pure: no torch, no replays. ``--over layers`` runs it over layers, ``--over samples`` over the
samples of a batch.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator, Sequence, TypeVar

__all__ = ["ddmin"]

T = TypeVar("T", bound=Hashable)


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """The 1-minimal failing subset of ``items`` by delta debugging.

    Args:
        items: the full configuration, which must fail (``fails(list(items))`` is True). Order is
            kept: chunks are contiguous, so a single culprit is found in about
            ``2 * log2(len(items))`` calls.
        fails: ``fails(subset) -> bool``, True when the subset alone still shows the failure.
            Results are cached by subset, so no subset is tested twice. An exception propagates
            (callers use it to stop at a replay budget).

    Returns:
        a failing subset, in the order of ``items``, from which no single element can be removed
        (1-minimal), when ``fails`` is monotone; in general a small failing subset.

    Example::

        >>> ddmin(list(range(32)), lambda s: 19 in s)
        [19]
    """
    cache: dict[frozenset, bool] = {}

    def test(sub: list[T]) -> bool:
        key = frozenset(sub)
        if key not in cache:
            cache[key] = bool(fails(sub))
        return cache[key]

    c = list(items)
    n = 2
    while len(c) >= 2:
        chunks = _chunks(c, n)
        reduced = next((ch for ch in chunks if test(ch)), None)  # reduce to a subset
        if reduced is not None:
            c, n = reduced, 2
            continue
        if len(chunks) > 2:  # reduce to a complement
            reduced = next((comp for comp in _complements(chunks) if test(comp)), None)
            if reduced is not None:
                c, n = reduced, max(n - 1, 2)
                continue
        if n >= len(c):
            break
        n = min(2 * n, len(c))  # finer chunks
    return c


def _chunks(c: list[T], n: int) -> list[list[T]]:
    """``c`` cut into ``n`` contiguous chunks of near-equal size (no empty chunk)."""
    bounds = [round(i * len(c) / n) for i in range(n + 1)]
    return [c[bounds[i] : bounds[i + 1]] for i in range(n) if bounds[i] < bounds[i + 1]]


def _complements(chunks: list[list[T]]) -> Iterator[list[T]]:
    """Each chunk's complement, lazily, in chunk order."""
    for i in range(len(chunks)):
        yield [x for j, ch in enumerate(chunks) if j != i for x in ch]
