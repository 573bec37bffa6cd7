"""The rollback plan, the episode and the loss scale in the text and HTML reports, and sample lists
that say what they hold (every row, or which ones, never a list silently cut)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanreplay import NonFiniteGradientError, Recorder, replay
from nanreplay.report.html import _birth_extra, _samples_html
from nanreplay.report.text import fmt_indices, render_report


def test_fmt_indices_says_all_or_lists_every_row():
    assert fmt_indices(list(range(32)), 32) == "all 32 rows"
    assert fmt_indices(list(range(16)), 32, count=32) == "all 32 rows"  # the count says every row, whatever was listed
    assert fmt_indices([0, 1, 2, 3, 9], 32) == "rows [0..3, 9] of 32"
    assert fmt_indices([4, 5], 8, unit="samples") == "samples [4, 5] of 8"
    assert fmt_indices(list(range(64)), 200, count=70) == "rows [0..63 and 6 more] of 200"


def test_a_birth_whose_every_row_is_nonfinite_says_so():
    every = {"rows": {"size": 32, "dim": 0, "count": 32, "indices": list(range(32))}}
    assert _birth_extra(every) == ["all 32 rows non-finite"]
    some = {"rows": {"size": 200, "dim": 0, "count": 70, "indices": list(range(64))}}
    assert _birth_extra(some) == ["non-finite rows [0..63 and 6 more] of 200"]


def test_the_samples_section_agrees_with_its_chart():
    diag = {"samples": None, "nonfinite_inputs": [{"leaf": "batch[0]", "health": {"nan": 32, "posinf": 0, "neginf": 0, "numel": 256,
                                                                                   "shape": [32, 8]}, "samples": list(range(32))}]}
    assert "all 32 rows" in _samples_html(diag)
    assert "No per-sample information" not in _samples_html({"samples": None}, charted=True)
    assert "No per-sample information" in _samples_html({"samples": None})
    batch_level = {"samples": {"indices": list(range(32)), "batch_size": 32, "method": "per-sample replay", "batch_level": True}}
    assert "the batch as a whole" in _samples_html(batch_level)


@pytest.fixture(scope="module")
def skip_bundle(tmp_path_factory):
    """action="skip", max_consecutive=3, snapshot_every=5, NaN inputs from step 10: the Recorder gives
    up at step 13; the bundle (step 10) holds the plan of the whole episode."""
    tmp = tmp_path_factory.mktemp("plan")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with Recorder(m, opt, out_dir=tmp, action="skip", max_consecutive=3, snapshot_every=5, diagnose=False) as rec:
        with pytest.raises(NonFiniteGradientError):
            for step in range(30):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
                if step >= 10:
                    x[1, 1] = float("nan")
                loss = F.mse_loss(m(x), y)
                rec.log_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return rec.bundles[0]


def test_the_text_report_shows_the_plan_and_the_episode(skip_bundle):
    diag = replay(skip_bundle)
    assert diag["rollback"]["skip_steps"] == [10, 11, 12, 13]
    text = render_report(diag)
    assert "  rollback:      restore step 10 (snapshot), skip the batches of steps 10..13" in text
    assert ("  episode:       4 consecutive non-finite steps 10..13 (gradients and loss, update skipped), weights untouched by "
            "non-finite values since step 10") in text


def test_the_html_report_shows_the_plan_and_the_episode(skip_bundle):
    pytest.importorskip("matplotlib")
    from nanreplay.report.html import render_html

    page = render_html(replay(skip_bundle))
    assert '<section id="rollback">' in page
    assert "restore step 10 (snapshot)" in page and "the batches of steps 10..13 (4 steps)" in page
    assert '<td class="num">10..13</td><td>gradients and loss</td><td>skipped</td>' in page


def test_a_zero_grad_norm_is_never_exploding_and_the_norm_before_clipping_is_read():
    from types import SimpleNamespace

    from nanreplay.diagnosis.evidence import grad_norm_history

    def rows(norms, pre=None):
        return [SimpleNamespace(step=k, grad_norm=g, grad_norm_pre_clip=(pre or {}).get(k), loss=1.0, lrs=[0.1]) for k, g in enumerate(norms)]

    zeros = grad_norm_history(rows([0.0, 0.0, 0.0, 0.0, 5.0]), 5)
    assert zeros["exploding"] is False and zeros["growth"] is None  # nothing to grow from
    dead = grad_norm_history(rows([1.0, 1.0, 1.0, 0.0, 0.0]), 5)
    assert dead["exploding"] is False and dead["growth"] == 0.0
    clipped = grad_norm_history(rows([1.0] * 5, pre={0: 2.0, 1: 2.0, 2: 2.1, 3: 2.0, 4: 400.0}), 5)  # clip_grad_norm_(1.0)
    assert clipped["exploding"] is True and clipped["grad_norms"][-1] == [4, 400.0]
