"""The allowlist of legitimate non-finite values: rules ``MODULE:OP[:-inf]`` that keep a birth
from being called the origin (``-Inf`` written on purpose by attention masking, by default).
Used by the op monitor during replay and validated by ``RecorderConfig``."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .numerics import Health

__all__ = ["AllowRule", "Allowlist", "DEFAULT_ALLOW"]


@dataclass(frozen=True)
class AllowRule:
    """One allowlist rule: a birth matches when its module FQN matches ``module`` and its aten op
    name matches ``op`` (``fnmatch`` patterns; ``"*"`` matches anything, including "outside the
    model") and, with ``neginf_only``, its output holds -Inf and no NaN or +Inf.

    Written as ``"MODULE:OP"`` or ``"MODULE:OP:-inf"``, e.g. ``"*:masked_fill:-inf"``,
    ``"encoder.*.attn:*"``.
    """

    module: str = "*"
    op: str = "*"
    neginf_only: bool = True

    @classmethod
    def parse(cls, spec: str) -> "AllowRule":
        """Parse ``"MODULE:OP[:-inf]"``.

        Raises:
            ValueError: any other shape, with the expected one.
        """
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2].lower() not in ("-inf", "any")):
            raise ValueError(
                f"an allowlist rule is 'MODULE:OP' or 'MODULE:OP:-inf' (fnmatch patterns, e.g. '*:masked_fill:-inf'), got {spec!r}"
            )
        return cls(parts[0], parts[1], len(parts) == 3 and parts[2].lower() == "-inf")

    def __str__(self) -> str:
        return f"{self.module}:{self.op}" + (":-inf" if self.neginf_only else "")

    def matches(self, module: Optional[str], op: str, output: Optional[Health]) -> bool:
        if output is None:
            return False
        if self.neginf_only and (output.nan or output.posinf or not output.neginf):
            return False
        if not fnmatch.fnmatchcase(op, self.op):
            return False
        return self.module == "*" or (module is not None and fnmatch.fnmatchcase(module, self.module))


#: -Inf written on purpose by attention masking: ``masked_fill(mask, -inf)``, ``torch.where``,
#: ``torch.full(..., -inf)`` (``nn.Transformer.generate_square_subsequent_mask``), fills, copies
#: and index writes. Only -Inf: a NaN (a fully masked softmax row) is never allowed by default.
DEFAULT_ALLOW: tuple[AllowRule, ...] = tuple(
    AllowRule("*", op, True)
    for op in ("masked_fill", "masked_fill_", "where", "full", "full_like", "fill", "fill_", "scalar_tensor",
               "copy_", "_to_copy", "index_put", "index_put_", "masked_scatter", "masked_scatter_", "lift_fresh",
               "clone", "new_full", "triu", "tril", "zero_", "_safe_softmax")
)


class Allowlist:
    """Rules for non-finite values that are legitimate, so they are never called the origin.

    Args:
        rules: extra rules (:class:`AllowRule` or their ``"MODULE:OP[:-inf]"`` strings).
        defaults: include :data:`DEFAULT_ALLOW` (attention masking with -Inf).
    """

    def __init__(self, rules: Iterable[Any] = (), *, defaults: bool = True) -> None:
        extra = [r if isinstance(r, AllowRule) else AllowRule.parse(str(r)) for r in rules]
        self.rules: list[AllowRule] = (list(DEFAULT_ALLOW) if defaults else []) + extra

    def match(self, module: Optional[str], op: str, output: Optional[Health]) -> Optional[AllowRule]:
        return next((r for r in self.rules if r.matches(module, op, output)), None)

    def to_json(self) -> list[str]:
        return [str(r) for r in self.rules]
