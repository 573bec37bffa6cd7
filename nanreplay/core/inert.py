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

Invisible characters act too: a zero-width space (U+200B), a word joiner (U+2060), a byte-order
mark (U+FEFF) or a soft hyphen (U+00AD) hide inside a name, the bidirectional isolates and
overrides (U+2066-U+2069, U+202A-U+202E) reorder what the eye reads, a no-break or en space looks
like a space. Every character of Unicode's format category (Cf), every separator but the space
(Zs, Zl, Zp) and every surrogate is escaped wherever bundle text is shown (:data:`INVISIBLE`). A
name under review is escaped beyond that: every character outside printable ASCII, so a
look-alike cannot pass for the real thing (``model\\u2024py:make``, with U+2024 ONE DOT LEADER,
shows as such, never as ``model.py:make``).

Text for an experiment tracker (TensorBoard's text plugin, W&B, MLflow render Markdown and some
HTML) goes through :func:`inert_markdown`: inert, then Markdown's link, image, emphasis, code and
table characters and HTML's ``& < > "`` escaped, so a stored ``![x](http://evil/)``,
``[click](javascript:...)`` or ``<img src=...>`` shows as the text it is.
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = ["inert", "inert_name", "inert_tree", "inert_markdown", "INVISIBLE"]

#: the characters of Unicode's format category (Cf: zero-width, joiners, byte-order mark, soft
#: hyphen, the bidirectional embeddings, overrides, isolates and marks, tags), every separator but
#: the space (Zs, Zl, Zp: no-break and typographic spaces, line and paragraph separators) and the
#: surrogates, as ranges of a regular expression's class; ``tests/core/test_inert.py`` checks it
#: covers every such character this Python's ``unicodedata`` knows (Unicode 15.1 lists included)
INVISIBLE = ("\u00a0\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u1680\u180e\u2000-\u200f\u2028-\u202f"
             "\u205f-\u2064\u2066-\u206f\u3000\ud800-\udfff\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
             "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f")
#: C0 controls except tab and newline, DEL, C1 controls, and the invisible characters
_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{INVISIBLE}]")
#: the same plus tab and newline: a value shows on its own line and cannot forge another
_UNSAFE_IN_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{INVISIBLE}]")
#: a name under review: everything but printable ASCII, and the backslash itself
_UNSAFE_IN_NAME = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
_NAMED = {"\r": "\\r", "\n": "\\n", "\t": "\\t", "\b": "\\b", "\f": "\\f", "\v": "\\v", "\\": "\\\\"}
#: Markdown's active characters (a ``_`` only where it can open or close emphasis: not inside a word)
_MARKDOWN = re.compile(r"[\\`*\[\]|~#]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}


def _escape(m: "re.Match[str]") -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def inert(text: Any, *, one_line: bool = False) -> str:
    """``str(text)`` with every control character that a terminal would act on, and every
    invisible character (:data:`INVISIBLE`), written as a visible escape (``\\x1b``, ``\\r``,
    ``\\x9b``, ``\\u202e``, ``\\u200b``); newlines and tabs are kept, unless ``one_line`` (a field
    of a line-based report: a newline in it could forge a line)."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE_IN_LINE if one_line else _UNSAFE).sub(_escape, s)


def inert_name(text: Any) -> str:
    """A name shown for review (a factory, a class, a path): every character outside printable
    ASCII escaped (controls, invisible characters, and look-alikes such as U+2024 ONE DOT LEADER
    or a Cyrillic ``а``), and backslashes too, so the name stays on its line and reads
    unambiguously: ``model\\u2024py:make`` is never ``model.py:make``."""
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


def inert_markdown(text: Any, *, limit: Optional[int] = None) -> str:
    """Text for a tracker that renders Markdown and HTML (TensorBoard's text plugin, W&B, MLflow):
    :func:`inert` on one line, then Markdown's active characters (``\\ ` * [ ] | ~ #``, a ``_`` at a
    word's edge) backslash-escaped and HTML's ``& < > "`` written as entities, so no link, image,
    emphasis or markup can come from it. ``limit``: at most that many characters, cut before a
    partial escape and ended with ``…``.

    >>> inert_markdown('![x](http://evil/) <img src=x> a_b *c*')
    '!\\\\[x\\\\](http://evil/) &lt;img src=x&gt; a_b \\\\*c\\\\*'
    """
    s = _MARKDOWN.sub(lambda m: "\\" + m.group(), inert(text, one_line=True))
    s = re.sub('[&<>"]', lambda m: _HTML[m.group()], s)
    if limit is None or len(s) <= limit:
        return s
    s = s[: max(0, limit - 1)]
    amp = s.rfind("&")
    if amp >= len(s) - 6 and ";" not in s[amp:]:
        s = s[:amp]  # not half an entity
    if (len(s) - len(s.rstrip("\\"))) % 2:
        s = s[:-1]  # not half an escape
    return s + "…"
