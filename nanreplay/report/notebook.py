"""The diagnosis as :func:`nanreplay.replay` and :func:`nanreplay.load_diagnosis` return it: the
plain mapping it always was (a ``dict`` subclass: ``json.dumps``, ``diag["origin"]`` and ``==``
work as before), which shows itself in a notebook.

* ``repr(diag)``: the one-line sentence (``summary``), so the last line of a cell reads like the
  first line of ``nanreplay replay``;
* ``diag._repr_html_()``: the HTML report of ``nanreplay report`` inline, without the page chrome
  (:func:`nanreplay.report.html.render_inline_html`), every value escaped as on the page; without
  matplotlib (the ``report`` extra) the text report of ``nanreplay replay`` in a ``<pre>``.
"""

from __future__ import annotations

from typing import Any, Optional

from ..core.inert import inert
from ..core.results import DiagnosisDict
from ..errors import MissingExtraError
from .summary import summary_sentence

__all__ = ["Diagnosis"]


class Diagnosis(dict):
    """A diagnosis (the keys of :class:`nanreplay.core.results.DiagnosisDict`, ``docs/report.md``)
    that renders itself: its ``repr`` is the summary sentence, its ``_repr_html_`` the report.

    >>> d = Diagnosis({"phase": "none", "step": 3, "reproduction": {"verdict": "not reproduced"}})
    >>> d
    step 3: the replay produced no non-finite value; not reproduced.
    >>> isinstance(d, dict), d["step"]
    (True, 3)
    """

    __slots__ = ("meta",)

    def __init__(self, diag: DiagnosisDict | dict, *, meta: Optional[dict] = None) -> None:
        super().__init__(diag)
        #: the bundle's metadata, for the report's environment section (``None``: not shown)
        self.meta = meta

    def __repr__(self) -> str:
        sentence = self.get("summary") or summary_sentence(self)  # type: ignore[arg-type]
        return inert(sentence, one_line=True)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's plain-text display
        p.text(repr(self))

    def _repr_html_(self) -> str:
        from . import html

        try:
            return html.render_inline_html(self, meta=self.meta)  # type: ignore[arg-type]
        except MissingExtraError as e:
            from .text import render_report

            return str(html.h('<div class="nanreplay-report"><pre>{}</pre><p>{}</p></div>', render_report(self), str(e)))  # type: ignore[arg-type]

    def __reduce__(self) -> tuple:
        return (self.__class__, (dict(self),), {"meta": self.meta})

    def __setstate__(self, state: dict) -> None:
        self.meta = state.get("meta")
