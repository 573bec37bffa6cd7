"""Text from a bundle made inert for a terminal.

A bundle's strings (module names, factory names, op names, the stored diagnosis, file paths) are
untrusted. Written to a terminal as they are, control characters act: ``ESC [ 2 J`` clears the
screen, an OSC sequence sets the window title or writes a hyperlink, ``\\r`` and backspace move the
cursor back so that later text hides earlier text (a factory name ``evil:run\\rtorch.nn:Linear``
shows as ``torch.nn:Linear``). Every command's human-readable output goes through :func:`inert`
(or :func:`inert_tree`, on the dict a report is rendered from) before nanreplay adds its own
styles; names under review go through :func:`inert_name`. ``--json`` output needs none of this:
``json.dumps`` escapes every control character.

>>> inert("evil:run\\rtorch.nn:Linear\\x1b]0;title\\x07")
'evil:run\\\\rtorch.nn:Linear\\\\x1b]0;title\\\\x07'
>>> inert_name("a\\nb\\tc\\\\d")
'a\\\\nb\\\\tc\\\\\\\\d'
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["inert", "inert_name", "inert_tree"]

#: C0 controls except tab and newline, DEL, C1 controls, and the Unicode format characters that
#: reorder or hide text (bidirectional overrides and isolates, line and paragraph separators)
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
#: the same plus tab and newline: a value shows on its own line and cannot forge another
_UNSAFE_IN_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
#: the same plus the backslash itself: a name shows on one line, unambiguously
_UNSAFE_IN_NAME = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\\\\]")
_NAMED = {"\r": "\\r", "\n": "\\n", "\t": "\\t", "\b": "\\b", "\f": "\\f", "\v": "\\v", "\\": "\\\\"}


def _escape(m: "re.Match[str]") -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def inert(text: Any, *, one_line: bool = False) -> str:
    """``str(text)`` with every control character that a terminal would act on written as a
    visible escape (``\\x1b``, ``\\r``, ``\\x9b``, ``\\u202e``); newlines and tabs are kept,
    unless ``one_line`` (a field of a line-based report: a newline in it could forge a line)."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE_IN_LINE if one_line else _UNSAFE).sub(_escape, s)


def inert_name(text: Any) -> str:
    """A name shown for review (a factory, a class, a path): like :func:`inert`, and newlines,
    tabs and backslashes are escaped too, so the name stays on its line and reads unambiguously."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE_IN_NAME.sub(_escape, s)


def inert_tree(obj: Any, *, one_line: bool = False, _depth: int = 0) -> Any:
    """A copy of a JSON-like value (dicts, lists, tuples) with every string, keys included, passed
    through :func:`inert` (with ``one_line``); other leaves are returned as they are. Nesting
    deeper than 200 levels is cut (a bundle's JSON is at most 64 deep)."""
    if isinstance(obj, str):
        return inert(obj, one_line=one_line)
    if _depth > 200:
        return "..."
    if isinstance(obj, dict):
        return {(inert(k, one_line=one_line) if isinstance(k, str) else k): inert_tree(v, one_line=one_line, _depth=_depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [inert_tree(v, one_line=one_line, _depth=_depth + 1) for v in obj]
        return tuple(items) if type(obj) is tuple else items
    return obj
