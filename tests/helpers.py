"""Test helpers shared by several test modules."""

from __future__ import annotations

import os
import re
import time
from html.parser import HTMLParser
from typing import Callable

import pytest

from nanreplay import NonFiniteGradientError, Recorder


def fail_once(model, opt, batch, loss_fn, out_dir, **opts) -> NonFiniteGradientError:
    """Run one recorded step of ``loss_fn(model, batch)`` that must fail, and return the error
    (it carries the bundle path and the in-process diagnosis)."""
    with Recorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, **opts) as rec:
        rec.record(batch)
        loss = loss_fn(model, batch)
        rec.log_loss(loss)
        loss.backward()
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    return info.value


def fail_within(model, opt, batches, step_loss, out_dir, **opts) -> NonFiniteGradientError:
    """Train ``step_loss(model, batch)`` on ``batches`` under ``Recorder(model, opt, out_dir=out_dir,
    **opts)`` (no loss function unless ``opts`` gives the Recorder one) until a step fails, and
    return its error; ``AssertionError`` when none does."""
    with Recorder(model, opt, out_dir=out_dir, **opts) as rec:
        for batch in batches:
            rec.record(batch)
            loss = step_loss(model, batch)
            rec.log_loss(loss)
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                return e
            opt.zero_grad()
    raise AssertionError("no step failed")


def _rank_main(rank: int, worker: Callable, *args) -> None:
    """Run one rank's ``worker`` and, when it returns, leave the process at once with exit status
    0: torch 2.13's gloo backend aborts now and then at interpreter exit ("terminate called
    without an active exception", SIGABRT, about 1 run in 10 with no nanreplay code loaded),
    after the worker has finished and written its results. An exception still propagates."""
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable, args: tuple, nprocs: int, timeout_s: float, why: str = "") -> None:
    """Start ``worker(rank, *args)`` in ``nprocs`` spawned processes (one per rank) and wait for
    them; fails the test after ``timeout_s`` seconds (``why`` says what a hang means) and kills
    any rank still alive."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_rank_main, args=(worker, *args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish within {timeout_s} s{why}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


class _Crawl(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def assert_inert_page(page: str) -> _Crawl:
    """Parse ``page`` and fail if anything from a bundle became markup: a second ``<meta
    http-equiv>`` (the CSP is the only one), an element that loads or navigates, a script that is
    not JSON data, an event-handler attribute. Returns the crawl (tags, script texts)."""
    crawl = _Crawl()
    crawl.feed(page)
    metas = [a for t, a in crawl.tags if t == "meta"]
    assert [a.get("http-equiv") for a in metas if "http-equiv" in a] == ["Content-Security-Policy"], metas
    assert not any(t in ("img", "iframe", "object", "embed", "base", "link", "form", "a") for t, _ in crawl.tags)
    assert all(a.get("type") == "application/json" for t, a in crawl.tags if t == "script")
    for tag, attrs in crawl.tags:
        assert not [k for k in attrs if k.startswith("on")], (tag, attrs)
    assert "attacker.example/\">" not in page and "<script>alert" not in page
    return crawl


def raw_controls(text: str) -> list[str]:
    """Control characters in ``text`` other than newline, tab and nanreplay's own SGR styles."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"]


def with_meta(src, dst, edit) -> str:
    """A copy of bundle ``src`` at ``dst`` whose metadata ``edit(extra_meta)`` changed (the
    environment and the run's config are kept on a rewrite, so an edit of them is what the copy
    records); trusted, as the Recorder's own."""
    from nanreplay import open_bundle
    from nanreplay.format.bundle import write_bundle

    with open_bundle(src) as b:
        content = b.content()
    edit(content.extra_meta)
    write_bundle(dst, content, trusted=True)
    return str(dst)
