"""``nanreplay bisect``: the searches that replay variations of a failing step.

:mod:`.api` holds :func:`~nanreplay.search.api.bisect`, the entry point; one module per search
(:mod:`.layers`, :mod:`.precision`, :mod:`.steps`, :mod:`.samples`); :mod:`.ddmin`, delta
debugging; :mod:`.common`, what the searches share (the replay and its budget, the result dict).
"""
